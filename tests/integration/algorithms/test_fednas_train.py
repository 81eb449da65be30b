"""FedNAS evaluation stage (algorithms/fednas_train.py): DARTS' drop path and auxiliary head
as options of the FedAvg training of the derived network. A tiny genotype (2 nodes, C=4,
one cell: the auxiliary head sees 4x4 maps) on 2 synthetic 8x8 clients keeps the compiled
programs few and small."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas.algorithms.common import make_batch_grad, make_client_optimizer, make_local_train
from jaxfednas.algorithms.fednas_train import FedNASTrainConfig, drop_path_schedule, fednas_train, make_network
from jaxfednas.config import ConfigError
from jaxfednas.data import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import run_local_epochs
from jaxfednas.experiment import make_partition
from jaxfednas.registry import make_config
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement
from jaxfednas.search_spaces.darts import AuxiliaryHeadCIFAR, Genotype, aux_input_size, aux_pool, drop_path
from jaxfednas.search_spaces.models import init_variables

CELL = Genotype(normal=(("sep_conv_3x3", 0), ("skip_connect", 1), ("avg_pool_3x3", 2), ("sep_conv_3x3", 0)),
                normal_concat=(2, 3),
                reduce=(("max_pool_3x3", 0), ("sep_conv_3x3", 1), ("skip_connect", 2), ("avg_pool_3x3", 1)),
                reduce_concat=(2, 3))
BASE = FedNASTrainConfig(genotype=CELL.to_json(), C=4, layers=1, batch_size=16, lr=0.05, eval_batch_size=64)


@pytest.fixture(scope="module")
def data2():
    cfg = make_config("fedavg", overrides={"data.dataset": "synthetic", "data.num_clients": 2})
    ds = load_dataset("synthetic", num_train=64, num_test=32)
    return make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- drop path


def test_drop_path_is_per_example_and_rescaled():
    x = jax.random.normal(jax.random.PRNGKey(0), (2000, 3, 3, 2))
    y = np.asarray(drop_path(x, 0.3, jax.random.PRNGKey(1)))
    x = np.asarray(x)
    kept = np.all(y != 0, axis=(1, 2, 3))
    assert np.all(kept | np.all(y == 0, axis=(1, 2, 3)))  # a whole example is dropped or kept
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-6)  # kept ones scaled by 1/keep
    assert abs(kept.mean() - 0.7) < 0.04


def test_drop_path_schedule():
    assert drop_path_schedule(BASE, 10) is None  # p = 0: off, no dropout rng at all
    lin = drop_path_schedule(dataclasses.replace(BASE, drop_path_prob=0.2), 10)
    np.testing.assert_allclose([float(lin(jnp.int32(t))) for t in (0, 5, 9, 10, 30)], [0, 0.1, 0.18, 0.2, 0.2],
                               rtol=1e-6)  # DARTS' p·epoch/epochs by round; capped past T
    const = drop_path_schedule(dataclasses.replace(BASE, drop_path_prob=0.5, drop_path_schedule="constant"), None)
    assert float(const(jnp.int32(0))) == float(const(jnp.int32(7))) == 0.5
    with pytest.raises(ValueError, match="needs rounds"):
        drop_path_schedule(dataclasses.replace(BASE, drop_path_prob=0.2), None)


class _Linear(nn.Module):
    """A network with the evaluation network's call signature, for the loop alone."""

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_local_training_without_options_is_the_plain_loop(data2):
    # The loop as it was before the options existed (no drop_path_prob, no aux): bitwise equal.
    model = _Linear()
    opt = make_client_optimizer(BASE)
    batch_grad = make_batch_grad(model, data2.info, BASE.augment)

    def step(carry, batch, key):
        params, stats, opt_state = carry
        grads, stats, metrics = batch_grad(params, stats, batch, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), metrics

    def plain(v, client, key):
        carry = (v["params"], v["batch_stats"], opt.init(v["params"]))
        (p, s, _), m = run_local_epochs(step, carry, client, key, epochs=2, batch_size=BASE.batch_size)
        return {"params": p, "batch_stats": s}, m

    v = init_variables(model, jax.random.PRNGKey(0), data2.info.image_shape)
    client = jax.tree.map(lambda a: a[0], data2.all_clients("train"))
    key = jax.random.PRNGKey(3)
    got = jax.jit(make_local_train(model, data2.info, dataclasses.replace(BASE, local_epochs=2)))(v, client, key)
    want = jax.jit(plain)(v, client, key)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_leaves(got), _leaves(want)))


@pytest.mark.slow
def test_drop_path_round_changes_the_update_and_is_deterministic(data2):
    off = fednas_train(BASE, data2.info, run=RunOptions(placement=Placement("map")))
    ramp = fednas_train(dataclasses.replace(BASE, drop_path_prob=0.4), data2.info,
                        run=RunOptions(rounds=2, placement=Placement("map")))
    s0 = off.init(jax.random.PRNGKey(0))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    plain = _leaves(off.round(s0, data2, k1)[0].variables)
    # p_t = 0.4 * t / 2: round 0 has p = 0 and is the round without drop path, to float rounding (two
    # programs: XLA may fuse them differently; bit for bit on some CPUs, not on all, jax 0.12.1)
    for x, y in zip(_leaves(ramp.round(s0, data2, k1)[0].variables), plain):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    s1 = s0.replace(round=jnp.int32(1))  # same weights, round 1: p = 0.2 (same compiled round)
    a, m = ramp.round(s1, data2, k1)
    b, _ = ramp.round(s1, data2, k1)
    c, _ = ramp.round(s1, data2, k2)
    a, b, c = (_leaves(x.variables) for x in (a, b, c))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))  # same key, same bits
    assert max(np.abs(x - y).max() for x, y in zip(a, plain)) > 1e-6  # drop path changed the update
    assert max(np.abs(x - y).max() for x, y in zip(a, c)) > 1e-6  # and depends on the round's key
    assert np.isfinite(float(m["train_loss"]))


@pytest.mark.slow
def test_cosine_lr_schedule_is_the_constant_rate_times_the_rounds_cosine(data2):
    """Round t of T = 4 with lr_schedule=cosine is, from the same state, the constant-rate
    round at lr · (1 + cos(π t / 4)) / 2 (rounds 1 and 3: 0.85355 and 0.14645 of it); round 0
    is the plain round bit for bit."""
    cos = fednas_train(dataclasses.replace(BASE, lr_schedule="cosine"), data2.info,
                       run=RunOptions(rounds=4, placement=Placement("map")))
    s0, key = cos.init(jax.random.PRNGKey(0)), jax.random.PRNGKey(5)
    plain = fednas_train(BASE, data2.info, run=RunOptions(placement=Placement("map")))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_leaves(cos.round(s0, data2, key)[0].variables),
                                                          _leaves(plain.round(s0, data2, key)[0].variables)))
    for t, factor in ((1, 0.8535534), (3, 0.1464466)):
        got = _leaves(cos.round(s0.replace(round=jnp.int32(t)), data2, key)[0].variables["params"])
        slower = fednas_train(dataclasses.replace(BASE, lr=BASE.lr * factor), data2.info,
                              run=RunOptions(placement=Placement("map")))
        want = _leaves(slower.round(s0.replace(round=jnp.int32(t)), data2, key)[0].variables["params"])
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        moved = _leaves(plain.round(s0, data2, key)[0].variables["params"])
        assert max(np.abs(a - b).max() for a, b in zip(got, moved)) > 1e-5  # not the constant rate
    with pytest.raises(ValueError, match="needs the run's length"):
        fednas_train(dataclasses.replace(BASE, lr_schedule="cosine"), data2.info)


# ----------------------------------------------------------------------------- auxiliary head


def test_aux_pool_fits_small_maps():
    assert aux_pool(8) == (5, 3) and aux_pool(32) == (5, 3)  # DARTS' 8x8 -> 2x2
    for n in (2, 3, 5, 7):
        k, s = aux_pool(n)
        assert (n - k) // s + 1 == 2
    with pytest.raises(ValueError, match="at least 2x2"):
        aux_pool(1)
    assert aux_input_size((32, 32), 20) == (8, 8) and aux_input_size((8, 8), 5) == (2, 2)
    assert aux_input_size((8, 8), 1) == (4, 4)  # one cell: one reduction before the head
    for hw in (2, 4, 8):
        x = jnp.zeros((3, hw, hw, 16))
        out = jax.eval_shape(lambda: AuxiliaryHeadCIFAR(10).init_with_output(jax.random.PRNGKey(0), x)[0])
        assert out.shape == (3, 10)


def test_aux_loss_is_main_plus_weighted_aux_and_evaluation_ignores_it(data2):
    cfg = dataclasses.replace(BASE, auxiliary_weight=0.4)
    algo = fednas_train(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    s = algo.init(jax.random.PRNGKey(0))
    v = s.variables
    assert "auxiliary_head" in v["params"] and "auxiliary_head" in v["batch_stats"]
    model = make_network(cfg, data2.info)
    client = jax.tree.map(lambda a: a[0], data2.all_clients("train"))
    batch = {"x": client.x[:16], "y": client.y[:16], "mask": jnp.arange(16) < 13}  # 3 padding rows

    @jax.jit
    def both(v, batch):
        _, _, m = make_batch_grad(model, data2.info, cfg.augment, aux_weight=0.4)(
            v["params"], v["batch_stats"], batch, jax.random.PRNGKey(0))
        (logits, aux), _ = model.apply(v, data2.info.normalize(batch["x"]), train=True, mask=batch["mask"],
                                       mutable=["batch_stats"])
        return m["loss_sum"], [optax.softmax_cross_entropy_with_integer_labels(z, batch["y"]) for z in (logits, aux)]

    loss_sum, (ce, ce_aux) = both(v, batch)
    ce, ce_aux = np.asarray(ce)[:13].sum(), np.asarray(ce_aux)[:13].sum()
    np.testing.assert_allclose(float(loss_sum), ce + 0.4 * ce_aux, rtol=1e-5)
    assert ce_aux > 1e-3

    # evaluation: the main head only — the numbers of the same network without the head
    plain = fednas_train(BASE, data2.info, run=RunOptions(placement=Placement("map")))
    strip = {c: {k: w for k, w in v[c].items() if k != "auxiliary_head"} for c in ("params", "batch_stats")}
    want = plain.evaluate(s.replace(variables=strip), data2)
    got = algo.evaluate(s, data2)
    assert set(got) == set(want)
    for k in got:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


# ----------------------------------------------------------------------------- config


def test_config_errors_and_presets(data2):
    with pytest.raises(ConfigError, match="algo.drop_path_prob"):
        FedNASTrainConfig(drop_path_prob=1.0)
    with pytest.raises(ConfigError, match="algo.drop_path_schedule"):
        FedNASTrainConfig(drop_path_schedule="cosine")
    with pytest.raises(ConfigError, match="algo.auxiliary_weight"):
        FedNASTrainConfig(auxiliary_weight=-0.4)
    tiny = dataclasses.replace(data2.info, image_shape=(4, 4, 1))  # 4x4 images leave 1x1 maps after cell 1
    with pytest.raises(ConfigError, match="algo.auxiliary_weight=0.4: the auxiliary head needs at least 2x2"):
        make_network(dataclasses.replace(BASE, auxiliary_weight=0.4, layers=2), tiny)
    make_network(dataclasses.replace(BASE, auxiliary_weight=0.4), tiny)  # one cell, one reduction: 2x2 fits
    default = make_config("fednas_train").algo
    assert (default.drop_path_prob, default.auxiliary_weight) == (0.0, 0.0)  # the main job: both off
    paper = make_config("fednas_train", preset="paper").algo
    assert (paper.drop_path_prob, paper.drop_path_schedule, paper.auxiliary_weight) == (0.2, "linear", 0.4)
    code = make_config("fednas_train", preset="authors_code").algo
    assert (code.drop_path_prob, code.drop_path_schedule, code.auxiliary_weight) == (0.5, "constant", 0.0)

