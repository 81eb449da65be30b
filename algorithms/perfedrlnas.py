"""PerFedRLNAS — Yao, Li, "Personalized Federated Neural Architecture Search via
Reinforcement Learning" (AAAI 2024 as "Perfedrlnas: One-for-all personalized federated
neural architecture search"; code: TL-System/plato, examples/model_search/pfedrlnas),
Algorithm 1, Eqs. 4-9.

A supernet A with D search dimensions (:mod:`jaxfednas.search_spaces.choice`; DARTS edges, an
elastic MobileNetV3, a hybrid conv/attention net) lives on the server with one policy
α_i (logits ``[D, max k_d]``, init 0, its own Adam state) per client, all K of them.
Round t (Algorithm 1)::

  line 5     sample N clients
  line 6     v_i^d ~ softmax(α_i^d) for every dimension d (Eq. 4): client i's subnet w_i
  line 8-10  client i trains w_i alone for E local epochs (SGD, the round's cosine lr) and
             uploads it with its local test accuracy Acc_i
  line 13    r_i = Acc_i − mean Acc − λ_time (RT_i − min RT) [/ min RT, below]      (Eq. 8)
             [− φ_i under a memory budget (Eq. 9): φ_i is the memory utilisation
             min(memory_i / budget_i, 1); a subnet that does not fit scores Acc_i = 0,
             φ_i = 1, RT_i = the round's largest RT]
  line 14    A ← every entry averaged over the clients whose subnet contains it,
             weighted by n_i ("divide by the counts of non-zero occurrences"),
             BatchNorm statistics included; entries no client used keep their value
  line 16    α_i ← Adam ascent on r_i ∇ log p(v_i) = r_i (δ_i − p_i) per dimension (Eqs. 5-7)

mean Acc (the paper's baseline): the history holds each client's latest reported
accuracy; after this round's clients are written into it, its mean over every client
seen so far.

λ_time "regulates accuracy and round time to the same scale" (the paper). Simulated
seconds have no common scale here (a digits round takes a fraction of a second, an
elastic CIFAR round minutes), so by default the time term is unitless:
``time_term="relative"``: λ_time (RT_i − min RT) / min RT, the extra round time as a
fraction of the round's fastest client's; ``time_term="seconds"`` is the paper's and
code's absolute form (the code's λ_time = 0.001 per second). The round's metrics report
``reward_time_share`` = Σ|time term| / Σ|r_i| over the reporting clients.

Round time and memory are simulated, seeded and kept in the state (:class:`Resources`):
per-client throughput (multiply-adds per second), up/down bandwidth (100 Mbit/s, the
paper's setting) and memory budget. RT_i = compute (3 × the subnet's forward
multiply-adds per training example and epoch, + one forward pass per evaluated
example) / throughput + the subnet's float32 weights down and up. Memory = weights,
gradient and momentum + one batch's activations (:meth:`SubnetCost.memory_bytes`).

Differences of the authors' code (docs/authors_code.md §4), as explicit options:
``aggregation="masked_delta"`` (``θ += Σ n_i/n · 1[|Δ_i| ≥ 1e-8] Δ_i``: not count-normalised),
``aggregate_bn=False`` (BN statistics never aggregated), ``baseline="running_max"``
(mean of each seen client's best-ever accuracy, taken before this round's values),
``reduce_probs="normal"`` (DARTS: the reduce cell's gradient uses the normal cell's
probabilities), ``phi="binary"`` (φ_i = 1 over budget, else 0: the code has no φ term
and only zeroes the accuracy; the binary φ is that plus the paper's penalty). With
``aggregate_bn=False`` the server's BatchNorm statistics never leave their init, so
the algorithm's :attr:`~jaxfednas.FederatedAlgorithm.evaluate` and :func:`adapt_new_clients`
first measure each evaluated subnet's statistics on the client's training split
(:func:`recalibrated`), as the code's clients re-estimate them in local training. The
reward's accuracy is the local *test* accuracy, as in the paper and the code (the
architecture is then selected on test data);
``reward_split="val"`` uses the client's validation split instead. Every space trains
with the DARTS code's SGD settings (the code: MobileNetV3 SGD lr 0.35, weight decay 5e-6;
NASViT AdamW 5e-4 with label smoothing; not offered).

Evaluation: ``evaluate`` tests each client's final architecture (the argmax of α_i,
:func:`policy_argmax`) with the supernet's weights as they are; ``personalize`` first
trains it E local epochs on the client's data, as the client would in a round (what
Algorithm 1's reported accuracies measure).

New clients (Fig. 5): :func:`adapt_new_clients` trains the policies of clients that never
took part by evaluating sampled subnets of the final supernet only (no weight updates).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, NamedTuple
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
from jaxfednas.config import ConfigError, ExperimentConfig, Validated, former_module_names, param
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData, run_local_epochs
from jaxfednas.evaluation import client_accuracies, client_accuracy_summary, evaluate_examples
from jaxfednas.optim import cosine_lr
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import (jit, Placement, gather_rows, map_clients, masked_weighted_mean, nothing_to_aggregate,
                               reported_metrics, reporting_clients, scatter_rows)
from jaxfednas.server import Server
from jaxfednas.search_spaces.choice import BYTES_PER_FLOAT, SubnetCost, check_space, choice_mask
from jaxfednas.search_spaces.sampling import random_choice

BN_MOMENTUM = 0.9  # every space's BatchNorm (Flax convention: running = 0.9 running + 0.1 batch)
DESCRIPTION = "PerFedRLNAS (Yao & Li): per-client REINFORCE policies over one supernet, subnets trained by clients"
SPACES = ("darts", "elastic", "hybrid")


@dataclasses.dataclass(frozen=True)
class PerFedRLNASConfig(Validated):
    SECTION = "algo"
    RENAMED = {"steps": "nodes"}
    space: str = param("darts", "search space: DARTS edges, elastic MobileNetV3, hybrid conv/attention", choices=SPACES)
    space_preset: str = param("auto", "geometry of the elastic/hybrid space (auto: small for <= 16 px images, "
                              "cifar otherwise; tiny for tests)", choices=("auto", "tiny", "small", "cifar"))
    C: int = param(8, "DARTS: initial channels (paper/code 16)", range=(2, 512))
    layers: int = param(5, "DARTS: cells (paper/code 8)", range=(1, 64))
    nodes: int = param(4, "DARTS: intermediate nodes per cell", range=(1, 8))
    primitives: str = param("darts", "DARTS: candidate ops per edge ('none' can be sampled, as the code)",
                            choices=("darts", "s2", "tiny"))
    single_path: bool = param(True, "DARTS: compute only each subnet's chosen op per edge (clients mapped one "
                              "after another); false: every op, masked (one vmap over clients)")
    local_epochs: int = param(5, "local epochs E per round (paper 5)", range=(1, 10_000))
    batch_size: int = param(32, "local minibatch size (code 32)", range=(1, 1_000_000))
    lr: float = param(0.025, "client SGD learning rate at round 0 (code 0.025)", range=(0.0, 100.0))
    lr_min: float = param(0.001, "floor of the per-round cosine over run.rounds (code 0.001)", range=(0.0, 100.0))
    momentum: float = param(0.9, "client SGD momentum", range=(0.0, 1.0))
    weight_decay: float = param(3e-4, "client weight decay on the subnet's weights", range=(0.0, 1.0))
    grad_clip: float = param(5.0, "global-norm gradient clipping (0: off)", range=(0.0, None))
    policy_lr: float = param(0.5, "Adam learning rate of every policy α_i (code 0.5)", range=(0.0, 100.0))
    policy_beta1: float = param(0.5, "Adam β1 of the policies (code 0.5)", range=(0.0, 1.0))
    policy_beta2: float = param(0.999, "Adam β2 of the policies", range=(0.0, 1.0))
    lambda_time: float = param(0.05, "λ_time of Eq. 8, per unit of time_term (relative: the round's fastest "
                               "client's time; seconds: the code's 0.001)", range=(0.0, 1e6))
    time_term: str = param("relative", "Eq. 8's RT_i − min RT: relative = divided by min RT (unitless, the same "
                           "scale in every space) or seconds (simulated seconds, the paper/code)",
                           choices=("relative", "seconds"))
    baseline: str = param("latest", "mean Acc of Eq. 8: latest accuracy of every seen client (paper) or "
                          "running_max (code)", choices=("latest", "running_max"))
    aggregation: str = param("count_normalized", "supernet update: count_normalized (paper) or masked_delta "
                             "(code: n-weighted masked deltas)", choices=("count_normalized", "masked_delta"))
    aggregate_bn: bool = param(True, "aggregate BatchNorm statistics like weights (false: the code keeps them; "
                               "evaluation then measures each subnet's statistics on the client's training split)")
    bn_recalibration_batches: int = param(4, "aggregate_bn=false: batches of eval_batch_size training examples a "
                                          "client measures its subnet's BatchNorm statistics on", range=(1, 10_000))
    reduce_probs: str = param("own", "DARTS: the reduce cell's policy gradient uses its own probabilities or the "
                              "normal cell's (the code's bug)", choices=("own", "normal"))
    reward_split: str = param("test", "split whose accuracy is the reward (paper/code: test)", choices=("test", "val"))
    memory_budget: bool = param(False, "Eq. 9: reward − φ_i; subnets over a client's memory budget score 0, "
                                "φ = 1")
    phi: str = param("utilization", "Eq. 9's φ_i: utilization = min(memory_i / budget_i, 1) (paper: memory "
                     "utilisation) or binary = 1 over budget, else 0", choices=("utilization", "binary"))
    budget_range: tuple[float, float] = param((0.25, 1.0), "memory budget = m_min + U[lo, hi] (m_max − m_min), "
                                              "m_min/m_max the smallest/largest subnet's training memory (paper: "
                                              "2-16 GB on NASViT)", range=(0.0, 10.0))
    throughput_range: tuple[float, float] = param((1e9, 1e10), "client throughput ~ log-U[lo, hi] multiply-adds per second")
    bandwidth_mbps: float = param(100.0, "up- and download bandwidth, Mbit/s (paper 100)", range=(1e-6, None))
    augment: str = param("auto", "on-device augmentation of client training (auto: none for digits, crop+flip "
                         "for CIFAR, as the code)", choices=AUGMENTS)
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))

    def check(self):
        if self.space == "darts" and self.C % 2:
            raise ConfigError(f"algo.C={self.C} must be even (FactorizedReduce splits channels in two)")
        for name in ("budget_range", "throughput_range"):
            lo, hi = getattr(self, name)
            if not (math.isfinite(lo) and math.isfinite(hi)):  # inf/NaN would reach the rewards as NaN
                raise ConfigError(f"algo.{name} must be finite numbers, got {(lo, hi)}")
            if not 0 <= lo <= hi or (name == "throughput_range" and lo <= 0):
                raise ConfigError(f"algo.{name} must be (lo, hi) with 0 <= lo <= hi (throughput > 0), got {(lo, hi)}")
        if self.reduce_probs == "normal" and self.space != "darts":
            raise ConfigError("algo.reduce_probs='normal' (the code's DARTS bug) needs algo.space='darts'")


CONFIG = PerFedRLNASConfig
# train / local test (the paper: no validation split); reward_split="val" needs one
DEFAULTS = {"data.split": (0.8, 0.0, 0.2), "run.clients_per_round": 0.25}
PRESETS = {
    "smoke": {"run.rounds": 3, "algo.C": 4, "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny",
              "algo.local_epochs": 1},
    # docs/authors_code.md §4.4 (DARTS config): CIFAR-10, 100 clients Dir(0.3), 5 per round,
    # 1500 rounds of 5 local epochs, batch 32, C=16 with 8 cells.
    "paper": {"data.dataset": "cifar10", "data.num_clients": 100, "data.partition": "dirichlet",
              "data.alpha": 0.3, "run.clients_per_round": 5, "run.rounds": 1500, "run.eval_every": 50,
              "algo.C": 16, "algo.layers": 8},
}


@flax.struct.dataclass
class Resources:
    """Each client's simulated device (leading axis K), drawn once from the run's seed."""

    throughput: jax.Array  # multiply-adds per second
    memory_budget: jax.Array  # bytes
    up_bps: jax.Array  # bits per second
    down_bps: jax.Array


@renamed_fields(policy="policy_logits", policy_opt="opt_state")  # their names before checkpoint schema 2
@flax.struct.dataclass
class PerFedRLNASState:
    variables: dict  # the supernet A: {"params", "batch_stats"}
    policy_logits: jax.Array  # [K, D, max k_d] α_i, each client's policy (padding slots unused)
    opt_state: Any  # each policy's Adam state, leading axis K
    acc: jax.Array  # [K] latest reported accuracy
    best_acc: jax.Array  # [K] best reported accuracy (the code's baseline and logged number)
    seen: jax.Array  # [K] bool: reported at least once
    resources: Resources
    round: jax.Array  # int32


# per-client fields (leading axis K): split along the clients mesh
ROWS = ("policy_logits", "opt_state", "acc", "best_acc", "seen", "resources")


def make_space(cfg: PerFedRLNASConfig, info: DataInfo):
    """The choice space ``cfg`` names, for ``info``'s images and classes."""
    if cfg.space == "darts":
        from jaxfednas.search_spaces.darts import PRIMITIVE_SETS, DartsSearchNetwork
        from jaxfednas.search_spaces.darts.space import DartsChoiceSpace
        net = DartsSearchNetwork(C=cfg.C, num_classes=info.num_classes, layers=cfg.layers, steps=cfg.nodes,
                                 multiplier=cfg.nodes, primitives=PRIMITIVE_SETS[cfg.primitives],
                                 single_path=cfg.single_path)
        space = DartsChoiceSpace(net, tuple(info.image_shape))
    else:
        preset = cfg.space_preset
        if preset == "auto":
            preset = "small" if max(info.image_shape[:2]) <= 16 else "cifar"
        if cfg.space == "elastic":
            from jaxfednas.search_spaces.elastic import ElasticMobileNet as Space
        else:
            from jaxfednas.search_spaces.hybrid import HybridViT as Space
        space = Space.from_preset(preset, num_classes=info.num_classes, image_shape=tuple(info.image_shape))
    check_space(space)
    return space


def largest_choice(space) -> np.ndarray:
    """The subnet with the largest training memory: the space's own ``largest_choice()``
    if it has one, else the last choice of every dimension."""
    if hasattr(space, "largest_choice"):
        return np.asarray(space.largest_choice(), np.int32)
    return np.array([len(d.choices) - 1 for d in space.dims], np.int32)


def smallest_choice(space) -> np.ndarray:
    """The subnet with the smallest training memory: ``smallest_choice()`` or the first
    choice of every dimension."""
    if hasattr(space, "smallest_choice"):
        return np.asarray(space.smallest_choice(), np.int32)
    return np.zeros(len(space.dims), np.int32)


def draw_resources(cfg: PerFedRLNASConfig, key: jax.Array, num_clients: int,
                   memory_range: tuple[float, float]) -> Resources:
    """Throughput log-uniform in ``throughput_range``, memory budget ``m_min + u (m_max −
    m_min)`` with u uniform in ``budget_range`` (``memory_range = (m_min, m_max)``, the
    smallest and largest subnet's training memory: a budget below 0 fits no subnet, one
    of 1 every subnet), symmetric bandwidth ``bandwidth_mbps``."""
    k_t, k_m = jax.random.split(key)
    lo, hi = (float(np.log(v)) for v in cfg.throughput_range)
    throughput = jnp.exp(jax.random.uniform(k_t, (num_clients,), minval=lo, maxval=hi))
    b_lo, b_hi = cfg.budget_range
    m_min, m_max = memory_range
    budget = m_min + jax.random.uniform(k_m, (num_clients,), minval=b_lo, maxval=b_hi) * (m_max - m_min)
    bps = jnp.full((num_clients,), cfg.bandwidth_mbps * 1e6, jnp.float32)
    return Resources(throughput=throughput, memory_budget=budget, up_bps=bps, down_bps=bps)


def masked_logits(policy: jax.Array, valid: np.ndarray) -> jax.Array:
    """α with the padding slots of short dimensions at −inf (probability 0)."""
    return jnp.where(valid, policy, -jnp.inf)


def policy_entropy(policy: jax.Array, valid: np.ndarray) -> jax.Array:
    """Mean entropy (nats) over clients and dimensions of softmax(α) (padding slots excluded:
    dimensions may have different numbers of choices)."""
    logp = jax.nn.log_softmax(masked_logits(policy, valid), -1)
    return (-jnp.where(valid, jnp.exp(logp) * logp, 0.0).sum(-1)).mean()


def policy_argmax(policy: jax.Array, valid: np.ndarray) -> jax.Array:
    """Each client's final architecture: argmax of α_i per dimension (``policy [..., D, K]``
    -> int32 ``[..., D]``). Exact ties (common: one Adam step with a negative reward raises
    every op but the sampled one by the same amount) go to a fixed pseudo-random choice
    among the tied ops rather than always to the first op (``none`` in DARTS)."""
    u = jax.random.uniform(jax.random.key(0x71E), policy.shape[-2:])
    tie = 1e-6 * jnp.maximum(jnp.abs(policy), 1.0) * u
    return jnp.argmax(masked_logits(policy + tie, valid), -1).astype(jnp.int32)


def policies_for(choices: jax.Array, max_choices: int) -> jax.Array:
    """Policies α ``[K, D, max_choices]`` whose argmax is exactly ``choices [K, D]``: to test
    given subnets (random ones: the control of :func:`random_subnets`) through ``evaluate``
    and ``personalize``, the very code that tests the learned policies' argmax subnets."""
    return 10.0 * jax.nn.one_hot(choices, max_choices)


def random_subnets(key: jax.Array, space, budgets: np.ndarray | None = None, *, num_clients: int = 1,
                   batch_size: int = 32, max_tries: int = 10_000) -> np.ndarray:
    """One uniformly random subnet per client ``[K, D]`` (:func:`jaxfednas.search_spaces.sampling.random_choice`;
    client k's draws from ``fold_in(key, k)``). With ``budgets`` [K] (bytes) the same filter
    the learned subnets face (Eq. 9): client k's subnet is uniform among those whose training
    memory (:meth:`SubnetCost.memory_bytes` at ``batch_size``) fits its budget; without,
    ``num_clients`` unconstrained draws."""
    budgets = np.full(num_clients, np.inf) if budgets is None else np.asarray(budgets, np.float64)
    rows = []
    for k, budget in enumerate(budgets):
        for t in range(max_tries):
            choice = random_choice(jax.random.fold_in(jax.random.fold_in(key, k), t), space)
            if space.cost(choice).memory_bytes(batch_size) <= budget:
                break
        else:
            raise ValueError(f"client {k}: no random subnet within its memory budget of {budget / 2**20:.1f} MiB "
                             f"in {max_tries} draws")
        rows.append(choice)
    return np.stack(rows).astype(np.int32)


def policy_gradient(policy: jax.Array, choice: jax.Array, reward: jax.Array, valid: np.ndarray,
                    probs_from: np.ndarray | None = None) -> jax.Array:
    """Eqs. 5-7: ``r (δ − p)`` per dimension, the ascent direction of the expected reward
    for one client (``policy [D, K]``, ``choice [D]``). ``probs_from[d]`` names the
    dimension whose probabilities dimension d uses (identity: the paper; the code's DARTS
    reduce cell reads the normal cell's)."""
    p = jax.nn.softmax(masked_logits(policy, valid), -1)
    if probs_from is not None:
        p = p[jnp.asarray(probs_from)]
    delta = jax.nn.one_hot(choice, policy.shape[-1], dtype=p.dtype)
    return jnp.where(valid, reward * (delta - p), 0.0)


def time_penalty(rt: jax.Array, reported: jax.Array, lambda_time: float, form: str) -> jax.Array:
    """Eq. 8's time term ``λ_time (RT_i − min RT)``, min RT over the clients that reported
    this round; ``form="relative"`` divides by min RT (a unitless fraction of the fastest
    client's time), ``"seconds"`` keeps simulated seconds. 0 for clients that did not report."""
    min_rt = jnp.min(jnp.where(reported, rt, jnp.inf))
    extra = rt - min_rt
    if form == "relative":
        extra = extra / jnp.where(min_rt > 0, min_rt, 1.0)
    elif form != "seconds":
        raise ValueError(f"time_term must be 'relative' or 'seconds', got {form!r}")
    return jnp.where(reported, lambda_time * extra, 0.0)


def rewards(acc: jax.Array, baseline: jax.Array, time: jax.Array, phi: jax.Array) -> jax.Array:
    """Eq. 8 (Eq. 9 with φ): ``r_i = Acc_i − mean Acc − time_i − φ_i`` with ``time_i`` the
    term of :func:`time_penalty`."""
    return acc - baseline - time - phi


def accuracy_baseline(kind: str, history: jax.Array, best: jax.Array, seen: jax.Array, idx: jax.Array,
                      acc: jax.Array, reported: jax.Array) -> jax.Array:
    """mean Acc of Eq. 8 (``history``, ``best``, ``seen``: ``[K]`` before this round; ``acc``,
    ``reported``: the round's clients ``idx``). ``"latest"`` (the paper): this round's
    accuracies written into the history of latest accuracies, then its mean over every
    client seen so far. ``"running_max"`` (the code): the mean of the seen clients'
    best-ever accuracies *before* this round (on the first round: this round's mean)."""
    if kind == "latest":
        hist = history.at[idx].set(jnp.where(reported, acc, history[idx]))
        now = seen.at[idx].set(seen[idx] | reported)
        return (hist * now).sum() / jnp.maximum(now.sum(), 1)
    if kind != "running_max":
        raise ValueError(f"baseline must be 'latest' or 'running_max', got {kind!r}")
    before = seen.sum()
    return jnp.where(before > 0, (best * seen).sum() / jnp.maximum(before, 1),
                     (acc * reported).sum() / jnp.maximum(reported.sum(), 1))


def memory_penalty(acc: jax.Array, rt: jax.Array, memory: jax.Array, budget: jax.Array, reported: jax.Array,
                   phi: str) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Eq. 9 for the round's clients: ``(Acc, RT, φ, fits)``. A subnet whose training memory
    exceeds the budget cannot train: Acc_i = 0, φ_i = 1 and RT_i = the largest RT of the
    clients that reported. Otherwise φ_i is the memory utilisation ``memory_i / budget_i``
    (``phi="utilization"``, the paper) or 0 (``phi="binary"``)."""
    fits = memory <= budget
    acc = jnp.where(fits, acc, 0.0)
    rt = jnp.where(fits, rt, jnp.max(jnp.where(reported, rt, -jnp.inf)))
    if phi == "utilization":
        p = jnp.minimum(memory / budget, 1.0)
    elif phi == "binary":
        p = (~fits).astype(jnp.float32)
    else:
        raise ValueError(f"phi must be 'utilization' or 'binary', got {phi!r}")
    return acc, rt, p, fits


def host_costs(space, choices: np.ndarray) -> np.ndarray:
    """``[N, 3]`` float32 (params, multiply-adds, activation floats) of ``N`` subnets."""
    return np.array([space.cost(c) for c in np.asarray(choices)], np.float32).reshape(-1, 3)


def traced_costs(space, choices: jax.Array) -> jax.Array:
    """``[N, 3]`` costs of traced choices: the space's ``traced_cost`` where it has one, else
    :func:`host_costs` through a host callback (costs are exact host integers)."""
    if hasattr(space, "traced_cost"):
        return jax.vmap(space.traced_cost)(choices)
    out = jax.ShapeDtypeStruct((choices.shape[0], 3), jnp.float32)
    return jax.pure_callback(lambda c: host_costs(space, c), out, choices)


def round_time(costs: jax.Array, n_train: jax.Array, n_eval: jax.Array, epochs: int, res: Resources) -> jax.Array:
    """Simulated seconds from sending the subnet to receiving it back (see the module doc)."""
    params, macs = costs[..., 0], costs[..., 1]
    compute = (3.0 * macs * n_train * epochs + macs * n_eval) / res.throughput
    bits = 8.0 * BYTES_PER_FLOAT * params
    return compute + bits / res.down_bps + bits / res.up_bps


def training_memory(costs: jax.Array, batch_size: int) -> jax.Array:
    """:meth:`SubnetCost.memory_bytes` (SGD momentum) of traced costs."""
    return BYTES_PER_FLOAT * (3.0 * costs[..., 0] + batch_size * costs[..., 2])


def make_client_train(cfg: PerFedRLNASConfig, info: DataInfo, space, precision: str = "fp32") -> Callable:
    """``train(variables, choice, data, key, lr) -> (variables, metrics)``: E epochs of SGD
    on the subnet ``choice`` alone. Only the entries it uses move (its variable mask:
    weight decay and momentum of unused weights are masked, BatchNorm statistics of unused
    layers restored), so the upload is the subnet. ``precision``: what the forward and
    backward compute in (:mod:`jaxfednas.precision`)."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    tx = optax.chain(*parts, optax.add_decayed_weights(cfg.weight_decay), optax.trace(cfg.momentum))

    def train(variables, choice, data: ClientData, key, lr):
        keep = space.variable_mask(choice, variables)
        grad = make_batch_grad(space.subnet(choice), info, cfg.augment, precision=precision)

        def step(carry, batch, key):
            params, stats, opt = carry
            g, new_stats, metrics = grad(params, stats, batch, key)
            g = jax.tree.map(lambda a, k: a * k, g, keep["params"])
            u, opt = tx.update(g, opt, params)
            params = jax.tree.map(lambda p, u, k: p - lr * k * u, params, u, keep["params"])
            stats = jax.tree.map(lambda new, old, k: jnp.where(k > 0, new, old), new_stats, stats,
                                 keep["batch_stats"])
            return (params, stats, opt), metrics

        carry = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
        (params, stats, _), metrics = run_local_epochs(step, carry, data, key, epochs=cfg.local_epochs,
                                                       batch_size=cfg.batch_size)
        return {"params": params, "batch_stats": stats}, metrics

    return train


def subnet_accuracy(space, info: DataInfo, variables, choice, data: ClientData, batch_size: int) -> jax.Array:
    """Accuracy of subnet ``choice`` (evaluation mode) on ``data``."""
    def logits(x):
        return space.subnet(choice).apply(variables, info.normalize(x), train=False)

    r = evaluate_examples(logits, data.x, data.y, data.count, batch_size=batch_size)
    return r["correct"] / jnp.maximum(r["count"], 1)


def recalibrated(cfg: PerFedRLNASConfig, space, info: DataInfo, variables: dict, choice: jax.Array,
                 data: ClientData) -> dict:
    """``variables`` with subnet ``choice``'s BatchNorm statistics measured on ``data`` (up to
    ``bn_recalibration_batches`` batches of ``eval_batch_size``, training mode, padding
    masked; :func:`jaxfednas.algorithms.common.client_batch_statistics`); weights unchanged. What
    evaluation uses when ``aggregate_bn=False`` leaves the server's statistics at init.
    Statistics of layers outside the subnet come back 0 (the subnet never reads them)."""
    def stats_of(stats, x, mask):
        v = {**variables, "batch_stats": stats}
        return space.subnet(choice).apply(v, info.normalize(x), train=True, mask=mask,
                                          mutable=["batch_stats"])[1]["batch_stats"]

    zeros = jax.tree.map(jnp.zeros_like, variables["batch_stats"])
    stats, _ = client_batch_statistics(stats_of, zeros, data, batch_size=cfg.eval_batch_size,
                                       max_batches=cfg.bn_recalibration_batches, momentum=BN_MOMENTUM)
    return {**variables, "batch_stats": stats}


def aggregate(cfg: PerFedRLNASConfig, space, old: dict, new: dict, choices: jax.Array, weights: jax.Array,
              server: Server = Server()) -> dict:
    """Algorithm 1, line 14: the clients' subnets back into the supernet (``count_normalized``
    with ``run.aggregator`` median / trimmed_mean: per entry over the subnets covering it)."""
    keys = ("params", "batch_stats") if cfg.aggregate_bn else ("params",)
    out = dict(old)
    if cfg.aggregation == "count_normalized":
        masks = jax.vmap(space.variable_mask, in_axes=(0, None))(choices, old)
        for k in keys:
            if server.aggregator == "mean":
                out[k] = masked_weighted_mean(new[k], masks[k], weights, fallback=old[k])
            else:
                out[k] = server.masked_aggregate(new[k], masks[k], weights, fallback=old[k])
        return out
    w = weights / jnp.maximum(weights.sum(), 1e-12)  # the code: Σ n_i/n 1[|Δ_i| ≥ 1e-8] Δ_i

    def step(o, x):
        d = x - o[None]
        m = (jnp.abs(d) >= 1e-8).astype(d.dtype)
        return o + jnp.tensordot(w, m * d, axes=1)

    for k in keys:
        out[k] = jax.tree.map(step, old[k], new[k])
    return out


def reduce_probs_from(cfg: PerFedRLNASConfig, n_dims: int) -> np.ndarray | None:
    """Eqs. 5-7's p_i^d per dimension: its own (None, the paper) or the DARTS normal cell's (the code)."""
    if cfg.reduce_probs != "normal":
        return None
    e = n_dims // 2
    return np.concatenate([np.arange(e), np.arange(e)])


def policy_optimizer(cfg: PerFedRLNASConfig) -> optax.GradientTransformation:
    """Line 16's optimizer of each α_i: Adam (the code's lr 0.5, β1 0.5), one state per client."""
    return optax.adam(cfg.policy_lr, b1=cfg.policy_beta1, b2=cfg.policy_beta2)


def init_state(cfg: PerFedRLNASConfig, space, info: DataInfo, policy_tx: optax.GradientTransformation,
               num_clients: int, memory_range: tuple[float, float], key: jax.Array) -> PerFedRLNASState:
    """Algorithm 1, line 2: the supernet A_0, every α_i = 0 with its Adam state, and the simulated devices."""
    k_net, k_res = jax.random.split(key)
    variables = space.init(k_net, jnp.zeros((1,) + tuple(info.image_shape), jnp.float32))
    policy = jnp.zeros((num_clients,) + choice_mask(space.dims).shape, jnp.float32)  # "initial α_i are all 0"
    zeros = jnp.zeros((num_clients,), jnp.float32)
    return PerFedRLNASState(
        variables=variables, policy_logits=policy, opt_state=jax.vmap(policy_tx.init)(policy),
        acc=zeros, best_acc=zeros, seen=jnp.zeros((num_clients,), bool),
        resources=draw_resources(cfg, k_res, num_clients, memory_range), round=jnp.zeros((), jnp.int32))


def sample_subnets(keys: jax.Array, policy: jax.Array, valid: np.ndarray) -> jax.Array:
    """Algorithm 1, line 6 / Eq. 4: v_i^d ~ softmax(α_i^d), one choice per dimension (``[N, D]`` int32)."""
    return jax.vmap(lambda k, a: jax.random.categorical(k, masked_logits(a, valid)))(keys, policy).astype(jnp.int32)


def client_update(train: Callable, space, info: DataInfo, eval_batch_size: int, c, shared):
    """Algorithm 1, lines 8-10: client i trains its subnet w_i and uploads it with its accuracy Acc_i."""
    choice, d, e, k = c
    v, lr_t = shared
    v, metrics = train(v, choice, d, k, lr_t)
    return v, subnet_accuracy(space, info, v, choice, e, eval_batch_size), metrics


def simulated_round_time(cfg: PerFedRLNASConfig, space, resources: Resources, idx: jax.Array, choices: jax.Array,
                         n_train: jax.Array, n_eval: jax.Array) -> tuple[jax.Array, jax.Array, Resources]:
    """Algorithm 1, line 13: the round time RT_i of each client's subnet; ``(costs, RT, devices)``."""
    res = gather_rows(resources, idx)
    costs = traced_costs(space, choices)
    return costs, round_time(costs, n_train, n_eval, cfg.local_epochs, res), res


class Scores(NamedTuple):
    """Algorithm 1, line 13 for the round's clients (leading axis N): the reward and its parts."""

    reward: jax.Array  # r_i of Eq. 8 (− φ_i of Eq. 9 under a memory budget)
    acc: jax.Array  # Acc_i (0 for a subnet over its client's memory budget)
    round_time: jax.Array  # RT_i, simulated seconds (over budget: the round's largest)
    time: jax.Array  # Eq. 8's λ_time term
    baseline: jax.Array  # mean Acc
    fits: jax.Array  # bool: the subnet fits its client's memory budget


def client_rewards(cfg: PerFedRLNASConfig, state: PerFedRLNASState, idx: jax.Array, acc: jax.Array, rt: jax.Array,
                   costs: jax.Array, budget: jax.Array, reported: jax.Array) -> Scores:
    """Algorithm 1, line 13: r_i = Acc_i − mean Acc − λ_time (RT_i − min RT) (Eq. 8), − φ_i (Eq. 9)."""
    m = acc.shape[0]
    phi, fits = jnp.zeros((m,), jnp.float32), jnp.ones((m,), bool)
    if cfg.memory_budget:
        acc, rt, phi, fits = memory_penalty(acc, rt, training_memory(costs, cfg.batch_size), budget, reported, cfg.phi)
    baseline = accuracy_baseline(cfg.baseline, state.acc, state.best_acc, state.seen, idx, acc, reported)
    time = time_penalty(rt, reported, cfg.lambda_time, cfg.time_term)
    return Scores(rewards(acc, baseline, time, phi), acc, rt, time, baseline, fits)


def reinforce_step(policy_tx: optax.GradientTransformation, policy: jax.Array, opt, choices: jax.Array,
                   reward: jax.Array, valid: np.ndarray, probs_from: np.ndarray | None = None):
    """Algorithm 1, line 16 / Eqs. 5-7: α_i ← Adam ascent on r_i ∇ log p(v_i), for each client (leading axis)."""
    grads = jax.vmap(lambda a, c, rr: policy_gradient(a, c, rr, valid, probs_from))(policy, choices, reward)
    updates, opt = jax.vmap(policy_tx.update)(-grads, opt)  # optax minimises: the negative ascent direction
    return policy + updates, opt


def reported_rows(state: PerFedRLNASState, idx: jax.Array, policy: jax.Array, opt, acc: jax.Array,
                  reported: jax.Array) -> dict:
    """Algorithm 1, lines 13 and 16: the new α_i, Adam states and accuracy history of the clients that reported."""
    return scatter_rows(
        {"policy_logits": state.policy_logits, "opt_state": state.opt_state, "acc": state.acc,
         "best_acc": state.best_acc, "seen": state.seen}, idx,
        {"policy_logits": policy, "opt_state": opt, "acc": acc, "best_acc": jnp.maximum(state.best_acc[idx], acc),
         "seen": jnp.ones(idx.shape, bool)}, keep=reported)


def round_metrics(metrics: dict, scores: Scores, costs: jax.Array, reported: jax.Array, weights: jax.Array,
                  policy: jax.Array, valid: np.ndarray) -> dict:
    """The round's diagnostics: local training, the reward's parts (Eqs. 8-9), the subnets, the policies."""
    trained = scores.fits.astype(jnp.float32)  # over budget: the device could not train, nothing to report
    n = jnp.maximum((metrics["examples"] * trained).sum(), 1)
    per_reported = jnp.maximum(reported.sum(), 1)
    return {
        "train_loss": (metrics["loss_sum"] * trained).sum() / n,
        "train_acc": (metrics["correct"] * trained).sum() / n,
        "train_examples": (metrics["examples"] * trained).sum(),
        "reward_time_share": (jnp.abs(scores.time * reported).sum()
                              / jnp.maximum(jnp.abs(scores.reward * reported).sum(), 1e-12)),
        "reward_acc": (scores.acc * reported).sum() / per_reported,
        "reward_mean": (scores.reward * reported).sum() / per_reported,
        "acc_baseline": scores.baseline, "round_time_s": jnp.max(jnp.where(reported, scores.round_time, 0.0)),
        "subnet_params": (costs[:, 0] * reported).sum() / per_reported,
        "over_budget": (~scores.fits).sum(), **_entropy(policy_entropy(policy, valid)),
        "server_update_skipped": nothing_to_aggregate(weights),
    }


def _entropy(h: jax.Array) -> dict:
    """The policies' entropy under the name every algorithm uses, ``arch_entropy``, and under
    its former name ``policy_entropy`` (the same number; goes in the next release)."""
    return {"arch_entropy": h, "policy_entropy": h}


def evaluate_policies(cfg: PerFedRLNASConfig, space, info: DataInfo, placement: Placement,
                      state: PerFedRLNASState, data: FederatedData) -> dict:
    """Each client's final architecture, the argmax of α_i (§"Policy"), tested with the supernet's weights."""
    valid = choice_mask(space.dims)
    best = policy_argmax(state.policy_logits, valid)  # [K, D]
    if cfg.aggregate_bn:
        def logits_of(choice):
            return lambda x: space.subnet(choice).apply(state.variables, info.normalize(x), train=False)

        rows = best
    else:  # the server's statistics never left init: each client measures its subnet's
        def logits_of(row):
            v = {**state.variables, "batch_stats": row[1]}
            return lambda x: space.subnet(row[0]).apply(v, info.normalize(x), train=False)

        rows = (best, map_clients(lambda c, v: recalibrated(cfg, space, info, v, c[0], c[1])["batch_stats"],
                                  (best, data.all_clients("train")), state.variables, placement=placement))

    out = client_accuracies(logits_of, rows, data, cfg.eval_batch_size, placement=placement, personal=True)
    costs = traced_costs(space, best)
    seen = jnp.maximum(state.seen.sum(), 1)
    out.update({
        "reported_acc_mean": (state.acc * state.seen).sum() / seen,
        "best_reported_acc_mean": (state.best_acc * state.seen).sum() / seen,  # the code's logged number
        **_entropy(policy_entropy(state.policy_logits, valid)),
        "personal_params_mean": costs[:, 0].mean(), "personal_macs_mean": costs[:, 1].mean(),
        "client_memory_budget_mb": state.resources.memory_budget / 2**20,
        "client_throughput_gmacs": state.resources.throughput / 1e9,
        "client_memory_mb": training_memory(costs, cfg.batch_size) / 2**20,
    })
    return out


def personalize_subnets(cfg: PerFedRLNASConfig, space, info: DataInfo, placement: Placement, train: Callable,
                        lr: Callable, state: PerFedRLNASState, data: FederatedData, key: jax.Array):
    """Algorithm 1, lines 8-10 on every client's argmax subnet: the test accuracy it would report now.

    E local epochs on its train split from the supernet's weights (the round's learning rate
    ``lr(round)``), then its local test accuracy (``client_test_acc``; the algorithm's ``evaluate`` tests the
    supernet's weights untrained). Rows: ``{"choice": [K, D]}``."""
    best = policy_argmax(state.policy_logits, choice_mask(space.dims))
    ids = jnp.arange(best.shape[0])

    def client(c, shared):
        choice, d, e, k = c
        v, lr_c = shared
        v, _ = train(v, choice, d, k, lr_c)
        logits = lambda x: space.subnet(choice).apply(v, info.normalize(x), train=False)  # noqa: E731
        return evaluate_examples(logits, e.x, e.y, e.count, batch_size=cfg.eval_batch_size)

    r = map_clients(client, (best, data.clients("train", ids), data.clients("test", ids),
                             rng.client_keys(key, ids)), (state.variables, lr(state.round)), placement=placement)
    return {"choice": best}, client_accuracy_summary(r["correct"], r["count"], prefix="client_test")


def _refuse_server_options(cfg: PerFedRLNASConfig, server: Server) -> None:
    """Server choices with no place in Algorithm 1, line 14 (the supernet is averaged per entry, not stepped)."""
    server.refuse("perfedrlnas", "each client trains a subnet, so a supernet entry is covered by a varying subset of "
                  "clients and a server optimizer's momentum would move entries no client trained",
                  optimizer=True, arch_optimizer=True)
    if cfg.aggregation != "count_normalized":
        server.refuse("perfedrlnas", f"algo.aggregation={cfg.aggregation!r} adds masked deltas; a robust aggregator "
                      "needs algo.aggregation=count_normalized", aggregator=True)


@checked_factory(PerFedRLNASConfig)
def perfedrlnas(cfg: PerFedRLNASConfig, info: DataInfo, *,
                run: RunOptions = RunOptions(clients_per_round=0.25)) -> FederatedAlgorithm:
    """Build PerFedRLNAS for data described by ``info``.

    Args:
      cfg: the space, the clients' training, the policies and the rewards (:class:`PerFedRLNASConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`;
        a quarter of the clients per round by default, the paper's): ``run.rounds`` (the
        learning rate's cosine, needed), clients per round, placement, drop-out (a client
        that fails to report neither enters the aggregate nor gets a reward: its policy and
        accuracy history stay as they were), the server (sampler and, with
        ``algo.aggregation=count_normalized``, aggregator; no server optimizer) and
        ``run.precision``, what client training computes in (rewards and evaluation float32).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``perfedrlnas`` with ``export``
      and ``personalize``.
    """
    rounds = run.need_rounds("perfedrlnas")
    server, precision, dropout_rate = run.server, run.precision, run.dropout_rate
    _refuse_server_options(cfg, server)
    space = make_space(cfg, info)
    placement = run.placement.single_path() if space.single_path else run.placement
    num_clients = info.num_clients
    m = run.clients(num_clients)
    server.check_clients(num_clients, m)
    valid, probs_from = choice_mask(space.dims), reduce_probs_from(cfg, len(space.dims))
    policy_tx = policy_optimizer(cfg)
    train = make_client_train(cfg, info, space, precision)
    client = functools.partial(client_update, train, space, info, cfg.eval_batch_size)
    lr = cosine_lr(cfg.lr, cfg.lr_min, rounds)
    memory_range = tuple(float(space.cost(c(space)).memory_bytes(cfg.batch_size))
                         for c in (smallest_choice, largest_choice))

    def init(key):
        return init_state(cfg, space, info, policy_tx, num_clients, memory_range, key)

    def round_fn(state: PerFedRLNASState, data: FederatedData, key: jax.Array):
        idx, keys = run.sample(key, state.round, data, num_clients)  # line 5
        policy = state.policy_logits[idx]
        choices = sample_subnets(rng.policy_keys(keys), policy, valid)  # line 6
        train_data, eval_data = data.clients("train", idx), data.clients(cfg.reward_split, idx)
        new, acc, metrics = map_clients(client, (choices, train_data, eval_data, keys),
                                        (state.variables, lr(state.round)), placement=placement)  # lines 8-10
        costs, rt, res = simulated_round_time(cfg, space, state.resources, idx, choices, train_data.count,
                                              eval_data.count)
        reported = reporting_clients(key, idx, dropout_rate)
        scores = client_rewards(cfg, state, idx, acc, rt, costs, res.memory_budget, reported)  # line 13
        weights = server.weights(train_data.count, reported) * scores.fits  # over budget: could not train
        variables = aggregate(cfg, space, state.variables, new, choices, weights, server)  # line 14
        policy, opt = reinforce_step(policy_tx, policy, gather_rows(state.opt_state, idx), choices, scores.reward,
                                     valid, probs_from)  # line 16
        state = state.replace(variables=variables, round=state.round + 1,
                              **reported_rows(state, idx, policy, opt, scores.acc, reported))
        return state, {**round_metrics(metrics, scores, costs, reported, weights, state.policy_logits, valid),
                       **reported_metrics(weights, key, idx, dropout_rate)}

    def evaluate(state: PerFedRLNASState, data: FederatedData):
        return evaluate_policies(cfg, space, info, placement, state, data)

    def personalize(state: PerFedRLNASState, data: FederatedData, key: jax.Array):
        return personalize_subnets(cfg, space, info, placement, train, lr, state, data, key)

    def export(state: PerFedRLNASState) -> PersonalSubnets:
        return PersonalSubnets.of(state, space, cfg)

    return FederatedAlgorithm(name="perfedrlnas", init=placement.jit_init(init, ROWS),
                              round=placement.jit_round(round_fn, init, ROWS),
                              evaluate=jit(evaluate), export=export, personalize=jit(personalize))


@dataclasses.dataclass(frozen=True)
class PersonalSubnets:
    """Each client's argmax architecture with its size and simulated cost, written as
    ``personal_architectures.json``: client id → ``{"architecture": {dimension: choice},
    "choice": [...], "params", "macs", "activation_floats", "inference_latency_s" (one
    example's forward on the client's device), "transfer_s" (weights down and up),
    "memory_bytes" (training, one batch), "memory_budget_bytes", "fits"}``."""

    FILENAME = "personal_architectures.json"
    clients: dict

    @classmethod
    def of(cls, state: PerFedRLNASState, space, cfg: PerFedRLNASConfig) -> PersonalSubnets:
        valid = choice_mask(space.dims)
        best = np.asarray(jax.device_get(policy_argmax(state.policy_logits, valid)), np.int32)
        res = jax.tree.map(np.asarray, jax.device_get(state.resources))
        clients = {}
        for k, choice in enumerate(best):
            cost: SubnetCost = space.cost(choice)
            bits = 8 * BYTES_PER_FLOAT * cost.params
            memory = cost.memory_bytes(cfg.batch_size)
            clients[str(k)] = {
                "architecture": space.describe(choice), "choice": choice.tolist(), **cost.to_dict(),
                "inference_latency_s": float(cost.macs / res.throughput[k]),
                "transfer_s": float(bits / res.down_bps[k] + bits / res.up_bps[k]),
                "memory_bytes": int(memory), "memory_budget_bytes": float(res.memory_budget[k]),
                "fits": bool(memory <= res.memory_budget[k]),
            }
        return cls(clients)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.clients, sort_keys=True, **kwargs)

    @classmethod
    def from_json(cls, s: str) -> PersonalSubnets:
        return cls(json.loads(s))


def adapt_new_clients(cfg: PerFedRLNASConfig, info: DataInfo, state: PerFedRLNASState, data: FederatedData,
                      clients, *, rounds: int, key: jax.Array, split: str = "test") -> tuple[jax.Array, np.ndarray]:
    """Fig. 5: policies for clients that never trained, learned from rewards alone. Every
    round each client in ``clients`` samples a subnet from its policy (init 0), scores it on
    its ``split`` with the final supernet's weights (no weight update), and takes the
    REINFORCE step of Eqs. 5-8 (baseline: the mean accuracy of these clients this round;
    the time term of ``cfg.time_term`` on the inference time of the split). With
    ``aggregate_bn=False`` each sampled subnet is scored with its BatchNorm statistics
    measured on the client's training split (:func:`recalibrated`). Returns the policies
    ``[len(clients), D, K]`` and the mean accuracy per round ``[rounds]``."""
    space = make_space(cfg, info)
    space.cost(smallest_choice(space))  # host-side cost tables before the trace
    valid = choice_mask(space.dims)
    ids = jnp.asarray(clients, jnp.int32)
    n = int(ids.shape[0])
    if n < 1 or rounds < 1:
        raise ValueError(f"adapt_new_clients needs clients and rounds >= 1, got {n} clients, {rounds} rounds")
    tx = policy_optimizer(cfg)
    evald, traind = data.clients(split, ids), data.clients("train", ids)
    res = gather_rows(state.resources, ids)

    def score(choice, e, t):
        v = state.variables if cfg.aggregate_bn else recalibrated(cfg, space, info, state.variables, choice, t)
        return subnet_accuracy(space, info, v, choice, e, cfg.eval_batch_size)

    @jit
    def step(carry, k):
        policy, opt = carry
        choices = sample_subnets(jax.random.split(k, n), policy, valid)
        acc = jax.lax.map(lambda a: score(*a), (choices, evald, traind))
        costs = traced_costs(space, choices)
        rt = costs[:, 1] * evald.count / res.throughput
        r = rewards(acc, acc.mean(), time_penalty(rt, jnp.ones((n,), bool), cfg.lambda_time, cfg.time_term), 0.0)
        return reinforce_step(tx, policy, opt, choices, r, valid), acc.mean()

    policy = jnp.zeros((n,) + valid.shape, jnp.float32)
    carry = (policy, jax.vmap(tx.init)(policy))
    curve = []
    for t in range(rounds):
        carry, a = step(carry, jax.random.fold_in(key, t))
        curve.append(float(a))
    return carry[0], np.array(curve)


def local_train_argmax(run_dir) -> dict:
    """Every client's argmax subnet of a finished PerFedRLNAS run after ``algo.local_epochs``
    epochs of its client's local training from the supernet's weights (SGD at the schedule's
    last learning rate), tested on the client's local test split: the algorithm's
    ``personalize``, what a client reports in a round of Algorithm 1."""
    from jaxfednas.stages import personalized_accuracy  # noqa: PLC0415

    def extra(run, _) -> dict:
        cfg = run.config
        lr = float(cosine_lr(cfg.algo.lr, cfg.algo.lr_min, cfg.run.rounds)(cfg.run.rounds))
        return {"epochs": cfg.algo.local_epochs, "lr": round(lr, 6)}

    return personalized_accuracy(run_dir, extra)


def random_control(run_dir, n: int, train_seeds: int = 1) -> dict:
    """The learned-vs-random control of a finished PerFedRLNAS run: ``n`` draws of one random
    subnet per client (:func:`random_subnets`, keys ``rng.random_arch_key(seed, i)``; with
    ``algo.memory_budget`` only subnets within the client's budget, the filter the learned
    ones face), tested by the same ``evaluate`` (supernet weights) and ``personalize`` (E
    local epochs) as the learned policies' argmax subnets; and the learned subnets'
    ``personalize`` again with ``train_seeds`` - 1 other training seeds (keys
    ``rng.personalize_key(repeat_seed(seed, j))``: other minibatches, the same subnets and
    weights), the seed noise of the local epochs."""
    import time  # noqa: PLC0415

    from jaxfednas.seeds import repeat_seed  # noqa: PLC0415
    from jaxfednas.stages import load_run  # noqa: PLC0415

    t0 = time.perf_counter()
    run = load_run(run_dir)
    cfg, algo, state = run.config, run.algorithm, run.state
    space = make_space(cfg.algo, run.data.info)
    budgets = np.asarray(jax.device_get(state.resources.memory_budget)) if cfg.algo.memory_budget else None
    k, width = state.policy_logits.shape[0], state.policy_logits.shape[-1]
    draws = []
    for i in range(n):
        choices = random_subnets(rng.random_arch_key(cfg.run.seed, i), space, budgets, num_clients=k,
                                 batch_size=cfg.algo.batch_size)
        st = state.replace(policy_logits=policies_for(jnp.asarray(choices), width))
        ev = jax.device_get(algo.evaluate(st, run.data))
        _, pers = algo.personalize(st, run.data, rng.personalize_key(cfg.run.seed))
        draws.append({"choices": choices.tolist(),
                      "supernet_weights": np.asarray(ev["client_test_acc"], np.float64).round(6).tolist(),
                      "local_epochs": np.asarray(jax.device_get(pers["client_test_acc"]), np.float64).round(6).tolist(),
                      "params_mean": float(np.mean([space.cost(c).params for c in choices]))})
    repeats = [np.asarray(jax.device_get(algo.personalize(state, run.data, rng.personalize_key(
        repeat_seed(cfg.run.seed, j)))[1]["client_test_acc"]), np.float64).round(6).tolist()
        for j in range(1, train_seeds)]
    return {"draws": draws, "repeats": repeats, "wall_s": round(time.perf_counter() - t0, 1)}


def clients_beating_random(learned, draws: list) -> float:
    """The share of clients whose learned subnet (per-client accuracies) beats the mean of
    their random subnets' (``draws``: one vector per draw)."""
    learned, rand = np.asarray(learned, np.float64), np.asarray(draws, np.float64)  # [K], [n, K]
    return float(np.mean(learned > np.nanmean(rand, 0)))


def client_means(learned_supernet, learned_local, params: float, rand: dict) -> dict:
    """:func:`random_control`'s ``rand`` as :attr:`jaxfednas.evidence.Control.evaluate`
    returns it, on client means: the learned argmax subnets after the local epochs over the
    training seeds, each draw's random subnets after them (the comparison), their parameters
    and their accuracies with the supernet's weights (``inherited``: the ranking's, and
    :func:`control_summary`'s other test), learned first; per client, the share of clients
    beating random in both tests (``clients_beating_random``)."""
    draws = rand["draws"]
    return {"randoms": [d["choices"] for d in draws], "random": [float(np.nanmean(d["local_epochs"])) for d in draws],
            "repeats": [float(np.nanmean(learned_local))] + [float(np.nanmean(r)) for r in rand.get("repeats", [])],
            "sizes": [params] + [d["params_mean"] for d in draws],
            "inherited": [float(np.nanmean(learned_supernet))] + [float(np.nanmean(d["supernet_weights"]))
                                                                  for d in draws],
            "clients_beating_random": {key: clients_beating_random(learned, [d[key] for d in draws]) for key, learned
                                       in (("supernet_weights", learned_supernet), ("local_epochs", learned_local))}}


def control(run_dir, path, rounds: int, learned_supernet, learned_local, params: float, *, resume: bool):
    """The learned-vs-random control of a finished PerFedRLNAS run as one batched
    :class:`jaxfednas.evidence.Control`: its ``evaluate`` is :func:`random_control` (every
    client's random subnets drawn per client, tested together; kept in ``path`` for the
    run's ``rounds``) read as :func:`client_means` beside the learned argmax subnets'
    per-client accuracies (``learned_supernet``, ``learned_local``) and mean parameters."""
    from pathlib import Path  # noqa: PLC0415

    from jaxfednas.evidence import Control  # noqa: PLC0415
    from jaxfednas.stages import cached_json  # noqa: PLC0415

    def evaluate(randoms, train_seeds: int) -> dict:
        rand = cached_json(path, {"rounds": rounds, "draws": len(randoms), "train_seeds": train_seeds}, resume,
                           lambda: random_control(run_dir, len(randoms), train_seeds))
        return client_means(learned_supernet, learned_local, params, rand)

    learned = PersonalSubnets.from_json((Path(run_dir) / PersonalSubnets.FILENAME).read_text()).clients
    return Control([learned[k]["choice"] for k in sorted(learned, key=int)], evaluate=evaluate)


def control_summary(ev) -> dict:
    """A run's learned-vs-random control for its report from :func:`control`'s
    :class:`jaxfednas.evidence.Evidence`: the draws, their parameters, learned vs random
    after the local epochs (``ev.versus``) and with the supernet's weights (the same
    comparison of the inherited accuracies), each with every draw's client mean and the
    share of clients beating random, and the diagnostics (``ev.snr``, ``ev.ranking``)."""
    sw = dataclasses.replace(ev, repeats=ev.inherited[:1], random_scores=ev.inherited[1:], inherited=None)
    beating = ev.details["clients_beating_random"]
    tests = {key: {**e.versus, "random_acc": list(e.random_scores), "clients_beating_random": beating[key]}
             for key, e in (("supernet_weights", sw), ("local_epochs", ev))}
    return {"draws": len(ev.randoms), "params_mean": float(np.mean(ev.sizes[1:])), "draw_params": list(ev.sizes[1:]),
            **tests, "diagnostics": {"train_seeds": len(ev.repeats), "seed_std": ev.snr["seed_std"],
                                     "signal_to_noise": ev.snr["ratio"], **ev.ranking}}


def training_summary(run_dir, final: dict, clients_per_round: int) -> dict:
    """A finished run's training, read from its directory (``metrics.jsonl``,
    ``personal_architectures.json``) and its ``final`` metrics: the clients' latest and best
    reported accuracies (means), the mean simulated round time and time term's share of the
    reward, the policies' entropy in the first and last round, the sampled subnets over
    budget per round, the subnets sampled in all (``clients_per_round`` a round) and the
    clients whose argmax subnet fits its budget."""
    from pathlib import Path  # noqa: PLC0415

    from jaxfednas.reports import read_metrics  # noqa: PLC0415

    metrics = read_metrics(run_dir)
    archs = PersonalSubnets.from_json((Path(run_dir) / PersonalSubnets.FILENAME).read_text())
    entropy = [m.get("arch_entropy", m.get("policy_entropy")) for m in metrics]  # (former name)
    return {"reported_acc_mean": final["reported_acc_mean"], "best_reported_acc_mean": final["best_reported_acc_mean"],
            "round_time_s": float(np.mean([m["round_time_s"] for m in metrics])),
            "reward_time_share": float(np.mean([m["reward_time_share"] for m in metrics])),
            "policy_entropy": [entropy[0], entropy[-1]], "over_budget": [int(m["over_budget"]) for m in metrics],
            "sampled_subnets": len(metrics) * clients_per_round, "fits": sum(c["fits"] for c in archs.clients.values())}


def training_report(rows: list[dict], clients: int) -> list[str]:
    """The Markdown lines of the PerFedRLNAS runs' training for a results page: per run (rows
    of an example's table with :func:`training_summary`'s numbers) the reported accuracies,
    the policies' entropy, the time term's share of the reward and the subnets over budget
    (of ``clients``); none without such a row."""
    if not rows:
        return []
    lines = ["", "| PerFedRLNAS run | reported acc (latest, mean) | best reported (code's number) | "
             "policy entropy first → last round | time term's share of \\|r\\| (mean over rounds) | sampled "
             "subnets over budget (all rounds) | argmax subnets within budget |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["policy_entropy"]
        lines.append(f"| {r['label']} | {r['reported_acc_mean']:.4f} | {r['best_reported_acc_mean']:.4f} | "
                     f"{e[0]:.3f} → {e[1]:.3f} | {r['reward_time_share']:.3f} | "
                     f"{sum(r['over_budget'])}/{r['sampled_subnets']} | {r['fits']}/{clients} |")
    return lines


def control_numbers(method: str, params: float, control: dict) -> tuple[dict, dict]:
    """One run's control (:func:`control_summary`) for a table over seeds
    (:func:`jaxfednas.seeds.over_seeds`): ``numbers`` (name -> value: learned vs random with
    the supernet's weights and after the local epochs, the diagnostics, the parameters; names
    start with ``method``) and ``points`` (``"points"``: supernet weights,
    ``"points_local_epochs"``): the learned subnets (``params``) and every random draw as
    (parameters, client-mean accuracy)."""
    numbers, points = {}, {}
    for tag, key, point in (("supernet weights", "supernet_weights", "points"),
                            ("+ local epochs", "local_epochs", "points_local_epochs")):
        v = control[key]
        numbers[f"{method}, {tag}: learned"] = v["searched"]
        numbers[f"{method}, {tag}: random (mean of draws)"] = v["random_mean"]
        numbers[f"{method}, {tag}: learned − random"] = v["searched_minus_random"]
        numbers[f"{method}, {tag}: fraction of draws beaten"] = v["beats"] / control["draws"]
        numbers[f"{method}, {tag}: clients beating random"] = v["clients_beating_random"]
        points[point] = {"searched": (params, v["searched"]), "random": list(zip(control["draw_params"], v["random_acc"]))}
    dg = control["diagnostics"]
    numbers[f"{method}: learned, + local epochs: std over {dg['train_seeds']} training seeds"] = dg["seed_std"]
    numbers[f"{method}: architecture signal-to-noise (+ local epochs)"] = dg["signal_to_noise"]
    numbers[f"{method}: supernet ranking, Kendall τ (supernet weights vs + local epochs)"] = dg["kendall_tau"]
    numbers[f"{method}: supernet ranking, Spearman ρ"] = dg["spearman"]
    numbers[f"{method}: params, learned (mean over clients)"] = params
    numbers[f"{method}: params, random (mean over clients and draws)"] = control["params_mean"]
    return numbers, points


def control_report(controlled: list[dict]) -> list[str]:
    """The Markdown lines of the learned-vs-random control for a results page: a table of
    learned vs random per run (rows of an example's table with a ``random_control``:
    :func:`control_summary`) and test (supernet weights, after the local epochs), the
    diagnostics and the random subnets' parameters; none without such a row."""
    if not controlled:
        return []
    lines = ["", "Learned vs random subnets (the control: one random subnet per client per draw, within the "
              "client's memory budget when the run has one, tested by the same code):", "",
              "| PerFedRLNAS run | tested | learned (argmax) | random (mean ± std over draws) | learned − random | "
              "draws the learned beat | clients whose learned subnet beats their random mean |",
              "|---|---|---|---|---|---|---|"]
    for r in controlled:
        c = r["random_control"]
        for label, key in (("supernet weights", "supernet_weights"), ("+ E local epochs", "local_epochs")):
            v = c[key]
            lines.append(f"| {r['label']} | {label} | {v['searched']:.4f} | {v['random_mean']:.4f} ± "
                         f"{v['random_std']:.4f} | {v['searched_minus_random']:+.4f} | {v['beats']} of "
                         f"{c['draws']} | {v['clients_beating_random']:.2f} |")
    lines += [""] + [
        f"Diagnostics ({r['label']}, client means): the learned subnets after the local epochs spread by "
        f"{d['seed_std']:.4f} (std over {d['train_seeds']} training seeds), the random draws by "
        f"{r['random_control']['local_epochs']['random_std']:.4f}: architecture signal-to-noise "
        f"{d['signal_to_noise']:.2f}. Supernet ranking over {d['n']} subnets (learned and draws), supernet weights "
        f"vs after the local epochs: Kendall's τ {d['kendall_tau']:+.3f}, Spearman's ρ {d['spearman']:+.3f}."
        for r in controlled for d in [r["random_control"]["diagnostics"]]]
    lines += ["", "Random subnets' mean parameters: " + "; ".join(
        f"{r['label']}: {r['random_control']['params_mean']:,.0f} (learned {r['params']:,.0f})" for r in controlled)
        + "."]
    return lines


def check(config: ExperimentConfig) -> None:
    """What needs the whole configuration, before the factory (:func:`jaxfednas.registry.build_algorithm`)."""
    if config.algo.reward_split == "val" and config.data.split[1] <= 0:
        raise ConfigError(f"algo.reward_split='val' needs a validation split: data.split={config.data.split} "
                          "has none (e.g. --set data.split=0.7,0.1,0.2)")


FACTORY = perfedrlnas


def ANNEALS_OVER_ROUNDS(cfg) -> bool:  # noqa: N802  (a resume must keep run.rounds where it holds)
    """Whether a learning rate anneals over ``run.rounds`` (:mod:`jaxfednas.resume`: a resume must then keep them)."""
    return True


RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator")


# its former name, one class per meaning since 0.2
__getattr__ = former_module_names(__name__, {"PersonalArchitectures": "PersonalSubnets"}, globals())
