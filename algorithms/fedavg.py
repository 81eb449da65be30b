"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017, arXiv:1602.05629), Algorithm 1.

Each round t: sample m = max(C·K, 1) clients S_t; every k in S_t runs E local
epochs of minibatch SGD (batch B) from the global weights w_t; the server sets

    w_{t+1} = w_t + η_s · Σ_{k∈S_t} (n_k / n_S) (w^k_{t+1} − w_t),   n_S = Σ_{k∈S_t} n_k,

which is plain FedAvg for the server learning rate η_s = 1 (the default).
BatchNorm running statistics are averaged with the same weights n_k / n_S.

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
from jaxfednas.optim import cosine_lr
from jaxfednas.runtime import jit, Placement, map_clients, reported_metrics, reporting_clients, resolve_clients_per_round
from jaxfednas.server import Server, tolerate_missing_server_state

DESCRIPTION = "FedAvg (McMahan et al. 2017): local SGD, n_k-weighted averaging of weights and BN statistics"


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(SupervisedConfig):
    server_lr: float = param(1.0, "server learning rate η_s applied to the averaged update (1 = FedAvg)", range=(0.0, 100.0))
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


def lr_scale_schedule(cfg: FedAvgConfig, rounds: int | None) -> Callable[[jax.Array], jax.Array] | None:
    """``round -> s`` (traced), the factor of ``cfg.lr`` in a round, of ``cfg.lr_schedule``;
    None for ``constant``."""
    if cfg.lr_schedule == "constant":
        return None
    if rounds is None:
        raise ConfigError("algo.lr_schedule='cosine' needs rounds (run.rounds)")
    return cosine_lr(1.0, 0.0, rounds)


@checked_factory(FedAvgConfig)
def fedavg(
    cfg: FedAvgConfig,
    info: DataInfo,
    *,
    clients_per_round: int | float = 1.0,
    placement: Placement = Placement(),
    model: nn.Module | None = None,
    dropout_rate: float = 0.0,
    aux_weight: float = 0.0,
    drop_path: Callable[[jax.Array], jax.Array] | None = None,
    lr_scale: Callable[[jax.Array], jax.Array] | None = None,
    server: Server = Server(),
    precision: str = "fp32",
    rounds: int | None = None,
) -> FederatedAlgorithm:
    """Build FedAvg for data described by ``info`` (``model`` replaces ``cfg.model`` when given;
    ``dropout_rate``: see :func:`jaxfednas.runtime.reporting_clients`).

    For a DARTS evaluation network (:mod:`jaxfednas.algorithms.fednas_train`): ``aux_weight`` > 0
    adds its auxiliary head's loss; ``drop_path(round) -> p`` gives the drop-path
    probability of the round's local training (every client, every step), None: no drop
    path (the computation of plain FedAvg). ``lr_scale(round) -> s`` multiplies the round's
    client learning rate by s (a schedule over rounds), None: ``cfg.lr_schedule``'s
    (:func:`lr_scale_schedule`; ``constant``: ``cfg.lr`` every round, plain FedAvg's
    computation). ``rounds``: T, ``run.rounds``, which the cosine schedule anneals over.
    ``server``: sampler, aggregator and server optimizer (:class:`jaxfednas.server.Server`);
    with a server optimizer ``cfg.server_lr`` must stay 1 (use ``run.server_lr``).
    ``precision``: what client training computes in (:mod:`jaxfednas.precision`; evaluation
    float32)."""
    if server.optimizer != "none" and cfg.server_lr != 1.0:
        raise ConfigError(f"algo.server_lr={cfg.server_lr} and run.server_optimizer={server.optimizer!r} both given: "
                          "algo.server_lr is plain server SGD; with a server optimizer set run.server_lr instead")
    server.refuse("fedavg", "FedAvg trains no architecture parameters", arch_optimizer=True)
    model = make_model(cfg.model, info.num_classes, info.name) if model is None else model
    lr_scale = lr_scale_schedule(cfg, rounds) if lr_scale is None else lr_scale
    m = resolve_clients_per_round(clients_per_round, info.num_clients)
    server.check_clients(info.num_clients, m)
    local_train = make_local_train(model, info, cfg, aux_weight=aux_weight, precision=precision)

    def init(key):
        variables = init_variables(model, key, info.image_shape)
        return FedAvgState(variables=variables, round=jnp.int32(0), server=server.init(variables))

    def round_fn(state: FedAvgState, data: FederatedData, key: jax.Array):
        idx, keys = server.sample(key, state.round, data, info.num_clients, m)
        clients = data.clients("train", idx)
        p = None if drop_path is None else drop_path(state.round)
        scale = None if lr_scale is None else lr_scale(state.round)
        new_vars, metrics = map_clients(
            lambda c, s: local_train(s[0], c[0], c[1], s[1], s[2]),
            (clients, keys),
            (state.variables, p, scale),
            placement=placement,
        )
        weights = server.weights(clients.count, reporting_clients(key, idx, dropout_rate))  # failed clients weigh 0
        avg = server.aggregate(new_vars, weights, fallback=state.variables)
        if server.optimizer == "none":
            old = state.variables["params"]
            params = jax.tree.map(lambda w, a: w + cfg.server_lr * (a - w), old, avg["params"])
            variables, opt = {"params": params, "batch_stats": avg["batch_stats"]}, state.server
        else:
            variables, opt = server.step(state.variables, avg, state.server, weights)
        metrics = {**train_metrics(metrics), **reported_metrics(weights, key, idx, dropout_rate)}
        return state.replace(variables=variables, round=state.round + 1, server=opt), metrics

    def evaluate(state: FedAvgState, data: FederatedData):
        out = evaluate_global(model, info, state.variables, data, cfg.eval_batch_size)
        if cfg.bn_recalibration_batches and not state.variables["batch_stats"]:
            out["global_test_acc_bn_recal"] = out["global_test_acc"]  # no BatchNorm: nothing to recalibrate
        elif cfg.bn_recalibration_batches:
            # Averaged over non-IID clients, the running statistics fit no client's data;
            # the clients measure the global model's own on their training examples.
            stats = recalibrated_batch_stats(model, info, state.variables, data, batch_size=cfg.eval_batch_size,
                                             max_batches=cfg.bn_recalibration_batches, placement=placement)
            recal = {**state.variables, "batch_stats": stats}
            out["global_test_acc_bn_recal"] = evaluate_global(model, info, recal, data,
                                                              cfg.eval_batch_size)["global_test_acc"]
        out.update(
            evaluate_clients(model, info, state.variables, data, cfg.eval_batch_size, placement=placement, personal=False)
        )
        return out

    return FederatedAlgorithm(name="fedavg", init=placement.jit_init(init), round=jit(round_fn), evaluate=jit(evaluate))


FACTORY = fedavg
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")
