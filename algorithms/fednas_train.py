"""FedNAS evaluation stage — He et al., "FedNAS: Federated Deep Learning via Neural
Architecture Search" (arXiv:2004.08546), §3.2: the architecture found by the search is
trained from scratch with FedAvg (the paper's "additional evaluation stage"; the
authors' ``train`` stage).

The network is the DARTS evaluation network (:class:`jaxfednas.search_spaces.darts.DartsNetwork`,
affine BatchNorm, pooling without BN) built from a :class:`Genotype`; the federated
training is :func:`jaxfednas.algorithms.fedavg.fedavg` unchanged (Algorithm 1 of McMahan et al.).

``algo.genotype`` is a known cell (``FEDNAS_V1`` — the cell the authors' code
hard-codes for this stage —, ``DARTS_V1``, ``DARTS_V2``), a path to a JSON genotype
(e.g. a search run's ``architecture.json``) or the JSON text itself (what
``examples/fednas.py`` stores, so that ``config.json`` alone reproduces the run).

Three parts of the DARTS evaluation recipe (Liu et al., arXiv:1806.09055, §3.2/§A.2) are
options, off by default (the digits main job trains without them):

* ``algo.drop_path_prob`` p: DARTS' drop path — every non-identity op's output inside a
  cell is zeroed per example with probability p_t and the kept examples scaled by
  1/(1 − p_t), in local training only. DARTS ramps p_t = p · epoch / epochs; a federation
  has rounds where DARTS has epochs, so here p_t = p · t / T in round t = 0 … T − 1 of
  T = ``run.rounds`` (``drop_path_schedule=linear``; 0 in the first round, constant
  within a round, every client the same); ``constant`` uses p in every round, as the
  FedNAS authors' train stage does (p = 0.5). Each minibatch slot draws its masks from
  its own key (:func:`jaxfednas.rng.drop_path_key`), so runs are reproducible and a
  resumed run draws what an uninterrupted one draws. A resumed run must keep
  ``run.rounds``: T is part of the schedule.
* ``algo.auxiliary_weight`` w: DARTS' CIFAR auxiliary head after cell ``2*layers//3``
  (ReLU → avg pool → 1×1 conv 128 → BN → ReLU → 2×2 conv 768 → BN → ReLU → linear); the
  local loss is CE + w · CE_aux (DARTS: 0.4), the reported ``train_loss`` is that
  objective. Evaluation uses the main head only; the head's weights are averaged like
  the others. DARTS pools the 8×8 maps of 32×32 images with a 5×5 window, stride 3; the
  8×8 digits leave 2×2 maps there, which the head pools with a smaller window
  (:func:`jaxfednas.search_spaces.darts.aux_pool`); maps smaller than 2×2 are a config error.

* ``algo.lr_schedule=cosine``: DARTS anneals the learning rate by a cosine to 0 over its
  epochs; here over the rounds: round t of T = ``run.rounds`` trains with
  ``algo.lr · (1 + cos(π t / T)) / 2`` (every client, every step of the round; the
  clients' fresh optimizer each round makes this exactly a per-round learning rate). A
  resumed run must keep ``run.rounds``. ``constant`` (the default) keeps ``algo.lr``.

The FedNAS paper states no evaluation recipe; the authors' train stage
(docs/authors_code.md §0.4, §2.1) uses a constant p = 0.5 and no auxiliary head. Preset
``paper`` follows DARTS (p = 0.2 ramped, w = 0.4, cosine learning rate), ``authors_code``
the authors' code (whose learning-rate schedule for this stage the reference notes do not
record: constant here).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp

from jaxfednas.algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg, round_rate
from jaxfednas.algorithm import FederatedAlgorithm, checked_factory
from jaxfednas.config import ConfigError, param
from jaxfednas.data.federated import DataInfo
from jaxfednas.run_options import RunOptions
from jaxfednas.search_spaces.darts import aux_input_size, DARTS_V1, DARTS_V2, DartsNetwork, FEDNAS_V1, Genotype

DESCRIPTION = "FedNAS evaluation stage: FedAvg training of a DARTS network built from a genotype"

KNOWN = {"FEDNAS_V1": FEDNAS_V1, "DARTS_V1": DARTS_V1, "DARTS_V2": DARTS_V2}


@dataclasses.dataclass(frozen=True)
class FedNASTrainConfig(FedAvgConfig):
    genotype: str = param("FEDNAS_V1", "known cell name, path to a genotype JSON, or the JSON itself")
    C: int = param(8, "initial channels of the evaluation network (FedNAS code: 16)", range=(2, 512))
    layers: int = param(5, "cells of the evaluation network (FedNAS code: 8)", range=(1, 64))
    drop_path_prob: float = param(0.0, "drop-path probability p of the cells' non-identity ops in local training "
                                  "(DARTS 0.2, FedNAS code 0.5; 0: off)", range=(0.0, 0.9))
    drop_path_schedule: str = param("linear", "linear: p·t/T in round t of T = run.rounds (DARTS' ramp, by round); "
                                    "constant: p every round (FedNAS code)", choices=("linear", "constant"))
    auxiliary_weight: float = param(0.0, "loss weight of the auxiliary head after cell 2·layers//3 "
                                    "(DARTS 0.4; 0: no auxiliary head)", range=(0.0, 10.0))

    def check(self):
        super().check()
        if self.C % 2:
            raise ConfigError(f"algo.C={self.C} must be even (FactorizedReduce splits channels in two)")
        resolve_genotype(self.genotype)


CONFIG = FedNASTrainConfig
_AUTHORS = {
    "data.dataset": "cifar10", "data.num_clients": 16, "data.partition": "dirichlet", "data.alpha": 0.5,
    "data.split": (1.0, 0.0, 0.0), "run.rounds": 500, "algo.C": 16, "algo.layers": 8,
    "algo.local_epochs": 15, "algo.batch_size": 64, "algo.lr": 0.025, "algo.weight_decay": 3e-4,
}
PRESETS = {
    "smoke": {"run.rounds": 3, "algo.C": 4, "algo.layers": 3},
    # The authors' train stage (docs/authors_code.md §2.1, §2.4): FedNAS_V1, C=16, 8 cells, CIFAR-10,
    # 16 Dirichlet(0.5) clients, 500 rounds, 15 local epochs, batch 64, lr 0.025, wd 3e-4; with
    # DARTS' drop path (0.2, ramped over the rounds), auxiliary head (0.4) and cosine learning rate: the
    # paper names no evaluation recipe, and DARTS' is the one it builds on.
    "paper": {**_AUTHORS, "algo.drop_path_prob": 0.2, "algo.drop_path_schedule": "linear",
              "algo.auxiliary_weight": 0.4, "algo.lr_schedule": "cosine"},
    # The same with the authors' train stage as coded: drop path 0.5 in every round, no auxiliary head.
    "authors_code": {**_AUTHORS, "algo.drop_path_prob": 0.5, "algo.drop_path_schedule": "constant",
                     "algo.auxiliary_weight": 0.0},
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
    """The evaluation network of ``cfg`` (with its auxiliary head when ``auxiliary_weight`` > 0)."""
    if cfg.auxiliary_weight > 0:
        h, w = aux_input_size(info.image_shape[:2], cfg.layers)
        if min(h, w) < 2:
            raise ConfigError(
                f"algo.auxiliary_weight={cfg.auxiliary_weight}: the auxiliary head needs at least 2x2 maps after "
                f"cell {2 * cfg.layers // 3}, {info.image_shape[0]}x{info.image_shape[1]} images leave {h}x{w}; "
                f"set it to 0 or use fewer cells")
    return DartsNetwork(resolve_genotype(cfg.genotype), cfg.C, info.num_classes, cfg.layers,
                        auxiliary=cfg.auxiliary_weight > 0)


def drop_path_schedule(cfg: FedNASTrainConfig, rounds: int | None):
    """``round -> p_t`` (traced) for :func:`jaxfednas.algorithms.fedavg.fedavg`, or None when drop path is off."""
    p = cfg.drop_path_prob
    if p == 0:
        return None
    if cfg.drop_path_schedule == "constant":
        return lambda t: jnp.float32(p)
    if rounds is None:
        raise ValueError("fednas_train: drop_path_schedule='linear' needs rounds (run.rounds)")
    # DARTS' p·epoch/epochs with rounds for epochs; capped at p for rounds past T
    return lambda t: jnp.float32(p) * jnp.minimum(t.astype(jnp.float32) / rounds, 1.0)


@checked_factory(FedNASTrainConfig)
def fednas_train(
    cfg: FedNASTrainConfig, info: DataInfo, *, run: RunOptions = RunOptions(),
) -> FederatedAlgorithm:
    """FedAvg (state :class:`FedAvgState`) of the DARTS network of ``cfg.genotype``.

    Args:
      cfg: the genotype, the network and its recipe (:class:`FedNASTrainConfig`).
      info: the data's description (:attr:`jaxfednas.data.federated.FederatedData.info`).
      run: what the run gives every algorithm (:class:`jaxfednas.run_options.RunOptions`), as
        for :func:`jaxfednas.algorithms.fedavg.fedavg`; ``run.rounds`` (T) is needed by the
        linear drop-path ramp and the cosine learning rate.

    Returns:
      The :class:`~jaxfednas.algorithm.FederatedAlgorithm` ``fednas_train``.
    """
    server, rounds = run.server, run.rounds
    server.refuse("fednas_train", "the derived genotype is fixed: no architecture parameters are trained",
                  arch_optimizer=True)
    algo = fedavg.extended(cfg, info, run=run, model=make_network(cfg, info), aux_weight=cfg.auxiliary_weight,
                           drop_path=drop_path_schedule(cfg, rounds))
    return algo._replace(name="fednas_train")


FACTORY = fednas_train
RUN_OPTIONS = ("clients_per_round", "dropout_rate", "precision", "sampler", "aggregator", "server_optimizer")


__all__ = ["FedNASTrainConfig", "FedAvgState", "fednas_train", "resolve_genotype", "make_network", "drop_path_schedule",
           "round_rate"]
