"""FedAvg's options: evaluation with BatchNorm statistics recalibrated on the clients, a
cosine learning rate over the rounds."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg
from jaxfednas.registry import build_algorithm
from jaxfednas.runtime import Placement
from conftest import tiny_federation


def test_recalibrated_accuracy_ignores_the_averaged_statistics(tiny_data):
    """global_test_acc_bn_recal re-estimates every BatchNorm's statistics from the clients'
    training examples: spoiling the running statistics FedAvg averaged changes the plain
    accuracy, not the recalibrated one; off by default; a model without BN has nothing to
    recalibrate."""
    info = tiny_data.info
    algo = fedavg(FedAvgConfig(model="resnet_tiny", bn_recalibration_batches=3), info, placement=Placement("map"))
    state = algo.init(jax.random.key(0))
    for r in range(2):
        state, _ = algo.round(state, tiny_data, jax.random.key(r + 1))
    good = algo.evaluate(state, tiny_data)
    spoiled = state.replace(variables={**state.variables, "batch_stats": jax.tree.map(
        lambda x: jnp.full_like(x, 50.0), state.variables["batch_stats"])})
    bad = algo.evaluate(spoiled, tiny_data)
    assert float(bad["global_test_acc"]) != float(good["global_test_acc"])
    assert float(bad["global_test_acc_bn_recal"]) == float(good["global_test_acc_bn_recal"])

    off = fedavg(FedAvgConfig(model="resnet_tiny"), info, placement=Placement("map"))
    assert "global_test_acc_bn_recal" not in off.evaluate(state, tiny_data)
    cnn = fedavg(FedAvgConfig(model="cnn", bn_recalibration_batches=3), info, placement=Placement("map"))
    out = cnn.evaluate(cnn.init(jax.random.key(0)), tiny_data)
    assert float(out["global_test_acc_bn_recal"]) == float(out["global_test_acc"])


def _params(state):
    return jax.tree.leaves(state.variables["params"])


def test_cosine_lr_schedule_scales_each_rounds_rate():
    """With algo.lr_schedule=cosine round t of T = 4 is, from the same state, the
    constant-rate round at lr · (1 + cos(π t / 4)) / 2 (round 2: half the rate); round 0 is
    the constant round bit for bit; the runner hands the factory run.rounds, and without
    rounds the schedule is refused in one line."""
    cfg, data = tiny_federation("fedavg", **{"algo.lr_schedule": "cosine", "run.rounds": 4})
    cos = build_algorithm(cfg, data.info)
    constant = fedavg(dataclasses.replace(cfg.algo, lr_schedule="constant"), data.info, clients_per_round=2)
    half = fedavg(dataclasses.replace(cfg.algo, lr_schedule="constant", lr=cfg.algo.lr / 2), data.info,
                  clients_per_round=2)
    s0, key = cos.init(jax.random.key(0)), jax.random.key(3)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_params(cos.round(s0, data, key)[0]),
                                                          _params(constant.round(s0, data, key)[0])))
    s2 = s0.replace(round=jnp.int32(2))
    got, want, full = (_params(a.round(s2, data, key)[0]) for a in (cos, half, constant))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(got, full)) > 1e-5  # not the constant rate
    with pytest.raises(ValueError, match="needs rounds"):
        fedavg(cfg.algo, data.info)


@pytest.mark.parametrize("name", ["ditto", "local_adaptation"])
def test_algorithms_built_on_fedavg_take_the_cosine_rate(name):
    """Ditto and local adaptation share FedAvg's configuration, and so its schedule: the runner
    hands them run.rounds, which the cosine rate needs (without it FedAvg refuses it)."""
    cfg, data = tiny_federation(name, **{"algo.lr_schedule": "cosine", "run.rounds": 4})
    algo = build_algorithm(cfg, data.info)
    assert algo.round is not None
