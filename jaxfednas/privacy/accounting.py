r"""Privacy accounting: Gaussian-DP (CLT), PLD and RDP, side by side.

Host-side Python + SciPy code; ``dp_accounting`` is imported inside the functions
that need it, and JAX is never imported, so this module can be audited and run
on a machine without an accelerator stack.

References
----------
* Z. Bu, J. Dong, Q. Long, W. J. Su, "Deep Learning with Gaussian Differential
  Privacy", Harvard Data Science Review 2020, arXiv:1911.11607 -- the central
  limit theorem (CLT) for Poisson- and uniformly-subsampled noisy SGD.
* J. Dong, A. Roth, W. J. Su, "Gaussian Differential Privacy", JRSS-B 2022,
  arXiv:1905.02383 -- f-DP, mu-GDP, and the mu-GDP <-> (epsilon, delta) duality
  used by :func:`gdp_delta` / :func:`gdp_epsilon`.
* I. Singh, H. Zhou, K. Yang, M. Ding, B. Lin, P. Xie, "Differentially-private
  Federated Neural Architecture Search" (DP-FNAS), arXiv:2006.10559 --
  Theorem 3.1 (and Appendix A-B): each party k is
  ``(B / N_k^tr) * sqrt(T (exp(1 / sigma^2) - 1))``-GDP for its weight-gradient
  mechanism on the training split and ``(B / N_k^val) * sqrt(T (exp(1 / tau^2)
  - 1))``-GDP for its architecture-gradient mechanism on the validation split.
  (Appendix B, Theorem B.1 prints the bound with misplaced parentheses; the
  formula above, from Bu et al., is the intended one.  The paper calls sigma^2
  a "variance"; here ``noise_multiplier`` is the noise standard deviation
  divided by the clipping norm, i.e. the per-step Gaussian mechanism is
  ``1 / noise_multiplier``-GDP.)
* B. Balle, Y.-X. Wang, "Improving the Gaussian Mechanism for Differential
  Privacy", ICML 2018 -- the exact (epsilon, delta) curve of a Gaussian
  mechanism, which equals :func:`gdp_delta` with ``mu = 1 / noise_multiplier``.
* The PLD and RDP numbers come from Google's ``dp_accounting`` library
  (``dp_accounting.pld.PLDAccountant``, ``dp_accounting.rdp.RdpAccountant``).

Unit of privacy and neighbouring relation
-----------------------------------------
The protected unit is **one example of one party's local data** (example-level
DP inside a party; not user-level, not party-level).  Two datasets of a party
are neighbours if one is obtained from the other by **adding or removing one
example**.  This is the ``NeighboringRelation.ADD_OR_REMOVE_ONE`` relation that
``dp_accounting``'s PLD and RDP accountants use by default (the PLD accountant
covers both the "add" and the "remove" direction).  The Poisson CLT of Bu et
al. is stated for the same setting; :func:`gdp_mu_uniform` (fixed-size batches
drawn without replacement) follows Bu et al.'s uniform-subsampling analysis,
which works with datasets of equal size differing in one example (replace-one).

**The CLT numbers are asymptotic**: mu is the limit of the composed trade-off
function as ``T -> infinity`` with ``p * sqrt(T)`` held fixed.  For a finite T
it is an approximation, not an upper bound, and it is usually *optimistic*
(smaller epsilon than the PLD upper bound) -- by up to several times for small
T or ``noise_multiplier < 1``.  Report the PLD epsilon as the guarantee and the
CLT number as "the paper's number"; :func:`compare_accountants` does both.

Assumptions behind every number here
------------------------------------
1. Each step samples a batch by **Poisson subsampling** with probability
   ``sampling_prob`` (every example independently), fresh at every step.  A
   fixed-size shuffled batch (what the DP-FNAS reference code does) is a
   different mechanism; use :func:`gdp_mu_uniform` for an indication only.
2. Every example's gradient is **clipped per example** to L2 norm ``C`` before
   summation and Gaussian noise of standard deviation ``noise_multiplier * C``
   is added to the sum (sensitivity ``C`` under add/remove).  Clipping slices
   of an already averaged gradient does not give this sensitivity.
3. The noise is added before anything leaves the party, and the adversary may
   see every noisy release; everything computed from the releases is
   post-processing.  ``steps`` counts the noisy releases that touch the
   dataset in question.
4. (DP-FNAS) The training and validation splits of a party are **disjoint**
   and each example's assignment to a split does not depend on the other
   examples (e.g. a fixed per-example assignment, not "the first half by
   index").  Then an example is touched by only one of the two mechanisms and
   the party's per-example guarantee is the **maximum** over the two
   mechanisms, not their sum (parallel composition; DP-FNAS Appendix A).
5. Hyper-parameter tuning, repeated runs and data-dependent choices of T are
   not accounted for.

Example
-------
>>> mu = gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1.0, steps=1000)
>>> round(mu, 4)
0.4145
>>> round(gdp_epsilon(mu=mu, delta=1e-5), 3)
1.618
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys

from scipy import optimize, special

__all__ = [
    "AccountingReport",
    "calibrate_noise_multiplier",
    "compare_accountants",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu_poisson",
    "gdp_mu_uniform",
    "max_steps",
    "overflow_probability",
    "pld_epsilon",
    "pld_interval",
    "rdp_epsilon",
]

from jaxfednas.privacy.checks import (  # noqa: F401  (ACCOUNTANTS, MAX_NOISE_MULTIPLIER re-exported)
    ACCOUNTANTS,
    MAX_NOISE_MULTIPLIER,
    _check_accountant,
    _check_delta,
    _check_epsilon,
    _check_mu,
    _check_noise_multiplier,
    _check_sampling_prob,
    _check_steps,
    _real,
)
from jaxfednas.privacy.pld_grid import (  # noqa: F401  (the grid's constants re-exported)
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    PLD_MAX_EXPLICIT_POINTS,
    PLD_MAX_INTERVAL,
    PLD_MAX_POINTS,
    _check_interval,
    pld_interval,
)

PLD_MAX_STEPS = 100_000_000  # PLD composes 1e8 steps in ~25 s (measured); far beyond, minutes to hours
# Calibration searches sigma in this range.  Below ~0.05 a subsampled-Gaussian
# PLD has privacy losses in the thousands and gets slow and memory hungry.
_SIGMA_MIN = 0.05
_SIGMA_MAX = 1e6
_STEPS_MAX = 10**12
_LOG_FLOAT_MAX = math.log(sys.float_info.max)


# --------------------------------------------------------------------------
# Gaussian DP: the CLT mu and the mu <-> (epsilon, delta) duality
# --------------------------------------------------------------------------
def _log_expm1(x: float) -> float:
    """log(exp(x) - 1) for x > 0 without overflow."""
    if x > 30.0:
        return x + math.log1p(-math.exp(-x))
    return math.log(math.expm1(x))


def _exp_or_inf(log_value: float) -> float:
    return math.inf if log_value > _LOG_FLOAT_MAX else math.exp(log_value)


def gdp_mu_poisson(*, sampling_prob: float, noise_multiplier: float, steps: int) -> float:
    r"""CLT mu of T Poisson-subsampled Gaussian steps (Bu et al.; DP-FNAS Thm 3.1).

    ``mu = p * sqrt(T * (exp(1 / sigma^2) - 1))``.  Asymptotic (T -> inf with
    ``p sqrt(T)`` fixed); not an upper bound for finite T.  For ``p = 1`` the
    exact answer is ``sqrt(T) / sigma`` and this formula overstates it.
    Computed in log space: a tiny sigma gives a huge mu, or ``inf`` once mu
    itself exceeds the float range.

    >>> round(gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1.0, steps=1000), 4)
    0.4145
    >>> gdp_mu_poisson(sampling_prob=0.5, noise_multiplier=0.01, steps=10)
    inf
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    t = _check_steps(steps)
    log_mu = math.log(p) + 0.5 * (math.log(t) + _log_expm1(1.0 / sigma / sigma))  # inf, not OverflowError
    return _exp_or_inf(log_mu)


def gdp_mu_uniform(*, sampling_prob: float, noise_multiplier: float, steps: int) -> float:
    r"""CLT mu for uniform subsampling (fixed batch, without replacement; Bu et al.).

    ``mu = sqrt(2) * p * sqrt(T * (exp(1/sigma^2) Phi(1.5/sigma)
    + 3 Phi(-0.5/sigma) - 2))`` with ``p = batch_size / dataset_size``.

    The ``sqrt(2)`` factor is part of Bu et al.'s uniform-subsampling result
    (and of the TensorFlow Privacy code its authors published).  It makes the
    two CLT numbers agree for large sigma, where both tend to
    ``p sqrt(T) / sigma``; without it the fixed-batch bound would be
    ``sqrt(2)`` times *smaller* than the Poisson one.  Asymptotic, like
    :func:`gdp_mu_poisson`; the neighbouring relation here is replace-one.

    The bracket is evaluated as ``expm1(x^2) Phi(1.5x) + (erf(1.5x/sqrt2) -
    3 erf(0.5x/sqrt2)) / 2`` with ``x = 1/sigma``, which is algebraically equal
    but does not cancel catastrophically for large sigma.

    >>> round(gdp_mu_uniform(sampling_prob=0.01, noise_multiplier=1.0, steps=1000), 4)
    0.5408
    >>> a = gdp_mu_uniform(sampling_prob=0.01, noise_multiplier=1e3, steps=10**4)
    >>> b = gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1e3, steps=10**4)
    >>> abs(a / b - 1) < 1e-3
    True
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    t = _check_steps(steps)
    x = 1.0 / sigma
    if x * x > 30.0:
        # exp(x^2) Phi(1.5x) dominates the bounded rest (|rest| <= 2) by > e^29.
        log_head = x * x + float(special.log_ndtr(1.5 * x))
        rest = 3.0 * float(special.ndtr(-0.5 * x)) - 2.0
        log_g = log_head + math.log1p(rest * math.exp(-log_head))
    else:
        g = (math.expm1(x * x) * float(special.ndtr(1.5 * x))
             + 0.5 * (float(special.erf(1.5 * x / math.sqrt(2.0)))
                      - 3.0 * float(special.erf(0.5 * x / math.sqrt(2.0)))))
        log_g = math.log(g)
    log_mu = 0.5 * math.log(2.0) + math.log(p) + 0.5 * (math.log(t) + log_g)
    return _exp_or_inf(log_mu)


_SQRT2 = math.sqrt(2.0)


def _log_half_erfcx(x: float) -> float:
    """log(erfcx(x / sqrt2) / 2) = log Phi(-x) + x^2 / 2, for x >= 0."""
    return math.log(0.5 * float(special.erfcx(x / _SQRT2)))


def _log_gdp_delta(mu: float, s: float, x: float) -> float:
    """log delta of mu-GDP at ``s = eps/mu - mu/2`` and ``x = eps/mu + mu/2`` (> 0).

    delta = Phi(-s) - e^eps Phi(-x).  Since eps - x^2/2 = -s^2/2 exactly,
    e^eps Phi(-x) = exp(-s^2/2) erfcx(x/sqrt2)/2: no e^eps, no overflow, and
    for s > 0 the two terms share the factor exp(-s^2/2), so their ratio is a
    ratio of two erfcx values (no cancellation of huge logs).
    """
    log_t2 = -0.5 * s * s + _log_half_erfcx(x)
    if s > 0.0:
        log_t1 = -0.5 * s * s + _log_half_erfcx(s)
        diff = _log_half_erfcx(x) - _log_half_erfcx(s)
    else:
        log_t1 = float(special.log_ndtr(-s))
        diff = log_t2 - log_t1
    if not diff < 0.0:  # x and s agree to machine precision: delta underflows
        return -math.inf
    return log_t1 + math.log(-math.expm1(diff))


def gdp_delta(*, mu: float, epsilon: float) -> float:
    r"""delta(epsilon) of a mu-GDP mechanism (Dong, Roth, Su, Corollary 2.13).

    ``delta = Phi(-eps/mu + mu/2) - exp(eps) Phi(-eps/mu - mu/2)``.  Evaluated
    in log space with the second term rewritten as
    ``exp(-(eps/mu - mu/2)^2 / 2) * erfcx((eps/mu + mu/2) / sqrt2) / 2``, an
    exact identity in which ``e^eps`` never appears, so large epsilon or mu
    cannot overflow.  With ``mu = 1/sigma`` this is the exact (epsilon, delta)
    curve of a Gaussian mechanism with sensitivity 1 and noise sigma
    (Balle & Wang 2018).  ``mu = inf`` gives 1.

    >>> round(gdp_delta(mu=1.0, epsilon=1.0), 6)
    0.126937
    >>> gdp_delta(mu=1.0, epsilon=1000.0) == 0.0
    True
    """
    mu = _check_mu(mu)
    eps = _check_epsilon(epsilon)
    if mu == math.inf:
        return 1.0
    return math.exp(_log_gdp_delta(mu, eps / mu - 0.5 * mu, eps / mu + 0.5 * mu))


def gdp_epsilon(*, mu: float, delta: float) -> float:
    r"""Smallest epsilon with ``gdp_delta(mu, epsilon) <= delta`` (exact inverse).

    Solved for ``s = eps/mu - mu/2`` (then ``eps = mu (s + mu/2)``): ``log
    delta(s)`` is strictly decreasing, finite, and its root lies in
    ``[-mu/2, 40]`` whatever mu is (delta <= Phi(-s)).  The upper end of the
    bracket is doubled from 1 until ``delta(hi) < delta``, then Brent's method
    finds the root -- no fixed epsilon bracket such as ``[0, 500]``, which
    fails for large mu (epsilon ~ mu^2 / 2).  Returns 0.0 if
    ``delta(0) <= delta``; ``inf`` if mu is infinite or epsilon exceeds the
    float range.

    >>> round(gdp_epsilon(mu=1.0, delta=1e-5), 4)
    4.3772
    >>> round(gdp_epsilon(mu=50.0, delta=1e-10), 1)
    1567.1
    >>> gdp_epsilon(mu=1e-7, delta=1e-5)
    0.0
    """
    mu = _check_mu(mu)
    delta = _check_delta(delta)
    if mu == math.inf:
        return math.inf
    log_target = math.log(delta)

    def f(s: float) -> float:
        return max(_log_gdp_delta(mu, s, s + mu), -1e300) - log_target

    lo = -0.5 * mu  # epsilon = 0
    if f(lo) <= 0.0:
        return 0.0
    hi = max(1.0, lo)
    while f(hi) > 0.0:
        lo, hi = hi, 2.0 * hi
    s = float(optimize.brentq(f, lo, hi, xtol=1e-13, rtol=1e-15, maxiter=500))
    return max(0.0, mu * (s + 0.5 * mu))


# --------------------------------------------------------------------------
# dp_accounting: PLD and RDP of the Poisson-subsampled Gaussian
# --------------------------------------------------------------------------
def _dp_event(p: float, sigma: float, steps: int):
    import dp_accounting

    step = dp_accounting.GaussianDpEvent(sigma)
    if p < 1.0:  # p == 1 is no subsampling: the plain Gaussian step
        step = dp_accounting.PoissonSampledDpEvent(p, step)
    return dp_accounting.SelfComposedDpEvent(step, steps)


def pld_epsilon(*, sampling_prob: float, noise_multiplier: float, steps: int, delta: float,
                value_discretization_interval: float | None = None) -> float:
    r"""Epsilon of T Poisson-subsampled Gaussian steps from the PLD accountant.

    ``dp_accounting.pld.PLDAccountant`` (add/remove-one, pessimistic
    discretisation) on ``SelfComposed(PoissonSampled(p, Gaussian(sigma)), T)``;
    for ``p == 1`` the Gaussian event is used directly.  This is a numerical
    upper bound; a coarser ``value_discretization_interval`` only makes it
    larger (safer) and faster.  ``None``: :func:`pld_interval` of the noise
    (1e-4 unless sigma is below ~0.35).

    >>> round(pld_epsilon(sampling_prob=1.0, noise_multiplier=1.0, steps=1, delta=1e-5), 2)
    4.38
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    t = _check_steps(steps)
    if t > PLD_MAX_STEPS:
        raise ValueError(f"steps={t} is beyond what the PLD accountant composes in reasonable time (at most "
                         f"{PLD_MAX_STEPS:.0e}: ~25 s); the RDP accountant (accountant='rdp', `jaxfednas privacy --accountant "
                         "rdp`; looser) takes any number of steps")
    d = _check_delta(delta)
    vdi = _check_interval(value_discretization_interval, sigma)
    from dp_accounting import pld

    accountant = pld.PLDAccountant(value_discretization_interval=vdi)
    try:
        accountant.compose(_dp_event(p, sigma, t))
        return float(accountant.get_epsilon(d))
    except MemoryError as e:  # the loss grid: its range over the interval; a tiny sigma or interval is huge
        need = str(e).split("allocate ", 1)[-1].split(" for", 1)[0] if "allocate" in str(e) else "more memory"
        raise ValueError(f"the PLD accountant's privacy-loss grid for noise_multiplier={sigma:g} at value "
                         f"discretisation interval {vdi:g} does not fit in memory (it needs {need}); a larger noise "
                         "multiplier, or a coarser interval (still an upper bound; `jaxfednas privacy "
                         "--pld-interval`), or the RDP accountant") from None


def rdp_epsilon(*, sampling_prob: float, noise_multiplier: float, steps: int,
                delta: float) -> float:
    r"""Epsilon of the same event from ``dp_accounting.rdp.RdpAccountant``.

    Default RDP orders, add/remove-one.  An upper bound, usually looser than
    PLD.  Fractional orders near 1 that fail to converge are skipped (the
    bound over the remaining orders stays valid; dp-accounting's warning about
    each is kept out of the output).  A noise so small that its square
    underflows gives ``inf``.

    >>> round(rdp_epsilon(sampling_prob=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5), 2)
    2.1
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    t = _check_steps(steps)
    d = _check_delta(delta)
    from dp_accounting import rdp

    if sigma * sigma == 0.0:  # (the accountant divides by sigma^2: no privacy left to bound)
        return math.inf
    accountant = rdp.RdpAccountant()
    with _quiet_absl_warnings():
        accountant.compose(_dp_event(p, sigma, t))
        return float(accountant.get_epsilon(d))


@contextlib.contextmanager
def _quiet_absl_warnings():
    """dp-accounting logs a WARNING through absl for every RDP order it skips (hundreds of lines in
    a calibration); the skipped orders only loosen the bound, so they are kept out of the output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _epsilon(accountant: str, p: float, sigma: float, steps: int, delta: float,
             vdi: float | None = None) -> float:
    if accountant == "pld":
        return pld_epsilon(sampling_prob=p, noise_multiplier=sigma, steps=steps, delta=delta,
                           value_discretization_interval=vdi)
    if accountant == "rdp":
        return rdp_epsilon(sampling_prob=p, noise_multiplier=sigma, steps=steps, delta=delta)
    mu = gdp_mu_poisson(sampling_prob=p, noise_multiplier=sigma, steps=steps)
    return gdp_epsilon(mu=mu, delta=delta)


# --------------------------------------------------------------------------
# comparison report
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class AccountingReport:
    """CLT, PLD and RDP epsilons of one Poisson-subsampled Gaussian mechanism.

    Attributes:
      sampling_prob, noise_multiplier, steps, delta: the inputs.
      mu_clt: Bu et al.'s CLT mu (asymptotic).
      epsilon_clt: ``gdp_epsilon(mu_clt, delta)`` -- the paper's number.
      epsilon_pld: PLD upper bound -- report this as the guarantee.
      epsilon_rdp: RDP upper bound (looser).
      clt_optimistic: ``epsilon_clt < epsilon_pld``.
      ratio_pld_over_clt: ``epsilon_pld / epsilon_clt`` (inf if epsilon_clt is 0).
      value_discretization_interval: the PLD's privacy-loss grid (coarser: looser bound).
    """

    sampling_prob: float
    noise_multiplier: float
    steps: int
    delta: float
    mu_clt: float
    epsilon_clt: float
    epsilon_pld: float
    epsilon_rdp: float
    clt_optimistic: bool
    ratio_pld_over_clt: float
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL  # the one used
    pld_left_out: str = ""  # why epsilon_pld is not computed (NaN), or "" when it is

    def to_table(self) -> str:
        """Fixed-width text table (what ``jaxfednas privacy`` prints)."""
        verdict = ("CLT is OPTIMISTIC: it understates epsilon; report the PLD value"
                   if self.clt_optimistic else
                   "CLT is not below PLD here; PLD is still the guarantee")
        lines = [
            f"sampling_prob p = {self.sampling_prob:g}   noise_multiplier sigma = "
            f"{self.noise_multiplier:g}   steps T = {self.steps}   delta = {self.delta:g}",
            "unit: one example of one party's data; neighbours: add/remove one example",
            f"{'accountant':<22}{'epsilon':>12}  note",
            f"{'CLT (Bu et al.)':<22}{self.epsilon_clt:>12.4f}  "
            f"mu = {self.mu_clt:.4f}-GDP; asymptotic approximation, not a bound",
            f"{'PLD (dp-accounting)':<22}{self.epsilon_pld:>12.4f}  upper bound (the guarantee; "
            f"value discretisation interval {self.value_discretization_interval:g})" if self.epsilon_pld == self.epsilon_pld
            else f"{'PLD (dp-accounting)':<22}{'—':>12}  not computed: {self.pld_left_out}; the RDP bound below holds",
            f"{'RDP (dp-accounting)':<22}{self.epsilon_rdp:>12.4f}  upper bound (looser)",
        ] + ([f"PLD / CLT = {self.ratio_pld_over_clt:.3f}: {verdict}"] if self.epsilon_pld == self.epsilon_pld else [])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()


def compare_accountants(*, sampling_prob: float, noise_multiplier: float, steps: int,
                        delta: float,
                        value_discretization_interval: float | None = None) -> AccountingReport:
    r"""Epsilon of one mechanism under the CLT, PLD and RDP accountants.

    ``value_discretization_interval=None``: :func:`pld_interval` of the noise.

    >>> r = compare_accountants(sampling_prob=0.01, noise_multiplier=1.0, steps=1000,
    ...                         delta=1e-5)
    >>> (round(r.epsilon_clt, 2), round(r.epsilon_pld, 2), r.clt_optimistic)
    (1.62, 1.83, True)
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    t = _check_steps(steps)
    d = _check_delta(delta)
    left_out = ""  # why PLD is not computed (the table says so; RDP and the CLT still are)
    try:
        vdi = _check_interval(value_discretization_interval, sigma)
    except ValueError as e:
        if value_discretization_interval is not None:  # an interval asked for explicitly: refused as given
            raise
        vdi, left_out = math.nan, f"too small a noise for the default grid ({str(e).split(': ', 1)[0]})"
    if t > PLD_MAX_STEPS:
        left_out = f"T > {PLD_MAX_STEPS:.0e} steps takes minutes to hours"
    mu = gdp_mu_poisson(sampling_prob=p, noise_multiplier=sigma, steps=t)
    eps_clt = gdp_epsilon(mu=mu, delta=d)
    eps_pld = math.nan if left_out else pld_epsilon(
        sampling_prob=p, noise_multiplier=sigma, steps=t, delta=d, value_discretization_interval=vdi)
    eps_rdp = rdp_epsilon(sampling_prob=p, noise_multiplier=sigma, steps=t, delta=d)
    ratio = eps_pld / eps_clt if eps_clt > 0.0 else math.inf
    return AccountingReport(
        sampling_prob=p, noise_multiplier=sigma, steps=t, delta=d, mu_clt=mu,
        epsilon_clt=eps_clt, epsilon_pld=eps_pld, epsilon_rdp=eps_rdp,
        clt_optimistic=bool(eps_clt < eps_pld), ratio_pld_over_clt=ratio, value_discretization_interval=vdi,
        pld_left_out=left_out)


# --------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------
def calibrate_noise_multiplier(*, sampling_prob: float, steps: int, target_epsilon: float,
                               delta: float, accountant: str = "pld",
                               tolerance: float = 1e-3) -> float:
    r"""Smallest noise multiplier whose epsilon is <= ``target_epsilon`` (to ``tolerance``).

    Bisection on ``log(sigma)``: the bracket starts at sigma = 1 and is doubled
    or halved until it holds the answer (within ``[0.05, 1e6]``), then halved
    until ``hi / lo <= 1 + tolerance``.  Returns ``hi``, which meets the
    target; any sigma below ``hi / (1 + tolerance)`` does not.
    ``accountant`` is ``"pld"`` (the guarantee), ``"rdp"`` or ``"clt"`` (the
    paper's asymptotic number).

    >>> sigma = calibrate_noise_multiplier(sampling_prob=0.01, steps=1000, target_epsilon=2.0,
    ...                                    delta=1e-5, accountant="clt")
    >>> round(sigma, 2)
    0.89
    """
    p = _check_sampling_prob(sampling_prob)
    t = _check_steps(steps)
    target = _check_epsilon(target_epsilon, "target_epsilon")
    if target == 0.0:
        raise ValueError("target_epsilon must be in (0, inf); epsilon = 0 needs infinite noise")
    d = _check_delta(delta)
    acc = _check_accountant(accountant)
    tol = _real("tolerance", tolerance)
    if not 0.0 < tol < 1.0:
        raise ValueError(f"tolerance must be in (0, 1), got {tol!r}")

    def meets(sigma: float) -> bool:
        return _epsilon(acc, p, sigma, t, d) <= target

    lo, hi = 1.0, 1.0
    if meets(1.0):
        while True:
            lo = hi / 2.0
            if lo < _SIGMA_MIN:
                raise ValueError(
                    f"target_epsilon={target!r} is met even at noise_multiplier={hi:g}; "
                    f"calibration searches noise_multiplier in [{_SIGMA_MIN}, {_SIGMA_MAX:g}]")
            if not meets(lo):
                break
            hi = lo
    else:
        while True:
            hi = lo * 2.0
            if hi > _SIGMA_MAX:
                raise ValueError(
                    f"target_epsilon={target!r} is not met even at noise_multiplier={lo:g}; "
                    "lower steps or sampling_prob")
            if meets(hi):
                break
            lo = hi
    # invariant: meets(hi) and not meets(lo)
    while hi / lo > 1.0 + tol:
        mid = math.sqrt(lo * hi)
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def max_steps(*, sampling_prob: float, noise_multiplier: float, target_epsilon: float,
              delta: float, accountant: str = "pld", value_discretization_interval: float | None = None) -> int:
    r"""Largest number of steps T whose epsilon is <= ``target_epsilon`` (0 if none).

    Doubles T until the target is exceeded, then bisects on integers.  Assumes
    epsilon is non-decreasing in T (true of the mechanism; the PLD
    discretisation keeps it so up to its tiny rounding).  ``value_discretization_interval``:
    the PLD accountant's (None: :func:`pld_interval` of the noise).

    >>> max_steps(sampling_prob=0.01, noise_multiplier=1.0, target_epsilon=1.0, delta=1e-5,
    ...           accountant="clt")
    418
    """
    p = _check_sampling_prob(sampling_prob)
    sigma = _check_noise_multiplier(noise_multiplier)
    target = _check_epsilon(target_epsilon, "target_epsilon")
    d = _check_delta(delta)
    acc = _check_accountant(accountant)
    vdi = _check_interval(value_discretization_interval, sigma) if acc == "pld" else None

    def meets(steps: int) -> bool:
        return _epsilon(acc, p, sigma, steps, d, vdi) <= target

    if not meets(1):
        return 0
    good, bad = 1, 2
    while meets(bad):
        good, bad = bad, 2 * bad
        if bad > _STEPS_MAX:
            raise ValueError(f"more than {_STEPS_MAX:g} steps meet target_epsilon={target!r}; "
                             "the budget is effectively unlimited for these settings")
    while bad - good > 1:
        mid = (good + bad) // 2
        if meets(mid):
            good = mid
        else:
            bad = mid
    return good


# --------------------------------------------------------------------------
# Poisson batches of a fixed physical size
# --------------------------------------------------------------------------
def overflow_probability(num_examples: int, sampling_prob: float, physical_batch: int) -> float:
    """``P[Binomial(num_examples, p) > physical_batch]`` (host side, SciPy).

    Pass ``N + 1`` for a party with ``N`` examples to cover its add-one neighbour.
    """
    from scipy.stats import binom

    if physical_batch >= num_examples:
        return 0.0
    return float(binom.sf(physical_batch, num_examples, sampling_prob))
