"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017, arXiv:1602.05629), Algorithm 1.

Each round t: sample m = max(C·K, 1) clients S_t; every k in S_t runs E local
epochs of minibatch SGD (batch B) from the global weights w_t; the server sets

    w_{t+1} = w_t + Σ_{k∈S_t} (n_k / n_S) (w^k_{t+1} − w_t),   n_S = Σ_{k∈S_t} n_k.

BatchNorm running statistics are averaged with the same weights n_k / n_S. A server step
size η_s ≠ 1 (``w_t + η_s · (...)``) is ``run.server_optimizer=sgd`` at ``run.server_lr`` = η_s
(the same numbers); the other server optimizers (FedAvgM, FedAdam, ...) step from the same
average (:mod:`jaxfednas.server`).

The clients' learning rate is ``algo.lr`` in every round (McMahan et al.), or with
``algo.lr_schedule=cosine`` ``algo.lr · (1 + cos(π t / T)) / 2`` in round t of
T = ``run.rounds`` (DARTS' annealing, by round; a resumed run must keep ``run.rounds``).
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
    SupervisedConfig,
    evaluate_clients,
    evaluate_global,
    make_local_train,
    recalibrated_batch_stats,
    train_metrics,
)
from jaxfednas.search_spaces.models import init_variables, make_model
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import ConfigError, param
from jaxfednas.data.federated import DataInfo, FederatedData
from jaxfednas.optim import rate_schedule
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, map_clients, reported_metrics, reporting_clients
from jaxfednas.server import tolerate_missing_server_state

DESCRIPTION = "FedAvg (McMahan et al. 2017): local SGD, n_k-weighted averaging of weights and BN statistics"


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(SupervisedConfig):
    RETIRED = {"server_lr": (1.0, "FedAvg's server step size η_s is run.server_lr with run.server_optimizer=sgd "
                                  "(one server learning rate for every algorithm)")}
    bn_recalibration_batches: int = param(
        0, "also report global_test_acc_bn_recal: the global model with BatchNorm statistics re-estimated on up to "
        "this many eval-size batches of each client's training examples, pooled n_k/n, instead of the clients' "
        "averaged running statistics (0: off)", range=(0, None))
    lr_schedule: str = param("constant", "constant: algo.lr every round; cosine: annealed to 0 over run.rounds "
                             "(DARTS' schedule, by round)", choices=("constant", "cosine"))


CONFIG = FedAvgConfig

PRESETS = {
    # CPU minutes on the embedded digits data.
    "smoke": {"run.rounds": 5, "algo.local_epochs": 1, "algo.batch_size": 32},
    # FedNAS paper's FedAvg baseline setting (Table 2): CIFAR-10, 16 Dirichlet(0.5)
    # clients, 100 rounds, 20 local epochs, batch 64. The paper does not state the
    # learning rate (it tunes over {0.1, 0.3, 0.01, 0.03, 0.001, 0.003}).
    "paper": {
        "data.dataset": "cifar10", "data.num_clients": 16, "data.partition": "dirichlet", "data.alpha": 0.5,
        "data.split": (1.0, 0.0, 0.0), "run.rounds": 100, "algo.model": "resnet18",
        "algo.local_epochs": 20, "algo.batch_size": 64, "algo.lr": 0.01,
    },
}


@tolerate_missing_server_state
@flax.struct.dataclass
class FedAvgState:
    variables: dict  # global model: {"params": ..., "batch_stats": ...}
    round: jax.Array  # int32, rounds completed
    server: dict = flax.struct.field(default_factory=dict)  # server optimizer state (jaxfednas.server)


def round_rate(cfg: FedAvgConfig, rounds: int | None) -> optax.ScalarOrSchedule:
    """The clients' learning rate by round: ``cfg.lr`` by ``cfg.lr_schedule`` over T =
    ``rounds`` (:func:`jaxfednas.optim.rate_schedule`: the number ``cfg.lr``, or a schedule
    ``round -> lr``)."""
    if cfg.lr_schedule != "constant" and rounds is None:
        raise ConfigError(f"algo.lr_schedule={cfg.lr_schedule!r} needs the run's length: "
                          "run=RunOptions(rounds=T, ...) (run.rounds)")
    return rate_schedule(cfg.lr_schedule, cfg.lr, horizon=rounds)


@checked_factory(FedAvgConfig)
def fedavg(cfg: FedAvgConfig, info: DataInfo, *, run: RunOptions = RunOptions(), model: nn.Module | None = None,
           aux_weight: float = 0.0, drop_path: Callable[[jax.Array], jax.Array] | None = None) -> FederatedAlgorithm:
    """Build FedAvg for data described by ``info``.

    Args:
      cfg: the client recipe and FedAvg's own settings (:class:`FedAvgConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`):
        clients per round, placement, the server (sampler, aggregator, server optimizer:
        ``sgd`` at ``run.server_lr`` is FedAvg's server step size η_s), drop-out, precision
        (client training; evaluation is float32) and ``rounds``, T, which
        ``cfg.lr_schedule='cosine'`` anneals over.
      model: replaces ``cfg.model`` when given.
      aux_weight: > 0 adds a DARTS evaluation network's auxiliary head loss
        (:mod:`jaxfednas.algorithms.fednas_train`).
      drop_path: ``drop_path(round) -> p``, the drop-path probability of the round's local
        training (every client, every step); None: no drop path (plain FedAvg's computation).

    The clients' learning rate in a round is ``cfg.lr`` by ``cfg.lr_schedule``
    (:func:`round_rate`: ``constant`` every round, plain FedAvg; ``cosine`` over T).

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``fedavg``: ``init``, ``round``
      and ``evaluate``.
    """
    server, placement, dropout_rate = run.server, run.placement, run.dropout_rate
    server.refuse("fedavg", "FedAvg trains no architecture parameters", arch_optimizer=True)
    model = make_model(cfg.model, info.num_classes, info.name) if model is None else model
    rate = round_rate(cfg, run.rounds)
    server.check_clients(info.num_clients, run.clients(info.num_clients))
    local_train = make_local_train(model, info, cfg, aux_weight=aux_weight, precision=run.precision)

    def init(key):
        variables = init_variables(model, key, info.image_shape)
        return FedAvgState(variables=variables, round=jnp.int32(0), server=server.init(variables))

    def round_fn(state: FedAvgState, data: FederatedData, key: jax.Array):
        idx, keys = run.sample(key, state.round, data, info.num_clients)
        clients = data.clients("train", idx)
        p = None if drop_path is None else drop_path(state.round)
        new_vars, metrics = map_clients(
            lambda c, s: local_train(s[0], c[0], c[1], s[1], s[2]),
            (clients, keys),
            (state.variables, p, rate(state.round) if callable(rate) else None),  # None: cfg.lr, a constant
            placement=placement,
        )
        if server.optimizer == "none":  # Algorithm 1's server step, w + Σ n_k/n_S (w_k − w)
            weights = server.weights(clients.count, reporting_clients(key, idx, dropout_rate))  # failed: weight 0
            avg = server.aggregate(new_vars, weights, fallback=state.variables)
            # written as an update of w, as every recorded FedAvg run computed it (bit for bit)
            params = jax.tree.map(lambda w, a: w + (a - w), state.variables["params"], avg["params"])
            variables, opt = {"params": params, "batch_stats": avg["batch_stats"]}, state.server
            reported = reported_metrics(weights, key, idx, dropout_rate)
        else:  # drop-out, the aggregator, and the server optimizer stepping w towards the average
            variables, opt, reported = run.combine(new_vars, clients.count, key, idx, state.variables, state.server)
        metrics = {**train_metrics(metrics), **reported}
        return state.replace(variables=variables, round=state.round + 1, server=opt), metrics

    def evaluate(state: FedAvgState, data: FederatedData):
        out = global_report(model, info, cfg, state.variables, data, placement=placement)
        out.update(
            evaluate_clients(model, info, state.variables, data, cfg.eval_batch_size, placement=placement, personal=False)
        )
        return out

    return FederatedAlgorithm(name="fedavg", init=placement.jit_init(init), round=jit(round_fn), evaluate=jit(evaluate))


FACTORY = fedavg


def global_report(model: nn.Module, info: DataInfo, cfg: FedAvgConfig, variables: dict, data: FederatedData, *,
                  placement) -> dict[str, jax.Array]:
    """The global model's test accuracy, ``global_test_acc``, and with ``cfg.bn_recalibration_batches``
    ``global_test_acc_bn_recal`` (FedAvg's, Ditto's and local adaptation's global model)."""
    out = evaluate_global(model, info, variables, data, cfg.eval_batch_size)
    if cfg.bn_recalibration_batches and not variables["batch_stats"]:
        out["global_test_acc_bn_recal"] = out["global_test_acc"]  # no BatchNorm: nothing to recalibrate
    elif cfg.bn_recalibration_batches:
        # Averaged over non-IID clients, the running statistics fit no client's data;
        # the clients measure the global model's own on their training examples.
        stats = recalibrated_batch_stats(model, info, variables, data, batch_size=cfg.eval_batch_size,
                                         max_batches=cfg.bn_recalibration_batches, placement=placement)
        recal = {**variables, "batch_stats": stats}
        out["global_test_acc_bn_recal"] = evaluate_global(model, info, recal, data,
                                                          cfg.eval_batch_size)["global_test_acc"]
    return out


def ANNEALS_OVER_ROUNDS(cfg) -> bool:  # noqa: N802  (a resume must keep run.rounds where it holds)
    """Whether a learning rate anneals over ``run.rounds`` (:mod:`jaxfednas.resume`: a resume must then keep them)."""
    return cfg.lr_schedule == "cosine"


RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")
