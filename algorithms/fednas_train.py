"""FedNAS evaluation stage — He et al., "FedNAS: Federated Deep Learning via Neural
Architecture Search" (arXiv:2004.08546), §3.2: the architecture found by the search is
trained from scratch with FedAvg (the paper's "additional evaluation stage"; the
authors' ``train`` stage).

The network is the DARTS evaluation network (:class:`search_spaces.darts.DartsNetwork`,
affine BatchNorm, pooling without BN) built from a :class:`Genotype`; the federated
training is :func:`algorithms.fedavg.fedavg` unchanged (Algorithm 1 of McMahan et al.).

``algo.genotype`` is a known cell (``FEDNAS_V1`` — the cell the authors' code
hard-codes for this stage —, ``DARTS_V1``, ``DARTS_V2``), a path to a JSON genotype
(e.g. a search run's ``architecture.json``) or the JSON text itself (what
``examples/fednas.py`` stores, so that ``config.json`` alone reproduces the run).

Deviations from the authors' train stage, both because the shared local-SGD loop
has no dropout rng or second head yet: no drop path (the code uses a constant 0.5)
and no auxiliary head (off in the FedNAS code as well).
"""
from __future__ import annotations

import dataclasses
import json
import os

from algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg
from jaxfednas.algorithm import FederatedAlgorithm
from jaxfednas.config import ConfigError, ExperimentConfig, param
from jaxfednas.data.federated import DataInfo
from jaxfednas.runtime import Placement
from search_spaces.darts import DARTS_V1, DARTS_V2, DartsNetwork, FEDNAS_V1, Genotype

DESCRIPTION = "FedNAS evaluation stage: FedAvg training of a DARTS network built from a genotype"

KNOWN = {"FEDNAS_V1": FEDNAS_V1, "DARTS_V1": DARTS_V1, "DARTS_V2": DARTS_V2}


@dataclasses.dataclass(frozen=True)
class FedNASTrainConfig(FedAvgConfig):
    genotype: str = param("FEDNAS_V1", "known cell name, path to a genotype JSON, or the JSON itself")
    C: int = param(8, "initial channels of the evaluation network (FedNAS code: 16)", range=(2, 512))
    layers: int = param(5, "cells of the evaluation network (FedNAS code: 8)", range=(1, 64))

    def check(self):
        if self.C % 2:
            raise ConfigError(f"algo.C={self.C} must be even (FactorizedReduce splits channels in two)")
        resolve_genotype(self.genotype)


CONFIG = FedNASTrainConfig
PRESETS = {
    "smoke": {"run.rounds": 3, "algo.C": 4, "algo.layers": 3},
    # The authors' train stage (docs/authors_code.md §2.1, §2.4): FedNAS_V1, C=16, 8 cells, CIFAR-10,
    # 16 Dirichlet(0.5) clients, 500 rounds, 15 local epochs, batch 64, lr 0.025, wd 3e-4.
    "paper": {
        "data.dataset": "cifar10", "data.num_clients": 16, "data.partition": "dirichlet", "data.alpha": 0.5,
        "data.split": (1.0, 0.0, 0.0), "run.rounds": 500, "algo.C": 16, "algo.layers": 8,
        "algo.local_epochs": 15, "algo.batch_size": 64, "algo.client_lr": 0.025, "algo.weight_decay": 3e-4,
    },
}


def resolve_genotype(spec: str) -> Genotype:
    """A :class:`Genotype` from a known name, a JSON file path or JSON text."""
    if spec in KNOWN:
        return KNOWN[spec]
    text = spec
    if not spec.lstrip().startswith("{"):
        if not os.path.isfile(spec):
            raise ConfigError(f"algo.genotype={spec!r}: not a known cell {sorted(KNOWN)}, a JSON file or JSON text")
        with open(spec) as f:
            text = f.read()
    try:
        return Genotype.from_json(text)
    except (ValueError, json.JSONDecodeError) as e:
        raise ConfigError(f"algo.genotype: not a valid genotype ({e})") from None


def make_network(cfg: FedNASTrainConfig, info: DataInfo) -> DartsNetwork:
    return DartsNetwork(resolve_genotype(cfg.genotype), cfg.C, info.num_classes, cfg.layers)


def fednas_train(
    cfg: FedNASTrainConfig, info: DataInfo, *, clients_per_round: int | float = 1.0, placement: Placement = Placement(),
    dropout_rate: float = 0.0,
) -> FederatedAlgorithm:
    """FedAvg (state :class:`FedAvgState`) of the DARTS network of ``cfg.genotype``."""
    algo = fedavg(cfg, info, clients_per_round=clients_per_round, placement=placement, model=make_network(cfg, info),
                  dropout_rate=dropout_rate)
    return algo._replace(name="fednas_train")


def build(config: ExperimentConfig, info: DataInfo) -> FederatedAlgorithm:
    return fednas_train(
        config.algo, info, clients_per_round=config.run.clients_per_round,
        placement=Placement.from_run(config.run), dropout_rate=config.run.dropout_rate,
    )


__all__ = ["FedNASTrainConfig", "FedAvgState", "fednas_train", "resolve_genotype", "make_network"]
