"""jaxfednas.nn: BatchNorm against flax.linen.BatchNorm (variables, outputs, statistics, gradients);
every depthwise formulation against the grouped convolution."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.nn import DEPTHWISE_IMPLS, BatchNorm, SeparableConv, compile_for, depthwise_conv


@pytest.mark.parametrize("platform", ["cpu", "gpu"])  # gpu: traced as for one (its stacked sums), run here
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_matches_flax(affine, platform):
    with compile_for(platform):
        _batch_norm_matches_flax(affine)


def _batch_norm_matches_flax(affine):
    kw = dict(momentum=0.9, epsilon=1e-3, use_scale=affine, use_bias=affine)
    if affine:
        kw["bias_init"] = nn.initializers.constant(0.25)
    ours, flax_bn = BatchNorm(**kw), nn.BatchNorm(**kw)
    x = 2.0 + 3.0 * jax.random.normal(jax.random.key(0), (6, 5, 4, 7))
    v = flax_bn.init(jax.random.key(1), x, use_running_average=False)
    v_ours = ours.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, v_ours)
    for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(v_ours)):
        np.testing.assert_array_equal(a, b)
    if affine:  # a non-trivial scale, so its gradient path is exercised
        v = {**v, "params": {"scale": 1.0 + jnp.arange(7.0) / 7, "bias": v["params"]["bias"]}}
    ct = jax.random.normal(jax.random.key(2), x.shape)
    for mask in (None, (jnp.arange(6) < 4)[:, None, None, None]):  # no padding; two padded rows
        def loss(fn, params, x):
            y, new = fn({**v, "params": params}, x, mask)
            return jnp.sum(y * ct), (y, new)

        run_ours = lambda var, x, m: ours.apply(var, x, mask=m, mutable=["batch_stats"])  # noqa: E731
        run_flax = lambda var, x, m: flax_bn.apply(  # noqa: E731
            var, x, use_running_average=False, mask=m, mutable=["batch_stats"])
        got = jax.jit(jax.grad(lambda p, x: loss(run_ours, p, x), argnums=(0, 1), has_aux=True))(
            v.get("params", {}), x)
        want = jax.jit(jax.grad(lambda p, x: loss(run_flax, p, x), argnums=(0, 1), has_aux=True))(
            v.get("params", {}), x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # grads (params, x), outputs, statistics
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
        if mask is not None:  # padded rows leave the statistics: change them, nothing else moves
            x2 = x.at[4:].set(100.0)
            (_, (y2, new2)) = loss(run_ours, v.get("params", {}), x2)
            np.testing.assert_allclose(y2[:4], got[1][0][:4], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(new2["batch_stats"]["mean"], got[1][1]["batch_stats"]["mean"], rtol=1e-6)
    # evaluation mode: the running statistics, Flax's order of operations (bitwise)
    stats = {"mean": jnp.linspace(-1, 1, 7), "var": jnp.linspace(0.5, 2, 7)}
    ve = {**v, "batch_stats": stats}
    np.testing.assert_array_equal(BatchNorm(use_running_average=True, **kw).apply(ve, x),
                                  nn.BatchNorm(use_running_average=True, **kw).apply(ve, x))


def test_batch_norm_rejects_a_mask_not_per_example():
    x = jnp.ones((4, 3, 3, 2))
    with pytest.raises(ValueError, match="one value per example"):
        BatchNorm().init(jax.random.key(0), x, mask=jnp.ones((4, 3, 3, 2), bool))


def test_batch_norm_call_argument_and_low_precision_input():
    x = jax.random.normal(jax.random.key(0), (4, 3, 3, 5))
    v = BatchNorm().init(jax.random.key(1), x)
    v = {**v, "batch_stats": {"mean": jnp.full(5, 0.5), "var": jnp.full(5, 2.0)}}
    # use_running_average at call time overrides the attribute (as Flax's merge of the two)
    np.testing.assert_array_equal(BatchNorm().apply(v, x, use_running_average=True),
                                  BatchNorm(use_running_average=True).apply(v, x))
    # bfloat16 input: statistics and output in float32, as Flax's
    ours, _ = BatchNorm().apply(v, x.astype(jnp.bfloat16), mutable=["batch_stats"])
    theirs, _ = nn.BatchNorm(use_running_average=False).apply(v, x.astype(jnp.bfloat16), mutable=["batch_stats"])
    assert ours.dtype == theirs.dtype == jnp.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


# (kernel, stride, dilation, padding) of every DARTS sep/dil conv, strided and not
SEPARABLE_CASES = [(3, 1, 1, 1), (5, 2, 1, 2), (3, 1, 2, 2), (5, 2, 2, 4)]


@pytest.mark.parametrize("k,stride,dil,pad", SEPARABLE_CASES)
def test_every_depthwise_formulation_equals_the_grouped_reference(k, stride, dil, pad):
    """Each formulation of the depthwise + 1x1 pair (``SeparableConv``, every ``DEPTHWISE_IMPLS``
    entry) and of the lone depthwise conv gives the grouped convolution's values, input
    gradient and kernel gradients in float32 to 1e-5 (a random cotangent)."""
    rng = np.random.default_rng(k * 100 + stride * 10 + dil)
    x = jnp.asarray(rng.standard_normal((2, 9, 9, 4)), jnp.float32)
    dw = jnp.asarray(0.5 * rng.standard_normal((k, k, 1, 4)), jnp.float32)
    pw = jnp.asarray(0.5 * rng.standard_normal((1, 1, 4, 6)), jnp.float32)
    out_hw = (9 + 2 * pad - dil * (k - 1) - 1) // stride + 1
    g_pair = jnp.asarray(rng.standard_normal((2, out_hw, out_hw, 6)), jnp.float32)
    g_dw = jnp.asarray(rng.standard_normal((2, out_hw, out_hw, 4)), jnp.float32)

    def pair(impl, x, dw, pw):
        return SeparableConv(6, k, stride, pad, dil, impl).apply({"params": {"depthwise": dw, "pointwise": pw}}, x)

    def lone(impl, x, dw):
        return depthwise_conv(x, dw, stride, dil, pad, impl)

    @jax.jit
    def everything(x, dw, pw):
        out = {}
        for impl in DEPTHWISE_IMPLS:
            y, vjp = jax.vjp(lambda *a, impl=impl: pair(impl, *a), x, dw, pw)
            z, vjp_lone = jax.vjp(lambda *a, impl=impl: lone(impl, *a), x, dw)
            out[impl] = (y, vjp(g_pair), z, vjp_lone(g_dw))
        return out

    with jax.default_matmul_precision("highest"):
        out = everything(x, dw, pw)
    ref = out["grouped"]
    for impl in DEPTHWISE_IMPLS:
        for got, want, what in zip(jax.tree.leaves(out[impl]), jax.tree.leaves(ref),
                                   ("y", "dx", "ddw", "dpw", "z", "dx lone", "ddw lone")):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{impl}: {what}")
