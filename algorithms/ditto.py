"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization" (ICML 2021, arXiv:2012.04221), Algorithm 1; a personalized baseline
of the FedNAS paper (He et al., arXiv:2004.08546, §3.1, Table 1).

Ditto solves, for every client k, the bi-level problem (Eq. 1)

    min_{v_k} h_k(v_k; w*) = F_k(v_k) + (λ/2) ||v_k − w*||²,   w* ∈ argmin_w G(F_1(w), ..., F_K(w)),

with G the FedAvg objective. Each round t (Algorithm 1), every sampled client k

  (a) runs E local epochs of SGD on the global model w_t; the server averages the
      results with weights n_k exactly as FedAvg does (this is
      :func:`jaxfednas.algorithms.fedavg.fedavg`'s own round, so ``w_{t+1}`` equals FedAvg's);
  (b) updates its persistent personal model v_k for E local epochs of

          v_k ← v_k − η (∇F_k(v_k) + λ (v_k − w_t)),

      where w_t is the global model received at the start of the round.

η is ``lr`` and ∇F_k goes through the same client optimizer as FedAvg's local
training (weight decay, momentum, clipping as configured), so with λ = 0 step (b) is
plain local training of v_k. Personal models start as copies of the initial global
model, keep their own BatchNorm statistics, and change only in rounds where their
client is sampled. Plain SGD needs η·λ < 2 for the proximal pull to be stable.
Evaluation tests each personal model on its client's test split (``client_test_acc*``)
and the global model on the global test set (``global_test_acc``) and on every client's
test split (``client_test_acc_global*``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxfednas.algorithms.common import (
    evaluate_clients,
    make_batch_grad,
    make_client_optimizer,
    train_metrics,
)
from jaxfednas.algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg, global_report
from jaxfednas.algorithms.local_adaptation import PAPER_SETTING, evaluate_clients_global
from jaxfednas.search_spaces.models import make_model
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import param
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData, run_local_epochs
from jaxfednas import rng
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import (jit, gather_rows, map_clients, reporting_clients, scatter_rows)
from jaxfednas.server import tolerate_missing_server_state

DESCRIPTION = "Ditto (Li et al. 2021): FedAvg global model plus per-client personal models pulled toward it by λ"

@dataclasses.dataclass(frozen=True)
class DittoConfig(FedAvgConfig):
    RENAMED = {**FedAvgConfig.RENAMED, "lam": "prox_lambda"}
    prox_lambda: float = param(
        0.1, "λ: weight of the proximal term pulling personal models v_k toward the global model "
        "(paper grid {2, 1, 0.1, 0.01, 0.001}); 0 = local training of v_k", range=(0.0, 1e4),
    )


CONFIG = DittoConfig
PRESETS = {
    "smoke": {"run.rounds": 5, "algo.local_epochs": 1, "algo.batch_size": 32},
    "paper": dict(PAPER_SETTING),
}


@tolerate_missing_server_state
@flax.struct.dataclass
class DittoState:
    variables: dict  # global model w: {"params": ..., "batch_stats": ...}
    personal: dict  # personal models v_k, every leaf with leading axis K
    round: jax.Array  # int32, rounds completed
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


ROWS = ("personal",)  # per-client fields (leading axis K): split along the clients mesh


def make_personal_train(model: nn.Module, info: DataInfo, cfg: DittoConfig, *, precision: str = "fp32") -> Callable:
    """``personal_train(v, w, client, key) -> (v, metrics)``: E local epochs of
    ``v ← v − η(∇F_k(v) + λ(v − w))`` with a fresh client optimizer; ``w`` (the
    round's global model) stays fixed. With ``λ = 0`` this is
    :func:`jaxfednas.algorithms.common.make_local_train` from ``v``."""
    opt = make_client_optimizer(cfg)
    batch_grad = make_batch_grad(model, info, cfg.augment, precision=precision)

    def personal_train(personal: dict, anchor: dict, client: ClientData, key: jax.Array):
        w = anchor["params"]

        def step(carry, batch, key):
            params, stats, opt_state = carry
            grads, stats, metrics = batch_grad(params, stats, batch, key)
            # ∇h_k(v) = ∇F_k(v) + λ(v − w): the proximal gradient is added in closed form.
            grads = jax.tree.map(lambda g, v, a: g + cfg.prox_lambda * (v - a), grads, params, w)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, stats, opt_state), metrics

        params, stats = personal["params"], personal["batch_stats"]
        (params, stats, _), metrics = run_local_epochs(
            step, (params, stats, opt.init(params)), client, key, epochs=cfg.local_epochs, batch_size=cfg.batch_size
        )
        return {"params": params, "batch_stats": stats}, metrics

    return personal_train


@checked_factory(DittoConfig)
def ditto(cfg: DittoConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
          model: nn.Module | None = None) -> FederatedAlgorithm:
    """Build Ditto for data described by ``info`` (``FederatedData.info``).

    Args:
      cfg: the client recipe, λ and the personal epochs.
      run: the run's options (:class:`~jaxfednas.run_options.RunOptions`), FedAvg's for the
        global model; both models train in ``run.precision`` (evaluation float32), and a
        cosine ``algo.lr_schedule`` anneals the global model's rate over ``run.rounds``
        (the personal models keep theirs).
      model: replaces ``cfg.model`` when given (e.g. a DARTS network from a genotype).

    Returns:
      The algorithm ``ditto``: FedAvg's global model and a personal one per client.
    """
    run.server.refuse("ditto", "Ditto trains no architecture parameters", arch_optimizer=True)
    model = make_model(cfg.model, info.num_classes, info.name) if model is None else model
    base = fedavg.extended(cfg, info, run=run, model=model)
    personal_train = make_personal_train(model, info, cfg, precision=run.precision)
    placement = run.placement

    def init(key):
        g = base.init(key)
        rows = jax.tree.map(lambda a: jnp.broadcast_to(a, (info.num_clients,) + a.shape), g.variables)
        return DittoState(variables=g.variables, personal=rows, round=g.round, server=g.server)

    def round_fn(state: DittoState, data: FederatedData, key: jax.Array):
        # (a) the global model: FedAvg's round, same key, same sampled clients.
        g, metrics = base.round(FedAvgState(variables=state.variables, round=state.round, server=state.server), data,
                                key)
        # (b) the sampled clients' personal models, anchored at w_t = state.variables.
        idx, keys = run.sample(key, state.round, data, info.num_clients)
        new_rows, pm = map_clients(
            lambda c, w: personal_train(c[2], w, c[0], c[1]),
            (data.clients("train", idx), rng.personal_keys(keys), gather_rows(state.personal, idx)),
            state.variables,
            placement=placement,
        )
        pm = train_metrics(pm)
        metrics.update({"personal_train_loss": pm["train_loss"], "personal_train_acc": pm["train_acc"]})
        personal = scatter_rows(state.personal, idx, new_rows, keep=reporting_clients(key, idx, run.dropout_rate))
        return DittoState(variables=g.variables, personal=personal, round=g.round, server=g.server), metrics

    def evaluate(state: DittoState, data: FederatedData):
        out = global_report(model, info, cfg, state.variables, data, placement=placement)  # (FedAvg's)
        out.update(evaluate_clients_global(model, info, state.variables, data, cfg.eval_batch_size, placement=placement))
        out.update(
            evaluate_clients(model, info, state.personal, data, cfg.eval_batch_size, placement=placement, personal=True)
        )
        return out

    return FederatedAlgorithm(name="ditto", init=placement.jit_init(init, ROWS),
                              round=placement.jit_round(round_fn, init, ROWS), evaluate=jit(evaluate))


FACTORY = ditto
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")
