"""DFNAS — Garg, Saha, Dutta, "Direct Federated Neural Architecture Search"
(arXiv:2010.06223), Algorithms 1 and 2, with DSNAS' estimator (Hu et al., "DSNAS: Direct
Neural Architecture Search without Parameter Retraining", arXiv:2002.09128, §3).

Algorithm 1 (client local search), every local step:

1. sample a one-hot Z_l ~ Cat(softmax(α_l)) for every choice block l (no temperature);
2. build the child of Z and multiply each block's output by a gate 1_l (= 1.0);
3. forward a minibatch to get L;
4. backward L to w and to the gates: the block credit ∂L/∂1_l = ⟨∂L/∂y_l, y_l⟩;
5. w ← SGD(∂L/∂w) and α ← Adam(∂L/∂1_l · ∂log p_α(Z)/∂α_l), where
   ∂log p_α(Z)/∂α_l = Z_l − softmax(α_l)  (the DSNAS gradient, §3.2);
6. "prune edges with α < α_th" — DSNAS' early fixing, see below.

Only the sampled unit of a block runs (``lax.switch``), and only its weights move: like
PyTorch's SGD skipping parameters without a gradient, the other units keep their
weights, momentum and BatchNorm statistics (weight decay included).

Algorithm 2 (server): sample clients, run Algorithm 1 on each from (w_t, α_t), then
w_{t+1} = Σ n_i/n w^i and α_{t+1} = Σ n_i/n α^i (BatchNorm statistics likewise).
One stage: the final child argmax(α) is the deliverable and is evaluated as is,
without retraining (:func:`jaxfednas.algorithms.dfnas.child_report` gives its size and cost).

Early fixing ("pruning"). DSNAS fixes block l to its argmax for the rest of the search
once p_top1 − p_top2 ≥ h (h = ``fix_threshold``, 0.3): from then on Z_l is that
one-hot and α_l is frozen. In the paper's words every candidate whose probability is
below the threshold α_th,l = p_top1 − h is pruned; the block is fixed when that prunes
all candidates but the argmax, which is exactly the DSNAS rule (docs/authors_code.md §7 row 17).
In the federated setting the rule is applied by the server to the aggregated α after
every round (DSNAS applies it at every epoch start; a round is one start of local
search from the shared α) and fixed blocks never unfix.

Resource constraint (DSNAS §3.3, optional: ``macs_coef`` > 0). The search loss gains
a penalty on the multiply-adds C(Z) of the sampled child above a target t, L + λ·C(Z)
while C(Z) > t. C(Z) is a sum of table lookups, C(Z) = C_0 + Σ_l F[l, Z_l]
(:func:`jaxfednas.search_spaces.shufflenet.macs_table`; stem and head C_0 are fixed), and is not
differentiable in Z, so it reaches α only through the score function, block by block
(SNAS' local decomposition: the other blocks' costs do not depend on α_l)::

    ∂/∂α_l ← ∂L/∂1_l·(Z_l − p_l) + λ·1[C(Z) > t]·(F[l, Z_l] − Σ_c p_lc F[l, c])·(Z_l − p_l),

with p_l = softmax(α_l) and F in millions of multiply-adds. The baseline Σ_c p_lc F[l, c]
leaves the expectation unchanged (E[Z_l − p_l] = 0) and removes most of the noise of a
penalty that is positive for every sample. While every child is over the target the
term is an unbiased estimate of ∇α λ·E[C(Z)]; near the target it is DSNAS' rule of
penalising only the samples over it (its code: 290 MFLOPs of blocks). w is unaffected.
Two differences from DSNAS' code, which backpropagates λ·Σ_l p_l[Z_l]·F[l, Z_l]: the
code's α gradient is the score times p_l[Z_l] (a rescaling of λ that grows as a block
concentrates) and has no baseline. Round metrics report ``expected_macs`` (the
expected C(Z) under softmax(α), fixed blocks at their choice) and ``child_macs``
(argmax(α)'s).

Single-path cost: on a device clients must run one after another so that a per-client
``lax.switch`` stays a real branch (under ``vmap`` it computes every candidate);
:meth:`jaxfednas.runtime.Placement.single_path` turns ``auto`` into a sequential map
within each device.

Hyper-parameters (the paper gives none): SGD momentum 0.9, weight decay 4e-5 on
convolution/linear kernels only and label smoothing 0.1 (DSNAS); α by Adam with
betas (0.5, 0.999), no weight decay (DSNAS); learning rate cosine-annealed over the
rounds; optimizers fresh every round (clients are stateless).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxfednas.algorithms.common import AUGMENTS, federated_batch_statistics, make_augment
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import ConfigError, Validated, param
from jaxfednas.data.augment import augment_batch
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData, run_local_epochs
from jaxfednas.evaluation import client_accuracies, global_accuracy
from jaxfednas.optim import active_momentum, rate_at, rate_schedule
from jaxfednas.precision import compute_in
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, Placement, map_clients
from jaxfednas.server import tolerate_missing_server_state
from jaxfednas.search_spaces import arch_entropy
from jaxfednas.search_spaces.shufflenet import (
    auto_depthwise_impl, BN_MOMENTUM, child_cost, derive, get_space, macs_table, MacsTable, ShuffleArch,
    ShuffleNetwork, SPACES,
)

DESCRIPTION = "DFNAS (Garg et al.): DSNAS single-path search on a ShuffleNetV2 supernet, FedAvg of w and α"


@dataclasses.dataclass(frozen=True)
class DFNASConfig(Validated):
    SECTION = "algo"
    RENAMED = {"w_lr": "lr", "w_momentum": "momentum", "w_weight_decay": "weight_decay",
               "flops_coef": "macs_coef", "flops_target": "macs_target"}
    space: str = param("small", "choice-block space (cross_silo: 20x4 CIFAR, cross_device: 12x3, small: digits)",
                       choices=tuple(SPACES))
    local_epochs: int = param(1, "local epochs E per round", range=(1, 10_000))
    batch_size: int = param(32, "local minibatch size", range=(1, 1_000_000))
    lr: float = param(0.1, "weight SGD learning rate (round 0)", range=(0.0, 100.0))
    lr_schedule: str = param("cosine", "cosine: anneal to 0 over the rounds; constant", choices=("cosine", "constant"))
    momentum: float = param(0.9, "weight SGD momentum", range=(0.0, 1.0))
    weight_decay: float = param(4e-5, "weight decay on conv/linear kernels (not BatchNorm)", range=(0.0, 1.0))
    label_smoothing: float = param(0.1, "label smoothing of the cross entropy", range=(0.0, 1.0))
    arch_lr: float = param(1e-3, "α Adam learning rate (DSNAS 1e-3)", range=(0.0, 10.0))
    fix_threshold: float = param(0.3, "fix a block once top-1 minus top-2 probability >= this (0: never)",
                                 range=(0.0, 1.0))
    augment: str = param("auto", "on-device augmentation", choices=AUGMENTS)
    dw_impl: str = param("auto", "depthwise conv form (auto: grouped on GPU; on CPU slices from 16x16 up, "
                         "grouped below; benchmarks/RESULTS.md; hybrid: grouped with a per-tap kernel gradient, jaxfednas.nn)",
                         choices=("auto", "grouped", "slices", "hybrid"))
    bn_eps: float = param(1e-5, "BatchNorm eps (DSNAS' ImageNet runs: 1e-2)", range=(0.0, 1.0))
    scan_blocks: bool = param(False, "run the identical blocks of a stage as one lax.scan: same variables and "
                              "numbers, traced once per stage (cross_silo local search on 2 CPU cores: compile "
                              "-10 to -26%, step +15 to +27%; docs/papers/dfnas.md)")
    bn_recalibration_batches: int = param(
        20, "evaluate the child with BatchNorm statistics re-estimated on up to this many training batches per "
        "client, averaged n_i/n (0: the running statistics of the search)", range=(0, None))
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))
    macs_coef: float = param(
        0.0, "DSNAS' resource constraint: α penalty λ per million multiply-adds of the sampled child while it is "
        "over macs_target (0: off; DSNAS' ImageNet search: 1e-6 to 1e-5)", range=(0.0, None))
    macs_target: int | float = param(
        0.82, "multiply-adds per image above which a sampled child is penalised: an integer count, or a float "
        "fraction in [0, 1] of the space's largest child (0.82: DSNAS' 290M of blocks on ImageNet)",
        range=(0, None))

    def check(self):
        if isinstance(self.macs_target, float) and self.macs_target > 1.0:
            raise ConfigError(f"algo.macs_target={self.macs_target!r}: a float is a fraction of the largest "
                              "child in [0, 1]; give multiply-adds as an integer")


CONFIG = DFNASConfig
PRESETS = {
    "smoke": {"run.rounds": 3},
    # Paper §3, Table 1 / Fig. 1: CIFAR-10, Dir(0.5), 8 clients, 150 rounds, the 4^20 space.
    "cross-silo": {
        "data.dataset": "cifar10", "data.num_clients": 8, "data.partition": "dirichlet", "data.alpha": 0.5,
        "data.split": (1.0, 0.0, 0.0), "run.rounds": 150, "algo.space": "cross_silo", "algo.batch_size": 64,
    },
    # Fig. 2: CINIC-10, 16 clients, 250 rounds, the 3^12 space.
    "cross-device": {
        "data.dataset": "cinic10", "data.num_clients": 16, "data.partition": "dirichlet", "data.alpha": 0.5,
        "data.split": (1.0, 0.0, 0.0), "run.rounds": 250, "algo.space": "cross_device", "algo.batch_size": 64,
    },
}


@tolerate_missing_server_state
@flax.struct.dataclass
class DFNASState:
    variables: dict  # supernet {"params", "arch": {"alpha": [blocks, candidates]}, "batch_stats"}
    fixed: jax.Array  # [blocks] bool: block frozen by early fixing
    fixed_choice: jax.Array  # [blocks] int32: its candidate (meaningful where fixed)
    round: jax.Array
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


def sample_path(key: jax.Array, alpha: jax.Array, fixed: jax.Array, fixed_choice: jax.Array) -> jax.Array:
    """Step 1: Z_l ~ Cat(softmax(α_l)) per block (no temperature); fixed blocks forced."""
    z = jax.random.categorical(key, alpha, axis=-1)
    return jnp.where(fixed, fixed_choice, z).astype(jnp.int32)


def dsnas_arch_grad(credit: jax.Array, path: jax.Array, alpha: jax.Array) -> jax.Array:
    """Step 5's α gradient: ∂L/∂1_l · ∂log p_α(Z)/∂α_l = credit_l · (Z_l − softmax(α_l))."""
    z = jax.nn.one_hot(path, alpha.shape[-1], dtype=alpha.dtype)
    return credit[:, None] * (z - jax.nn.softmax(alpha, -1))


def macs_credit(path: jax.Array, alpha: jax.Array, table: jax.Array, fixed_cost: float, target: float,
                 coef: float) -> jax.Array:
    """The resource constraint's block credits (module docstring): λ·1[C(Z) > t]·(F[l, Z_l]
    − E_{softmax(α_l)} F[l]); ``table`` [blocks, candidates] and the costs in millions of
    multiply-adds. Added to ∂L/∂1_l, :func:`dsnas_arch_grad` turns it into the score-function
    gradient of the penalty."""
    cost = jnp.take_along_axis(table, path[:, None], -1)[:, 0]
    over = fixed_cost + cost.sum() > target
    baseline = (jax.nn.softmax(alpha, -1) * table).sum(-1)
    return jnp.where(over, coef * (cost - baseline), 0.0)


def expected_cost(alpha: jax.Array, fixed: jax.Array, fixed_choice: jax.Array, table: jax.Array,
                  fixed_cost: float) -> jax.Array:
    """E[C(Z)] under Z_l ~ softmax(α_l), fixed blocks at their choice (units of ``table``)."""
    p = jnp.where(fixed[:, None], jax.nn.one_hot(fixed_choice, alpha.shape[-1]), jax.nn.softmax(alpha, -1))
    return fixed_cost + (p * table).sum()


def cost_table(cfg: DFNASConfig, info: DataInfo) -> MacsTable:
    """Multiply-adds per block and candidate of ``cfg.space`` on ``info``'s images."""
    return macs_table(cfg.space, info.num_classes, tuple(info.image_shape))


def target_macs(cfg: DFNASConfig, table: MacsTable) -> float:
    """``cfg.macs_target`` in multiply-adds (a float is a fraction of the largest child)."""
    if isinstance(cfg.macs_target, float):
        return cfg.macs_target * float(table.fixed + table.blocks.max(-1).sum())
    return float(cfg.macs_target)


def macs_penalty(cfg: DFNASConfig, info: DataInfo) -> Callable:
    """``penalty(path, alpha) -> [blocks]``: :func:`macs_credit` with ``cfg``'s λ, target and
    the space's cost table in millions of multiply-adds."""
    table = cost_table(cfg, info)
    target = target_macs(cfg, table)
    if target >= table.fixed + table.blocks.max(-1).sum():
        warnings.warn(f"algo.macs_target={cfg.macs_target!r} ({target:,.0f} multiply-adds) is not below the "
                      f"largest child of space {cfg.space!r}: the FLOPs penalty never applies", stacklevel=3)
    mega = jnp.asarray(table.blocks / 1e6, jnp.float32)
    return lambda path, alpha: macs_credit(path, alpha, mega, table.fixed / 1e6, target / 1e6, cfg.macs_coef)


def fix_blocks(alpha: jax.Array, fixed: jax.Array, fixed_choice: jax.Array, threshold: float):
    """Step 6 (DSNAS early fixing): fix every block whose top-1 minus top-2 probability
    reaches ``threshold`` to its argmax; already-fixed blocks stay as they are."""
    if threshold <= 0:
        return fixed, fixed_choice
    p = jnp.sort(jax.nn.softmax(alpha, -1), axis=-1)
    newly = (p[:, -1] - p[:, -2] >= threshold) & ~fixed
    choice = jnp.where(newly, jnp.argmax(alpha, -1), fixed_choice).astype(jnp.int32)
    return fixed | newly, choice


def unit_mask(params: dict, path: jax.Array, num_candidates: int) -> dict:
    """1.0 for every leaf that ran this step (stem, head, the sampled unit of each block),
    0.0 for the units that did not."""
    def block_mask(l, tree):
        onehot = jax.nn.one_hot(path[l], num_candidates)
        return {u: jax.tree.map(lambda _: onehot[int(u.split("_")[1])], sub) for u, sub in tree.items()}

    return {
        name: block_mask(int(name[len("block"):]), tree) if name.startswith("block")
        else jax.tree.map(lambda _: jnp.float32(1.0), tree)
        for name, tree in params.items()
    }


def depthwise_impl(cfg: DFNASConfig, info: DataInfo) -> str:
    """``cfg.dw_impl``, with ``auto`` resolved by :func:`jaxfednas.search_spaces.shufflenet.auto_depthwise_impl`."""
    return auto_depthwise_impl(min(info.image_shape[:2])) if cfg.dw_impl == "auto" else cfg.dw_impl


def make_supernet(cfg: DFNASConfig, info: DataInfo, *, all_paths: bool = False) -> ShuffleNetwork:
    return ShuffleNetwork(get_space(cfg.space), info.num_classes, dw_impl=depthwise_impl(cfg, info),
                          all_paths=all_paths, bn_eps=cfg.bn_eps, scan_blocks=cfg.scan_blocks)


def make_local_search(cfg: DFNASConfig, info: DataInfo, model: ShuffleNetwork, epochs: int, *,
                      precision: str = "fp32") -> Callable:
    """``local_search(variables, fixed, fixed_choice, lr, client, key) -> (variables, metrics)``:
    Algorithm 1 for ``epochs`` local epochs on the client's training split. ``precision``: what
    the forward and backward compute in (:func:`jaxfednas.precision.compute_in`: weights, gate
    credits and BatchNorm statistics stay float32)."""
    aug = make_augment(cfg.augment, info.name)
    apply = compute_in(precision, model.apply)
    nc = model.space.num_candidates
    arch_tx = optax.adam(cfg.arch_lr, b1=0.5, b2=0.999)
    penalty = macs_penalty(cfg, info) if cfg.macs_coef > 0 else None  # static: off compiles today's program

    def loss_fn(params, gates, stats, batch, path):
        logits, new = apply({"params": params, "batch_stats": stats}, batch["x"], path, gates, train=True,
                            mask=batch["mask"], mutable=["batch_stats"])
        mask = batch["mask"]
        labels = optax.smooth_labels(jax.nn.one_hot(batch["y"], info.num_classes), cfg.label_smoothing)
        ce = optax.softmax_cross_entropy(logits, labels) * mask
        correct = ((jnp.argmax(logits, -1) == batch["y"]) & mask).sum()
        return ce.sum() / jnp.maximum(mask.sum(), 1), (new["batch_stats"], {"loss_sum": ce.sum(), "correct": correct})

    def local_search(variables, fixed, fixed_choice, lr, client: ClientData, key):
        params, alpha = variables["params"], variables["arch"]["alpha"]
        # 5: SGD on the units that ran (others keep weights and momentum, as PyTorch skips
        # parameters without a gradient); weight decay on kernels only.
        kernels = lambda tree: jax.tree.map(lambda v: v.ndim > 1, tree)  # noqa: E731
        w_tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=kernels),
                           active_momentum(cfg.momentum), optax.scale_by_learning_rate(lr))

        def step(carry, batch, k):
            params, w_state, stats, alpha, arch_state = carry
            k_z, k_aug = jax.random.split(k)
            path = sample_path(k_z, alpha, fixed, fixed_choice)  # 1
            batch = {**batch, "x": augment_batch(k_aug, info.normalize(batch["x"]), aug)}
            gates = jnp.ones((alpha.shape[0],), jnp.float32)  # 2: the "1" after every block
            (_, (new_stats, ms)), (g_w, credit) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                params, gates, stats, batch, path)  # 3-4
            upd, w_state = w_tx.update(g_w, w_state, params, active=unit_mask(params, path, nc))  # 5
            params = optax.apply_updates(params, upd)
            arch_credit = credit if penalty is None else credit + penalty(path, alpha)  # resource constraint: α only
            g_a = jnp.where(fixed[:, None], 0.0, dsnas_arch_grad(arch_credit, path, alpha))
            upd, arch_state = arch_tx.update(g_a, arch_state, alpha)
            alpha = jnp.where(fixed[:, None], alpha, optax.apply_updates(alpha, upd))  # fixed α stays as stored
            metrics = {"loss_sum": ms["loss_sum"], "correct": ms["correct"], "examples": batch["mask"].sum(),
                       "credit_sum": credit}
            return (params, w_state, new_stats, alpha, arch_state), metrics

        carry = (params, w_tx.init(params), variables["batch_stats"], alpha, arch_tx.init(alpha))
        (params, _, stats, alpha, _), metrics = run_local_epochs(
            step, carry, client, key, epochs=epochs, batch_size=cfg.batch_size)
        return {"params": params, "arch": {"alpha": alpha}, "batch_stats": stats}, metrics

    return local_search


@checked_factory(DFNASConfig)
def dfnas(
    cfg: DFNASConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
) -> FederatedAlgorithm:
    """DFNAS (Algorithm 2 around Algorithm 1) on data described by ``info``.

    Args:
      cfg: the ShuffleNet supernet, the DSNAS local search and its schedule (:class:`DFNASConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`):
        ``run.rounds`` (the cosine horizon, needed), clients per round, placement (clients
        mapped one at a time on a device: a single path each), the server (sampler,
        aggregator, server optimizers of w and α; fixed blocks keep their α whatever the α
        optimizer), drop-out and ``run.precision``, what the local search computes in
        (evaluation runs in float32).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``dfnas`` with ``export``.
    """
    rounds = run.need_rounds("dfnas")
    server, precision = run.server, run.precision
    model = make_supernet(cfg, info)
    server.check_clients(info.num_clients, run.clients(info.num_clients))
    placement = run.placement.single_path()
    local_search = make_local_search(cfg, info, model, cfg.local_epochs, precision=precision)
    nb = model.space.num_blocks
    table = cost_table(cfg, info)
    madds = jnp.asarray(table.blocks, jnp.float32)  # float32 sums: exact to ~1e-7 relative

    def init(key):
        x = jnp.zeros((1,) + info.image_shape, jnp.float32)
        v = dict(model.init({"params": key}, x, train=False))
        return DFNASState(variables=v, fixed=jnp.zeros((nb,), bool), fixed_choice=jnp.zeros((nb,), jnp.int32),
                          round=jnp.int32(0), server=server.init(v, ("params", "arch")))

    learning_rate = rate_schedule(cfg.lr_schedule, cfg.lr, horizon=rounds)  # a number or a schedule of the round

    def round_fn(state: DFNASState, data: FederatedData, key):
        idx, keys = run.sample(key, state.round, data, info.num_clients)  # Alg. 2: select S_t
        lr = rate_at(learning_rate, state.round)
        per_client = (data.clients("train", idx), keys)
        shared = (state.variables, state.fixed, state.fixed_choice, lr)
        new_vars, met = map_clients(
            lambda c, s: local_search(*s, *c), per_client, shared, placement=placement)  # Alg. 1 on each
        # Alg. 2: w and α averaged with n_i / n (failed clients weigh 0), the server optimizers of both
        avg, opt, reported = run.combine(new_vars, per_client[0].count, key, idx, state.variables, state.server,
                                         ("params", "arch"))
        # fixed blocks keep their stored α exactly (an average of equal values can round)
        old_alpha = state.variables["arch"]["alpha"]
        avg["arch"] = {"alpha": jnp.where(state.fixed[:, None], old_alpha, avg["arch"]["alpha"])}
        fixed, choice = fix_blocks(avg["arch"]["alpha"], state.fixed, state.fixed_choice, cfg.fix_threshold)
        n = jnp.maximum(met["examples"].sum(), 1)
        metrics = {
            "train_loss": met["loss_sum"].sum() / n,
            "train_acc": met["correct"].sum() / n,
            "local_steps": met["steps"].sum(),
            "lr": lr,
            "arch_entropy": arch_entropy(avg["arch"]["alpha"]),
            "fixed_blocks": fixed.sum(),
            "expected_macs": expected_cost(avg["arch"]["alpha"], fixed, choice, madds, table.fixed),
            "child_macs": table.fixed + jnp.take_along_axis(
                madds, jnp.argmax(avg["arch"]["alpha"], -1)[:, None], -1).sum(),
            **reported,
        }
        return DFNASState(variables=avg, fixed=fixed, fixed_choice=choice, round=state.round + 1, server=opt), metrics

    def recalibrated(variables, path, data: FederatedData):
        return recalibrated_child(cfg, info, model, variables, path, data, max_batches=cfg.bn_recalibration_batches,
                                  placement=placement)

    def evaluate(state: DFNASState, data: FederatedData):
        """The final child argmax(α), run inside the supernet (its output equals the built
        child's, tested), on the global test set and on every client's test split: with the
        supernet's averaged running BatchNorm statistics (``global_test_acc``,
        ``client_test_acc*``, as every algorithm) and, when ``bn_recalibration_batches`` > 0,
        with the child's statistics re-estimated on the clients' training data
        (``global_test_acc_bn_recal``, ``client_test_acc_bn_recal*``)."""
        v = state.variables
        path = jnp.argmax(v["arch"]["alpha"], -1)

        def logits(variables):
            return lambda x: model.apply(variables, info.normalize(x), path, train=False)

        out = global_accuracy(logits(v), data, cfg.eval_batch_size)
        out.update(client_accuracies(logits, v, data, cfg.eval_batch_size, placement=placement))
        if cfg.bn_recalibration_batches:
            child = recalibrated(v, path, data)
            out["global_test_acc_bn_recal"] = global_accuracy(logits(child), data, cfg.eval_batch_size)["global_test_acc"]
            out.update(client_accuracies(logits, child, data, cfg.eval_batch_size, placement=placement, tag="_bn_recal"))
        out["arch_entropy"] = arch_entropy(v["arch"]["alpha"])
        out["fixed_blocks"] = state.fixed.sum()
        return out

    def export(state: DFNASState) -> ShuffleArch:
        return derive(state.variables["arch"]["alpha"], cfg.space)

    return FederatedAlgorithm(name="dfnas", init=placement.jit_init(init), round=jit(round_fn), evaluate=jit(evaluate),
                              export=export)


def recalibrated_child(cfg: DFNASConfig, info: DataInfo, model, variables: dict, path: jax.Array,
                       data: FederatedData, *, max_batches: int, placement: Placement) -> dict:
    """Federated BatchNorm recalibration of the child ``path`` (DSNAS recalibrates its child
    before deployment; no weight changes): every client measures the child's batch
    statistics on up to ``max_batches`` batches of its training data, the server pools them
    n_i/n. In the supernet each unit's running statistics were only updated when it was
    sampled, and mostly under other paths; the child's own statistics replace them. Returns
    ``{"params", "batch_stats"}`` of the child inside the supernet."""
    def stats_of(stats, x, mask):
        return model.apply({"params": variables["params"], "batch_stats": stats}, info.normalize(x), path,
                           train=True, mask=mask, mutable=["batch_stats"])[1]["batch_stats"]

    zeros = jax.tree.map(jnp.zeros_like, variables["batch_stats"])
    stats = federated_batch_statistics(stats_of, zeros, data, batch_size=cfg.eval_batch_size, max_batches=max_batches,
                                       momentum=BN_MOMENTUM, placement=placement)
    return {"params": variables["params"], "batch_stats": stats}


def make_inherited_accuracy(cfg: DFNASConfig, info: DataInfo, *, placement: Placement = Placement()
                            ) -> Callable[[dict, ShuffleArch, FederatedData], float]:
    """The weight-sharing estimate of a child's accuracy, for ranking children by the
    trained supernet: ``accuracy(variables, arch, data)`` is the global test accuracy of the
    supernet ``variables`` run as ``arch``'s single path, its BatchNorm statistics
    recalibrated on the clients' training examples under that path (as
    ``global_test_acc_bn_recal``; ``bn_recalibration_batches`` batches per client, 10 when
    that is 0). The weights are the supernet's, untrained for this child. One compiled
    program serves every child of the space."""
    model = make_supernet(cfg, info)
    placement = placement.single_path()

    def accuracy(variables, path, data):
        child = recalibrated_child(cfg, info, model, variables, path, data,
                                   max_batches=cfg.bn_recalibration_batches or 10, placement=placement)
        logits = lambda x: model.apply(child, info.normalize(x), path, train=False)  # noqa: E731
        return global_accuracy(logits, data, cfg.eval_batch_size)["global_test_acc"]

    compiled = jit(accuracy)

    def of(variables: dict, arch: ShuffleArch, data: FederatedData) -> float:
        if arch.space != cfg.space:
            raise ValueError(f"a child of space {arch.space!r} in a supernet of space {cfg.space!r}")
        return float(compiled(variables, jnp.asarray(arch.choices, jnp.int32), data))

    return of


def child_report(arch: ShuffleArch, info: DataInfo) -> dict:
    """The deliverable's size: parameters and multiply-adds per image (host side)."""
    cost = child_cost(arch, info.num_classes, info.image_shape)
    return {"architecture": str(arch), "params": cost["params"], "macs": cost["macs"]}


FACTORY = dfnas


def ANNEALS_OVER_ROUNDS(cfg) -> bool:  # noqa: N802  (a resume must keep run.rounds where it holds)
    """Whether a learning rate anneals over ``run.rounds`` (:mod:`jaxfednas.resume`: a resume must then keep them)."""
    return cfg.lr_schedule == "cosine"


RUN_OPTIONS = (
    "clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer", "arch_server_optimizer",
)
