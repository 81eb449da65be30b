"""FedAvg's options: evaluation with BatchNorm statistics recalibrated on the clients, a
cosine learning rate over the rounds."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg
from jaxfednas.registry import build_algorithm
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement
from conftest import tiny_federation


def test_recalibrated_accuracy_ignores_the_averaged_statistics(tiny_data):
    """global_test_acc_bn_recal re-estimates every BatchNorm's statistics from the clients'
    training examples: spoiling the running statistics FedAvg averaged changes the plain
    accuracy, not the recalibrated one; off by default; a model without BN has nothing to
    recalibrate."""
    info = tiny_data.info
    algo = fedavg(FedAvgConfig(model="resnet_tiny", bn_recalibration_batches=3), info, run=RunOptions(placement=Placement("map")))
    state = algo.init(jax.random.key(0))
    for r in range(2):
        state, _ = algo.round(state, tiny_data, jax.random.key(r + 1))
    good = algo.evaluate(state, tiny_data)
    spoiled = state.replace(variables={**state.variables, "batch_stats": jax.tree.map(
        lambda x: jnp.full_like(x, 50.0), state.variables["batch_stats"])})
    bad = algo.evaluate(spoiled, tiny_data)
    assert float(bad["global_test_acc"]) != float(good["global_test_acc"])
    assert float(bad["global_test_acc_bn_recal"]) == float(good["global_test_acc_bn_recal"])

    off = fedavg(FedAvgConfig(model="resnet_tiny"), info, run=RunOptions(placement=Placement("map")))
    assert "global_test_acc_bn_recal" not in off.evaluate(state, tiny_data)
    cnn = fedavg(FedAvgConfig(model="cnn", bn_recalibration_batches=3), info, run=RunOptions(placement=Placement("map")))
    out = cnn.evaluate(cnn.init(jax.random.key(0)), tiny_data)
    assert float(out["global_test_acc_bn_recal"]) == float(out["global_test_acc"])


def test_ditto_and_local_adaptation_report_the_recalibrated_global_model(tiny_data):
    """algo.bn_recalibration_batches was accepted by ditto and local_adaptation (their configs extend
    FedAvg's) and reported nothing; their global model now reports it as FedAvg does."""
    from jaxfednas.algorithms.ditto import DittoConfig, ditto
    from jaxfednas.algorithms.local_adaptation import LocalAdaptationConfig, local_adaptation

    info, run = tiny_data.info, RunOptions(placement=Placement("map"))
    reference = fedavg(FedAvgConfig(model="resnet_tiny", bn_recalibration_batches=2), info, run=run)
    state = reference.round(reference.init(jax.random.key(0)), tiny_data, jax.random.key(1))[0]
    want = float(reference.evaluate(state, tiny_data)["global_test_acc_bn_recal"])
    adapt = local_adaptation(LocalAdaptationConfig(model="resnet_tiny", bn_recalibration_batches=2,
                                                   finetune_epochs=1), info, run=run)
    assert float(adapt.evaluate(state, tiny_data)["global_test_acc_bn_recal"]) == want
    personal = ditto(DittoConfig(model="resnet_tiny", bn_recalibration_batches=2), info, run=run)
    d = personal.init(jax.random.key(0)).replace(variables=state.variables)
    assert float(personal.evaluate(d, tiny_data)["global_test_acc_bn_recal"]) == want
    off = ditto(DittoConfig(model="resnet_tiny"), info, run=run)
    assert "global_test_acc_bn_recal" not in off.evaluate(d, tiny_data)


def _params(state):
    return jax.tree.leaves(state.variables["params"])


def test_cosine_lr_schedule_scales_each_rounds_rate():
    """With algo.lr_schedule=cosine round t of T = 4 is, from the same state, the
    constant-rate round at lr · (1 + cos(π t / 4)) / 2 (round 2: half the rate); round 0 is
    the constant round bit for bit; the runner hands the factory run.rounds, and without
    rounds the schedule is refused in one line."""
    cfg, data = tiny_federation("fedavg", **{"algo.lr_schedule": "cosine", "run.rounds": 4})
    cos = build_algorithm(cfg, data.info)
    constant = fedavg(dataclasses.replace(cfg.algo, lr_schedule="constant"), data.info, run=RunOptions(clients_per_round=2))
    half = fedavg(dataclasses.replace(cfg.algo, lr_schedule="constant", lr=cfg.algo.lr / 2), data.info,
                  run=RunOptions(clients_per_round=2))
    s0, key = cos.init(jax.random.key(0)), jax.random.key(3)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_params(cos.round(s0, data, key)[0]),
                                                          _params(constant.round(s0, data, key)[0])))
    s2 = s0.replace(round=jnp.int32(2))
    got, want, full = (_params(a.round(s2, data, key)[0]) for a in (cos, half, constant))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(got, full)) > 1e-5  # not the constant rate
    with pytest.raises(ValueError, match=r"algo\.lr_schedule='cosine' needs the run's length: run=RunOptions\(rounds=T"):
        fedavg(cfg.algo, data.info)


@pytest.mark.parametrize("name", ["ditto", "local_adaptation"])
def test_algorithms_built_on_fedavg_take_the_cosine_rate(name):
    """Ditto and local adaptation share FedAvg's configuration, and so its schedule: the runner
    hands them run.rounds, which the cosine rate needs (without it FedAvg refuses it)."""
    cfg, data = tiny_federation(name, **{"algo.lr_schedule": "cosine", "run.rounds": 4})
    algo = build_algorithm(cfg, data.info)
    assert algo.round is not None


def test_one_server_learning_rate():
    """FedAvg's former algo.server_lr is gone: η_s is run.server_lr with the sgd server
    optimizer, and gives w + η_s (mean − w); an old config.json's algo.server_lr=1.0 (no
    effect) still loads, silently; any other value is refused with what to set instead."""
    from jaxfednas.config import ConfigError
    from jaxfednas.registry import config_from_dict, make_config
    from jaxfednas.server import Server

    cfg, data = tiny_federation("fedavg")
    plain = fedavg(cfg.algo, data.info, run=RunOptions(clients_per_round=2))
    sgd = fedavg(cfg.algo, data.info, run=RunOptions(clients_per_round=2, server=Server(optimizer="sgd", lr=0.5)))
    s0, key = plain.init(jax.random.key(0)), jax.random.key(3)
    mean = _params(plain.round(s0, data, key)[0])
    for w, m, got in zip(_params(s0), mean, _params(sgd.round(s0.replace(server=sgd.init(key).server), data, key)[0])):
        np.testing.assert_allclose(got, w + 0.5 * (m - w), rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match=r"^algo\.server_lr=0\.5: the setting is gone; FedAvg's server step size "
                                          r"η_s is run\.server_lr with run\.server_optimizer=sgd"):
        make_config("fedavg", overrides={"algo.server_lr": "0.5"})
    with pytest.raises(ConfigError, match=r"algo\.server_lr=2\.0: the setting is gone"):
        FedAvgConfig(server_lr=2.0)
    with pytest.warns(FutureWarning, match=r"algo\.server_lr=1\.0 has no effect"):
        assert make_config("fedavg", overrides={"algo.server_lr": 1}) == make_config("fedavg")
    old = make_config("fedavg").to_dict()
    old["algo"]["server_lr"] = 1.0  # a run directory's config.json from before
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_dict(old) == make_config("fedavg")


def test_a_config_of_an_algorithm_built_on_fedavg_is_refused_by_fedavg(tiny_data):
    """fedavg(DittoConfig(prox_lambda=5), info) ran FedAvg and ignored λ; now a TypeError naming the
    fields FedAvg does not read. Ditto itself builds on FedAvg with its config (fedavg.extended)."""
    from jaxfednas.algorithms.ditto import DittoConfig, ditto

    with pytest.raises(TypeError, match=r"fedavg\(\): cfg is a DittoConfig, whose fields prox_lambda.* fedavg does "
                                        r"not read: pass a FedAvgConfig"):
        fedavg(DittoConfig(prox_lambda=5.0), tiny_data.info)
    ditto(DittoConfig(prox_lambda=5.0), tiny_data.info)
    assert fedavg.extended(DittoConfig(prox_lambda=5.0), tiny_data.info).name == "fedavg"
