"""Per-FedAvg (first order) — Fallah, Mokhtari, Ozdaglar, "Personalized Federated
Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach"
(NeurIPS 2020, arXiv:2002.07948), Algorithm 1 with the FO-MAML gradient; a personalized
baseline of the FedNAS paper (He et al., arXiv:2004.08546, §3.1, Table 1).

Per-FedAvg trains a global model w for the MAML objective (Eq. 3)

    min_w F(w) = (1/n) Σ_k f_k(w − α ∇f_k(w)),

i.e. for a model that does well after one step of size α on a client's own data. Each
round, every sampled client k runs E local epochs; each local step draws a minibatch D
(the epoch's next batch) and a second, independent minibatch D' (a fresh random draw
of B examples from the client's train split) and takes the first-order step

    temp = w − α ∇f_k(w; D)
    w    ← w − β ∇f_k(temp; D')           (FO-MAML: the Hessian term is dropped)

β is ``lr`` and α = ``inner_lr_multiple`` · β. The server averages the clients'
w with weights n_k, as FedAvg does. f_k includes the L2 term (weight_decay/2)·||w||²,
so ∇f_k = ∇CE + weight_decay · w at the point where it is evaluated. The outer step is
SGD with the configured ``momentum`` (0 gives Algorithm 1 exactly; the ``paper`` preset
uses 0) after optional global-norm clipping. BatchNorm statistics follow both forward
passes of a step and are averaged like weights. The reported ``train_loss`` is the
meta-objective's: the loss of ``temp`` on D'.

Evaluation personalizes as the paper does: every client adapts the global model with
``adapt_steps`` SGD steps of size α on random minibatches of its own train split
(fixed keys, so ``evaluate`` is a pure function of the state), then is tested on its
own test split (``client_test_acc*``); the global model is reported on the global test
set (``global_test_acc``) and, un-adapted, on every client (``client_test_acc_global*``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxfednas.algorithms.common import SupervisedConfig, evaluate_global, make_batch_grad, train_metrics
from jaxfednas.algorithms.local_adaptation import PAPER_SETTING, evaluate_adapted, evaluate_clients_global
from jaxfednas.search_spaces.models import init_variables, make_model
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import param
from jaxfednas.data.federated import (
    ClientData,
    DataInfo,
    FederatedData,
    epoch_permutation,
    get_batch,
    run_local_epochs,
    tree_where,
)
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, map_clients
from jaxfednas.server import tolerate_missing_server_state

DESCRIPTION = "Per-FedAvg (Fallah et al. 2020), first-order MAML local steps; clients adapt with SGD steps at test time"


@dataclasses.dataclass(frozen=True)
class PerFedAvgConfig(SupervisedConfig):
    inner_lr_multiple: float = param(
        5.0, "α / β: the inner (adaptation) step size α as a multiple of lr = β (paper grid {1, 3, 5, 7, 10})",
        range=(0.0, 1000.0),
    )
    adapt_steps: int = param(
        1, "SGD steps of size α each client takes from the global model on its train data before testing",
        range=(0, 10_000),
    )

    @property
    def alpha(self) -> float:
        """Inner (adaptation) step size α."""
        return self.inner_lr_multiple * self.lr


CONFIG = PerFedAvgConfig
PRESETS = {
    "smoke": {"run.rounds": 5, "algo.local_epochs": 1, "algo.batch_size": 32},
    # Algorithm 1 is plain SGD on both steps: no momentum.
    "paper": {**PAPER_SETTING, "algo.momentum": 0.0},
}


@tolerate_missing_server_state
@flax.struct.dataclass
class PerFedAvgState:
    variables: dict  # global (meta) model w: {"params": ..., "batch_stats": ...}
    round: jax.Array  # int32, rounds completed
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


def make_grad(model: nn.Module, info: DataInfo, cfg: PerFedAvgConfig, *, precision: str = "fp32") -> Callable:
    """``grad(params, stats, batch, key) -> (∇f(params; batch), stats, metrics)`` with
    f = masked mean cross entropy + (weight_decay/2)·||params||²; ``key`` drives augmentation;
    ``precision``: what the forward and backward compute in (:mod:`jaxfednas.precision`)."""
    batch_grad = make_batch_grad(model, info, cfg.augment, precision=precision)

    def grad(params, stats, batch, key):
        g, stats, metrics = batch_grad(params, stats, batch, key)
        g = jax.tree.map(lambda gi, p: gi + cfg.weight_decay * p, g, params)
        return g, stats, metrics

    return grad


def make_outer_optimizer(cfg: PerFedAvgConfig) -> optax.GradientTransformation:
    """The β step: optional clipping, then SGD (weight decay is already inside ∇f)."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*parts, optax.sgd(cfg.lr, momentum=cfg.momentum or None))


def make_meta_step(model: nn.Module, info: DataInfo, cfg: PerFedAvgConfig, *, precision: str = "fp32") -> Callable:
    """``meta_step(carry, batch_d, batch_d2, key) -> (carry, metrics)`` with
    ``carry = (params, batch_stats, outer_opt_state)``: one first-order Per-FedAvg step
    ``temp = w − α∇f(w; D)``, ``w ← w − β∇f(temp; D')``."""
    grad = make_grad(model, info, cfg, precision=precision)
    outer = make_outer_optimizer(cfg)

    def meta_step(carry, batch_d, batch_d2, key):
        params, stats, opt_state = carry
        k_d, k_d2 = jax.random.split(key)
        g, stats, _ = grad(params, stats, batch_d, k_d)
        temp = jax.tree.map(lambda w, gi: w - cfg.alpha * gi, params, g)
        g2, stats, metrics = grad(temp, stats, batch_d2, k_d2)
        updates, opt_state = outer.update(g2, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), metrics

    return meta_step


def random_batch(client: ClientData, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """``batch_size`` distinct examples drawn uniformly from the client's valid rows
    (all of them, masked to ``count``, when the client has fewer)."""
    return get_batch(client, epoch_permutation(key, client.count, client.y.shape[0]), jnp.int32(0), batch_size)


def make_meta_train(model: nn.Module, info: DataInfo, cfg: PerFedAvgConfig, *, precision: str = "fp32") -> Callable:
    """``meta_train(variables, client, key) -> (variables, metrics)``: E local epochs of
    :func:`make_meta_step`, D from the epoch's permutation, D' a fresh random draw."""
    meta_step = make_meta_step(model, info, cfg, precision=precision)
    outer = make_outer_optimizer(cfg)

    def meta_train(variables: dict, client: ClientData, key: jax.Array):
        def step(carry, batch, key):
            k_d2, k_step = jax.random.split(key)
            batch_d = {k: batch[k] for k in ("x", "y", "mask")}
            return meta_step(carry, batch_d, random_batch(client, k_d2, cfg.batch_size), k_step)

        params, stats = variables["params"], variables["batch_stats"]
        (params, stats, _), metrics = run_local_epochs(
            step, (params, stats, outer.init(params)), client, key, epochs=cfg.local_epochs, batch_size=cfg.batch_size
        )
        return {"params": params, "batch_stats": stats}, metrics

    return meta_train


def make_adapt(model: nn.Module, info: DataInfo, cfg: PerFedAvgConfig, *, precision: str = "fp32") -> Callable:
    """``adapt(variables, client, key) -> variables``: ``adapt_steps`` steps
    ``w ← w − α∇f(w; D)`` on random minibatches D of the client's data (a client
    without data keeps ``variables``)."""
    grad = make_grad(model, info, cfg, precision=precision)

    def adapt(variables: dict, client: ClientData, key: jax.Array):
        def body(carry, s):
            params, stats = carry
            k_batch, k_aug = jax.random.split(jax.random.fold_in(key, s))
            g, new_stats, _ = grad(params, stats, random_batch(client, k_batch, cfg.batch_size), k_aug)
            new = (jax.tree.map(lambda w, gi: w - cfg.alpha * gi, params, g), new_stats)
            return tree_where(client.count > 0, new, carry), None

        carry = (variables["params"], variables["batch_stats"])
        (params, stats), _ = jax.lax.scan(body, carry, jnp.arange(cfg.adapt_steps))
        return {"params": params, "batch_stats": stats}

    return adapt


@checked_factory(PerFedAvgConfig)
def perfedavg(cfg: PerFedAvgConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
              model: nn.Module | None = None) -> FederatedAlgorithm:
    """Build first-order Per-FedAvg for data described by ``info``: ``cfg`` its recipe and
    inner step, ``run`` the run's options (:class:`~jaxfednas.run_options.RunOptions`; the
    meta-training and the adaptation before the personalized evaluation compute in
    ``run.precision``, the accuracies in float32), ``model`` a network in place of
    ``cfg.model``. Returns the algorithm ``perfedavg``."""
    model = make_model(cfg.model, info.num_classes, info.name) if model is None else model
    server, placement, precision = run.server, run.placement, run.precision
    m = run.clients(info.num_clients)
    server.refuse("perfedavg", "Per-FedAvg trains no architecture parameters", arch_optimizer=True)
    server.check_clients(info.num_clients, m)
    meta_train = make_meta_train(model, info, cfg, precision=precision)
    adapt = make_adapt(model, info, cfg, precision=precision)

    def init(key):
        variables = init_variables(model, key, info.image_shape)
        return PerFedAvgState(variables=variables, round=jnp.int32(0), server=server.init(variables))

    def round_fn(state: PerFedAvgState, data: FederatedData, key: jax.Array):
        idx, keys = run.sample(key, state.round, data, info.num_clients)
        clients = data.clients("train", idx)
        new_vars, metrics = map_clients(
            lambda c, v: meta_train(v, c[0], c[1]), (clients, keys), state.variables,
            placement=placement,
        )
        # drop-out (failed clients weigh 0), the aggregator and the server optimizer
        variables, opt, reported = run.combine(new_vars, clients.count, key, idx, state.variables, state.server)
        metrics = {**train_metrics(metrics), **reported}
        return state.replace(variables=variables, round=state.round + 1, server=opt), metrics

    def evaluate(state: PerFedAvgState, data: FederatedData):
        out = evaluate_global(model, info, state.variables, data, cfg.eval_batch_size)
        out.update(evaluate_clients_global(model, info, state.variables, data, cfg.eval_batch_size, placement=placement))
        out.update(evaluate_adapted(model, info, adapt, state.variables, data, cfg.eval_batch_size, placement=placement))
        return out

    return FederatedAlgorithm(name="perfedavg", init=placement.jit_init(init), round=jit(round_fn), evaluate=jit(evaluate))


FACTORY = perfedavg
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")
