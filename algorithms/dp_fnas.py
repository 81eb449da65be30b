r"""DP-FNAS — Singh, Zhou, Yang, Ding, Lin, Xie, "Differentially-private Federated Neural
Architecture Search" (arXiv:2006.10559): Algorithm 1 with Eq. 5-7, accounted by
Theorem 3.1 (and, as the guarantee, by a PLD accountant).

One iteration of Algorithm 1 (every party takes part; two exchanges)::

    party k:  I ~ Poisson(p) of D_k^tr;  G_k = (Σ_{i∈I} clip_{R^G}(∇_W ℓ_i(W, A)) + σ R^G U_k) / (p N_k^tr)
    server:   W' = W − ξ Σ_k G_k    (the server's SGD step; "sum" as the paper, or "mean")
    party k:  J ~ Poisson(p_val) of D_k^val;
              h_i = ∇_A ℓ_i(W', A) − ξ ∇²_{A,W} L_k^tr(W, A) ∇_{W'} ℓ_i(W', A)    i ∈ J  (Eq. 5)
              H_k = (Σ_{i∈J} clip_{R^H}(h_i) + τ R^H V_k) / (p_val N_k^val)
    server:   A ← A − η Σ_k H_k     (Adam as DARTS, or SGD as printed); every party continues from (W', A)

``L_k^tr`` is party k's loss on the Poisson training sample of the same iteration (the
batch of its ``G_k``). The Hessian-vector product is DARTS' central difference with
``ε = 0.01 / ‖∇_{W'} ℓ_i‖`` per example (``arch_gradient="second_fd"``, default), the
exact product (``"second_hvp"``) or dropped (``"first"``: ``h_i = ∇_A ℓ_i(W', A)``, what
Algorithm 1 literally writes). ``W'`` is the server's real update of W (with its
momentum and weight decay), so the DARTS "virtual step" costs nothing extra.

FNAS (no noise) is ``noise_multiplier = 0``; with ``clip_norm = arch_clip_norm = 0``
it is the non-private algorithm. Vanilla NAS is one party (``data.num_clients=1``).

Privacy (see :mod:`jaxfednas.privacy.mechanism` for the mechanism's assumptions and
:mod:`jaxfednas.privacy` for the accountants). Unit: one example of one party;
neighbours: add/remove one example. Each party runs two Poisson-subsampled Gaussian
mechanisms, M^G on its training split (p, σ) and M^H on its validation split
(p_val, τ), each composed over the T iterations; the metrics report, at ``delta``, μ
(Bu et al.'s CLT, the paper's Theorem 3.1) per mechanism and every ε named by its
accountant: ``epsilon_pld`` (the guarantee), ``epsilon_clt`` (the paper's number) and,
with ``accountant="rdp"``, ``epsilon_rdp`` — each the maximum over the mechanisms, with
``_train`` / ``_val`` per mechanism (:meth:`jaxfednas.privacy.Accountant.report`).
``target_epsilon`` fixes T up front with :func:`jaxfednas.privacy.max_steps` (for both
mechanisms, with ``accountant``) and the search stops there: iterations past the budget
are skipped inside the compiled round, so no release exceeds it *by that accountant*;
``budget_epsilon`` is that accountant's ε. ``accountant="clt"`` enforces the optimistic
CLT number (PLD ε may exceed the target) and warns when the algorithm is built.

Caveats, stated rather than hidden:

* Theorem 3.1 treats M^H as touching the validation split only. The second-order
  term of Eq. 5 also reads the party's training sample, and its influence on H_k is
  not bounded by the per-example clipping of validation gradients. The reported
  guarantee for *training* examples therefore covers M^G only; with
  ``arch_gradient="first"`` it is exact (Algorithm 1 as printed).
* BatchNorm couples examples; the search network uses a per-example GroupNorm
  (``norm``), a deviation from the DARTS supernet (DESIGN invariant 4).
* The normaliser is the expected batch ``p N_k`` (public), not ``|I_t|`` (Algorithm 1),
  which is data dependent.
* Round metrics computed on private samples (losses, accuracies, clipped fractions,
  overflow counts) and the evaluation on clients' data are diagnostics, not releases.
* The augmentation stage (train the derived genotype: ``algorithms/fednas_train.py``)
  is ordinary FedAvg and not private.

Cost: the weight step is one per-example gradient per sampled training example. The
first-order architecture step is one per-example gradient per sampled validation
example; the second-order one adds, for each validation example, two gradient passes
(``second_fd``) or one second-order pass (``second_hvp``) over the party's training
sample, because per-example clipping needs every h_i (batch-level DARTS needs one):
about B_val times the first-order cost (~20x on the digits example).
``per_example_chunk`` bounds the memory of these passes.

Deviations from the authors' code (docs/authors_code.md §6), all in the paper's direction: true
per-example clipping of both gradients (the code clips slices of the averaged
gradient and never clips h), Poisson sampling, an accountant, noise on the whole
h_i rather than on the Hessian term only, α aggregated on the server (the code never
aggregates it), and a correctly parenthesised finite difference (the code's is ε²
too small, i.e. first order).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxfednas.algorithms.common import AUGMENTS, make_augment
from jaxfednas.algorithms.fednas import write_architecture_plots
from jaxfednas.search_spaces import arch_entropy
from jaxfednas import privacy
from jaxfednas.privacy import mechanism as dp
from jaxfednas.privacy.accounting import ACCOUNTANTS
from jaxfednas.privacy.dp_fnas import Accountant, max_iterations
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.checkpoint import renamed_fields
from jaxfednas.config import ConfigError, ExperimentConfig, param
from jaxfednas.data.augment import augment_batch
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData
from jaxfednas.distributed import to_host
from jaxfednas.evaluation import client_accuracies, global_accuracy
from jaxfednas.optim import arch_hessian_vector, cosine_lr
from jaxfednas.precision import compute_in
from jaxfednas import rng
from jaxfednas.rng import client_keys
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, Placement, map_clients
from jaxfednas.server import Server
from jaxfednas.search_spaces.darts import PRIMITIVE_SETS, DartsSearchNetwork, DartsSpaceConfig, derive, supernet_of
from jaxfednas.search_spaces.darts.genotypes import Genotype
from jaxfednas.search_spaces.darts.masks import mask_from_genotype, mask_weights

DESCRIPTION = "DP-FNAS (Singh et al.): DARTS search with per-example clipped, noised W and α gradients per party"

ARCH_GRADIENTS = ("second_fd", "second_hvp", "first")


@dataclasses.dataclass(frozen=True)
class DPFNASConfig(DartsSpaceConfig):
    """The supernet's geometry (:class:`DartsSpaceConfig`: C, layers, nodes, primitives), then DP-FNAS' own."""
    # the server's settings are server_*: this algorithm has no client optimizer (every
    # other algorithm's algo.lr is the clients'); the w_* names are older still
    RENAMED = {**DartsSpaceConfig.RENAMED, "w_lr": "server_lr", "w_lr_min": "server_lr_min",
               "w_lr_decay_iterations": "server_lr_decay_iterations", "w_momentum": "server_momentum",
               "w_weight_decay": "server_weight_decay", "w_clip": "server_grad_clip",
               **{name: f"server_{name}" for name in ("lr", "lr_min", "lr_decay_iterations", "momentum",
                                                       "weight_decay", "grad_clip")},
               **{name: f"arch_server_{name[5:]}" for name in ("arch_optimizer", "arch_lr", "arch_weight_decay")}}
    norm: str = param("group", "per-example normalisation replacing BatchNorm (BN would couple examples)",
                      choices=("group", "layer"))
    iterations_per_round: int = param(10, "Algorithm 1 iterations per round (one compiled call)", range=(1, 100_000))
    sampling_prob: float = param(0.1, "Poisson sampling probability p on each party's training split (B/N_k)",
                                 range=(1e-9, 1.0))
    val_sampling_prob: float = param(0.0, "Poisson sampling probability on the validation split (0: sampling_prob)",
                                     range=(0.0, 1.0))
    physical_batch: int = param(0, "slots of a Poisson batch (0: auto, overflow probability <= 1e-9 per release)",
                                range=(0, None))
    clip_norm: float = param(1.0, "R^G: per-example clipping norm of weight gradients (0: none, only without noise)",
                             range=(0.0, None))
    arch_clip_norm: float = param(1.0, "R^H: per-example clipping norm of architecture gradients (0: none)",
                                  range=(0.0, None))
    noise_multiplier: float = param(1.0, "sigma: std of U_k / R^G (0: FNAS, no noise)", range=(0.0, None))
    arch_noise_multiplier: float | None = param(None, "tau: std of V_k / R^H (None: noise_multiplier)",
                                                range=(0.0, None))
    arch_gradient: str = param("second_fd", "Eq. 5 Hessian term: finite difference, exact HVP, or none (first order)",
                               choices=ARCH_GRADIENTS)
    fd_eps: float = param(0.01, "finite-difference scale: eps = fd_eps / ||grad_W' l_val|| (DARTS 0.01)",
                          range=(1e-12, None))
    aggregation: str = param("sum", "server combines party gradients by their sum (Algorithm 1) or mean",
                             choices=("sum", "mean"))
    server_lr: float = param(0.025, "server weight learning rate xi at the first iteration", range=(0.0, 100.0))
    server_lr_min: float = param(0.001, "cosine floor of xi", range=(0.0, 100.0))
    server_lr_decay_iterations: int = param(0, "iterations over which xi decays from server_lr to server_lr_min "
                                              "by a cosine (0: constant)", range=(0, None))
    server_momentum: float = param(0.9, "server weight SGD momentum", range=(0.0, 1.0))
    server_weight_decay: float = param(3e-4, "weight decay (server side, post-processing)", range=(0.0, 1.0))
    server_grad_clip: float = param(5.0, "global-norm clip of the aggregated weight gradient (0: off)",
                                    range=(0.0, None))
    arch_server_optimizer: str = param("adam", "server optimizer of A: adam (DARTS, the authors' code) or sgd "
                                "(A <- A - eta sum_k H_k, Algorithm 1 as printed)", choices=("adam", "sgd"))
    arch_server_lr: float = param(3e-4, "architecture learning rate eta", range=(0.0, 10.0))
    arch_server_weight_decay: float = param(1e-3, "architecture weight decay", range=(0.0, 1.0))
    delta: float = param(1e-5, "delta of the reported (epsilon, delta)", range=(1e-300, 0.999999))
    target_epsilon: float = param(0.0, "privacy budget: stop before epsilon (by `accountant`) of either mechanism "
                                  "exceeds it; reported as budget_epsilon (0: none)", range=(0.0, None))
    accountant: str = param("pld", "accountant enforcing target_epsilon: pld (the guarantee), rdp (looser) or clt "
                            "(the paper's asymptotic number, optimistic: warns)", choices=ACCOUNTANTS)
    per_example_chunk: int = param(0, "examples vmapped together in per-example passes (0: whole batch)",
                                   range=(0, None))
    augment: str = param("auto", "on-device augmentation", choices=AUGMENTS)
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))

    @property
    def tau(self) -> float:
        return self.noise_multiplier if self.arch_noise_multiplier is None else self.arch_noise_multiplier

    @property
    def p_val(self) -> float:
        return self.val_sampling_prob or self.sampling_prob

    def check(self):
        super().check()
        for noise, clip, nn_, cn in ((self.noise_multiplier, self.clip_norm, "noise_multiplier", "clip_norm"),
                                     (self.tau, self.arch_clip_norm, "arch_noise_multiplier", "arch_clip_norm")):
            if noise > 0 and clip <= 0:
                raise ConfigError(f"algo.{nn_}={noise} needs algo.{cn} > 0: without clipping the noise "
                                  "has no sensitivity to calibrate against")
            if noise > 0:  # the PLD epsilon reported each round must be computable: refused now, not after round 1
                try:
                    privacy.pld_interval(noise)
                except ValueError:  # (the run has no PLD interval or accountant to change: the noise is the lever)
                    raise ConfigError(f"algo.{nn_}={noise:g} is too small for the PLD accountant every DP-FNAS "
                                      "round reports (one step's privacy losses span more than its grid: epsilon "
                                      "of that order, no privacy to speak of); use a larger noise multiplier "
                                      "(e.g. from `jaxfednas privacy --target-epsilon`), or 0 for the non-private "
                                      "counterpart") from None
        if self.target_epsilon > 0 and (self.noise_multiplier <= 0 or self.tau <= 0):
            raise ConfigError("algo.target_epsilon needs noise on both mechanisms (noise_multiplier and "
                              "arch_noise_multiplier > 0)")


CONFIG = DPFNASConfig
# Each party's data: search-train (M^G) / search-val (M^H) / local test; parties get an
# IID random split as in the paper's experiments.
# Each example goes to train / val independently of the others (data.split_method): the
# reported ε = max over M^G and M^H (parallel composition) needs it.
DEFAULTS = {"data.split": (0.5, 0.25, 0.25), "data.partition": "iid", "data.split_method": "independent"}
PRESETS = {
    "smoke": {"run.rounds": 2, "algo.C": 4, "algo.layers": 2, "algo.nodes": 2, "algo.primitives": "tiny",
              "algo.iterations_per_round": 2},
    # Paper §4.1 / docs/authors_code.md §6.4: CIFAR-10, train 25k / val 25k split IID over the
    # parties (4, as Table 2), test set on the server; C=16, 8 cells; R^G=0.01,
    # R^H=0.1, noise 1 on both; batch 256 per party (p = 256 / 6250 ~ 0.04); 50 epochs
    # ~ 1225 iterations; w lr 0.05 -> 0.002 cosine, momentum 0.9, wd 3e-4, clip 5;
    # alpha Adam 3e-4 (0.5, 0.999), wd 1e-3. First-order architecture gradient: with
    # per-example clipping Eq. 5's Hessian term costs one pass over the party's training
    # batch per validation example (~2 x 256 x 256 example passes per party and
    # iteration at B = 256), out of reach here; the authors' code is effectively first
    # order too (docs/authors_code.md §6.2). Pass algo.arch_gradient=second_fd to pay for it.
    "paper": {
        "data.dataset": "cifar10", "data.num_clients": 4, "data.partition": "iid", "data.split": (0.5, 0.5, 0.0),
        "run.rounds": 49, "algo.iterations_per_round": 25, "algo.C": 16, "algo.layers": 8,
        "algo.sampling_prob": 0.04, "algo.clip_norm": 0.01, "algo.arch_clip_norm": 0.1,
        "algo.noise_multiplier": 1.0, "algo.server_lr": 0.05, "algo.server_lr_min": 0.002,
        "algo.server_lr_decay_iterations": 1225,
        "algo.per_example_chunk": 32,
        "algo.arch_gradient": "first",
    },
}


@renamed_fields(w_opt_state="opt_state.params", a_opt_state="opt_state.arch")  # before checkpoint schema 2
@flax.struct.dataclass
class DPFNASState:
    variables: dict  # {"params": W, "arch": A} of the supernet (no batch_stats: per-example norm)
    opt_state: dict  # the server optimizers' states: {"params": of W, "arch": of A}
    iteration: jax.Array  # Algorithm 1 iterations done = releases T of each mechanism per party
    round: jax.Array


def make_supernet(cfg: DPFNASConfig, info: DataInfo) -> DartsSearchNetwork:
    """The DARTS supernet of ``cfg`` with per-example normalisation (``cfg.norm``)."""
    return supernet_of(cfg, info.num_classes, norm=cfg.norm)


def sampling_probs(manifest: dict, expected_batch: float) -> tuple[float, float]:
    """``(p, p_val)``: the Poisson sampling probabilities (Algorithm 1, line 4) at which a
    party of ``manifest`` (a partition manifest) draws ``expected_batch`` of its training and
    of its validation examples in expectation, ``p = B / N_k`` over the parties' mean size
    (at most 1); equal parties (IID) share one p and so one ε."""
    n_tr = [len(c["train"]) for c in manifest["clients"]]
    n_val = [len(c["val"]) for c in manifest["clients"]]
    return min(1.0, expected_batch * len(n_tr) / sum(n_tr)), min(1.0, expected_batch * len(n_val) / sum(n_val))


def physical_batch(cfg: DPFNASConfig, max_examples: int, sampling_prob: float) -> int:
    """Slots of a party's Poisson batch for a split of ``max_examples`` padded rows
    (a multiple of ``per_example_chunk`` when chunking)."""
    b = cfg.physical_batch or dp.auto_physical_batch(max_examples, sampling_prob)
    if cfg.per_example_chunk:
        b = math.ceil(b / cfg.per_example_chunk) * cfg.per_example_chunk
    return int(b)


def example_loss(model: DartsSearchNetwork, params, arch, x, y, precision: str = "fp32"):
    """ℓ_i(W, A): cross-entropy of ONE example (the network sees a batch of one: no coupling),
    computed in ``precision`` (:mod:`jaxfednas.precision`; the loss and its gradients float32)."""
    logits = compute_in(precision, model.apply)({"params": params, "arch": arch}, x[None], train=True)[0]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return loss, (jnp.argmax(logits) == y).astype(jnp.float32)


def poisson_batch(client: ClientData, key, p: float, slots: int, tags: tuple[int, int], info: DataInfo, aug):
    """Algorithm 1, "take a Poisson subsample I_t with probability p" of a party's split, augmented."""
    sample_tag, aug_tag = tags
    s = dp.poisson_sample(jax.random.fold_in(key, sample_tag), client.count, client.y.shape[0], p, slots)
    x = augment_batch(jax.random.fold_in(key, aug_tag), info.normalize(client.x[s.idx]), aug)
    return {"x": x, "y": client.y[s.idx]}, s


def expected_batch(p: float, count: jax.Array) -> jax.Array:
    """The normaliser p N_k of G_k and H_k (public; Algorithm 1 divides by |I_t|, see Caveats)."""
    return jnp.maximum(p * count, p)


def sample_loss(loss, mask: jax.Array, expected: jax.Array, params, arch, batch) -> jax.Array:
    """Eq. 5's L_k^tr(W, A): the losses of the party's training sample, normalised as G_k."""
    losses = jax.vmap(lambda x, y: loss(params, arch, x, y)[0])(batch["x"], batch["y"])
    return jnp.where(mask, losses, 0.0).sum() / expected


def weight_gradient(loss, params, arch, e):
    """Algorithm 1: g_t^(i) = ∇_W ℓ_i(W, A) of one training example."""
    (value, correct), g = jax.value_and_grad(loss, has_aux=True)(params, arch, e["x"], e["y"])
    return g, {"loss": value, "correct": correct}


def arch_gradient(loss, w_new, arch, e, hessian_term=None, xi=None):
    """Eq. 5: h_i = ∇_A ℓ_i(W', A) − ξ ∇²_{A,W} L_k^tr(W, A) ∇_{W'} ℓ_i(W', A) of one validation
    example; ``hessian_term(v) = ∇²_{A,W} L_k^tr · v``, None: first order (Algorithm 1 as printed)."""
    if hessian_term is None:
        (value, correct), g_a = jax.value_and_grad(loss, argnums=1, has_aux=True)(w_new, arch, e["x"], e["y"])
    else:
        (value, correct), (g_a, v) = jax.value_and_grad(loss, argnums=(1, 0), has_aux=True)(
            w_new, arch, e["x"], e["y"])
        hv = hessian_term(v)
        g_a = jax.tree.map(lambda a, h: a - xi * h, g_a, hv)
    return g_a, {"loss": value, "correct": correct}


def gaussian_mechanism(clipped_sum, key, noise_tag: int, noise_std: float, expected: jax.Array):
    """Algorithm 1 / Eqs. 6-7: (Σ_i clipped + σ R U_k) / (p N_k), the party's release G_k or H_k."""
    return dp.noisy_average(clipped_sum, jax.random.fold_in(key, noise_tag), noise_std=noise_std,
                            expected_batch_size=expected)


def make_parties(cfg: DPFNASConfig, info: DataInfo, model: DartsSearchNetwork | None = None,
                 precision: str = "fp32"):
    """Party k's two releases of Algorithm 1, as the compiled round runs them (one party; the
    runtime maps them over the parties):

    * ``party_G((train, key), (W, A)) -> (G_k, stats)``: Poisson sample ``p`` of the training
      split, per-example clip to ``R^G``, add ``N(0, (σ R^G)²)``, divide by ``p N_k^tr``;
    * ``party_H((train, val, key), (W, W', A, ξ)) -> (H_k, stats)``: the same on the
      validation split with ``p_val``, ``R^H`` and ``τ`` (Eq. 5-7).

    ``key`` is the party's key of the iteration. These are the mechanisms the accountant
    (:class:`jaxfednas.privacy.Accountant`) composes: (p, σ) and (p_val, τ) per iteration.
    ``precision``: what the per-example forward and backward compute in; the clipping, the
    noise and everything after see float32 gradients, so the privacy analysis is unchanged.
    """
    model = make_supernet(cfg, info) if model is None else model
    aug = make_augment(cfg.augment, info.name)
    loss = functools.partial(example_loss, model, precision=precision)
    chunk = cfg.per_example_chunk or None

    def sample_train(train: ClientData, key):  # I ~ Poisson(p) of D_k^tr (the same key: the same examples)
        slots = physical_batch(cfg, train.y.shape[0], cfg.sampling_prob)
        return poisson_batch(train, key, cfg.sampling_prob, slots, (rng.DP_TRAIN_SAMPLE, rng.DP_TRAIN_AUG), info, aug)

    def party_G(args, shared):
        """Party k, first exchange: the clipped, noised weight gradient G_k."""
        (train, key), (params, arch) = args, shared
        batch, s = sample_train(train, key)
        g_i = functools.partial(weight_gradient, loss, params, arch)
        # Σ_{i∈I} clip_{R^G}(g_i), then G_k
        total, aux, n_clip = dp.per_example_clipped_sum(g_i, batch, s.mask, cfg.clip_norm or None, chunk=chunk)
        g_k = gaussian_mechanism(total, key, rng.DP_TRAIN_NOISE, cfg.noise_multiplier * cfg.clip_norm,
                                 expected_batch(cfg.sampling_prob, train.count))
        return g_k, {"train_loss_sum": aux["loss"], "train_correct": aux["correct"], "train_sampled": s.num_sampled,
                     "train_overflow": s.overflow, "train_clipped": n_clip}

    def party_H(args, shared):
        """Party k, second exchange: the clipped, noised architecture gradient H_k (Eq. 5-7)."""
        (train, val, key), (w_old, w_new, arch, xi) = args, shared
        slots_val = physical_batch(cfg, val.y.shape[0], cfg.p_val)
        vb, s_val = poisson_batch(val, key, cfg.p_val, slots_val, (rng.DP_VAL_SAMPLE, rng.DP_VAL_AUG), info, aug)
        hessian_term = None
        if cfg.arch_gradient != "first":  # Eq. 5's second-order term on this iteration's G_k sample
            tb, s_tr = sample_train(train, key)
            train_loss = functools.partial(sample_loss, loss, s_tr.mask, expected_batch(cfg.sampling_prob, train.count))
            method = "fd" if cfg.arch_gradient == "second_fd" else "hvp"
            hessian_term = functools.partial(arch_hessian_vector, train_loss, w_old, arch, tb, method=method,
                                             eps_scale=cfg.fd_eps)
        h_i = functools.partial(arch_gradient, loss, w_new, arch, hessian_term=hessian_term, xi=xi)
        # Σ_{i∈J} clip_{R^H}(h_i), then H_k
        total, aux, n_clip = dp.per_example_clipped_sum(h_i, vb, s_val.mask, cfg.arch_clip_norm or None, chunk=chunk)
        h_k = gaussian_mechanism(total, key, rng.DP_VAL_NOISE, cfg.tau * cfg.arch_clip_norm,
                                 expected_batch(cfg.p_val, val.count))
        return h_k, {"val_loss_sum": aux["loss"], "val_correct": aux["correct"], "val_sampled": s_val.num_sampled,
                     "val_overflow": s_val.overflow, "val_clipped": n_clip}

    return party_G, party_H


def _clt_budget_warning(cfg: DPFNASConfig, cap: int, accountant: Accountant) -> str:
    msg = (f"algo.accountant=clt enforces algo.target_epsilon={cfg.target_epsilon:g} with the CLT's "
           "asymptotic epsilon (the paper's Theorem 3.1), not an upper bound: it is usually below the PLD "
           "guarantee, so the run may spend more privacy than the target")
    if cap == privacy.NO_BUDGET:
        return msg
    eps = accountant.report(cap)["epsilon_pld"]
    if eps > cfg.target_epsilon:
        msg += f" (at the {cap} iterations it allows, PLD epsilon = {eps:.4g})"
    return msg + "; use algo.accountant=pld for a guarantee"


def privacy_budget(cfg: DPFNASConfig) -> tuple[int, Accountant]:
    """Theorem 3.1's accountant and the iterations T it allows within ``target_epsilon``."""
    cap = max_iterations(cfg)
    if cap == 0:
        raise ConfigError(f"algo.target_epsilon={cfg.target_epsilon} is exceeded by a single iteration "
                          f"(accountant {cfg.accountant}, delta {cfg.delta})")
    accountant = Accountant(cfg)
    if cfg.accountant == "clt" and cfg.target_epsilon > 0:
        warnings.warn(_clt_budget_warning(cfg, cap, accountant), stacklevel=3)  # at dp_fnas's caller
    return cap, accountant


def server_weight_optimizer(cfg: DPFNASConfig) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """Algorithm 1, server: W ← W − ξ Σ_k G_k (with momentum, weight decay, clipping; ξ's schedule)."""
    if cfg.server_lr_decay_iterations:
        xi_schedule = cosine_lr(cfg.server_lr, cfg.server_lr_min, cfg.server_lr_decay_iterations)
    else:
        xi_schedule = optax.constant_schedule(cfg.server_lr)
    w_parts = [optax.clip_by_global_norm(cfg.server_grad_clip)] if cfg.server_grad_clip else []
    w_tx = optax.chain(*w_parts, optax.add_decayed_weights(cfg.server_weight_decay),
                       optax.sgd(xi_schedule, momentum=cfg.server_momentum or None))
    return xi_schedule, w_tx


def server_arch_optimizer(cfg: DPFNASConfig) -> optax.GradientTransformation:
    """Algorithm 1, server: A ← A − η Σ_k H_k (Adam as DARTS, or SGD as printed; weight decay)."""
    a_opt = (optax.adam(cfg.arch_server_lr, b1=0.5, b2=0.999) if cfg.arch_server_optimizer == "adam"
             else optax.sgd(cfg.arch_server_lr))
    return optax.chain(optax.add_decayed_weights(cfg.arch_server_weight_decay), a_opt)


def _tree_sum(tree):
    return jax.tree.map(lambda x: x.sum(0), tree)


def server_aggregate(per_party, aggregation: str, num_parties: int):
    """Algorithm 1, server: Σ_k of the parties' releases (``aggregation="mean"``: divided by K)."""
    s = _tree_sum(per_party)
    if aggregation == "mean":
        s = jax.tree.map(lambda x: x / num_parties, s)
    return s


def server_step(tx: optax.GradientTransformation, grad, opt_state, params):
    """Algorithm 1, server: one step of ``tx`` on the aggregated release; returns (params, opt_state)."""
    upd, opt_state = tx.update(grad, opt_state, params)
    return optax.apply_updates(params, upd), opt_state


def init_state(model: DartsSearchNetwork, info: DataInfo, w_tx, a_tx, key) -> DPFNASState:
    """Algorithm 1's starting point: the supernet's W and A and both server optimizers' states."""
    x = jnp.zeros((1,) + info.image_shape, jnp.float32)
    v = dict(model.init({"params": key}, x, train=False))
    v = {"params": v["params"], "arch": v["arch"]}
    return DPFNASState(variables=v, opt_state={"params": w_tx.init(v["params"]), "arch": a_tx.init(v["arch"])},
                       iteration=jnp.int32(0), round=jnp.int32(0))


def round_metrics(stats: dict, it: jax.Array, cap: int, xi_schedule, arch) -> dict:
    """The round's diagnostics over its iterations (private-data sums: not releases, see Caveats)."""
    s = {k: v.sum() for k, v in stats.items()}
    n_tr, n_val = jnp.maximum(s["train_sampled"], 1), jnp.maximum(s["val_sampled"], 1)
    return {
        "train_loss": s["train_loss_sum"] / n_tr, "train_acc": s["train_correct"] / n_tr,
        "search_val_loss": s["val_loss_sum"] / n_val, "search_val_acc": s["val_correct"] / n_val,
        "train_sampled": s["train_sampled"], "val_sampled": s["val_sampled"],
        "train_overflow": s["train_overflow"], "val_overflow": s["val_overflow"],
        "train_clipped_frac": s["train_clipped"] / n_tr, "val_clipped_frac": s["val_clipped"] / n_val,
        "iterations": it, "iterations_run": s["iterations_run"], "max_iterations": jnp.int32(cap),
        "budget_exhausted": (it >= cap).astype(jnp.int32), "lr": xi_schedule(it),
        "arch_entropy": arch_entropy(arch),
    }


def privacy_spent(cfg: DPFNASConfig, accountant: Accountant, state: DPFNASState,
                  data: FederatedData) -> dict[str, float]:
    """Theorem 3.1 (and the PLD guarantee): μ and ε per mechanism after the T iterations done."""
    t = int(to_host(state.iteration))
    out = dict(accountant.report(t))
    if cfg.noise_multiplier > 0 or cfg.tau > 0:
        counts = to_host((data.train.counts, data.val.counts))  # (gathered if split over processes)
        out.update(accountant.overflow_bound(
            t, counts[0], counts[1], physical_batch(cfg, data.train.y.shape[1], cfg.sampling_prob),
            physical_batch(cfg, data.val.y.shape[1], cfg.p_val)))
    return out


def evaluate_supernet(cfg: DPFNASConfig, model: DartsSearchNetwork, info: DataInfo, placement: Placement,
                      state: DPFNASState, data: FederatedData) -> dict:
    """Test accuracy of the searched supernet (W, A) on the server's and the parties' splits (§4)."""
    def logits_fn(variables):
        return lambda x: model.apply(variables, info.normalize(x), train=False)

    v = state.variables
    out = global_accuracy(logits_fn(v), data, cfg.eval_batch_size)
    for split in ("val", "test"):
        out.update(client_accuracies(logits_fn, v, data, cfg.eval_batch_size, placement=placement, split=split))
    out["arch_entropy"] = arch_entropy(v["arch"])
    out["iterations"] = state.iteration
    return out


def make_inherited_accuracy(cfg: DPFNASConfig, info: DataInfo):
    """The weight-sharing estimate of a cell's accuracy, for ranking cells by the searched
    supernet (as :func:`jaxfednas.algorithms.fednas.make_inherited_accuracy`):
    ``accuracy(variables, genotype, data)`` is the global test accuracy of the supernet
    ``variables`` (W, A) with every edge fixed to ``genotype``'s operation (a 0/1 mask).
    Its normalisation is per example (``cfg.norm``), so there are no statistics to
    recalibrate. One compiled program serves every genotype."""
    model = make_supernet(cfg, info)
    primitives = PRIMITIVE_SETS[cfg.primitives]

    def accuracy(variables, weights, data):
        logits = lambda x: model.apply(variables, info.normalize(x), train=False, arch_weights=weights)  # noqa: E731
        return global_accuracy(logits, data, cfg.eval_batch_size)["global_test_acc"]

    compiled = jit(accuracy)

    def of(variables: dict, genotype: Genotype, data: FederatedData) -> float:
        return float(compiled(variables, mask_weights(mask_from_genotype(genotype, primitives, cfg.nodes)), data))

    return of


def export_genotype(cfg: DPFNASConfig, state: DPFNASState):
    """The searched architecture: DARTS' derivation from A (the paper's final cell)."""
    arch = jax.device_get(state.variables["arch"])
    return derive(arch["alphas_normal"], arch["alphas_reduce"], primitives=PRIMITIVE_SETS[cfg.primitives],
                  steps=cfg.nodes, multiplier=cfg.nodes)


@checked_factory(DPFNASConfig)
def dp_fnas(cfg: DPFNASConfig, info: DataInfo, *, run: RunOptions = RunOptions()) -> FederatedAlgorithm:
    """DP-FNAS (Algorithm 1) on data described by ``info``; every party takes part in
    every iteration. ``round`` and ``evaluate`` are compiled; the host accountant's μ
    and ε per mechanism for the iterations done so far are ``host_metrics(state,
    data)``, which the runner adds to both. Nothing depends on ``run.rounds``, so a
    finished run can be extended or resumed exactly.

    Args:
      cfg: the supernet, the mechanisms (clipping, noise, sampling) and the server's
        optimizers (:class:`DPFNASConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`); of
        its options DP-FNAS honours the placement and ``run.precision``, what the parties'
        per-example gradients compute in (evaluation float32); the others are refused
        (every party in every iteration: the accountant's assumption).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``dp_fnas`` with ``export`` and
      ``host_metrics`` (μ and ε).
    """
    placement, precision = run.placement, run.precision
    model = make_supernet(cfg, info)
    cap, accountant = privacy_budget(cfg)
    xi_schedule, w_tx = server_weight_optimizer(cfg)
    a_tx = server_arch_optimizer(cfg)
    party_G, party_H = make_parties(cfg, info, model, precision)
    aggregate = functools.partial(server_aggregate, aggregation=cfg.aggregation, num_parties=info.num_clients)

    def iteration(carry, key, data: FederatedData):
        """One iteration of Algorithm 1 (skipped, with no release, once the budget is spent)."""
        keys = client_keys(key, jnp.arange(info.num_clients))
        train, val = data.all_clients("train"), data.all_clients("val")

        variables, w_state, a_state, it = carry
        params, arch = variables["params"], variables["arch"]
        # Past the budget the parties skip their work (each inside its own client slot: no
        # lax.cond around map_clients, see its docstring) and the carry is kept as it was.
        go = it < cap
        g_k, st_g = map_clients(party_G, (train, keys), (params, arch), placement=placement,
                                active=go)  # every party: G_k
        xi = xi_schedule(it)  # the step size of this W update (Eq. 5's xi)
        new_params, new_w_state = server_step(w_tx, aggregate(g_k), w_state, params)  # W' = W − ξ Σ_k G_k
        h_k, st_h = map_clients(party_H, (train, val, keys), (params, new_params, arch, xi),
                                placement=placement, active=go)  # every party: H_k (Eq. 5-7)
        new_arch, new_a_state = server_step(a_tx, aggregate(h_k), a_state, arch)  # A ← A − η Σ_k H_k
        stats = {k: v.sum() for k, v in {**st_g, **st_h}.items()}
        stats["iterations_run"] = go.astype(jnp.int32)
        stepped = ({"params": new_params, "arch": new_arch}, new_w_state, new_a_state, it + 1)
        return jax.tree.map(lambda new, old: jnp.where(go, new, old), stepped, carry), stats

    def init(key):
        return init_state(model, info, w_tx, a_tx, key)

    def round_fn(state: DPFNASState, data: FederatedData, key):
        carry = (state.variables, state.opt_state["params"], state.opt_state["arch"], state.iteration)
        carry, stats = jax.lax.scan(lambda c, j: iteration(c, rng.dp_iteration_key(key, j), data), carry,
                                    jnp.arange(cfg.iterations_per_round))
        variables, w_state, a_state, it = carry
        metrics = round_metrics(stats, it, cap, xi_schedule, variables["arch"])
        return state.replace(variables=variables, opt_state={"params": w_state, "arch": a_state}, iteration=it,
                             round=state.round + 1), metrics

    def evaluate(state: DPFNASState, data: FederatedData):
        return evaluate_supernet(cfg, model, info, placement, state, data)

    return FederatedAlgorithm(name="dp_fnas", init=placement.jit_init(init), round=jit(round_fn),
                              evaluate=jit(evaluate), export=functools.partial(export_genotype, cfg),
                              host_metrics=functools.partial(privacy_spent, cfg, accountant),
                              write_architecture=write_architecture_plots)


def privacy_report(cfg: DPFNASConfig, iterations: int) -> privacy.DPFNASReport:
    """The full per-party report (CLT, PLD and RDP per mechanism) after ``iterations``."""
    if cfg.noise_multiplier <= 0 or cfg.tau <= 0:
        raise ValueError("privacy_report needs noise on both mechanisms")
    spec = lambda name, p, s, r: privacy.MechanismSpec(  # noqa: E731
        name=name, sampling_prob=p, noise_multiplier=s, clip_norm=r, steps=max(1, iterations))
    return privacy.dpfnas_report(train=spec("weights/train (M^G)", cfg.sampling_prob, cfg.noise_multiplier,
                                            cfg.clip_norm),
                                 val=spec("arch/val (M^H)", cfg.p_val, cfg.tau, cfg.arch_clip_norm),
                                 delta=cfg.delta)


def check(config: ExperimentConfig) -> None:
    """What needs the whole configuration, before the factory (:func:`jaxfednas.registry.build_algorithm`)."""
    if config.data.split[1] <= 0:
        raise ConfigError(f"data.split={config.data.split}: DP-FNAS needs a validation split (M^H runs on it), "
                          "e.g. --set data.split=0.5,0.25,0.25")
    cpr = config.run.clients_per_round
    if not (cpr == 1.0 or cpr == config.data.num_clients):
        raise ConfigError(f"run.clients_per_round={cpr}: every party takes part in every iteration of "
                          "Algorithm 1 (the accountant assumes it); use 1.0")
    if config.data.split_method != "independent":
        raise ConfigError(f"data.split_method={config.data.split_method!r}: the reported ε (max over the train and "
                          "validation mechanisms) needs each example's split drawn independently of the other "
                          "examples; use data.split_method=independent (the DP-FNAS default)")
    if config.run.dropout_rate > 0:
        raise ConfigError(f"run.dropout_rate={config.run.dropout_rate}: DP-FNAS's Algorithm 1 and its accountant "
                          "have every party in every iteration; use 0")
    if config.run.precision != "fp32" and config.algo.arch_gradient == "second_fd":
        raise ConfigError(f"run.precision={config.run.precision!r} with algo.arch_gradient=second_fd: the finite "
                          "difference W' ± ε v (ε = 0.01/‖v‖) is below bfloat16's resolution of W'; use "
                          "algo.arch_gradient=second_hvp or first, or run.precision=fp32")
    if config.algo.arch_gradient == "second_hvp" and Placement.from_run(config.run).resolved() == "shard_map":
        raise ConfigError("algo.arch_gradient=second_hvp under placement shard_map (run.placement=auto on several "
                          "devices picks it): JAX cannot batch the per-example second-order gradient of a grouped "
                          "(depthwise) convolution inside shard_map; use run.placement=map or vmap, or "
                          "algo.arch_gradient=second_fd")
    server = Server.from_run(config.run)
    server.refuse("dp_fnas", "its privacy accountant assumes every party in every iteration (it samples examples, "
                  "not parties: algo.sampling_prob); use run.sampler=uniform", sampler=True)
    server.refuse("dp_fnas", "the server sums the parties' noisy gradients (algo.aggregation) and steps W and α with "
                  "its own optimizers (algo.server_momentum, algo.arch_server_optimizer); there are no client models "
                  "to combine",
                  aggregator=True, optimizer=True, arch_optimizer=True)


FACTORY = dp_fnas
RUN_OPTIONS = ("precision",)


__all__ = ["Accountant", "DPFNASConfig", "DPFNASState", "dp_fnas", "make_parties", "make_supernet",
           "make_inherited_accuracy", "max_iterations", "physical_batch", "privacy_report"]
