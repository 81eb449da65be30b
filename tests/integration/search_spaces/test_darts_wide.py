"""Edges grouped by source (search_spaces/darts/wide.py) against the edge scan: the same
variables, the same logits, gradients, running statistics and evaluation outputs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.search_spaces.darts.operations import PRIMITIVES
from jaxfednas.search_spaces.darts.search import DartsSearchNetwork, SearchCell
from jaxfednas.nn import batch_norm_train, compile_for
from jaxfednas.search_spaces.darts.wide import max_pool_3x3


def _rel(a, b):  # on the host: eager jnp ops would compile a program per leaf shape
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return max(float(np.max(np.abs(p - q)) / (np.max(np.abs(p)) + 1e-12))
               for p, q in ((np.asarray(p), np.asarray(q)) for p, q in leaves))


def _run(net, variables, x, y, mask):
    def loss(params, arch):
        logits, new = net.apply({"params": params, "arch": arch, "batch_stats": variables["batch_stats"]}, x,
                                train=True, mask=mask, mutable=["batch_stats"])
        ce = -jax.nn.log_softmax(logits)[jnp.arange(x.shape[0]), y] * mask
        return ce.sum(), (logits, new["batch_stats"])

    @jax.jit  # one program per network: training step and evaluation
    def run(variables):
        (_, (logits, stats)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(
            variables["params"], variables["arch"])
        return logits, stats, grads, net.apply(variables, x, train=False)

    return run(variables)


@pytest.mark.parametrize("primitives", [
    # one op of every kind the grouped cell builds differently: pooling, skip (identity and
    # FactorizedReduce), a two-block separable conv, a dilated one, the 7x1/1x7 pair
    pytest.param(("none", "max_pool_3x3", "skip_connect", "sep_conv_3x3", "dil_conv_5x5", "conv_7x1_1x7"),
                 marks=pytest.mark.slow),  # (~40 s cold; the depthwise forms' unit test: tests/unit/jaxfednas/test_nn.py)
    ("none", "avg_pool_3x3", "skip_connect"),  # parameter-free edges only
    pytest.param(PRIMITIVES + ("conv_7x1_1x7",), marks=pytest.mark.slow),  # every op (opt-in: ~40 s)
])
def test_grouped_equals_edge_scan(primitives):
    # 3 cells: a normal cell, a reduction cell, a reduction cell after a reduction
    kw = dict(C=4, num_classes=5, layers=3, steps=2, multiplier=2, primitives=primitives)
    _assert_same(DartsSearchNetwork(**kw, group_edges=False), DartsSearchNetwork(**kw, group_edges=True))


@pytest.mark.parametrize("primitives", [
    ("none", "max_pool_3x3", "skip_connect", "sep_conv_3x3"),
    pytest.param(PRIMITIVES + ("conv_7x1_1x7",), marks=pytest.mark.slow),  # every op (opt-in)
])
def test_gpu_default_equals_the_gpu_reference(primitives):
    """What a GPU runs by default, traced for one on this CPU (:func:`jaxfednas.nn.compile_for`:
    native convolution gradients, a sep conv's second block as one grouped convolution per
    source): the grouped cells in the fused formulation (~9x fewer GPU kernels,
    benchmarks/kernels.py), against the edge scan with grouped depthwise convolutions, the
    reference of benchmarks/gpu.py."""
    kw = dict(C=4, num_classes=5, layers=3, steps=2, multiplier=2, primitives=primitives)
    with compile_for("gpu"):
        default, reference = DartsSearchNetwork(**kw), DartsSearchNetwork(**kw, dw_impl="grouped")
        assert default.runs_grouped((8, 8, 3)) and not reference.runs_grouped((8, 8, 3))
        _assert_same(reference, default)


def _assert_same(scan, grouped):
    x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (6,), 0, 5)
    mask = jnp.arange(6) < 4  # two padded rows stay out of the BatchNorm statistics
    # one compiled init (eagerly, flax's init compiles ~190 small programs: ~10 s here); the
    # grouped network's variables only need the same structure
    variables = dict(jax.jit(functools.partial(scan.init, train=False))(jax.random.key(2), x))
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(
        jax.eval_shape(functools.partial(grouped.init, train=False), jax.random.key(2), x))
    # distinct running statistics per edge, so evaluation must use each edge's own
    variables["batch_stats"] = jax.jit(lambda stats: jax.tree_util.tree_map(
        lambda a: a + jax.random.uniform(jax.random.key(a.size), a.shape), stats))(variables["batch_stats"])
    a, b = _run(scan, variables, x, y, mask), _run(grouped, variables, x, y, mask)
    assert jax.tree_util.tree_structure(a[1]) == jax.tree_util.tree_structure(b[1])
    # logits: float32 rounding in a different order, amplified by BatchNorm over 4 examples
    # (over init keys 0-5: 5e-7 to 1.4e-5, the logits' own scale; a wrong edge gives ~1e-1)
    assert _rel(a[0], b[0]) < 5e-5
    assert _rel(a[1], b[1]) < 1e-5  # every updated running statistic
    assert _rel(a[2], b[2]) < 1e-4  # gradients w.r.t. weights and α
    assert _rel(a[3], b[3]) < 1e-5  # evaluation mode
    changed = jax.tree_util.tree_map(lambda old, new: bool(np.any(np.asarray(old) != np.asarray(new))),
                                     variables["batch_stats"], b[1])
    assert all(jax.tree_util.tree_leaves(changed))  # every BatchNorm of every edge was updated


def test_unbiased_running_var_reaches_a_grouped_cell_traced_before():
    """The parity option of FedNAS' ``bn_stats_updates=code`` (PyTorch's unbiased running
    variance, the network's ``unbiased_running_var`` field) is part of the grouped cell's jit
    cache key: traced first with the default (biased) variance, the cell still updates its
    edges' statistics unbiased in a network with the field on, as the edge scan does, and
    biased again without it."""
    kw = dict(C=4, num_classes=5, layers=1, steps=2, multiplier=2, primitives=("avg_pool_3x3", "sep_conv_3x3"))
    scan, grouped = DartsSearchNetwork(**kw, group_edges=False), DartsSearchNetwork(**kw, group_edges=True)
    x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
    mask = jnp.arange(6) < 4
    variables = dict(jax.jit(functools.partial(scan.init, train=False))(jax.random.key(2), x))

    def stats(net, unbiased):
        def f(v):  # a new outer trace each call; the grouped cell's own jit cache persists
            model = net.clone(unbiased_running_var=unbiased)
            return model.apply(v, x, train=True, mask=mask, mutable=["batch_stats"])[1]["batch_stats"]
        return jax.jit(f)(variables)

    got = {flag: stats(grouped, flag) for flag in (False, True, False)}  # default first, as a default run would
    for flag in (False, True):
        assert _rel(stats(scan, flag), got[flag]) < 1e-5
    assert _rel(got[True], got[False]) > 1e-3  # the edges' variances differ by n/(n-1)



def _jaxprs(jaxpr):
    """``jaxpr`` and every jaxpr nested in it (pjit, scan, cond, custom_vjp bodies)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for v in eqn.params.values():
            for sub in v if isinstance(v, list | tuple) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxprs(inner)


def _conv_dtypes(jaxpr, inside: str | None = None) -> set:
    """The operand dtypes of the convolutions in ``jaxpr`` (only in the nested jits named ``inside``)."""
    out = set()
    for j in _jaxprs(jaxpr):
        for e in j.eqns:
            if inside is not None and e.primitive.name in ("pjit", "jit") and e.params.get("name") == inside:
                out |= _conv_dtypes(e.params["jaxpr"].jaxpr)
            elif inside is None and e.primitive.name == "conv_general_dilated":
                out.add(str(e.invars[0].aval.dtype))
    return out


def test_precision_reaches_a_grouped_cell_traced_before_in_the_other_precision():
    """``run.precision`` reaches the grouped cell (a jit of its own, cached across networks)
    through its arguments' dtypes, never a Python-side switch: traced first in bfloat16, the
    float32 forward after it has no bfloat16 anywhere and equals the edge scan's; traced
    first in float32, the bfloat16 forward after it runs the cell's convolutions in
    bfloat16 and stays near the edge scan's."""
    from jaxfednas.precision import compute_in

    kw = dict(C=4, num_classes=5, layers=1, steps=2, multiplier=2, primitives=("avg_pool_3x3", "sep_conv_3x3"))
    scan, grouped = DartsSearchNetwork(**kw, group_edges=False), DartsSearchNetwork(**kw, group_edges=True)
    x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
    mask = jnp.arange(6) < 4
    variables = dict(jax.jit(functools.partial(scan.init, train=False))(jax.random.key(2), x))

    def forward(net, precision):  # a new outer function each call; the grouped cell's jit cache persists
        def f(v):
            return compute_in(precision, net.apply)(v, x, train=True, mask=mask, mutable=["batch_stats"])
        return jax.jit(f)(variables), jax.make_jaxpr(f)(variables).jaxpr

    order = ("bf16", "fp32", "bf16")  # bfloat16 traced first, then float32, then bfloat16 again
    got = [forward(grouped, p) for p in order]
    want = {p: forward(scan, p)[0] for p in ("fp32", "bf16")}
    (out32, _), jaxpr32 = got[1]
    assert _conv_dtypes(jaxpr32) == {"float32"}
    assert _rel(want["fp32"], got[1][0]) < 1e-5
    for (out16, _), jaxpr16 in (got[0], got[2]):
        assert _conv_dtypes(jaxpr16, inside="_wide_cell") == {"bfloat16"}
        assert _rel(want["bf16"][0], out16) < 5e-2 and _rel(out32, out16) > 1e-4  # bfloat16 rounding shows

def test_default_groups_on_every_backend_and_falls_back():
    assert SearchCell(4, False, False)._grouped()
    with compile_for("gpu"):
        assert SearchCell(4, False, False)._grouped()
        assert not SearchCell(4, False, False, dw_impl="grouped")._grouped()
        assert DartsSearchNetwork(4, 5, 3).runs_grouped((8, 8, 3))  # on CPU only from 16x16 pixels
    assert not DartsSearchNetwork(4, 5, 3).runs_grouped((8, 8, 3))
    assert not SearchCell(4, False, False, single_path=True)._grouped()
    assert not SearchCell(4, False, False, norm="group")._grouped()
    with pytest.raises(ValueError, match="group_edges=True needs scan_edges=True"):
        SearchCell(4, False, False, scan_edges=False, group_edges=True)._grouped()


@pytest.mark.parametrize("algo", ["fednas", "spider", "dp_fnas"])
def test_algo_dw_impl_reaches_the_supernet(algo):
    """``algo.dw_impl`` picks every DARTS algorithm's formulation (auto: the backend's), and a
    non-fused one turns the grouped cells off; group_edges=on with it is refused."""
    from jaxfednas.config import ConfigError
    from jaxfednas.registry import make_config
    from jaxfednas.search_spaces.darts import supernet_of

    for impl, want in (("auto", None), ("slices", "slices"), ("hybrid", "hybrid")):
        net = supernet_of(make_config(algo, overrides={"algo.dw_impl": impl}).algo, 10)
        assert net.dw_impl == want
        assert net.runs_grouped((32, 32, 3)) == (impl == "auto")
    if algo != "dp_fnas":  # DP-FNAS has no group_edges (its GroupNorm never groups)
        with pytest.raises(ConfigError, match="dw_impl=fused"):
            make_config(algo, overrides={"algo.dw_impl": "grouped", "algo.group_edges": "on"})


def test_max_pool_gradient_goes_to_the_first_maximum():
    x = jax.random.normal(jax.random.key(0), (2, 7, 7, 3))
    x = x.at[0, 2, 2, 0].set(5.0).at[0, 2, 3, 0].set(5.0)  # a tie inside several windows
    for stride in (1, 2):
        ct = jax.random.normal(jax.random.key(1), max_pool_3x3(x, stride).shape)

        def ref(x):
            return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, stride, stride, 1),
                                         ((0, 0), (1, 1), (1, 1), (0, 0)))

        np.testing.assert_array_equal(max_pool_3x3(x, stride), ref(x))
        g_ours = jax.grad(lambda x: jnp.sum(max_pool_3x3(x, stride) * ct))(x)
        g_ref = jax.grad(lambda x: jnp.sum(ref(x) * ct))(x)
        np.testing.assert_allclose(g_ours, g_ref, rtol=0, atol=1e-6)


def test_batch_norm_backward_equals_autodiff_of_its_forward():
    def ref(y, m):  # the masked affine-free BatchNorm the grouped cell normalises with
        mean = y.mean((0, 1, 2), where=m[:, None, None, None])
        var = jnp.maximum(0.0, (y * y).mean((0, 1, 2), where=m[:, None, None, None]) - mean * mean)
        return (y - mean) * jax.lax.rsqrt(var + 1e-5), mean, var

    y = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (5, 4, 3, 6))
    cts = (jax.random.normal(jax.random.key(1), y.shape), jax.random.normal(jax.random.key(2), (6,)),
           jax.random.normal(jax.random.key(3), (6,)))
    for m in (jnp.ones(5, bool), jnp.arange(5) < 3):  # no padding; two padded rows
        @jax.jit
        def both(y):
            ours, vjp_ours = jax.vjp(lambda y: batch_norm_train(y, m.astype(y.dtype)), y)
            theirs, vjp_ref = jax.vjp(lambda y: ref(y, m), y)
            return ours, theirs, vjp_ours(cts)[0], vjp_ref(cts)[0]

        ours, theirs, g_ours, g_ref = both(y)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g_ours, g_ref, rtol=1e-4, atol=1e-5)
        if not bool(m.all()):  # padded rows: their own output's gradient only, no statistics term
            np.testing.assert_allclose(g_ours[3:], cts[0][3:] * jax.lax.rsqrt(ours[2] + 1e-5), rtol=1e-5)


def test_cells_of_equal_shapes_share_one_trace(monkeypatch):
    from jaxfednas.search_spaces.darts import wide
    runs = []
    real = wide.WideCell.run
    monkeypatch.setattr(wide.WideCell, "run", lambda self, *a: runs.append(self.reduction) or real(self, *a))
    # 8 cells: N N R N N R N N; the two normal cells of a stage differ in their
    # preprocessing (inputs, FactorizedReduce after a reduction), not in their edges
    net = DartsSearchNetwork(C=4, num_classes=3, layers=8, steps=2, multiplier=2,
                             primitives=("none", "max_pool_3x3", "sep_conv_3x3"), group_edges=True)
    x = jnp.zeros((3, 12, 12, 3))  # shapes no other test traces (the trace cache is per process)
    variables = jax.eval_shape(functools.partial(net.init, train=False), jax.random.key(0), x)
    jax.eval_shape(lambda v: net.apply(v, x, train=True, mutable=["batch_stats"]), variables)
    assert sorted(runs) == [False, False, False, True, True]  # 3 normal and 2 reduction shapes
