"""FedAvg's optional evaluation with BatchNorm statistics recalibrated on the clients."""
import jax
import jax.numpy as jnp

from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg
from jaxfednas.runtime import Placement


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
