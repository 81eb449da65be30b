"""SPIDER — Mushtaq, He, Ding, Avestimehr, "Distributed Architecture Search Over
Heterogeneous Distributions" (TMLR 2023; earlier version "SPIDER: Searching Personalized
Neural Architecture for Federated Learning", arXiv:2112.13939; code: ErumMushtaq/SPIDER), Algorithm 1
(SPIDER-Trainer), Algorithm 2 (SPIDER-Searcher), Eq. 4-6.

Every client k keeps two networks over one DARTS supernet (the s2 space by default):
the global supernet w, shared by everyone, and a personal model v_k whose architecture
A_k is a mask over the supernet's (edge, op) table (:mod:`jaxfednas.search_spaces.darts.masks`).
Each op's weight is the constant 1 (the authors' code: an edge outputs the plain sum of
its kept ops). Round t (Algorithm 1), for every sampled client k::

  line 10   A_k ← SPIDER-Searcher(A_k, t_s, τ, t)                       (Algorithm 2)
  line 12-14  w_share = the received w^t restricted to the (edge, op) pairs A_k keeps
  line 16-18  per minibatch (the same batch for both models):
              w_k ← w_k − η_w ∇_w F_k(w_k, A)
              v_k ← v_k − η_v (∇_v F_k(v_k, A_k) + λ (v_k − w_share))   (Eq. 4)
  line 6    w^{t+1} = Σ_k N_k/N w_k (BatchNorm statistics included)

SPIDER-Searcher (Algorithm 2, Phase 2), at the client's round t ≥ t_s with t a multiple of
τ: for the normal, then the reduce cell, pick an undecided edge at random, measure the
local validation accuracy with each of its ops removed, and keep the op whose removal
*lowers accuracy most* (the paper's prose, "only the operation with the highest impact on
the accuracy is kept", and the authors' code; Algorithm 2's printed line 8 says the
opposite — ``criterion="paper_text"`` follows it). Once every edge has its op, the same
triggers run the code's topology projection (docs/authors_code.md §5.3; the paper has
none): for one random node per cell type, remove the incoming edge whose removal gives the
highest validation accuracy until two remain — the first in the round of the last op
choice, as in the code. By default each drop is scored on the edges left after the
previous drops, ties to the first edge (``projection="greedy"``). The code's loop rebuilds
the full weights for every pass, so an earlier drop is back when the next one is scored:
on fixed weights it ranks every incoming edge once on the node's full edge set and drops
the highest until two remain, ties to the later edge (``projection="one_shot"``). The two
agree for a node with three inputs (ties aside), not in general. Phase 3: a client whose
architecture is final trains on train + validation (§5.1; ``final_on_val``). Validation
accuracy during the search is measured with BatchNorm in training mode (batch statistics),
as darts-pt and the SPIDER code do, without moving the running statistics.

Timeline: ``t`` is the *client's own* count of participations (its search clock), so a
client that is not sampled neither trains nor advances its search; with every client in
every round (the paper's setting and the only one the code supports) it is the round
number, and with t_s = 30, τ = 20 the first choice happens at round 40 (the first multiple
of 20 ≥ 30), as in the code. Every 0/1 mask has the supernet's static shape, so one
compiled round serves every client's architecture; removed ops are computed and
multiplied by 0, and their weights are frozen in v_k.

Options for parity with the authors' code (docs/authors_code.md §5): ``personal_grad_clip=0``
(its personal-model clip never runs), ``projection="one_shot"``,
``personal_init="independent"`` (default: personal supernets start from one initialisation
independent of the global one), ``search_batch_size=32`` (the search's BatchNorm batch;
the code drops a last partial batch, kept here). Kept from the code where the paper is
silent: SGD momentum 0.9, weight decay 1e-3, both learning rates annealed per round by a
cosine to ``lr_min`` (0) over the run, personal optimizer state kept across rounds. Not
offered (the paper-vs-code table of docs/papers/spider.md): the code keeps each client's global-model momentum
across rounds (here it starts from zero every round, as FedAvg's clients); it re-estimates
the personal model's BatchNorm running statistics on the training set after each pruning
and moves them in the search's passes; it weights FedAvg by each client's whole partition
(here the training examples of the round, train + validation in phase 3).
"""
from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfednas.algorithms.common import AUGMENTS, client_batch_statistics, make_batch_grad
from jaxfednas import rng
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.checkpoint import renamed_fields
from jaxfednas.config import ConfigError, ExperimentConfig, former_module_names, param
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData, run_local_epochs
from jaxfednas.files import make_dirs
from jaxfednas.evaluation import client_accuracies, evaluate_examples, global_accuracy
from jaxfednas.optim import cosine_lr
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import (jit, Placement, gather_rows, map_clients, reporting_clients,
                               scatter_rows)
from jaxfednas.server import tolerate_missing_server_state
from jaxfednas.search_spaces.darts import (BN_MOMENTUM, DartsSearchNetwork, DartsSpaceConfig, group_edges_param, num_edges,
                                 plot_genotype, PRIMITIVE_SETS, primitives_param, supernet_of)
from jaxfednas.search_spaces.darts.masks import CELLS, Subnet, full_mask, genotype_from_mask, incoming_edges, variable_mask

DESCRIPTION = "SPIDER (Mushtaq et al.): FedAvg'd supernet + personal subnets pulled to it, perturbation search"
CRITERIA = ("removal_hurts_most", "paper_text")
PROJECTIONS = ("greedy", "one_shot")


@dataclasses.dataclass(frozen=True)
class SpiderConfig(DartsSpaceConfig):
    """The supernet's geometry (:class:`DartsSpaceConfig`; SPIDER's default ops: s2), then SPIDER's own."""
    RENAMED = {**DartsSpaceConfig.RENAMED, "local_lr": "personal_lr", "local_grad_clip": "personal_grad_clip",
               "lam": "prox_lambda"}
    primitives: str = primitives_param("s2", "candidate ops (paper: s2 = skip_connect, sep_conv_3x3); a zero op "
                                       "'none' is never kept (removal is a mask zero)")
    local_epochs: int = param(1, "local epochs per round (code 1)", range=(1, 10_000))
    batch_size: int = param(32, "local minibatch size (paper 32)", range=(1, 1_000_000))
    lr: float = param(0.01, "global-model SGD learning rate at round 0 (paper grid {0.01, 0.03})", range=(0.0, 100.0))
    personal_lr: float = param(0.01, "personal-model SGD learning rate at round 0", range=(0.0, 100.0))
    lr_min: float = param(0.0, "floor of both learning rates' per-round cosine over run.rounds (code: 0)",
                          range=(0.0, 100.0))
    momentum: float = param(0.9, "SGD momentum of both models", range=(0.0, 1.0))
    weight_decay: float = param(1e-3, "weight decay of both models (the code's hard-coded 1e-3)", range=(0.0, 1.0))
    grad_clip: float = param(5.0, "global-norm clip of the global model's gradient (0: off)", range=(0.0, None))
    personal_grad_clip: float = param(5.0, "global-norm clip of the personal model's gradient (0: off, as the "
                                   "authors' code, whose personal clip never runs)", range=(0.0, None))
    prox_lambda: float = param(0.01, "λ of Eq. 4, the pull of v_k toward w_share (paper grid {0.01, 0.1, 1}); "
                       "0 = local-only NAS (App. D.2)", range=(0.0, 1e4))
    warmup_rounds: int = param(30, "t_s: a client's own rounds before its search starts (paper 30)",
                               range=(0, 1_000_000))
    recovery_rounds: int = param(20, "τ: a client searches at its rounds t >= t_s that are multiples of τ "
                                 "(paper 20)", range=(1, 1_000_000))
    criterion: str = param("removal_hurts_most", "op choice: keep the op whose removal lowers validation "
                           "accuracy most (prose, code) or paper_text (Alg. 2 line 8 as printed)", choices=CRITERIA)
    projection: str = param("greedy", "topology projection: drop the incoming edge whose removal gives the highest "
                            "validation accuracy, re-scoring the edges left after each drop, ties to the first "
                            "(greedy), or rank every edge once on the node's full edge set, ties to the later "
                            "(one_shot: the authors' code)", choices=PROJECTIONS)
    final_on_val: bool = param(True, "phase 3: a client with a final architecture trains on train + validation")
    personal_init: str = param("independent", "personal supernets start from one initialisation independent of "
                               "the global one (code) or as copies of it", choices=("independent", "global"))
    augment: str = param("auto", "on-device augmentation", choices=AUGMENTS)
    group_edges: str = group_edges_param()
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))
    search_batch_size: int = param(0, "batch of the search's validation passes, whose BatchNorm uses batch "
                                   "statistics (0: eval_batch_size; the code: its loader's 32, dropping a last "
                                   "partial batch, which is kept here)", range=(0, None))
    gain_epochs: int = param(30, "fine-tuning epochs per entry of the personalization-gain matrix (Eq. 6; "
                             "paper 30)", range=(1, 10_000))


CONFIG = SpiderConfig
# §5.1: each client's data 60 % train / 20 % validation (search) / 20 % local test.
DEFAULTS = {"data.split": (0.6, 0.2, 0.2)}
PRESETS = {
    "smoke": {"run.rounds": 7, "algo.C": 4, "algo.layers": 3, "algo.nodes": 2, "algo.warmup_rounds": 1,
              "algo.recovery_rounds": 1},
    # §5.1 / App. A and docs/authors_code.md §5: CIFAR-100, 8 clients Dir(0.2), all participating,
    # 1000 rounds, batch 32, s2 space C=16 with 8 cells, t_s=30, τ=20, λ=0.01, lr 0.01.
    "paper": {
        "data.dataset": "cifar100", "data.num_clients": 8, "data.partition": "dirichlet", "data.alpha": 0.2,
        "run.rounds": 1000, "run.eval_every": 10, "algo.C": 16, "algo.layers": 8,
    },
}


@renamed_fields(arch="arch_masks", clock="client_rounds")  # their names before checkpoint schema 2
@tolerate_missing_server_state
@flax.struct.dataclass
class SpiderState:
    variables: dict  # the global supernet w: {"params", "batch_stats"}
    personal: dict  # personal models v_k: {"params", "batch_stats"}, leading axis K
    opt_state: Any  # each personal model's SGD momentum, leading axis K
    arch_masks: dict  # A_k as 0/1 masks {"normal": [K, E, |O|], "reduce": [K, E, |O|]}
    edge_done: jax.Array  # [K, 2, E] bool: (cell type, edge) whose op is chosen (E \ E_s)
    node_done: jax.Array  # [K, 2, steps] bool: nodes whose two incoming edges are chosen
    client_rounds: jax.Array  # [K] int32: rounds each client took part in (its search clock t)
    round: jax.Array  # int32, rounds completed
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


# per-client fields (leading axis K): split along the clients mesh
ROWS = ("personal", "opt_state", "arch_masks", "edge_done", "node_done", "client_rounds")


def initial_mask(primitives, steps: int) -> dict[str, np.ndarray]:
    """A_k at phase 1: the whole supernet, every op of every edge (a zero op excepted)."""
    keep = np.array([p != "none" for p in primitives], np.float32)
    return {c: m * keep for c, m in full_mask(primitives, steps).items()}


def stack_cells(mask: dict) -> jax.Array:
    return jnp.stack([mask[c] for c in CELLS])


def unstack_cells(mask: jax.Array) -> dict:
    return {c: mask[i] for i, c in enumerate(CELLS)}


def sgd(clip: float, cfg: SpiderConfig) -> optax.GradientTransformation:
    """PyTorch's SGD without its learning rate (applied per round): clip, + wd·p, momentum."""
    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    return optax.chain(*parts, optax.add_decayed_weights(cfg.weight_decay), optax.trace(cfg.momentum))


def combined_split(train: ClientData, val: ClientData, use_val: jax.Array) -> ClientData:
    """Phase 3's data (§5.1): the client's train rows followed by its validation rows when
    ``use_val``, else its train rows; static shape ``M_train + M_val`` either way."""
    mt, mv = train.y.shape[0], val.y.shape[0]
    i = jnp.arange(mt + mv)
    src = jnp.minimum(jnp.where(i < train.count, i, mt + i - train.count), mt + mv - 1)
    x, y = jnp.concatenate([train.x, val.x])[src], jnp.concatenate([train.y, val.y])[src]
    return ClientData(x=x, y=y, count=train.count + jnp.where(use_val, val.count, 0))


def op_choice(acc_without: jax.Array, present: jax.Array, criterion: str) -> jax.Array:
    """Algorithm 2, line 8: the op to keep on an edge from ``acc_without[j]``, the validation
    accuracy with op j removed. ``removal_hurts_most``: the op whose removal gives the lowest
    accuracy; ``paper_text``: the highest (the printed rule). Ties go to the first op."""
    if criterion == "removal_hurts_most":
        return jnp.argmin(jnp.where(present, acc_without, jnp.inf))
    return jnp.argmax(jnp.where(present, acc_without, -jnp.inf))


def edge_to_drop(acc_without: jax.Array, kept: jax.Array, projection: str) -> jax.Array:
    """Topology projection (docs/authors_code.md §5.3): the incoming edge to drop from
    ``acc_without[s]``, the validation accuracy with the node's edge ``s`` removed: the one
    whose removal gives the highest accuracy (the least useful edge), among the ``kept``
    edges. Ties go to the first edge (``greedy``) or to the later one (``one_shot``: the
    code's ``not (crit < best)`` comparison)."""
    score = jnp.where(kept, acc_without, -jnp.inf)
    if projection == "greedy":
        return jnp.argmax(score)
    return score.shape[0] - 1 - jnp.argmax(score[::-1])


def make_search(cfg: SpiderConfig, n_ops: int, accuracies: Callable) -> Callable:
    """Algorithm 2 over any evaluator: ``accuracies(variables, candidates, val) -> [n]``, the
    validation accuracy of each candidate mask (``[n, 2, E, |O|]``). Returns
    ``search(variables, mask, edge_done, node_done, val, key)``, one trigger for one client."""
    n_edges, steps = num_edges(cfg.nodes), cfg.nodes
    into = jnp.asarray(incoming_edges(steps))  # [steps, steps + 1], -1 padded
    n_slots = max(n_ops, steps + 1)  # candidates per evaluation: ops of an edge, or edges into a node

    def search(variables, mask, edge_done, node_done, val, key):
        def cell(c, carry):
            mask, edge_done, node_done = carry
            k_edge, k_node = jax.random.split(jax.random.fold_in(key, c))
            open_edges, open_nodes = ~edge_done[c], ~node_done[c]
            # Algorithm 2, line 4: i = RANDOM(E_s); the node for topology projection likewise
            e = jax.random.choice(k_edge, n_edges, p=open_edges / jnp.maximum(open_edges.sum(), 1))
            n = jax.random.choice(k_node, steps, p=open_nodes / jnp.maximum(open_nodes.sum(), 1))
            edge_done = jnp.where(open_edges.any(), edge_done.at[c, e].set(True), edge_done)
            ready = edge_done[c].all() & open_nodes.any()  # every op chosen: project node n now
            slots = into[n]
            edge_in = jnp.maximum(slots, 0)

            def move(i, carry):
                """Move 0: Algorithm 2, lines 6-9 on edge e (choose its op). Moves 1..: drop the
                incoming edge of node n whose removal gives the highest validation accuracy
                while more than two remain (the code's topology projection), each drop scored
                on the edges left (``greedy``) or every drop ranked by move 1's scores on the
                node's full edge set (``one_shot``, the code). One call site evaluates every
                candidate set, so the search compiles one forward pass."""
                mask, scores = carry
                kept = jnp.zeros(n_slots, bool).at[: steps + 1].set((slots >= 0) & (mask[c, edge_in].sum(-1) > 0))
                op_move = i == 0
                active = jnp.where(op_move, open_edges.any(), ready & (kept.sum() > 2))
                fresh = op_move | (i == 1) if cfg.projection == "one_shot" else True
                cands = jnp.where(
                    op_move,
                    jnp.stack([mask.at[c, e, min(j, n_ops - 1)].set(0.0) for j in range(n_slots)]),
                    jnp.stack([mask.at[c, edge_in[min(s, steps)]].set(0.0) for s in range(n_slots)]),
                )
                acc = jax.lax.cond(active & fresh, lambda: accuracies(variables, cands, val), lambda: scores)
                keep = op_choice(acc[:n_ops], mask[c, e] > 0, cfg.criterion)
                chose_op = mask.at[c, e].set(jax.nn.one_hot(keep, n_ops, dtype=mask.dtype))
                dropped = mask.at[c, edge_in[edge_to_drop(acc, kept, cfg.projection)]].set(0.0)
                return jnp.where(active, jnp.where(op_move, chose_op, dropped), mask), acc

            mask, _ = jax.lax.fori_loop(0, steps, move, (mask, jnp.zeros(n_slots)))
            node_done = jnp.where(ready, node_done.at[c, n].set(True), node_done)
            return mask, edge_done, node_done

        return jax.lax.fori_loop(0, len(CELLS), cell, (mask, edge_done, node_done))

    return search


def make_val_accuracies(cfg: SpiderConfig, info: DataInfo, net: DartsSearchNetwork) -> Callable:
    """The searcher's evaluator ``accuracies(variables, candidates, val) -> [n]``: each
    candidate mask's accuracy on the client's whole validation split."""

    def val_accuracy(variables, mask, val: ClientData):
        """Accuracy on the whole validation split in batches of ``search_batch_size``,
        BatchNorm on each batch's statistics."""
        m = val.y.shape[0]
        b = min(cfg.search_batch_size or cfg.eval_batch_size, m)

        def one(i):
            pos = i * b + jnp.arange(b)
            valid = pos < val.count
            idx = jnp.minimum(pos, m - 1)
            logits, _ = Subnet(net, unstack_cells(mask)).apply(
                variables, info.normalize(val.x[idx]), train=True, mask=valid, mutable=["batch_stats"])
            return ((jnp.argmax(logits, -1) == val.y[idx]) & valid).sum()

        correct = jax.lax.map(one, jnp.arange(-(-m // b))).sum()
        return correct / jnp.maximum(val.count, 1)

    def accuracies(variables, candidates, val):
        return jax.lax.map(lambda mk: val_accuracy(variables, mk, val), candidates)

    return accuracies


def make_searcher(cfg: SpiderConfig, info: DataInfo, net: DartsSearchNetwork) -> Callable:
    """``search(variables, mask, edge_done, node_done, val, key)``: one trigger of
    SPIDER-Searcher for one client (masks stacked ``[2, E, |O|]``, normal then reduce),
    scoring candidates by their accuracy on the client's validation split."""
    return make_search(cfg, len(net.primitives), make_val_accuracies(cfg, info, net))


def make_trainer(cfg: SpiderConfig, info: DataInfo, net: DartsSearchNetwork, full: dict, *,
                 precision: str = "fp32") -> Callable:
    """``train(w, personal, opt_state, mask, data, key, lr_w, lr_v)``: Algorithm 1, lines
    12-18, for one client: local epochs of the global model's SGD step and the personal
    model's step on Eq. 4, on the same minibatches. ``precision``: what both models' forward
    and backward compute in (:func:`jaxfednas.precision.compute_in`; the op masks too)."""
    primitives = tuple(net.primitives)
    w_tx, v_tx = sgd(cfg.grad_clip, cfg), sgd(cfg.personal_grad_clip, cfg)

    def train(w, personal, opt_state, mask, data: ClientData, key, lr_w, lr_v):
        w_share = w["params"]  # line 14: the received w^t; `keep` restricts it to A_k's ops
        keep = variable_mask(unstack_cells(mask), w_share, primitives, cfg.nodes, cfg.layers)
        archs = jnp.stack([stack_cells(full), mask])

        def grads(wp, ws, vp, vs, batch, key):
            """Both models' minibatch gradients through one compiled forward/backward
            (``lax.map`` over the pair: half the compile time of two call sites)."""
            def one(args):
                params, stats, arch = args
                subnet = Subnet(net, unstack_cells(arch))
                return make_batch_grad(subnet, info, cfg.augment, precision=precision)(params, stats, batch, key)

            pair = jax.tree.map(lambda a, b: jnp.stack([a, b]), (wp, ws), (vp, vs))
            g, s, m = jax.lax.map(one, (*pair, archs))
            first, second = (jax.tree.map(lambda x: x[i], (g, s, m)) for i in (0, 1))
            return first, second

        def step(carry, batch, key):
            (wp, ws, w_opt), (vp, vs, v_opt) = carry
            (gw, ws, mw), (gv, vs, mv) = grads(wp, ws, vp, vs, batch, key)  # line 17 and ∇_v F_k(v, A_k)
            # line 18: ∇_v F_k(v, A_k) + λ (v − w_share), on the parameters A_k keeps (the
            # gradient of a removed op is exactly 0; its weights stay frozen)
            gv = jax.tree.map(lambda g, v, a, k: k * (g + cfg.prox_lambda * (v - a)), gv, vp, w_share, keep)
            uw, w_opt = w_tx.update(gw, w_opt, wp)
            uv, v_opt = v_tx.update(gv, v_opt, vp)
            wp = jax.tree.map(lambda p, u: p - lr_w * u, wp, uw)
            vp = jax.tree.map(lambda p, u, k: p - lr_v * k * u, vp, uv, keep)
            return ((wp, ws, w_opt), (vp, vs, v_opt)), {**mw, **{f"personal_{k}": x for k, x in mv.items()}}

        carry = ((w["params"], w["batch_stats"], w_tx.init(w["params"])),
                 (personal["params"], personal["batch_stats"], opt_state))
        ((wp, ws, _), (vp, vs, opt_state)), metrics = run_local_epochs(
            step, carry, data, key, epochs=cfg.local_epochs, batch_size=cfg.batch_size)
        return {"params": wp, "batch_stats": ws}, {"params": vp, "batch_stats": vs}, opt_state, metrics

    return train


@checked_factory(SpiderConfig)
def spider(cfg: SpiderConfig, info: DataInfo, *, run: RunOptions = RunOptions()) -> FederatedAlgorithm:
    """Build SPIDER for data described by ``info``.

    Args:
      cfg: the supernet, the searcher and both learners' rates (:class:`SpiderConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`):
        ``run.rounds`` (the learning rates' per-round cosine, needed), clients per round,
        placement, drop-out (a client that fails to report is left out of the aggregate and
        keeps its rows: model, architecture, search progress, clock), the server (sampler,
        aggregator and server optimizer of the global supernet; the architectures are
        personal, never averaged) and ``run.precision``, what local training computes in
        (the searcher's validation accuracies and evaluation run in float32).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``spider``.
    """
    rounds = run.need_rounds("spider")
    server, placement, precision, dropout_rate = run.server, run.placement, run.precision, run.dropout_rate
    server.refuse("spider", "its architectures are personal (A_k), the server averages only the global supernet's "
                  "weights", arch_optimizer=True)
    net = supernet_of(cfg, info.num_classes)
    primitives = tuple(net.primitives)
    num_clients, steps = info.num_clients, cfg.nodes
    m = run.clients(num_clients)
    server.check_clients(num_clients, m)
    start = initial_mask(primitives, steps)
    full = {c: jnp.asarray(v) for c, v in start.items()}  # the global supernet: every op, weight 1
    search = make_searcher(cfg, info, net)
    train = make_trainer(cfg, info, net, full, precision=precision)
    v_tx = sgd(cfg.personal_grad_clip, cfg)
    lr_w, lr_v = cosine_lr(cfg.lr, cfg.lr_min, rounds), cosine_lr(cfg.personal_lr, cfg.lr_min, rounds)

    def rows(tree):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients,) + jnp.shape(a)), tree)

    def init(key):
        x = jnp.zeros((1,) + info.image_shape, jnp.float32)
        # the global and the personal supernets' initialisations, one trace of init for both
        both = jax.vmap(lambda k: _init_variables(net, full, k, x))(jax.random.split(key))
        w = jax.tree.map(lambda a: a[0], both)
        v = w if cfg.personal_init == "global" else jax.tree.map(lambda a: a[1], both)
        node_done = np.zeros((len(CELLS), steps), bool)
        node_done[:, 0] = True  # node 0 has only its two inputs: nothing to choose
        return SpiderState(
            variables=w, personal=rows(v), opt_state=rows(v_tx.init(v["params"])),
            arch_masks=rows({c: jnp.asarray(a) for c, a in start.items()}),
            edge_done=jnp.zeros((num_clients, len(CELLS), num_edges(steps)), bool),
            node_done=rows(jnp.asarray(node_done)), client_rounds=jnp.zeros((num_clients,), jnp.int32),
            round=jnp.zeros((), jnp.int32), server=server.init(w),
        )

    def round_fn(state: SpiderState, data: FederatedData, key: jax.Array):
        idx, keys = run.sample(key, state.round, data, num_clients)
        t = state.client_rounds[idx]
        mask = stack_cells(gather_rows(state.arch_masks, idx)).swapaxes(0, 1)  # [m, 2, E, |O|]
        edge_done, node_done = state.edge_done[idx], state.node_done[idx]
        personal, val = gather_rows(state.personal, idx), data.clients("val", idx)
        # Algorithm 1, line 10 / Algorithm 2, line 3 (on each client's own clock)
        trigger = search_due(cfg, t, edge_done.all((1, 2)) & node_done.all((1, 2)))

        def one(c, _):
            v, mk, ed, nd, vd, k, go = c
            return jax.lax.cond(go, lambda: search(v, mk, ed, nd, vd, k), lambda: (mk, ed, nd))

        mask, edge_done, node_done = map_clients(
            one, (personal, mask, edge_done, node_done, val, rng.search_keys(keys), trigger), placement=placement)
        final = edge_done.all((1, 2)) & node_done.all((1, 2))
        train_data = jax.vmap(combined_split)(data.clients("train", idx), val, final & cfg.final_on_val) \
            if cfg.final_on_val else data.clients("train", idx)

        def client(c, shared):
            w, lw, lv = shared
            v, opt, mk, d, k = c
            return train(w, v, opt, mk, d, k, lw, lv)

        new_w, new_v, new_opt, metrics = map_clients(
            client, (personal, gather_rows(state.opt_state, idx), mask, train_data, keys),
            (state.variables, lr_w(state.round), lr_v(state.round)), placement=placement)
        # line 6: Σ N_k/N w_k over the clients that report, then the server optimizer, if any
        w, opt, server_metrics = run.combine(new_w, train_data.count, key, idx, state.variables, state.server)
        reported = reporting_clients(key, idx, dropout_rate)  # who keeps their new rows
        rows = scatter_rows(
            {"personal": state.personal, "opt_state": state.opt_state, "arch_masks": state.arch_masks,
             "edge_done": state.edge_done, "node_done": state.node_done, "client_rounds": state.client_rounds}, idx,
            {"personal": new_v, "opt_state": new_opt, "arch_masks": unstack_cells(mask.swapaxes(0, 1)),
             "edge_done": edge_done, "node_done": node_done, "client_rounds": t + 1}, keep=reported)
        state = SpiderState(variables=w, round=state.round + 1, server=opt, **rows)
        n = jnp.maximum(metrics["examples"].sum(), 1)
        return state, {
            "train_loss": metrics["loss_sum"].sum() / n, "train_acc": metrics["correct"].sum() / n,
            "personal_train_loss": metrics["personal_loss_sum"].sum() / n,
            "personal_train_acc": metrics["personal_correct"].sum() / n,
            "train_examples": metrics["examples"].sum(), "searching_clients": trigger.sum(),
            "edges_decided": state.edge_done.mean(), "final_clients": _final(state).sum(),
            **server_metrics,
        }

    def logits_of_subnet(v):
        return lambda x: Subnet(net, v["arch_masks"]).apply(
            {"params": v["params"], "batch_stats": v["batch_stats"]}, info.normalize(x), train=False)

    def evaluate(state: SpiderState, data: FederatedData):
        supernet = {**state.variables, "arch_masks": full}
        out = global_accuracy(logits_of_subnet(supernet), data, cfg.eval_batch_size)
        out.update(client_accuracies(logits_of_subnet, {**state.personal, "arch_masks": state.arch_masks}, data,
                                     cfg.eval_batch_size, placement=placement, personal=True))
        sizes = jax.vmap(lambda a: _kept_parameters(a, state.variables["params"], primitives, cfg))(state.arch_masks)
        out.update({"edges_decided": state.edge_done.mean(), "final_clients": _final(state).sum(),
                    "personal_params_mean": sizes.mean(),
                    "supernet_params": sum(x.size for x in jax.tree.leaves(state.variables["params"]))})
        return out

    def export(state: SpiderState) -> PersonalGenotypes:
        return PersonalGenotypes.of(state, primitives, steps)

    return FederatedAlgorithm(
        name="spider", init=placement.jit_init(init, ROWS), round=placement.jit_round(round_fn, init, ROWS),
        evaluate=jit(evaluate),
        export=export, write_architecture=PersonalGenotypes.plot,
    )


def _init_variables(net: DartsSearchNetwork, full: dict, key: jax.Array, x: jax.Array) -> dict:
    v = net.init(key, x, arch_weights=full)
    return {"params": v["params"], "batch_stats": v["batch_stats"]}


def _final(state: SpiderState) -> jax.Array:
    return state.edge_done.all((1, 2)) & state.node_done.all((1, 2))


def _kept_parameters(mask: dict, params: dict, primitives, cfg: SpiderConfig) -> jax.Array:
    keep = variable_mask(mask, params, primitives, cfg.nodes, cfg.layers)
    return sum((jnp.broadcast_to(k, p.shape)).sum() for k, p in zip(jax.tree.leaves(keep), jax.tree.leaves(params)))


@dataclasses.dataclass(frozen=True)
class PersonalGenotypes:
    """What SPIDER exports: each client's architecture — its genotype once the search is
    final, else the ops each edge still keeps. Written as ``personal_genotypes.json``."""

    FILENAME = "personal_genotypes.json"
    clients: dict  # client id -> {"final": bool, "genotype": dict | None, "normal": [[op, ...]], "reduce": ...}

    @classmethod
    def of(cls, state: SpiderState, primitives, steps: int) -> PersonalGenotypes:
        arch = jax.tree.map(np.asarray, jax.device_get(state.arch_masks))
        final = np.asarray(jax.device_get(_final(state)))
        clients = {}
        for k in range(len(final)):
            mask = {c: arch[c][k] for c in CELLS}
            kept = {c: [[primitives[j] for j in np.flatnonzero(row)] for row in mask[c]] for c in CELLS}
            genotype = genotype_from_mask(mask, primitives, steps).to_dict() if final[k] else None
            clients[str(k)] = {"final": bool(final[k]), "genotype": genotype, **kept}
        return cls(clients)

    def genotypes(self) -> dict:
        """Client id -> :class:`~jaxfednas.search_spaces.darts.Genotype` for the clients whose search is final."""
        from jaxfednas.search_spaces.darts import Genotype
        return {int(k): Genotype.from_dict(v["genotype"]) for k, v in self.clients.items() if v["final"]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.clients, sort_keys=True, **kwargs)

    @classmethod
    def from_json(cls, s: str) -> PersonalGenotypes:
        return cls(json.loads(s))

    def plot(self, out_dir) -> None:
        """Cell diagrams ``client_<k>_normal.png`` / ``_reduce.png`` of every final architecture."""
        out_dir = make_dirs(out_dir)
        for k, genotype in self.genotypes().items():
            plot_genotype(genotype, out_dir / f"client_{k}")


# --- Personalization gain (Eq. 6) --------------------------------------------------------------


def personalization_gain(p: np.ndarray) -> np.ndarray:
    """Eq. 6: ``g_i = Σ_{j≠i} (p_ii − p_ij) / (c − 1)`` from the matrix ``p[i, j]`` =
    accuracy on client i's data of client j's architecture. Mean over i = SPIDER's gain."""
    p = np.asarray(p, np.float64)
    c = p.shape[0]
    if p.shape != (c, c) or c < 2:
        raise ValueError(f"the personalization matrix must be square with at least 2 clients, got {p.shape}")
    return (c * np.diag(p) - p.sum(1)) / (c - 1)  # Σ_{j≠i} (p_ii − p_ij) = c p_ii − Σ_j p_ij


def gain_matrix(cfg: SpiderConfig, info: DataInfo, state: SpiderState, data: FederatedData, *,
                epochs: int | None = None, placement: Placement = Placement()) -> np.ndarray:
    """The matrix P of §5.2.2: ``p[i, j]`` = client i's local test accuracy of client j's
    final architecture A_j, fine-tuned on client i's train + validation data for ``epochs``
    (default ``cfg.gain_epochs``) epochs from the global supernet's weights
    (:func:`fine_tuned_accuracy`), so a row compares architectures from the same weights on
    the same data. The paper reports the best accuracy over the fine-tuning epochs
    (test-set selection); this reports the last. Every client's search must be final."""
    final = np.asarray(jax.device_get(_final(state)))
    if not final.all():
        raise ValueError(f"clients {np.flatnonzero(~final).tolist()} have not finished their search: "
                         "run more rounds (or a shorter algo.warmup_rounds / algo.recovery_rounds)")
    k = info.num_clients
    every = {c: jnp.broadcast_to(a[None], (k,) + a.shape) for c, a in state.arch_masks.items()}  # row i: A_1 .. A_K
    return fine_tuned_accuracy(cfg, info, state.variables, every, data, epochs=epochs, placement=placement)


def fine_tuned_accuracy(cfg: SpiderConfig, info: DataInfo, variables: dict, masks: dict, data: FederatedData, *,
                        epochs: int | None = None, placement: Placement = Placement(),
                        training_seed: int = 0) -> np.ndarray:
    """``acc[i, j]``: client i's local test accuracy of the architecture ``masks[c][i, j]``
    (0/1 masks ``{"normal": [K, n, E, |O|], "reduce": ...}``: n candidates for each client),
    fine-tuned on client i's train + validation data for ``epochs`` (default
    ``cfg.gain_epochs``) epochs of SGD (``personal_lr``, momentum, weight decay,
    ``personal_grad_clip``; no λ term) from ``variables`` (the global supernet's weights; only
    the variables a mask keeps move). Every candidate of client i sees the same minibatches,
    so a row differs only in the architecture: the personalization gain's recipe
    (:func:`gain_matrix`), and the one a random architecture is trained with when it is
    compared with a searched one. ``training_seed`` > 0 draws other minibatches (and
    augmentations): the same recipe with another training seed."""
    net = supernet_of(cfg, info.num_classes)
    primitives = tuple(net.primitives)
    tx = sgd(cfg.personal_grad_clip, cfg)
    w = variables
    epochs = epochs or cfg.gain_epochs

    def fine_tune(mask, client: ClientData, test: ClientData, key):
        subnet = Subnet(net, unstack_cells(mask))
        grad = make_batch_grad(subnet, info, cfg.augment)
        keep = variable_mask(unstack_cells(mask), w["params"], primitives, cfg.nodes, cfg.layers)

        def step(carry, batch, key):
            params, stats, opt = carry
            g, stats, metrics = grad(params, stats, batch, key)
            u, opt = tx.update(jax.tree.map(lambda a, k: a * k, g, keep), opt, params)
            params = jax.tree.map(lambda p, u, k: p - cfg.personal_lr * k * u, params, u, keep)
            return (params, stats, opt), metrics

        (params, stats, _), _ = run_local_epochs(step, (w["params"], w["batch_stats"], tx.init(w["params"])),
                                                 client, key, epochs=epochs, batch_size=cfg.batch_size)
        logits = lambda x: subnet.apply({"params": params, "batch_stats": stats},  # noqa: E731
                                        info.normalize(x), train=False)
        r = evaluate_examples(logits, test.x, test.y, test.count, batch_size=cfg.eval_batch_size)
        return r["correct"] / jnp.maximum(r["count"], 1)

    @jit
    def row(row_masks, client: ClientData, test: ClientData, key):  # acc[i, :] for one client i
        return map_clients(lambda mask, _: fine_tune(mask, client, test, key), row_masks, placement=placement)

    def one(split: str, i: int) -> ClientData:
        return jax.tree.map(lambda a: a[0], data.clients(split, jnp.asarray([i])))

    stacked = jnp.stack([jnp.asarray(masks[c], jnp.float32) for c in CELLS], axis=2)  # [K, n, 2, E, |O|]
    if stacked.ndim != 5 or stacked.shape[0] != info.num_clients:
        raise ValueError(f"masks must be [K={info.num_clients}, n, E, |O|] per cell, got {masks[CELLS[0]].shape}")
    keys = rng.adaptation_keys(jnp.arange(info.num_clients))
    if training_seed:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, training_seed))(keys)
    return np.stack([
        np.asarray(row(stacked[i], combined_split(one("train", i), one("val", i), jnp.asarray(True)), one("test", i),
                       keys[i]))
        for i in range(info.num_clients)
    ])


def inherited_accuracy(cfg: SpiderConfig, info: DataInfo, variables: dict, masks: dict, data: FederatedData, *,
                       placement: Placement = Placement(), max_batches: int = 10) -> np.ndarray:
    """``acc[i, j]``: client i's local test accuracy of the architecture ``masks[c][i, j]``
    (as :func:`fine_tuned_accuracy`'s) with the weights it inherits from ``variables`` (the
    global supernet's; none moves) and its BatchNorm statistics recalibrated under that mask
    on client i's train + validation data (:func:`~jaxfednas.algorithms.common.client_batch_statistics`:
    the exact mean and variance of up to ``max_batches`` batches, nothing left of the
    supernet's own statistics). The weight-sharing estimate a supernet-based search ranks
    architectures by (issue 49's ranking diagnostic)."""
    net = supernet_of(cfg, info.num_classes)
    params = variables["params"]
    zeros = jax.tree.map(jnp.zeros_like, variables["batch_stats"])

    def score(mask, client: ClientData, test: ClientData):
        subnet = Subnet(net, unstack_cells(mask))

        def stats_of(stats, x, m):
            return subnet.apply({"params": params, "batch_stats": stats}, info.normalize(x), train=True, mask=m,
                                mutable=["batch_stats"])[1]["batch_stats"]

        stats, _ = client_batch_statistics(stats_of, zeros, client, batch_size=cfg.eval_batch_size,
                                           max_batches=max_batches, momentum=BN_MOMENTUM)
        logits = lambda x: subnet.apply({"params": params, "batch_stats": stats},  # noqa: E731
                                        info.normalize(x), train=False)
        r = evaluate_examples(logits, test.x, test.y, test.count, batch_size=cfg.eval_batch_size)
        return r["correct"] / jnp.maximum(r["count"], 1)

    @jit
    def row(row_masks, client: ClientData, test: ClientData):  # acc[i, :] for one client i
        return map_clients(lambda mask, _: score(mask, client, test), row_masks, placement=placement)

    def one(split: str, i: int) -> ClientData:
        return jax.tree.map(lambda a: a[0], data.clients(split, jnp.asarray([i])))

    stacked = jnp.stack([jnp.asarray(masks[c], jnp.float32) for c in CELLS], axis=2)  # [K, n, 2, E, |O|]
    if stacked.ndim != 5 or stacked.shape[0] != info.num_clients:
        raise ValueError(f"masks must be [K={info.num_clients}, n, E, |O|] per cell, got {masks[CELLS[0]].shape}")
    return np.stack([
        np.asarray(row(stacked[i], combined_split(one("train", i), one("val", i), jnp.asarray(True)), one("test", i)))
        for i in range(info.num_clients)
    ])


def kept_parameters(cfg: SpiderConfig, params: dict, mask: dict) -> int:
    """Weights of the supernet ``params`` that one architecture's 0/1 ``mask`` keeps (a
    personal subnet's size, as ``personal_params_mean`` counts it)."""
    return int(_kept_parameters(mask, params, PRIMITIVE_SETS[cfg.primitives], cfg))


def random_masks(cfg: SpiderConfig, seed: int, num_clients: int, draws: int, *,
                 size: Callable[[dict], float] | None = None, targets=None) -> dict:
    """The random control's architectures (the searched-vs-random comparison beside §5.2.2):
    draw i gives client k the SPIDER mask of a DARTS cell pair drawn uniformly from the
    space (``sampling.random_mask``, key ``fold_in(random_arch_key(seed, i), k)``), as
    ``{"normal": [K, draws, E, |O|], ...}``. With ``size`` (a mask's parameters) and
    ``targets`` (one per client), each draw is rejection-sampled (``sampling.matched``) to
    within ±10 % of its client's target."""
    from jaxfednas.search_spaces.sampling import matched, random_mask  # noqa: PLC0415

    prims = PRIMITIVE_SETS[cfg.primitives]

    def draw(i: int, k: int) -> dict:
        key = jax.random.fold_in(rng.random_arch_key(seed, i), k)
        if size is None:
            return random_mask(key, prims, cfg.nodes)
        try:
            return matched(key, lambda kk: random_mask(kk, prims, cfg.nodes), size, targets[k], max_tries=20_000)[0]
        except ValueError as e:
            raise ConfigError(f"--match-size, client {k}: {e}; run without --match-size") from None

    m = [[draw(i, k) for i in range(draws)] for k in range(num_clients)]
    return {c: np.asarray([[d[c] for d in row] for row in m], np.float32).reshape(
        (num_clients, draws) + initial_mask(prims, cfg.nodes)[c].shape) for c in CELLS}


INHERITED_BN = "recalibrated"  # gain.json's inherited accuracies: BN statistics measured exactly under each mask


def _candidate_masks(own: dict, rand: dict) -> dict:
    """Each client's candidates for the ranking (its searched mask, then its random draws) as
    lists: what :func:`_inherited` scores, kept in gain.json so a later call can score them again."""
    return {c: np.concatenate([own[c], rand[c]], axis=1).astype(np.int8).tolist() for c in CELLS}


def _inherited(run, g: dict) -> dict:
    """``{"inherited": acc[i, j], "inherited_bn", "masks"}``: client i's candidate j (its
    searched mask, then its random draws: ``g["random"]["masks"]``, rebuilt from the run's
    masks and the draws' keys when an older gain.json lacks them) with the global supernet's
    weights, BN statistics recalibrated under it (:func:`inherited_accuracy`)."""
    cfg, info, state = run.config.algo, run.data.info, run.state
    masks = g["random"].get("masks")
    if masks is None:  # written before the masks were kept: the same draws again from their keys
        params = state.variables["params"]
        arch = {c: np.asarray(a) for c, a in state.arch_masks.items()}
        k, draws = info.num_clients, g["random"]["draws"]
        searched = [kept_parameters(cfg, params, {c: arch[c][i] for c in CELLS}) for i in range(k)]
        size = (lambda m: kept_parameters(cfg, params, m)) if g["random"].get("match_size") else None  # noqa: E731
        rand = random_masks(cfg, run.config.run.seed, k, draws, size=size, targets=searched)
        masks = _candidate_masks({c: arch[c][:, None] for c in CELLS}, rand)
    acc = inherited_accuracy(cfg, info, state.variables, {c: np.asarray(m, np.float32) for c, m in masks.items()},
                             run.data, placement=run.options.placement)
    return {"inherited": acc.round(6).tolist(), "inherited_bn": INHERITED_BN, "masks": masks}


def gain_and_control(run_dir, path, epochs: int, *, resume: bool, draws: int = 0, match_size: bool = False,
                     train_seeds: int = 1, plot=None) -> dict:
    """The personalization-gain matrix of a finished SPIDER run's final state (§5.2.2, Eq. 6;
    :func:`gain_matrix`'s recipe) and, with ``draws``, the random control: every client's
    ``draws`` random masks (:func:`random_masks`) fine-tuned with the same recipe
    (:func:`fine_tuned_accuracy`: the gain's epochs, minibatches and starting weights) in
    the same call. Kept in ``path`` (JSON) and reused on ``resume`` when it was computed for
    the same rounds, epochs and draws (and ``match_size``: random masks within ±10 % of each
    client's searched mask's parameters). With ``draws`` and ``train_seeds`` > 1, also the two
    diagnostics' inputs: every client's searched mask fine-tuned again with ``train_seeds`` - 1
    other training seeds (``repeats``) and every mask's inherited accuracy (``inherited``:
    :func:`inherited_accuracy`). A result whose inherited accuracies were measured the
    earlier way (one epoch at learning rate 0, running statistics) gets them measured again
    on ``resume``, nothing else. A computed matrix is drawn to ``plot`` (a heatmap)."""
    from jaxfednas.checkpoint import atomic_write_text  # noqa: PLC0415
    from jaxfednas.plots import plot_gain_matrix  # noqa: PLC0415
    from jaxfednas.seeds import repeat_seed  # noqa: PLC0415
    from jaxfednas.stages import load_run  # noqa: PLC0415

    run_dir, path = Path(run_dir), Path(path)
    rounds = json.loads((run_dir / "summary.json").read_text())["rounds"]
    if resume and path.exists():
        g = json.loads(path.read_text())
        if g["epochs"] == epochs and g["spider_rounds"] == rounds and g.get("random", {}).get("draws", 0) == draws \
                and g.get("random", {}).get("match_size", False) == match_size \
                and g.get("random", {}).get("train_seeds", 1) == (train_seeds if draws else 1):
            if "inherited" in g["random"] and g["random"].get("inherited_bn") != INHERITED_BN:
                g["random"].update(_inherited(load_run(run_dir), g))
                atomic_write_text(path, json.dumps(g, indent=1) + "\n")
            return g
    print(f"== personalization gain: every client's architecture fine-tuned {epochs} epochs on every client"
          + (f", and {draws} random masks per client" if draws else ""), flush=True)
    t0 = time.perf_counter()
    run = load_run(run_dir)
    cfg, info, state = run.config.algo, run.data.info, run.state
    k = info.num_clients
    arch = {c: np.asarray(a) for c, a in state.arch_masks.items()}
    params = state.variables["params"]
    size = (lambda m: kept_parameters(cfg, params, m)) if match_size else None  # noqa: E731
    searched = [kept_parameters(cfg, params, {c: arch[c][i] for c in CELLS}) for i in range(k)]
    rand = random_masks(cfg, run.config.run.seed, k, draws, size=size, targets=searched)
    # row i: A_1 .. A_K (gain_matrix's candidates), then client i's random masks
    masks = {c: np.concatenate([np.broadcast_to(arch[c][None], (k,) + arch[c].shape), rand[c]], axis=1)
             for c in CELLS}
    acc = fine_tuned_accuracy(cfg, info, state.variables, masks, run.data, epochs=epochs,
                              placement=run.options.placement)
    p, g = acc[:, :k], personalization_gain(acc[:, :k])
    diagnostics = {}
    if draws and train_seeds > 1:
        place = run.options.placement
        own = {c: arch[c][:, None] for c in CELLS}  # [K, 1, E, |O|]: each client's searched mask
        repeats = [fine_tuned_accuracy(cfg, info, state.variables, own, run.data, epochs=epochs, placement=place,
                                       training_seed=repeat_seed(run.config.run.seed, j))[:, 0]
                   for j in range(1, train_seeds)]
        diagnostics = {"train_seeds": train_seeds, "repeats": [r.round(6).tolist() for r in repeats],
                       **_inherited(run, {"random": {"masks": _candidate_masks(own, rand)}})}
    result = {"epochs": epochs, "spider_rounds": run.rounds, "matrix": p.round(6).tolist(), "gain": g.round(6).tolist(),
              "mean_gain": float(g.mean()), "wall_s": round(time.perf_counter() - t0, 1),
              "random": {"draws": draws, "match_size": match_size, "seed": run.config.run.seed,
                         "acc": acc[:, k:].round(6).tolist(),
                         "params": [[kept_parameters(cfg, params, {c: rand[c][i, j] for c in CELLS})
                                     for j in range(draws)] for i in range(k)],
                         "searched_params": searched, **diagnostics}}
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    if plot is not None:
        plot_gain_matrix(p, g, plot, title=f"SPIDER p[i, j] after {epochs} fine-tuning epochs; mean gain "
                         f"{g.mean():+.3f}")
    return result


def client_means(g: dict) -> dict:
    """:func:`gain_and_control`'s result ``g`` as :attr:`jaxfednas.evidence.Control.evaluate`
    returns it, on client means: the searched masks (``p[k, k]``, then each other training
    seed's), each draw's random masks, their kept parameters and (with the diagnostics'
    inputs) their inherited accuracies, searched first; ``g`` itself as ``"gain"``."""
    r = g["random"]
    searched, rand = np.diag(np.asarray(g["matrix"])), np.asarray(r["acc"])
    sizes = [float(np.mean(np.asarray(r["searched_params"], float)))]
    return {"repeats": [float(searched.mean())] + [float(np.mean(x)) for x in r.get("repeats", [])],
            "random": rand.mean(0).tolist(), "sizes": sizes + np.asarray(r["params"], float).mean(0).tolist(),
            "inherited": np.asarray(r["inherited"]).mean(0).tolist() if "repeats" in r else None, "gain": g}


def control(searched, run_dir, path, epochs: int, *, resume: bool, match_size: bool = False, plot=None):
    """The personalization gain and the random control of a finished SPIDER run as one
    batched :class:`jaxfednas.evidence.Control`: its ``evaluate`` is :func:`gain_and_control`
    (every client's random masks drawn per client and fine-tuned with the gain matrix, kept
    in ``path``) read as :func:`client_means`; the gain is ``Evidence.details["gain"]``."""
    from jaxfednas.evidence import Control  # noqa: PLC0415

    return Control(searched, evaluate=lambda randoms, train_seeds: client_means(gain_and_control(
        run_dir, path, epochs, resume=resume, draws=len(randoms), match_size=match_size, train_seeds=train_seeds,
        plot=plot)))


def searched_versus_random(ev) -> dict:
    """Searched vs random from :func:`control`'s :class:`jaxfednas.evidence.Evidence` (client
    means: ``mean``, the plot's ``points`` and, with several training seeds, the
    ``diagnostics``) and, per client, its searched mask (``p[k, k]``) against its own random
    masks (``clients``; ``pairs_beaten`` of the client x draw ``pairs``)."""
    from jaxfednas.seeds import versus_random  # noqa: PLC0415

    g = ev.details["gain"]
    searched, rand = np.diag(np.asarray(g["matrix"])), np.asarray(g["random"]["acc"])
    out = {"clients": [versus_random(searched[k], rand[k].tolist()) for k in range(len(searched))],
           "mean": ev.versus, "pairs_beaten": int((searched[:, None] > rand).sum()), "pairs": int(rand.size),
           "points": ev.points()}
    if len(ev.repeats) > 1:
        out["diagnostics"] = {"train_seeds": len(ev.repeats), "seed_std": ev.snr["seed_std"],
                              "signal_to_noise": ev.snr["ratio"], "inherited": list(ev.inherited), **ev.ranking}
    return out


def control_numbers(ev, versus: dict) -> dict:
    """The random control's numbers for a table over seeds (:func:`jaxfednas.seeds.over_seeds`),
    name -> value: :meth:`~jaxfednas.evidence.Evidence.numbers` of client means (searched,
    random, their difference; the diagnostics where measured) with the fraction of client x
    draw pairs the searched mask wins and the masks' parameters; from :func:`control`'s
    ``ev`` and :func:`searched_versus_random`'s ``versus``."""
    from jaxfednas.evidence import Labels  # noqa: PLC0415

    labels = Labels(searched="searched masks fine-tuned (mean over clients)", random_std=None, beaten=None,
                    random_mean="random masks fine-tuned (mean over clients and draws)", difference="searched − random",
                    seed_std="searched masks: std over {n} training seeds (mean over clients)")
    return {**ev.versus_numbers(labels),
            "client × draw pairs where searched beats random (fraction)": versus["pairs_beaten"] / versus["pairs"],
            "searched masks: parameters (mean over clients)": ev.sizes[0],
            "random masks: parameters (mean)": float(np.mean(ev.details["gain"]["random"]["params"])),
            **(ev.diagnostic_numbers(labels) if len(ev.repeats) > 1 else {})}


def gain_report(g: dict) -> list[str]:
    """The Markdown lines of :func:`gain_and_control`'s personalization-gain matrix ``g`` for a
    results page: the matrix, each client's gain and their mean."""
    p, k = np.asarray(g["matrix"]), len(g["gain"])
    lines = ["", f"## Personalization gain (§5.2.2, Eq. 6; {g['epochs']} fine-tuning epochs, last epoch)", "",
             "p[i, j]: client i's local test accuracy of client j's architecture fine-tuned on client i's train + "
             "validation data from the global supernet's weights; g_i = Σ_j≠i (p_ii − p_ij) / (c − 1). "
             "Heatmap: `plots/gain_matrix.png`.", "",
             "| data \\ arch | " + " | ".join(map(str, range(k))) + " | g_i |", "|---" * (k + 2) + "|"]
    lines += [f"| {i} | " + " | ".join(f"{x:.3f}" for x in p[i]) + f" | {g['gain'][i]:+.4f} |" for i in range(k)]
    return lines + ["", f"mean personalization gain: {g['mean_gain']:+.4f} ({g['wall_s']:.0f} s)"]


def control_report(g: dict, v: dict) -> list[str]:
    """The Markdown lines of the random control for a results page: per client and over
    clients, searched vs random masks (:func:`gain_and_control`'s ``g``,
    :func:`searched_versus_random`'s ``v``), and the diagnostics where measured."""
    r, n, m = g["random"], g["random"]["draws"], v["mean"]
    matched_text = ", size-matched ±10 %" if r.get("match_size") else ""
    lines = ["", f"## Searched vs random architectures ({n} random masks per client{matched_text}, same "
             "fine-tuning)", "",
             f"Every client's searched mask (p[k, k] above) against {n} masks drawn uniformly from the same space "
             + ("among those with parameters within ±10 % of the searched mask's " if r.get("match_size") else "")
             + "for that client (`sampling.random_mask`, keys `fold_in(random_arch_key(seed, i), k)`), each "
             f"fine-tuned as the gain matrix's entries: {g['epochs']} epochs on the client's train + validation "
             "data from the global supernet's weights, the same minibatches; local test accuracy. params: the "
             "supernet weights the mask keeps. Plot: `plots/searched_vs_random.png`.", "",
             "| client | searched params | searched acc | random params (mean) | random acc (mean ± std) | "
             "searched − random | random beaten (ties) |", "|---|---|---|---|---|---|---|"]
    for k, c in enumerate(v["clients"]):
        lines.append(f"| {k} | {r['searched_params'][k]:,} | {c['searched']:.4f} | {np.mean(r['params'][k]):,.0f} "
                     f"| {c['random_mean']:.4f} ± {c['random_std']:.4f} | {c['searched_minus_random']:+.4f} | "
                     f"{c['beats']} of {n} ({c['ties']}) |")
    lines.append(f"| mean over clients | {v['points']['searched'][0]:,.0f} | {m['searched']:.4f} | "
                 f"{np.mean(r['params']):,.0f} | {m['random_mean']:.4f} ± {m['random_std']:.4f} | "
                 f"{m['searched_minus_random']:+.4f} | {m['beats']} of {n} draws ({m['ties']}) |")
    lines += ["", f"Mean over clients: searched {m['searched']:.4f} vs random {m['random_mean']:.4f} "
              f"({m['searched_minus_random']:+.4f}; std over draws of the clients' mean); the searched mask beats "
              f"its random mask in {v['pairs_beaten']} of {v['pairs']} client × draw pairs."]
    d = v.get("diagnostics")
    if d:
        lines += ["", f"Diagnostics (client means): the searched masks fine-tuned with {d['train_seeds']} training "
                  f"seeds (other minibatches) spread by {d['seed_std']:.4f} (std), the random draws by "
                  f"{m['random_std']:.4f}: architecture signal-to-noise {d['signal_to_noise']:.2f}. With the "
                  "global supernet's weights under each mask (BatchNorm statistics recalibrated under it on the "
                  "client's train + validation data, no weight moved) the masks reach "
                  f"{', '.join(f'{x:.4f}' for x in d['inherited'])} "
                  f"(searched first): supernet ranking Kendall's τ {d['kendall_tau']:+.3f}, Spearman's ρ "
                  f"{d['spearman']:+.3f} over {d['n']} architectures."]
    return lines


def search_due(cfg: SpiderConfig, t, finished):
    """Algorithm 1, line 10 / Algorithm 2, line 3: SPIDER-Searcher acts at the client's
    round ``t`` (its own clock, 0-based) when ``t >= t_s``, ``t`` is a multiple of τ and
    its architecture is not ``finished``. Works on NumPy and JAX arrays alike."""
    return (t >= cfg.warmup_rounds) & (t % cfg.recovery_rounds == 0) & ~finished


def search_schedule(cfg: SpiderConfig) -> list[int]:
    """The client rounds t (0-based, the client's own clock) at which SPIDER-Searcher acts:
    one op choice per cell type at each of the first E triggers, then one topology
    projection per remaining node, the first in the round of the last op choice."""
    first = -(-cfg.warmup_rounds // cfg.recovery_rounds) * cfg.recovery_rounds  # first multiple of τ >= t_s
    triggers = num_edges(cfg.nodes) + max(cfg.nodes - 2, 0)
    return [first + i * cfg.recovery_rounds for i in range(triggers)]


def check(config: ExperimentConfig) -> None:
    """What needs the whole configuration, before the factory (:func:`jaxfednas.registry.build_algorithm`)."""
    last = search_schedule(config.algo)[-1]
    if config.run.rounds <= last:
        warnings.warn(
            f"spider: run.rounds={config.run.rounds} ends before any client's search does (its last choice comes "
            f"at the client's round {last + 1} with algo.warmup_rounds={config.algo.warmup_rounds}, "
            f"algo.recovery_rounds={config.algo.recovery_rounds}, {num_edges(config.algo.nodes)} edges): "
            "personal architectures stay partial", stacklevel=2)


FACTORY = spider


def ANNEALS_OVER_ROUNDS(cfg) -> bool:  # noqa: N802  (a resume must keep run.rounds where it holds)
    """Whether a learning rate anneals over ``run.rounds`` (:mod:`jaxfednas.resume`: a resume must then keep them)."""
    return True


RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")


# its former name, one class per meaning since 0.2
__getattr__ = former_module_names(__name__, {"PersonalArchitectures": "PersonalGenotypes"}, globals())
