"""FedNAS — He, Annavaram, Avestimehr, "FedNAS: Federated Deep Learning via Neural
Architecture Search" (arXiv:2004.08546), Algorithm 1 with Eq. 4 and Eq. 5.

Every round t the sampled clients run ``ClientLocalSearch`` (Alg. 1, lines 9-15):
E local epochs of MiLeNAS mixed-level search on a DARTS supernet, per minibatch::

    w ← w − η_w ∇_w L_tr(w, α)                                   (Eq. 4)
    α ← α − η_α (∇_α L_tr(w, α) + λ ∇_α L_val(w, α))

with both gradients taken at the same (w, α) ("optimizes α and w simultaneously"),
the training batch from the client's train split and the validation batch drawn at
random from the client's *own* validation split. The server then averages weights,
BatchNorm statistics and architecture with N_k / N (Eq. 5).

Deviations of the authors' code that are available as options for parity
(docs/authors_code.md §2.2-2.3, §7 rows 5-7), all off by default:

* ``alpha_aggregation="client0"`` — the FedML code broadcasts client 0's α;
* ``order="alpha_first"`` — the code steps α first, then w at the new α;
* ``grad_clip=0`` — the code clips α's gradients and never the weights'; this option only
  removes the weight clip (α's gradient is not clipped in either setting);
* ``bn_stats_updates="code"`` — the paper does not say how BatchNorm running statistics
  move; by default they take one momentum update per step, from the training forward,
  with the biased batch variance (Flax). The code's step runs three training-mode
  forwards (α on the training batch, α on the validation batch, then w) and PyTorch
  updates the statistics on each, with the unbiased variance ``n/(n-1) var``. Only the
  running statistics change (the forward and both gradients are the same), and with
  them the paper's supernet number ``global_test_acc``.

Kept from the code because the paper is silent: optimizers and the cosine
schedule (0.025 → 0.001 over the local epochs) are re-created every round.

``evaluate`` reports the paper's supernet accuracy ``global_test_acc`` (eval mode, the
averaged BN running statistics) and beside it ``global_test_acc_bn_batch`` (each test
batch's own statistics) and ``global_test_acc_bn_recal`` (statistics re-estimated by the
clients on their training examples and pooled,
:func:`jaxfednas.algorithms.common.recalibrated_batch_stats`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxfednas.algorithms.common import AUGMENTS, federated_batch_statistics, make_augment, recalibrated_batch_stats
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import ConfigError, ExperimentConfig, param
from jaxfednas.data.augment import augment_batch
from jaxfednas.data.federated import (ClientData, DataInfo, FederatedData, num_steps, random_batch, run_local_epochs,
                                     run_local_epochs_selected)
from jaxfednas.files import make_dirs
from jaxfednas.evaluation import (client_accuracies, client_accuracy_summary, evaluate_examples, global_accuracy,
                                  select_by_validation)
from jaxfednas.optim import ARCH, WEIGHTS, cosine_lr, darts_arch_optimizer, darts_weight_optimizer, milenas_grads
from jaxfednas.precision import compute_in
from jaxfednas.rng import client_keys
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, Placement, map_clients, reported_metrics, reporting_clients
from jaxfednas.server import tolerate_missing_server_state
from jaxfednas.search_spaces import arch_entropy
from jaxfednas.search_spaces.darts import (BN_MOMENTUM, PRIMITIVE_SETS, DartsSearchNetwork, DartsSpaceConfig, derive,
                                 group_edges_param, supernet_of, Genotype, plot_genotype)
from jaxfednas.search_spaces.darts.masks import mask_from_genotype, mask_weights

DESCRIPTION = "FedNAS (He et al.): MiLeNAS local search on a DARTS supernet, FedAvg of weights and α"

@dataclasses.dataclass(frozen=True)
class FedNASConfig(DartsSpaceConfig):
    """The supernet's geometry (:class:`DartsSpaceConfig`: C, layers, nodes, primitives), then FedNAS' own."""
    RENAMED = {**DartsSpaceConfig.RENAMED, "w_lr": "lr", "w_lr_min": "lr_min", "w_momentum": "momentum",
               "w_weight_decay": "weight_decay", "w_clip": "grad_clip", "lam": "milenas_lambda"}
    local_epochs: int = param(1, "local epochs E per round (paper 5)", range=(1, 10_000))
    batch_size: int = param(32, "local minibatch size (paper 64)", range=(1, 1_000_000))
    lr: float = param(0.025, "weight learning rate at the first local epoch", range=(0.0, 100.0))
    lr_min: float = param(0.001, "cosine floor of the weight learning rate", range=(0.0, 100.0))
    momentum: float = param(0.9, "weight SGD momentum", range=(0.0, 1.0))
    weight_decay: float = param(3e-4, "weight decay", range=(0.0, 1.0))
    grad_clip: float = param(5.0, "weight gradient global-norm clip (0: off, as the authors' code)", range=(0.0, None))
    arch_lr: float = param(3e-4, "architecture Adam learning rate", range=(0.0, 10.0))
    arch_weight_decay: float = param(1e-3, "architecture weight decay", range=(0.0, 1.0))
    milenas_lambda: float = param(1.0, "λ: weight of ∇α L_val in Eq. 4", range=(0.0, None))
    order: str = param("simultaneous", "simultaneous (Eq. 4) or alpha_first (authors' code)",
                       choices=("simultaneous", "alpha_first"))
    passes: str = param("auto", "how Eq. 4's two passes are compiled: loop (one loop body, compiled once; the "
                        "validation pass skips its kernel gradients), inline (one after the other), auto (loop on "
                        "CPU); same gradients (jaxfednas.optim.milenas_grads)", choices=("auto", "loop", "inline"))
    alpha_aggregation: str = param("mean", "mean (Eq. 5) or client0 (the FedML bug, for parity)",
                                   choices=("mean", "client0"))
    bn_stats_updates: str = param(
        "once", "BatchNorm running statistics per local step: once (the training forward, biased batch variance, "
        "as Flax) or code (the authors' PyTorch step: one update per training-mode forward -- α on the training "
        "batch, α on the validation batch, w -- with the unbiased batch variance)", choices=("once", "code"))
    augment: str = param("auto", "on-device augmentation", choices=AUGMENTS)
    scan_edges: bool = param(True, "run a cell's edges as lax.scan (fast compile) or unrolled (faster steps on "
                             "CPU at C>=16, slower compile; benchmarks/RESULTS.md)")
    group_edges: str = group_edges_param()
    personalize_epochs: int = param(5, "local adaptation epochs of personalized FedNAS (§2.5)", range=(1, 10_000))
    bn_recalibration_batches: int = param(
        10, "also report global_test_acc_bn_recal: the supernet with BatchNorm statistics re-estimated on up to "
        "this many eval-size batches of each client's training examples, pooled n_k/n (0: off)", range=(0, None))
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))

    def check(self):
        super().check()
        if self.group_edges == "on" and not self.scan_edges:
            raise ConfigError("algo.group_edges=on needs algo.scan_edges=true (the grouped form reads the "
                              "scanned variables)")


CONFIG = FedNASConfig
# Each client's examples: search-train / search-val (α step) / local test.
DEFAULTS = {"data.split": (0.5, 0.25, 0.25)}
PRESETS = {
    "smoke": {"run.rounds": 3, "algo.C": 4, "algo.layers": 3},
    # Paper Table 2 / docs/authors_code.md §2.4: CIFAR-10, 16 clients Dir(0.5), all participating,
    # 50 rounds, 5 local epochs, batch 64, C=16, 8 cells; each client's data split 50/50
    # into search-train / search-val as the standalone FedNAS code; global test set.
    "paper": {
        "data.dataset": "cifar10", "data.num_clients": 16, "data.partition": "dirichlet", "data.alpha": 0.5,
        "data.split": (0.5, 0.5, 0.0), "run.rounds": 50, "algo.C": 16, "algo.layers": 8,
        "algo.local_epochs": 5, "algo.batch_size": 64,
    },
}


@tolerate_missing_server_state
@flax.struct.dataclass
class FedNASState:
    variables: dict  # {"params", "arch", "batch_stats"} of the supernet
    round: jax.Array
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


def cpu_scheduler(cfg: FedNASConfig) -> str:
    """The XLA:CPU scheduler of FedNAS' search and adaptation programs
    (:func:`jaxfednas.runtime.jit`): XLA's own (``"default"``) when Eq. 4's two passes run as
    one loop body (``passes`` auto / loop) -- they cannot overlap, so the memory-optimised
    scheduler no longer halves a step's memory and only costs speed (config (b): XLA temp
    2.97 -> 6.23 GiB, still below PyTorch's 8.9 GiB step; 13.5 -> 11.5-11.9 s/step; compile
    46.0 -> 41.3 s; bitwise-equal results) -- and the memory-optimised one (``"memory"``) for
    ``passes="inline"``, whose independent passes XLA's own scheduler keeps alive together
    (12.1 GiB). ``JAXFEDNAS_CPU_SCHEDULER`` still overrides both."""
    return "memory" if cfg.passes == "inline" else "default"


def make_supernet(cfg: FedNASConfig, info: DataInfo) -> DartsSearchNetwork:
    """The DARTS supernet of ``cfg`` (every intermediate node concatenated, as in DARTS)."""
    return supernet_of(cfg, info.num_classes, scan_edges=cfg.scan_edges)


def make_local_search(cfg: FedNASConfig, info: DataInfo, model: DartsSearchNetwork, epochs: int, *,
                      precision: str = "fp32") -> Callable:
    """``local_search(variables, train, val, key, select=None) -> (variables, metrics)``:
    ClientLocalSearch(k, w, α) of Algorithm 1 (lines 9-15), ``epochs`` local epochs of
    the MiLeNAS step (Eq. 4) with fresh optimizers and a cosine schedule over the epochs.

    ``select(variables) -> (score, record)``, if given, scores the starting model and the
    model after every epoch and the best one is returned instead of the last
    (:func:`jaxfednas.data.federated.run_local_epochs_selected`: ties to the later epoch,
    ``metrics["selected"]`` and ``metrics["candidates"]``); the steps are the same.
    ``precision``: what both passes of Eq. 4 compute in (:func:`jaxfednas.precision.compute_in`:
    w, α, their gradients and the BatchNorm statistics stay float32)."""
    aug = make_augment(cfg.augment, info.name)
    code_bn = cfg.bn_stats_updates == "code"
    # parity option: PyTorch's n/(n-1) var in the running variance, a field of the module the search applies
    apply = compute_in(precision, model.clone(unbiased_running_var=code_bn).apply)

    def loss_fn(params, arch, stats, batch):
        logits, new = apply(
            {"params": params, "arch": arch, "batch_stats": stats}, batch["x"], train=True, mask=batch["mask"],
            mutable=["batch_stats"],
        )
        mask = batch["mask"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * mask
        correct = ((jnp.argmax(logits, -1) == batch["y"]) & mask).sum()
        return ce.sum() / jnp.maximum(mask.sum(), 1), (new["batch_stats"], {"loss_sum": ce.sum(), "correct": correct})

    def local_search(variables, train: ClientData, val: ClientData, key, select: Callable | None = None):
        steps_per_epoch = jnp.maximum(num_steps(train.count, cfg.batch_size), 1)
        lr = cosine_lr(cfg.lr, cfg.lr_min, epochs)
        w_tx = darts_weight_optimizer(lr=lambda count: lr(count // steps_per_epoch), momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay, clip=cfg.grad_clip or None)
        a_tx = darts_arch_optimizer(lr=cfg.arch_lr, b1=0.5, b2=0.999, weight_decay=cfg.arch_weight_decay)
        tree = {"params": variables["params"], "arch": variables["arch"]}

        def apply(tree, opt_state, g_w=None, g_a=None):  # one optimizer for w, one for α
            params, arch = tree["params"], tree["arch"]
            if g_a is not None:
                upd, a_state = a_tx.update(g_a, opt_state[ARCH], arch)
                arch, opt_state = optax.apply_updates(arch, upd), {**opt_state, ARCH: a_state}
            if g_w is not None:
                upd, w_state = w_tx.update(g_w, opt_state[WEIGHTS], params)
                params, opt_state = optax.apply_updates(params, upd), {**opt_state, WEIGHTS: w_state}
            return {"params": params, "arch": arch}, opt_state

        def step(carry, batch, k):
            tree, stats, opt_state = carry
            k_tr, k_val, k_aug = jax.random.split(k, 3)
            tr = {**batch, "x": augment_batch(k_tr, info.normalize(batch["x"]), aug)}
            vb = random_batch(val, k_val, cfg.batch_size)  # the client's own validation split
            vb["x"] = augment_batch(k_aug, info.normalize(vb["x"]), aug)
            grads, new, ms = milenas_grads(loss_fn, tree["params"], tree["arch"], stats, tr, vb, lam=cfg.milenas_lambda,
                                           passes=cfg.passes, val_stats=code_bn)
            after_tr, after_val = new if code_bn else (new, None)  # each forward's update of `stats`
            if cfg.order == "simultaneous":  # Eq. 4: both gradients at the same (w, α)
                tree, opt_state = apply(tree, opt_state, g_w=grads["params"], g_a=grads["arch"])
                after_w = after_tr  # ∇w came from the training forward
            else:  # authors' code: α step at w, then the w step at the new α
                tree, opt_state = apply(tree, opt_state, g_a=grads["arch"])
                (_, (after_w, _)), g_w = jax.value_and_grad(loss_fn, has_aux=True)(tree["params"], tree["arch"],
                                                                                   stats, tr)
                tree, opt_state = apply(tree, opt_state, g_w=g_w)
            if code_bn:  # the code's three updates in its order: α on train, α on val, w
                stats = replay_bn_update(replay_bn_update(after_tr, stats, after_val), stats, after_w)
            else:  # one update, from the forward that gave ∇w
                stats = after_w
            metrics = {
                "loss_sum": ms["train"]["loss_sum"], "correct": ms["train"]["correct"], "examples": batch["mask"].sum(),
                "val_correct": ms["val"]["correct"], "val_examples": vb["mask"].sum(),
            }
            return (tree, stats, opt_state), metrics

        opt_state = {WEIGHTS: w_tx.init(tree["params"]), ARCH: a_tx.init(tree["arch"])}
        carry = (tree, variables["batch_stats"], opt_state)

        def model_of(carry):
            tree, stats, _ = carry
            return {"params": tree["params"], "arch": tree["arch"], "batch_stats": stats}

        if select is None:
            carry, metrics = run_local_epochs(step, carry, train, key, epochs=epochs, batch_size=cfg.batch_size)
            return model_of(carry), metrics
        return run_local_epochs_selected(step, carry, train, key, epochs=epochs, batch_size=cfg.batch_size,
                                         model_of=model_of, select=select)

    return local_search


def replay_bn_update(current: dict, start: dict, updated: dict) -> dict:
    """The running statistics ``current`` after one more momentum update with the batch
    statistics ``b`` of a forward that turned ``start`` into ``updated``
    (``updated = m start + (1 - m) b``, ``m`` = :data:`BN_MOMENTUM`): ``m current + (1 - m) b``.
    Replays a forward's update on other statistics without running it again."""
    return jax.tree.map(lambda c, s, u: BN_MOMENTUM * c + (u - BN_MOMENTUM * s), current, start, updated)


@checked_factory(FedNASConfig)
def fednas(
    cfg: FedNASConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
) -> FederatedAlgorithm:
    """FedNAS (Algorithm 1) on data described by ``info``; ``personalize`` is §2.5.

    Args:
      cfg: the supernet, the MiLeNAS local search and §2.5's adaptation (:class:`FedNASConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`):
        clients per round, placement, the server (sampler, aggregator, server optimizers of
        w and α), drop-out and ``run.precision``, what the local search and §2.5's
        adaptation compute in (evaluation and BatchNorm recalibration run in float32).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``fednas`` with ``export``
      (the derived genotype) and ``personalize``.
    """
    server, placement, precision, dropout_rate = run.server, run.placement, run.precision, run.dropout_rate
    primitives = PRIMITIVE_SETS[cfg.primitives]
    model = make_supernet(cfg, info)
    server.check_clients(info.num_clients, run.clients(info.num_clients))
    local_search = make_local_search(cfg, info, model, cfg.local_epochs, precision=precision)
    adapt = make_local_search(cfg, info, model, cfg.personalize_epochs, precision=precision)

    def init(key):
        x = jnp.zeros((1,) + info.image_shape, jnp.float32)
        v = dict(model.init({"params": key}, x, train=False))
        v.setdefault("batch_stats", {})
        return FedNASState(variables=v, round=jnp.int32(0), server=server.init(v, ("params", "arch")))

    def round_fn(state: FedNASState, data: FederatedData, key):
        # Alg. 1 line 4: sample clients; line 5: ClientLocalSearch on each.
        idx, keys = run.sample(key, state.round, data, info.num_clients)
        per_client = (data.clients("train", idx), data.clients("val", idx), keys)
        new_vars, met = map_clients(
            lambda c, v: local_search(v, *c), per_client, state.variables, placement=placement
        )
        weights = server.weights(per_client[0].count, reporting_clients(key, idx, dropout_rate))  # failed: weight 0
        avg = server.aggregate(new_vars, weights, fallback=state.variables)  # Eq. 5: w, BN statistics, α with N_k / N
        if cfg.alpha_aggregation == "client0":
            avg["arch"] = jax.tree.map(lambda a: a[0], new_vars["arch"])
        avg, opt = server.step(state.variables, avg, state.server, weights, ("params", "arch"))
        n = jnp.maximum(met["examples"].sum(), 1)
        metrics = {
            "train_loss": met["loss_sum"].sum() / n,
            "train_acc": met["correct"].sum() / n,
            "search_val_acc": met["val_correct"].sum() / jnp.maximum(met["val_examples"].sum(), 1),
            "local_steps": met["steps"].sum(),
            "arch_entropy": arch_entropy(avg["arch"]),
            **reported_metrics(weights, key, idx, dropout_rate),
        }
        return state.replace(variables=avg, round=state.round + 1, server=opt), metrics

    def logits_fn(variables):
        return lambda x: model.apply(variables, info.normalize(x), train=False)

    def evaluate(state: FedNASState, data: FederatedData):
        v = state.variables
        out = global_accuracy(logits_fn(v), data, cfg.eval_batch_size)
        # The paper's number above uses BN running statistics (eval mode). After few local
        # steps per round those lag behind the weights; the same supernet normalised by each
        # test batch's own statistics shows how much of the gap is that lag.
        batch_bn = lambda x: model.apply(v, info.normalize(x), train=True, mutable=["batch_stats"])[0]  # noqa: E731
        out["global_test_acc_bn_batch"] = global_accuracy(batch_bn, data, cfg.eval_batch_size)["global_test_acc"]
        if cfg.bn_recalibration_batches:
            # Federated recalibration: the statistics of the clients' training examples under
            # the current w and α, measured by the clients and pooled n_k/n (no test data used).
            stats = recalibrated_batch_stats(model, info, v, data, batch_size=cfg.eval_batch_size,
                                             max_batches=cfg.bn_recalibration_batches, placement=placement)
            recal = logits_fn({**v, "batch_stats": stats})
            out["global_test_acc_bn_recal"] = global_accuracy(recal, data, cfg.eval_batch_size)["global_test_acc"]
        for split in ("val", "test"):
            out.update(client_accuracies(logits_fn, v, data, cfg.eval_batch_size, placement=placement, split=split))
        out["arch_entropy"] = arch_entropy(v["arch"])
        return out

    def personalize(state: FedNASState, data: FederatedData, key):
        """§2.5 "alternative local adaptation": every client runs ``personalize_epochs``
        epochs of the same MiLeNAS rule (Eq. 4) on its own data, from the global w and α.
        Each client keeps, among the global model (candidate 0) and its model after each
        epoch (1..E), the one most accurate on its own validation split (ties: the later;
        :func:`jaxfednas.evaluation.select_by_validation`) — the paper reports the round
        best on the clients' test splits instead. Returns those models (rows, a leading
        client axis) and: ``client_test_acc*`` (the kept models on each client's test
        split), ``personal_epoch`` (the kept candidate), ``client_test_acc_final*`` (after
        all E epochs), ``client_test_acc_global*`` (the global model, candidate 0) and the
        per-candidate ``client_{val,test}_acc_by_epoch`` ``[clients, E + 1]``."""
        ids = jnp.arange(info.num_clients)

        def correct(v, split: ClientData):
            r = evaluate_examples(logits_fn(v), split.x, split.y, split.count, batch_size=cfg.eval_batch_size)
            return r["correct"]

        def one(c, v):
            train, val, test, k = c

            def select(m):  # the choice reads the validation count only; test is recorded for the report
                record = {"val": correct(m, val), "test": correct(m, test)}
                return record["val"], record

            return adapt(v, train, val, k, select=select)

        per_client = (data.all_clients("train"), data.all_clients("val"), data.all_clients("test"),
                      client_keys(key, ids))
        rows, met = map_clients(one, per_client, state.variables, placement=placement)
        by_epoch = met["candidates"]  # [clients, E + 1] correct counts
        idx, _ = select_by_validation(by_epoch["val"], by_epoch["test"])
        out = client_accuracies(logits_fn, rows, data, cfg.eval_batch_size, placement=placement, personal=True)
        test_n = data.all_clients("test").count
        out.update(client_accuracy_summary(by_epoch["test"][:, -1], test_n, tag="_final"))
        out.update(client_accuracy_summary(by_epoch["test"][:, 0], test_n, tag="_global"))
        out["personal_epoch"] = idx
        for split, n in (("val", data.all_clients("val").count), ("test", test_n)):
            out[f"client_{split}_acc_by_epoch"] = by_epoch[split] / jnp.maximum(n, 1)[:, None]
        out["arch_entropy"] = arch_entropy(rows["arch"])
        return rows, out

    def export(state: FedNASState):
        arch = jax.device_get(state.variables["arch"])
        return derive(arch["alphas_normal"], arch["alphas_reduce"], primitives=primitives, steps=cfg.nodes,
                      multiplier=cfg.nodes)

    scheduler = cpu_scheduler(cfg)
    keep_calls = model.runs_grouped(info.image_shape)  # the grouped cells: one nested jit per cell shape
    return FederatedAlgorithm(
        name="fednas", init=placement.jit_init(init), round=jit(round_fn, scheduler=scheduler, keep_calls=keep_calls),
        evaluate=jit(evaluate),
        export=export, write_architecture=write_architecture_plots,
        personalize=jit(personalize, scheduler=scheduler, keep_calls=keep_calls),
    )


def make_inherited_accuracy(cfg: FedNASConfig, info: DataInfo, *, placement: Placement = Placement()
                            ) -> Callable[[dict, Genotype, FederatedData], float]:
    """The weight-sharing estimate of a cell's accuracy, for ranking cells by the trained
    supernet: ``accuracy(variables, genotype, data)`` is the global test accuracy of the
    supernet ``variables`` with every edge fixed to ``genotype``'s operation (a 0/1 mask: the
    mixed operation of Eq. 1 reduced to the one kept op, edges the cell does not keep removed)
    and its BatchNorm statistics recalibrated on the clients' training examples under that
    subnet (as ``global_test_acc_bn_recal``: federated, pooled n_k/n, up to
    ``bn_recalibration_batches`` batches per client, 10 when that is 0). The weights are the
    supernet's, untrained for this cell. One compiled program serves every genotype."""
    model = make_supernet(cfg, info)
    primitives = PRIMITIVE_SETS[cfg.primitives]

    def accuracy(variables, weights, data):
        def stats_of(stats, x, mask):
            v = {**variables, "batch_stats": stats}
            return model.apply(v, info.normalize(x), train=True, mask=mask, arch_weights=weights,
                               mutable=["batch_stats"])[1]["batch_stats"]

        stats = federated_batch_statistics(stats_of, jax.tree.map(jnp.zeros_like, variables["batch_stats"]), data,
                                           batch_size=cfg.eval_batch_size,
                                           max_batches=cfg.bn_recalibration_batches or 10, momentum=BN_MOMENTUM,
                                           placement=placement)
        v = {**variables, "batch_stats": stats}
        logits = lambda x: model.apply(v, info.normalize(x), train=False, arch_weights=weights)  # noqa: E731
        return global_accuracy(logits, data, cfg.eval_batch_size)["global_test_acc"]

    compiled = jit(accuracy)

    def of(variables: dict, genotype: Genotype, data: FederatedData) -> float:
        weights = mask_weights(mask_from_genotype(genotype, primitives, cfg.nodes))
        return float(compiled(variables, weights, data))

    return of


def client_genotypes(cfg: FedNASConfig, arch_rows: dict) -> list[Genotype]:
    """The genotype of every client's row of α (leading client axis), e.g. after ``personalize``."""
    arch = jax.device_get(arch_rows)
    prims = PRIMITIVE_SETS[cfg.primitives]
    return [derive(n, r, primitives=prims, steps=cfg.nodes, multiplier=cfg.nodes)
            for n, r in zip(arch["alphas_normal"], arch["alphas_reduce"])]


def write_architecture_plots(genotype: Genotype, out_dir) -> None:
    """Cell diagrams ``cell_normal.png`` / ``cell_reduce.png`` of the exported genotype."""
    plot_genotype(genotype, os.path.join(make_dirs(out_dir), "cell"))


def check(config: ExperimentConfig) -> None:
    """What needs the whole configuration, before the factory (:func:`jaxfednas.registry.build_algorithm`)."""
    if config.data.split[1] <= 0:
        raise ConfigError(
            f"data.split={config.data.split}: FedNAS needs a validation split (the α step of Eq. 4 uses each "
            "client's own validation data), e.g. --set data.split=0.5,0.25,0.25"
        )


FACTORY = fednas
RUN_OPTIONS = (
    "clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer", "arch_server_optimizer",
)
