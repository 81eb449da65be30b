"""The two diagnostics of a searched-vs-random result: architecture signal-to-noise and the
supernet's ranking (Kendall's τ, Spearman's ρ), and FedNAS' inherited-weight accuracy."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxfednas.algorithms.fednas import FedNASConfig, fednas, make_inherited_accuracy, make_supernet
from jaxfednas.data import make_federated_data
from jaxfednas.data.datasets import load_dataset
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement
from jaxfednas.search_spaces.darts import PRIMITIVE_SETS
from jaxfednas.search_spaces.darts.masks import mask_from_genotype, mask_weights, Subnet
from jaxfednas.search_spaces.sampling import random_genotype
from jaxfednas.seeds import kendall_tau, signal_to_noise, spearman_rho, supernet_ranking


def test_rank_correlations_by_hand_and_against_scipy_with_ties():
    # 4 items, one swapped pair: 5 concordant, 1 discordant of 6 -> τ = 4/6; ranks d = (0,1,1,0): ρ = 1 - 6·2/60
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert spearman_rho([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0 and math.isnan(kendall_tau([1, 1], [1, 2]))
    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(3, 9))
        x, y = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, n).astype(float)
        if len(set(x)) > 1 and len(set(y)) > 1:
            assert kendall_tau(list(x), list(y)) == pytest.approx(scipy.stats.kendalltau(x, y).statistic, abs=1e-12)
            assert spearman_rho(list(x), list(y)) == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    r = supernet_ranking([0.1, 0.2, 0.3], [0.5, 0.7, 0.6])
    assert (r["kendall_tau"], r["n"]) == (pytest.approx(1 / 3), 3)


def test_signal_to_noise_is_the_ratio_of_sample_stds():
    r = signal_to_noise([0.5, 0.7, 0.9], [0.60, 0.61, 0.62])
    assert r["arch_std"] == pytest.approx(0.2) and r["seed_std"] == pytest.approx(0.01)
    assert r["ratio"] == pytest.approx(20.0) and (r["random_n"], r["repeats_n"]) == (3, 3)
    assert signal_to_noise([0.5, 0.7], [0.6, 0.6])["ratio"] == math.inf
    assert math.isnan(signal_to_noise([0.5], [0.6, 0.7])["ratio"])  # one random cell: no spread to compare
    assert math.isnan(signal_to_noise([0.5, 0.7], [0.6])["ratio"])


@pytest.fixture(scope="module")
def same_train_and_test():
    """One client whose training examples are also the server's test set (one batch)."""
    ds = load_dataset("synthetic", num_train=48, num_test=8)
    ds = dataclasses.replace(ds, x_test=ds.x_train, y_test=ds.y_train)
    idx = np.arange(48)
    return make_federated_data(ds, {"train": [idx], "val": [idx[:8]], "test": [idx[:8]]})


@pytest.mark.slow
def test_inherited_accuracy_is_the_masked_supernet_with_the_clients_statistics(same_train_and_test):
    """With the test set equal to the one client's training set, taken in one batch, BN
    statistics recalibrated on the training set are that batch's own statistics: the
    inherited accuracy must equal the masked supernet run in training mode on it."""
    data = same_train_and_test
    cfg = FedNASConfig(C=4, layers=2, nodes=2, primitives="tiny", batch_size=16, eval_batch_size=64,
                       bn_recalibration_batches=1)
    algo = fednas(cfg, data.info, run=RunOptions(placement=Placement("map")))
    state, _ = algo.round(algo.init(jax.random.PRNGKey(0)), data, jax.random.PRNGKey(1))  # trained a little
    v = state.variables
    accuracy = make_inherited_accuracy(cfg, data.info, placement=Placement("map"))
    net, prims = make_supernet(cfg, data.info), PRIMITIVE_SETS[cfg.primitives]
    accs = []
    for i in range(3):
        g = random_genotype(jax.random.PRNGKey(i), prims, cfg.nodes)
        w = mask_weights(mask_from_genotype(g, prims, cfg.nodes))
        x = data.info.normalize(jnp.asarray(data.server_x))
        logits, _ = Subnet(net, w).apply({"params": v["params"], "batch_stats": v["batch_stats"]}, x, train=True,
                                         mutable=["batch_stats"])
        by_hand = float((jnp.argmax(logits, -1) == jnp.asarray(data.server_y)).mean())
        accs.append(accuracy(v, g, data))
        # the two routes reduce the BN moments in different orders: on another processor a
        # near-tied logit may flip one of the 48 predictions, so one example's worth of slack
        # (ignoring the mask in the recalibration moves it by 3 examples)
        assert accs[-1] == pytest.approx(by_hand, abs=1 / 48 + 1e-9), i
    assert len(set(accs)) > 1  # the genotype reaches the network


@pytest.mark.slow
def test_dp_fnas_inherited_accuracy_is_the_masked_supernet_whatever_its_alpha(same_train_and_test):
    """DP-FNAS normalises per example: nothing to recalibrate, so the inherited accuracy is the
    masked supernet in evaluation mode on the test set, by hand, and α does not enter it."""
    from jaxfednas.algorithms import dp_fnas as dpf

    data = same_train_and_test
    cfg = dpf.DPFNASConfig(C=4, layers=2, nodes=2, primitives="tiny", eval_batch_size=64)
    v = dpf.dp_fnas(cfg, data.info, run=RunOptions(placement=Placement("map"))).init(jax.random.PRNGKey(0)).variables
    accuracy = dpf.make_inherited_accuracy(cfg, data.info)
    net, prims = dpf.make_supernet(cfg, data.info), PRIMITIVE_SETS[cfg.primitives]
    x, y = data.info.normalize(jnp.asarray(data.server_x)), jnp.asarray(data.server_y)
    other_alpha = {**v, "arch": jax.tree.map(lambda a: a + jnp.arange(a.size).reshape(a.shape), v["arch"])}
    accs = []
    for i in range(4):
        g = random_genotype(jax.random.PRNGKey(i), prims, cfg.nodes)
        w = mask_weights(mask_from_genotype(g, prims, cfg.nodes))
        by_hand = float((jnp.argmax(Subnet(net, w).apply({"params": v["params"]}, x, train=False), -1) == y).mean())
        accs.append(accuracy(v, g, data))
        # by hand and compiled: a near-tied logit may flip one of the 48 predictions on another
        # processor (one example's slack); α is an input the mask ignores, so the same program
        # gives the same bits whatever α holds
        assert accs[-1] == pytest.approx(by_hand, abs=1 / 48 + 1e-9), i
        assert accuracy(other_alpha, g, data) == accs[-1], i
    assert len(set(accs)) > 1  # the genotype reaches the network


@pytest.mark.slow  # about a minute on 2 cores: three rounds on digits so that paths differ
def test_dfnas_inherited_accuracy_is_the_childs_recalibrated_accuracy():
    """For a child, the inherited accuracy is what DFNAS' evaluate reports as
    ``global_test_acc_bn_recal`` when α's argmax is that child (the same single path, the same
    recalibration), whatever the α the supernet carries."""
    from jaxfednas.algorithms.dfnas import make_inherited_accuracy as dfnas_inherited
    from jaxfednas.data import partition as part
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import build_algorithm, make_config
    from jaxfednas.search_spaces.sampling import random_shuffle_arch

    cfg = make_config("dfnas", overrides={
        "data.dataset": "digits", "data.num_clients": 2, "data.partition": "iid", "data.split": (0.75, 0.0, 0.25),
        "algo.space": "tiny", "algo.batch_size": 32, "algo.local_epochs": 2, "algo.lr": 0.05,
        "algo.bn_recalibration_batches": 2, "run.rounds": 3})
    ds = load_dataset("digits")
    data = make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))
    algo = build_algorithm(cfg, data.info)
    state = algo.init(jax.random.PRNGKey(0))
    for r in range(3):  # trained enough that paths predict differently
        state, _ = algo.round(state, data, jax.random.PRNGKey(r))
    accuracy = dfnas_inherited(cfg.algo, data.info)
    accs = set()
    for i in range(3):
        child = random_shuffle_arch(jax.random.PRNGKey(i), cfg.algo.space)
        one_hot = jax.nn.one_hot(jnp.asarray(child.choices), state.variables["arch"]["alpha"].shape[-1]) * 10.0
        as_argmax = state.replace(variables={**state.variables, "arch": {"alpha": one_hot}})
        accs.add(accuracy(state.variables, child, data))
        # two compiled programs reduce the BN moments in their own orders: on another processor
        # a near-tied logit may flip one of the 360 test predictions, so one example's slack
        assert accuracy(state.variables, child, data) == pytest.approx(
            float(algo.evaluate(as_argmax, data)["global_test_acc_bn_recal"]), abs=1 / 360 + 1e-9)
    assert len(accs) > 1  # the child's path reaches the network
