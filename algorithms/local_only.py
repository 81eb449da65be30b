"""Local-only training: every client trains its own model on its own data, no
communication. The lower baseline for personalization (FedNAS paper §4, and the
"local" rows of Ditto/perFedAvg comparisons).

Each client's model is a persistent row of the state (leading client axis); a
round gathers the sampled clients' rows, runs E local epochs on each and
scatters them back. Every client starts from the same initial weights, so the
only difference from FedAvg is the missing averaging step.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxfednas.algorithms.common import SupervisedConfig, evaluate_clients, make_local_train, train_metrics
from jaxfednas.search_spaces.models import init_variables, make_model
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.data.federated import DataInfo, FederatedData
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import (jit, gather_rows, map_clients, reporting_clients, scatter_rows)

DESCRIPTION = "Local-only training: each client trains a personal model on its own data"


@dataclasses.dataclass(frozen=True)
class LocalOnlyConfig(SupervisedConfig):
    pass


CONFIG = LocalOnlyConfig
PRESETS = {
    "smoke": {"run.rounds": 5, "algo.local_epochs": 1, "algo.batch_size": 32},
    "paper": {
        "data.dataset": "cifar10", "data.num_clients": 20, "data.partition": "label_skew",
        "data.classes_per_client": 5, "data.split": (0.75, 0.0, 0.25), "run.clients_per_round": 4,
        "run.rounds": 100, "algo.model": "resnet18", "algo.local_epochs": 5, "algo.batch_size": 32,
        "algo.lr": 0.01,
    },
}


@flax.struct.dataclass
class LocalOnlyState:
    clients: dict  # per-client models, every leaf with leading axis K
    round: jax.Array


ROWS = ("clients",)  # per-client fields (leading axis K): split along the clients mesh


@checked_factory(LocalOnlyConfig)
def local_only(
    cfg: LocalOnlyConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
) -> FederatedAlgorithm:
    """Each client trains its own model; the server only samples the clients.

    Args:
      cfg: the client recipe (:class:`LocalOnlyConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`):
        clients per round, placement, the sampler (no aggregator, no server optimizer),
        drop-out and ``run.precision``, what client training computes in (evaluation float32).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``local_only``.
    """
    server, placement, precision, dropout_rate = run.server, run.placement, run.precision, run.dropout_rate
    server.refuse("local_only", "there is no server model: each client keeps its own", aggregator=True,
                  optimizer=True)
    model = make_model(cfg.model, info.num_classes, info.name)
    m = run.clients(info.num_clients)
    server.check_clients(info.num_clients, m)
    local_train = make_local_train(model, info, cfg, precision=precision)

    def init(key):
        v = init_variables(model, key, info.image_shape)
        rows = jax.tree.map(lambda a: jnp.broadcast_to(a, (info.num_clients,) + a.shape), v)
        return LocalOnlyState(clients=rows, round=jnp.int32(0))

    def round_fn(state: LocalOnlyState, data: FederatedData, key: jax.Array):
        idx, keys = run.sample(key, state.round, data, info.num_clients)
        rows = gather_rows(state.clients, idx)
        new_rows, metrics = map_clients(
            lambda c, _: local_train(c[2], c[0], c[1]),
            (data.clients("train", idx), keys, rows),
            None,
            placement=placement,
        )
        rows = scatter_rows(state.clients, idx, new_rows, keep=reporting_clients(key, idx, dropout_rate))
        state = state.replace(clients=rows, round=state.round + 1)
        return state, train_metrics(metrics)

    def evaluate(state: LocalOnlyState, data: FederatedData):
        return evaluate_clients(model, info, state.clients, data, cfg.eval_batch_size, placement=placement, personal=True)

    return FederatedAlgorithm(name="local_only", init=placement.jit_init(init, ROWS),
                              round=placement.jit_round(round_fn, init, ROWS), evaluate=jit(evaluate))


FACTORY = local_only
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler")
