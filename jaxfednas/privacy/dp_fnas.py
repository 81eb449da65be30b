"""DP-FNAS accounting (Singh et al., "Differentially-private Federated Neural
Architecture Search", arXiv:2006.10559, Theorem 3.1): every party runs two mechanisms
— M^G, weight gradients on its training split (p, σ), and M^H, architecture gradients
on its validation split (p_val, τ) — on disjoint data, so a party's per-example
guarantee is the maximum over the two (parallel composition; assumption 4 of
:mod:`jaxfednas.privacy.accounting`). Host-side, no JAX.

* :class:`MechanismSpec`, :func:`dpfnas_report` / :class:`DPFNASReport` — CLT, PLD and
  RDP numbers of both mechanisms of a party;
* :class:`Accountant` — the per-round numbers DP-FNAS reports (memoised per T), and a
  union bound on Poisson batches overflowing their fixed physical size;
* :func:`max_iterations` — the iterations a ``target_epsilon`` allows.

The functions taking ``cfg`` read these attributes of a DP-FNAS configuration
(``jaxfednas.algorithms.dp_fnas.DPFNASConfig``): ``sampling_prob``, ``noise_multiplier``,
``p_val``, ``tau``, ``delta``, ``accountant``, ``target_epsilon``.

Unit of privacy: one example of one party; add/remove neighbours (see
:mod:`jaxfednas.privacy.accounting` for every assumption behind the numbers).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxfednas.privacy.accounting import (
    AccountingReport,
    compare_accountants,
    gdp_epsilon,
    gdp_mu_poisson,
    max_steps,
    overflow_probability,
    pld_epsilon,
    rdp_epsilon,
)
from jaxfednas.privacy.checks import _check_delta, _check_noise_multiplier, _check_sampling_prob, _check_steps, _real

__all__ = ["Accountant", "DPFNASReport", "MechanismSpec", "NO_BUDGET", "dpfnas_report", "max_iterations"]

NO_BUDGET = 2**31 - 1  # max_iterations when no target_epsilon binds


@dataclasses.dataclass(frozen=True, kw_only=True)
class MechanismSpec:
    """One DP-FNAS mechanism of a party (Algorithm 1).

    Attributes:
      name: e.g. ``"weights/train"`` (M^G on D^tr) or ``"arch/val"`` (M^H on D^val).
      sampling_prob: Poisson sampling probability, ``B / N_k`` in Theorem 3.1.
      noise_multiplier: noise std / clip_norm (sigma or tau of Theorem 3.1).
      clip_norm: per-example clipping norm R^G or R^H; informational only (it
        scales the noise, not epsilon).
      steps: number of noisy releases of this mechanism (T).
    """

    name: str
    sampling_prob: float
    noise_multiplier: float
    clip_norm: float | None = None
    steps: int

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _check_sampling_prob(self.sampling_prob)
        _check_noise_multiplier(self.noise_multiplier)
        _check_steps(self.steps)
        if self.clip_norm is not None:
            c = _real("clip_norm", self.clip_norm)
            if not 0.0 < c < math.inf:
                raise ValueError(f"clip_norm must be in (0, inf) or None, got {c!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPFNASReport:
    """Per-party DP-FNAS guarantee: each mechanism, and the per-example maximum.

    The overall fields are maxima over ``train`` and ``val``: the splits are
    disjoint, so an example is touched by one mechanism only (parallel
    composition, DP-FNAS Appendix A) and the guarantees do not add up.
    """

    train_spec: MechanismSpec
    val_spec: MechanismSpec
    train: AccountingReport
    val: AccountingReport
    delta: float
    mu_clt: float
    epsilon_clt: float
    epsilon_pld: float
    epsilon_rdp: float

    def to_table(self) -> str:
        lines = ["DP-FNAS privacy of one party (per example, add/remove one example)"]
        for spec, rep in ((self.train_spec, self.train), (self.val_spec, self.val)):
            clip = "" if spec.clip_norm is None else f", clip_norm = {spec.clip_norm:g}"
            lines += ["", f"[{spec.name}]{clip}", rep.to_table()]
        lines += [
            "",
            "overall per-example guarantee = max over the two mechanisms (train and",
            "validation data are disjoint and assigned independently of other examples,",
            "so each example is used by one mechanism only: parallel composition):",
            f"  CLT mu = {self.mu_clt:.4f}   epsilon: CLT {self.epsilon_clt:.4f}   "
            f"PLD {self.epsilon_pld:.4f}   RDP {self.epsilon_rdp:.4f}   at delta = {self.delta:g}",
            "  (jaxfednas assigns each example from a hash of (seed, its index):",
            "  data.split_method=independent.) If an example may sit in both splits, add",
            "  the epsilons instead (sequential composition).",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()


def dpfnas_report(*, train: MechanismSpec, val: MechanismSpec, delta: float,
                  value_discretization_interval: float | None = None) -> DPFNASReport:
    r"""Account M^G (weights, training split) and M^H (architecture, validation split).

    Each mechanism is composed over its own steps; the party's per-example
    guarantee is the maximum of the two (see :class:`DPFNASReport`).

    >>> spec = MechanismSpec(name="weights/train", sampling_prob=0.01, noise_multiplier=1.0,
    ...                      steps=1000)
    >>> r = dpfnas_report(train=spec, val=dataclasses.replace(spec, name="arch/val",
    ...                   noise_multiplier=2.0), delta=1e-5)
    >>> r.epsilon_pld == max(r.train.epsilon_pld, r.val.epsilon_pld) == r.train.epsilon_pld
    True
    """
    for name, spec in (("train", train), ("val", val)):
        if not isinstance(spec, MechanismSpec):
            raise ValueError(f"{name} must be a MechanismSpec, got {type(spec).__name__}")
    d = _check_delta(delta)
    reps = [compare_accountants(sampling_prob=s.sampling_prob,
                                noise_multiplier=s.noise_multiplier, steps=s.steps, delta=d,
                                value_discretization_interval=value_discretization_interval)
            for s in (train, val)]
    return DPFNASReport(
        train_spec=train, val_spec=val, train=reps[0], val=reps[1], delta=d,
        mu_clt=max(r.mu_clt for r in reps),
        epsilon_clt=max(r.epsilon_clt for r in reps),
        epsilon_pld=max(r.epsilon_pld for r in reps),
        epsilon_rdp=max(r.epsilon_rdp for r in reps))


def max_iterations(cfg) -> int:
    """Iterations allowed by ``target_epsilon`` (both mechanisms; ``NO_BUDGET`` if none)."""
    if cfg.target_epsilon <= 0:
        return NO_BUDGET
    steps = []
    for p, s in ((cfg.sampling_prob, cfg.noise_multiplier), (cfg.p_val, cfg.tau)):
        try:
            steps.append(max_steps(sampling_prob=p, noise_multiplier=s, target_epsilon=cfg.target_epsilon,
                                           delta=cfg.delta, accountant=cfg.accountant))
        except ValueError:  # more steps than privacy.max_steps searches: the budget never binds
            steps.append(NO_BUDGET)
    return int(min(steps))


class Accountant:
    """Host-side accounting of one party's two mechanisms after T iterations (memoised).

    Every party has the same p and noise, so the numbers hold for every party.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self._cache: dict[int, dict[str, float]] = {}

    def mechanisms(self):
        c = self.cfg
        return (("train", c.sampling_prob, c.noise_multiplier), ("val", c.p_val, c.tau))

    def report(self, steps: int) -> dict[str, float]:
        """Every ε named by its accountant, after ``steps`` iterations (T releases of each mechanism).

        * ``mu_<m>`` — Bu et al.'s CLT μ (Theorem 3.1) of mechanism m in {train, val};
        * ``epsilon_clt_<m>`` (the paper's asymptotic number, usually optimistic),
          ``epsilon_pld_<m>`` (the guarantee), and ``epsilon_rdp_<m>`` when ``accountant`` is
          ``"rdp"`` (RDP is looser than PLD, and only computed when it enforces the budget);
        * ``epsilon_clt``, ``epsilon_pld`` (, ``epsilon_rdp``): the maximum over the two
          mechanisms (disjoint splits compose in parallel), when both are noised;
        * ``budget_epsilon``: with a ``target_epsilon``, the ε of ``accountant`` — the number
          the budget is enforced on, so ``budget_epsilon <= target_epsilon`` always holds;
          with ``accountant="clt"`` ``epsilon_pld`` may exceed the target.
        """
        if steps in self._cache:
            return self._cache[steps]
        c = self.cfg
        names = ("clt", "pld", "rdp") if c.accountant == "rdp" else ("clt", "pld")
        out: dict[str, float] = {}
        for name, p, noise in self.mechanisms():
            if noise <= 0:
                continue  # no noise: no finite guarantee, nothing to report
            if steps == 0:
                out.update({f"mu_{name}": 0.0, **{f"epsilon_{a}_{name}": 0.0 for a in names}})
                continue
            mu = gdp_mu_poisson(sampling_prob=p, noise_multiplier=noise, steps=steps)
            out[f"mu_{name}"] = mu
            out[f"epsilon_clt_{name}"] = gdp_epsilon(mu=mu, delta=c.delta)
            out[f"epsilon_pld_{name}"] = pld_epsilon(sampling_prob=p, noise_multiplier=noise, steps=steps,
                                                     delta=c.delta)
            if "rdp" in names:
                out[f"epsilon_rdp_{name}"] = rdp_epsilon(sampling_prob=p, noise_multiplier=noise, steps=steps,
                                                         delta=c.delta)
        if "mu_train" in out and "mu_val" in out:
            for a in names:
                out[f"epsilon_{a}"] = max(out[f"epsilon_{a}_train"], out[f"epsilon_{a}_val"])
            if c.target_epsilon > 0:
                out["budget_epsilon"] = out[f"epsilon_{c.accountant}"]
        self._cache[steps] = out
        return out

    def overflow_bound(self, steps: int, counts_train, counts_val, slots_train: int, slots_val: int) -> dict:
        """Union bound on the probability that any release so far overflowed its
        physical batch (for the largest party, plus one example)."""
        c = self.cfg
        q_tr = overflow_probability(int(np.max(counts_train)) + 1, c.sampling_prob, slots_train)
        q_val = overflow_probability(int(np.max(counts_val)) + 1, c.p_val, slots_val)
        return {"overflow_bound_train": min(1.0, steps * q_tr), "overflow_bound_val": min(1.0, steps * q_val)}
