"""``run.precision``: client training in bfloat16 with float32 parameters, statistics and state.

- fp32 (the default) builds the program it built before the option existed: no bfloat16
  anywhere in any round, and :func:`compute_in` hands back ``apply`` itself;
- bf16: the convolutions and matrix products of client training are bfloat16 in every round's
  jaxpr, while the state a round returns (parameters, α, BatchNorm statistics, optimizer
  state) keeps fp32's dtypes; a network's BatchNorm running statistics and the gradients
  come back float32, the statistics as float32 arithmetic gives them;
- bf16 reaches fp32's accuracy on the embedded digits (a short FedAvg run);
- DP-FNAS and PerFedRLNAS refuse bf16, naming themselves.
"""
import collections

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from conftest import tiny_federation
from jaxfednas import nn as jnn
from jaxfednas.config import ConfigError
from jaxfednas.precision import cast_floating, compute_in
from jaxfednas.registry import build_algorithm, ALGORITHMS, make_config
from jaxfednas.rng import init_key, round_key

BF16_ALGORITHMS = sorted(ALGORITHMS)


def _jaxprs(jaxpr):
    """``jaxpr`` and every jaxpr nested in it (scan, cond, custom_vjp, pjit bodies ...)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for v in eqn.params.values():
            for x in v if isinstance(v, list | tuple) else [v]:
                if isinstance(x, jcore.ClosedJaxpr):
                    yield from _jaxprs(x.jaxpr)
                elif isinstance(x, jcore.Jaxpr):
                    yield from _jaxprs(x)


def _ops(jaxpr) -> collections.Counter:
    """``(primitive, dtype of the first operand)`` counts of the convolutions and dots."""
    return collections.Counter((e.primitive.name, str(e.invars[0].aval.dtype)) for j in _jaxprs(jaxpr)
                               for e in j.eqns if e.primitive.name in ("conv_general_dilated", "dot_general"))


def _has_bf16(jaxpr) -> bool:
    return any(getattr(v.aval, "dtype", None) == jnp.bfloat16
               for j in _jaxprs(jaxpr) for e in j.eqns for v in (*e.invars, *e.outvars))


def _round(name, precision):
    extra = {"algo.arch_gradient": "first"} if name == "dp_fnas" else {}  # bf16 refuses its second_fd
    cfg, data = tiny_federation(name, **{"run.precision": precision}, **extra)
    algo = build_algorithm(cfg, data.info)
    s0 = jax.eval_shape(algo.init, init_key(0))
    return s0, jax.make_jaxpr(algo.round)(s0, data, round_key(0, 0)), jax.eval_shape(
        algo.round, s0, data, round_key(0, 0))[0]


@pytest.mark.parametrize("name", BF16_ALGORITHMS)
def test_bf16_round_computes_in_bf16_and_keeps_the_state_fp32(name):
    s0, bf16, s1 = _round(name, "bf16")  # (the fp32 default's numbers: test_contract's recorded ones)
    ops = _ops(bf16.jaxpr)
    assert ops["conv_general_dilated", "bfloat16"] > 0 and ops["dot_general", "bfloat16"] > 0, ops
    if name in ("spider", "perfedrlnas"):  # validation accuracy (candidates' scores, rewards): float32 forwards
        assert ops["conv_general_dilated", "float32"] * 3 <= ops["conv_general_dilated", "bfloat16"], ops
    else:  # every convolution is client training's (the float32 dots left: the server's weighted means)
        assert ops["conv_general_dilated", "float32"] == 0, ops
    dtypes = lambda s: [(jax.tree_util.keystr(p), x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(s)]  # noqa: E731
    assert dtypes(s1) == dtypes(s0)  # parameters, statistics, optimizer state: float32 as initialised
    assert jnp.dtype(jnp.bfloat16) not in {x.dtype for x in jax.tree.leaves(s0)}


@pytest.mark.parametrize("name", ["fedavg", "fednas"])
def test_fp32_default_program_has_no_bfloat16(name):
    assert not _has_bf16(_round(name, "fp32")[1].jaxpr)


class _Net(fnn.Module):
    """A conv, Flax's BatchNorm, this library's BatchNorm and a dense layer."""

    @fnn.compact
    def __call__(self, x, train: bool = True, mask=None):
        mask = None if mask is None else mask[:, None, None, None]
        x = fnn.Conv(8, (3, 3))(x)
        x = fnn.relu(fnn.BatchNorm(use_running_average=not train, momentum=0.9)(x, mask=mask))
        x = jnn.Conv(8, (3, 3))(x)
        x = fnn.relu(jnn.BatchNorm(use_running_average=not train, momentum=0.9)(x, mask=mask))
        return fnn.Dense(3)(x.mean((1, 2)))


def test_compute_in_keeps_statistics_and_gradients_float32():
    net = _Net()
    x = jax.random.normal(jax.random.key(0), (6, 5, 5, 2))
    mask = jnp.array([True] * 5 + [False])
    v = jax.jit(net.init)(jax.random.key(1), x)
    # running statistics that bfloat16 cannot hold: a round trip through it would show
    stats = jax.tree.map(lambda a: a + jax.random.uniform(jax.random.key(2), a.shape) * 0.1 + 1e-3 / 3,
                         v["batch_stats"])
    apply = net.apply
    assert compute_in("fp32", apply) is apply

    def loss(params, apply):
        logits, new = apply({"params": params, "batch_stats": stats}, x, mask=mask, mutable=["batch_stats"])
        return (logits ** 2).sum(), (logits, new["batch_stats"])

    bf16 = jax.jit(jax.value_and_grad(lambda p: loss(p, compute_in("bf16", net.apply)), has_aux=True))
    (_, (logits, new)), grads = bf16(v["params"])
    for tree in (logits, new, grads):
        assert {a.dtype for a in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    ops = _ops(jax.make_jaxpr(bf16)(v["params"]).jaxpr)  # 2 forward, 2 kernel and 1 input gradient convs
    assert ops["conv_general_dilated", "bfloat16"] == 5 and ops["conv_general_dilated", "float32"] == 0, ops
    assert ops["dot_general", "bfloat16"] == 3 and ops["dot_general", "float32"] == 0, ops
    # the statistics' update is float32 arithmetic: 0.9 old + 0.1 batch statistics (those of the
    # bfloat16 activations, taken in float32): close to fp32's, and the old part exact -- the
    # same step from zero statistics isolates it (training mode: the forward does not read them)
    (_, (_, new32)), grads32 = jax.jit(jax.value_and_grad(lambda p: loss(p, net.apply), has_aux=True))(v["params"])
    zero = jax.tree.map(jnp.zeros_like, stats)
    _, from_zero = jax.jit(lambda p: compute_in("bf16", net.apply)(
        {"params": p, "batch_stats": zero}, x, mask=mask, mutable=["batch_stats"]))(v["params"])
    for bn in ("BatchNorm_0", "BatchNorm_1"):
        for k in ("mean", "var"):
            got, old = new[bn][k], stats[bn][k]
            np.testing.assert_allclose(got, new32[bn][k], rtol=0.02, atol=0.02)
            # from bfloat16-rounded statistics this would be off by up to 0.9 * 2^-9 * |old|
            np.testing.assert_allclose(got - from_zero["batch_stats"][bn][k], 0.9 * old, rtol=1e-5, atol=1e-6)
    # this library's BatchNorm gives Flax's output dtype: bfloat16 from bfloat16 input and parameters
    xb = x.astype(jnp.bfloat16)
    bn = {"params": v["params"]["BatchNorm_1"], "batch_stats": stats["BatchNorm_1"]}
    for variables, out in ((bn, jnp.float32), (cast_floating(bn, jnp.bfloat16), jnp.bfloat16)):
        y, new_bn = jax.jit(lambda v: jnn.BatchNorm().apply(v, xb[..., :1].repeat(8, -1), mutable=["batch_stats"]))(
            {**variables, "batch_stats": bn["batch_stats"]})
        assert y.dtype == out and new_bn["batch_stats"]["mean"].dtype == jnp.float32
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads32))  # (a conv bias before BN: ~0)
    for g, g32 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads32)):
        np.testing.assert_allclose(g, g32, rtol=0.1, atol=0.02 * scale)


def test_unknown_precision_refused():
    with pytest.raises(ConfigError, match="run.precision='fp16' is not allowed"):
        make_config("fedavg", overrides={"run.precision": "fp16"})


def test_dp_fnas_bf16_refuses_the_finite_difference():
    """W' ± ε v with ε = 0.01/‖v‖ is below bfloat16's resolution: second_fd is refused."""
    cfg = make_config("dp_fnas", overrides={"run.precision": "bf16", "algo.arch_gradient": "second_fd"})
    with pytest.raises(ConfigError, match="second_fd"):
        build_algorithm(cfg, tiny_federation("dp_fnas")[1].info)
    for grad in ("second_hvp", "first"):  # (second_hvp is refused under shard_map, whatever the precision)
        cfg = make_config("dp_fnas", overrides={"run.precision": "bf16", "algo.arch_gradient": grad,
                                                "run.placement": "map"})
        build_algorithm(cfg, tiny_federation("dp_fnas")[1].info)


@pytest.mark.slow
def test_bf16_fedavg_reaches_fp32_accuracy_on_digits():
    """FedAvg's smoke preset (5 rounds) on the embedded digits, the same seed, fp32 and bf16.

    Measured (the test suite's XLA settings, 2-core CPU): global test accuracy fp32 0.7139,
    bf16 0.7111 (360 test images: one apart). Outside the test settings
    (fully optimised XLA), seeds 0-4 gave |fp32 - bf16| accuracy 0.0056, 0.0028, 0.0, 0.025,
    0.0056 (at most 9 images); the tolerance, 0.04, leaves margin over the largest."""
    from jaxfednas.data import make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition

    ds = load_dataset("digits")
    acc = {}
    for precision in ("fp32", "bf16"):
        cfg = make_config("fedavg", preset="smoke", overrides={"run.precision": precision, "run.placement": "map"})
        data = make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))
        algo = build_algorithm(cfg, data.info)
        s = algo.init(init_key(cfg.run.seed))
        for r in range(cfg.run.rounds):
            s, m = algo.round(s, data, round_key(cfg.run.seed, r))
        acc[precision] = float(algo.evaluate(s, data)["global_test_acc"])
    assert acc["fp32"] > 0.6, acc  # trained well past chance (0.1), so the comparison means something
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.04, acc


def test_subnet_space_norms_take_statistics_in_float32():
    """The elastic and hybrid spaces' own BatchNorm / LayerNorm: from a bfloat16 input the
    statistics are float32 arithmetic on its values (as from the same values in float32),
    the running averages stay float32 and the output is bfloat16."""
    from jaxfednas.search_spaces.elastic import mobilenet
    from jaxfednas.search_spaces.hybrid import network as hybrid

    c = 16
    xb = (3.0 + jax.random.normal(jax.random.key(0), (64, 6, 6, c))).astype(jnp.bfloat16)
    x32 = xb.astype(jnp.float32)
    p = {"scale": jnp.full((c,), 1.5), "bias": jnp.full((c,), 0.25)}
    s = {"mean": jnp.zeros((c,)), "var": jnp.ones((c,))}
    mask = jnp.arange(64) < 60
    for bn in (mobilenet._batch_norm, hybrid._batch_norm):
        y, new = bn(xb, p, s, True, mask)
        y32, new32 = bn(x32, p, s, True, mask)
        assert y.dtype == jnp.bfloat16 and {a.dtype for a in jax.tree.leaves(new)} == {jnp.dtype(jnp.float32)}
        for k in ("mean", "var"):  # bfloat16 sums of 2160 values would be off by ~1e-2 relative
            np.testing.assert_allclose(new[k], new32[k], rtol=1e-6)
        np.testing.assert_allclose(y.astype(jnp.float32), y32, rtol=1e-2, atol=1e-2)
    h = xb.reshape(64, 36, c) * 40.0
    out = hybrid._layer_norm(h, p)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), hybrid._layer_norm(h.astype(jnp.float32), p), rtol=1e-2, atol=1e-2)
