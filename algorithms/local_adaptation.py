"""Local adaptation: FedAvg, then every client fine-tunes the global model on its own
data before it is tested — the simplest personalization baseline of He et al.,
"Towards Non-I.I.D. and Invisible Data with FedNAS: Federated Deep Learning via Neural
Architecture Search" (arXiv:2004.08546, §3.1, Table 1, row "Local Adaptation").

Training is FedAvg unchanged (McMahan et al., arXiv:1602.05629, Algorithm 1; the rounds
are :func:`jaxfednas.algorithms.fedavg.fedavg`'s own compiled round). Personalization happens at
evaluation only: client k starts from the current global model w_t and runs
``finetune_epochs`` epochs of its client optimizer on its own train split,

    v_k = LocalSGD_k(w_t; finetune_epochs),

then v_k is tested on client k's test split. The fine-tuning keys are fixed
(:func:`adaptation_keys`), so ``evaluate(state, data)`` is a pure function of the
state. The un-adapted global model's per-client numbers are reported beside the
personalized ones under the prefix ``client_test_acc_global`` (e.g.
``client_test_acc_global_mean_unweighted``), so the gain of adaptation is visible.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfednas.algorithms.common import make_local_train, make_logits_fn
from jaxfednas.algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg, global_report
from jaxfednas.search_spaces.models import make_model
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import param
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData
from jaxfednas.evaluation import client_accuracies, client_accuracy_summary, evaluate_examples
from jaxfednas import rng
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import jit, Placement, map_clients

DESCRIPTION = "Local adaptation (FedNAS Table 1): FedAvg, then each client fine-tunes the global model before testing"

# The FedNAS paper's personalized setting (§3.1, Table 1), shared by the three
# personalized baselines: CIFAR-10, 20 clients with 5 classes each, each client's data
# split 75/25 into train/test, 4 clients per round, ResNet-18, batch 32. Rounds, local
# epochs and learning rate follow the local_only preset (the paper tunes the lr).
PAPER_SETTING = {
    "data.dataset": "cifar10", "data.num_clients": 20, "data.partition": "label_skew",
    "data.classes_per_client": 5, "data.split": (0.75, 0.0, 0.25), "run.clients_per_round": 4,
    "run.rounds": 100, "algo.model": "resnet18", "algo.local_epochs": 5, "algo.batch_size": 32,
    "algo.lr": 0.01,
}


@dataclasses.dataclass(frozen=True)
class LocalAdaptationConfig(FedAvgConfig):
    finetune_epochs: int = param(
        1, "epochs each client fine-tunes the global model on its own train split before its test evaluation",
        range=(1, 10_000),
    )


CONFIG = LocalAdaptationConfig
PRESETS = {
    "smoke": {"run.rounds": 5, "algo.local_epochs": 1, "algo.batch_size": 32},
    "paper": dict(PAPER_SETTING),
}


def adaptation_keys(num_clients: int) -> jax.Array:
    """One fixed key per client for evaluation-time adaptation, keyed by
    ``(rng.ADAPT_SEED, client)`` only, never by the round key, so evaluating the same
    state twice gives the same numbers."""
    return rng.adaptation_keys(jnp.arange(num_clients, dtype=jnp.int32))


def evaluate_clients_global(model, info, variables, data, batch_size, *, placement: Placement) -> dict[str, jax.Array]:
    """Each client's test accuracy with the shared (un-personalized) model, named
    ``client_test_acc_global[...]`` so it sits beside the personalized numbers."""
    return client_accuracies(make_logits_fn(model, info), variables, data, batch_size, placement=placement,
                             tag="_global")


def evaluate_adapted(
    model: nn.Module,
    info: DataInfo,
    adapt: Callable[[dict, ClientData, jax.Array], dict],
    variables: dict,
    data: FederatedData,
    batch_size: int,
    *,
    placement: Placement,
) -> dict[str, jax.Array]:
    """``client_test_acc[...]`` of ``adapt(variables, train_k, key_k)`` on each client's
    test split. Adaptation and testing share one per-client function, so the K adapted
    models never exist at once."""
    logits_fn = make_logits_fn(model, info)

    def one(c, shared):
        train, test, key = c
        v = adapt(shared, train, key)
        return evaluate_examples(logits_fn(v), test.x, test.y, test.count, batch_size=batch_size)

    per_client = (data.all_clients("train"), data.all_clients("test"), adaptation_keys(info.num_clients))
    r = map_clients(one, per_client, variables, placement=placement)
    return client_accuracy_summary(r["correct"], r["count"])


@checked_factory(LocalAdaptationConfig)
def local_adaptation(cfg: LocalAdaptationConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
                     model: nn.Module | None = None) -> FederatedAlgorithm:
    """FedAvg rounds; evaluation fine-tunes the global model on every client first.

    ``cfg`` adds the fine-tuning epochs to FedAvg's recipe; ``run`` is FedAvg's
    (:class:`~jaxfednas.run_options.RunOptions`): the rounds' training and the fine-tuning
    compute in ``run.precision`` (the accuracies in float32), and a cosine
    ``algo.lr_schedule`` anneals the rounds' rate over ``run.rounds`` (the fine-tuning keeps
    ``algo.lr``); ``model`` replaces ``cfg.model`` when given. Returns the algorithm
    ``local_adaptation``.
    """
    model = make_model(cfg.model, info.num_classes, info.name) if model is None else model
    run.server.refuse("local_adaptation", "it trains no architecture parameters", arch_optimizer=True)
    base = fedavg.extended(cfg, info, run=run, model=model)
    finetune = make_local_train(model, info, dataclasses.replace(cfg, local_epochs=cfg.finetune_epochs),
                                precision=run.precision)
    placement = run.placement

    def evaluate(state: FedAvgState, data: FederatedData):
        out = global_report(model, info, cfg, state.variables, data, placement=placement)  # (FedAvg's)
        out.update(evaluate_clients_global(model, info, state.variables, data, cfg.eval_batch_size, placement=placement))
        out.update(evaluate_adapted(
            model, info, lambda v, c, k: finetune(v, c, k)[0], state.variables, data, cfg.eval_batch_size,
            placement=placement,
        ))
        return out

    # base.init and base.round are FedAvg's own jit-compiled functions.
    return FederatedAlgorithm(name="local_adaptation", init=base.init, round=base.round, evaluate=jit(evaluate))


FACTORY = local_adaptation
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")
