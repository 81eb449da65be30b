"""DARTS search space: ops, supernet, genotypes, evaluation network, plots.

Networks here are tiny (C=2..4, 2-4 primitives, 8x8 inputs) so the file stays fast on
two CPU cores; the full-size networks are only counted through ``jax.eval_shape``.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.cost import count_params
from jaxfednas.search_spaces.darts import (
    AvgPool3x3,
    DARTS_V1,
    DARTS_V2,
    DartsNetwork,
    DartsSearchNetwork,
    depthwise_conv,
    derive,
    derive_from_weights,
    DilConv,
    drop_path,
    EvalCell,
    FactorizedReduce,
    FEDNAS_V1,
    Genotype,
    make_op,
    MaxPool3x3,
    MixedOp,
    plot_cell,
    plot_genotype,
    PRIMITIVES,
    PRIMITIVES_S2,
    SepConv,
    unroll_variables,
    Zero,
)

TINY_PRIMS = ("none", "skip_connect", "dil_conv_3x3")


def _x(shape, seed=0):
    # Host RNG: every new shape drawn with jax.random would compile a threefry program.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _fake_init(module, *args, seed=0, **kwargs):
    """Variables with the shapes ``module.init`` would give, drawn on the host.

    Compiling a real ``init`` costs seconds on XLA:CPU (a threefry loop per parameter);
    equality tests only need some fixed values.
    """
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        if "'var'" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype)
        scale = 1e-3 if "alphas" in name else 0.1 if "'mean'" in name else 0.5
        return jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _close(a, b, rtol=1e-5, atol=1e-5):
    for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def tiny_search():
    net = DartsSearchNetwork(C=4, num_classes=5, layers=3, steps=2, multiplier=2, primitives=TINY_PRIMS)
    x = _x((4, 8, 8, 3))
    return net, x, _fake_init(net, x, seed=1)


@pytest.fixture(scope="module")
def tiny_train(tiny_search):
    """One compiled train-mode forward of the tiny supernet, shared by several tests."""
    net, _, _ = tiny_search
    return jax.jit(lambda v, x, mask, w: net.apply(v, x, train=True, mask=mask, arch_weights=w,
                                                   mutable=["batch_stats"]))


def test_init_collections_and_alpha_scale():
    net = DartsSearchNetwork(C=2, num_classes=3, layers=1, primitives=("skip_connect",))
    x = jnp.ones((2, 4, 4, 3))
    # An rbg key: threefry initialisers take seconds to compile on XLA:CPU.
    v = jax.jit(lambda k, x: net.init({"params": k}, x))(jax.random.key(0, impl="unsafe_rbg"), x)
    assert set(v) == {"params", "arch", "batch_stats"}
    assert v["arch"]["alphas_reduce"].shape == (14, 1)
    a = np.concatenate([np.ravel(v["arch"]["alphas_normal"]), np.ravel(v["arch"]["alphas_reduce"])])
    assert 0 < np.abs(a).max() < 0.01 and np.std(a) > 1e-4  # 1e-3 * N(0, 1)


# ----------------------------------------------------------------------------- ops


def test_depthwise_formulations_agree_values_and_grads():
    x = _x((2, 9, 9, 3))
    for k, stride, dil, pad in [(3, 2, 2, 2)]:
        w = _x((k, k, 1, 3), seed=1)
        g = _x(depthwise_conv(x, w, stride, dil, pad, "grouped").shape, seed=2)  # random cotangent

        @jax.jit
        def both(w, x, g):
            out = {}
            for impl in ("grouped", "slices"):
                f = lambda w, x, impl=impl: jnp.sum(depthwise_conv(x, w, stride, dil, pad, impl) * g)  # noqa: E731
                out[impl] = (depthwise_conv(x, w, stride, dil, pad, impl), jax.grad(f, argnums=(0, 1))(w, x))
            return out

        out = both(w, x, g)
        _close(out["grouped"], out["slices"], rtol=1e-4, atol=1e-5)


def test_separable_blocks_same_in_every_formulation():
    """grouped and fused give equal outputs and gradients on the same parameters
    (slices vs grouped: test_depthwise_formulations_agree_values_and_grads)."""
    x = _x((4, 8, 8, 4))
    blocks = {
        "sep3_s2": lambda impl: SepConv(4, 3, 2, 1, affine=False, dw_impl=impl),
        "dil5_s1": lambda impl: DilConv(4, 5, 1, 4, 2, affine=False, dw_impl=impl),
    }
    variables = {b: _fake_init(make("grouped"), x, False) for b, make in blocks.items()}
    cot = {b: _x(jax.eval_shape(lambda m=make: m("grouped").apply(variables[b], x, False)).shape, seed=3)
           for b, make in blocks.items()}

    @jax.jit
    def run(params, x):
        res = {}
        for b, make in blocks.items():
            for impl in ("grouped", "fused"):
                def f(p, x, m=make(impl), b=b):
                    y = m.apply({**variables[b], "params": p}, x, True, mutable=["batch_stats"])[0]
                    return jnp.sum(y * cot[b]), y
                res[b, impl] = jax.grad(f, argnums=(0, 1), has_aux=True)(params[b], x)
        return res

    res = run({b: v["params"] for b, v in variables.items()}, x)
    for b in blocks:
        _close(res[b, "fused"][1], res[b, "grouped"][1], rtol=1e-4, atol=1e-4)
        _close(res[b, "fused"][0], res[b, "grouped"][0], rtol=1e-3, atol=1e-4)


def test_avg_pool_excludes_padding_and_max_pool():
    x = jnp.full((1, 5, 5, 2), 3.0)
    for s in (1, 2):
        y = AvgPool3x3(s).apply({}, x)
        np.testing.assert_allclose(y, 3.0, rtol=1e-6)  # corners too: padding is not counted
    ramp = jnp.arange(16.0).reshape(1, 4, 4, 1)
    y = AvgPool3x3(1).apply({}, ramp)
    assert float(y[0, 0, 0, 0]) == pytest.approx((0 + 1 + 4 + 5) / 4)
    m = MaxPool3x3(2).apply({}, -jnp.ones((1, 4, 4, 1)))
    assert m.shape == (1, 2, 2, 1) and float(m.max()) == -1.0  # padding never wins


def test_zero_and_factorized_reduce_shapes():
    x = _x((2, 8, 8, 6))
    assert Zero(2).apply({}, x).shape == (2, 4, 4, 6)
    assert float(jnp.abs(Zero(1).apply({}, x)).max()) == 0.0
    fr = FactorizedReduce(10, affine=False)
    v = jax.eval_shape(lambda: fr.init(jax.random.PRNGKey(0), x, False))
    assert jax.eval_shape(lambda v: fr.apply(v, x, False), v).shape == (2, 4, 4, 10)
    assert count_params(v["params"]) == 2 * 6 * 5  # two 1x1 convs 6 -> 5, no BN params
    with pytest.raises(ValueError, match="even C_out"):
        FactorizedReduce(5).init(jax.random.PRNGKey(0), x, False)


def test_op_parameter_counts():
    x = jnp.ones((2, 8, 8, 4))

    def n(name, affine=False, stride=1):
        op = make_op(name, 4, stride, affine)
        return count_params(jax.eval_shape(lambda: op.init(jax.random.PRNGKey(0), x, False)).get("params", {}))

    assert n("sep_conv_3x3") == 2 * (9 * 4 + 4 * 4)  # the separable block is applied twice
    assert n("sep_conv_5x5") == 2 * (25 * 4 + 4 * 4)
    assert n("dil_conv_3x3") == 9 * 4 + 4 * 4  # applied once
    assert n("dil_conv_5x5", affine=True) == 25 * 4 + 4 * 4 + 2 * 4  # affine BN adds scale and bias
    assert n("skip_connect") == 0 and n("skip_connect", stride=2) == 2 * 4 * 2
    assert n("max_pool_3x3") == n("avg_pool_3x3") == n("none") == 0
    with pytest.raises(ValueError, match="unknown op"):
        make_op("conv_9x9", 4, 1, False)


# ----------------------------------------------------------------------------- supernet


def test_search_network_shapes(tiny_search):
    net, x, v = tiny_search
    assert set(v) == {"params", "arch", "batch_stats"}
    assert v["arch"]["alphas_normal"].shape == (2 + 3, len(TINY_PRIMS))
    assert v["arch"]["alphas_reduce"].shape == (2 + 3, len(TINY_PRIMS))
    full = jax.eval_shape(lambda: net.clone(steps=4, multiplier=4).init(jax.random.PRNGKey(0), x))
    assert full["arch"]["alphas_normal"].shape == full["arch"]["alphas_reduce"].shape == (14, len(TINY_PRIMS))
    assert jax.jit(lambda v, x: net.apply(v, x))(v, x).shape == (4, 5)
    logits, upd = jax.eval_shape(lambda: net.apply(v, x, train=True, mutable=["batch_stats"]))
    assert logits.shape == (4, 5) and set(upd) == {"batch_stats"}
    steps3 = DartsSearchNetwork(C=4, num_classes=5, layers=2, steps=3, multiplier=3, primitives=("skip_connect",))
    v3 = jax.eval_shape(lambda: steps3.init(jax.random.PRNGKey(0), x))
    assert v3["arch"]["alphas_reduce"].shape == (2 + 3 + 4, 1)


def test_arch_gradient_nonzero_and_finite(tiny_search):
    net, x, v = tiny_search
    y = jnp.arange(4) % 5

    def loss(arch):
        logits, _ = net.apply({**v, "arch": arch}, x, train=True, mutable=["batch_stats"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    g = jax.jit(jax.grad(loss))(v["arch"])
    for name in ("alphas_normal", "alphas_reduce"):
        assert bool(jnp.all(jnp.isfinite(g[name]))) and float(jnp.abs(g[name]).max()) > 0


def _only(tree, keep):
    """Drop the op sub-trees of a MixedOp not named in ``keep`` (recursively)."""
    if not isinstance(tree, dict):
        return tree
    ops = {p for p in PRIMITIVES} | {f"{p}_bn" for p in PRIMITIVES}
    return {k: _only(v, keep) for k, v in tree.items() if k not in ops or k in keep}


def test_one_hot_arch_weights_equal_single_op_network(tiny_search, tiny_train):
    net, x, v = tiny_search
    k = TINY_PRIMS.index("dil_conv_3x3")
    one_hot = jnp.zeros((5, len(TINY_PRIMS))).at[:, k].set(1.0)
    got, _ = tiny_train(v, x, jnp.ones((4,), bool), {"normal": one_hot, "reduce": one_hot})
    single = net.clone(primitives=("dil_conv_3x3",))
    keep = {"dil_conv_3x3"}
    vs = {"params": _only(v["params"], keep), "batch_stats": _only(v["batch_stats"], keep),
          "arch": jax.tree_util.tree_map(lambda a: a[:, k:k + 1], v["arch"])}
    want, _ = jax.jit(lambda v, x: single.apply(v, x, train=True, mutable=["batch_stats"]))(vs, x)
    _close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="arch_weights"):
        net.apply(v, x, arch_weights={"normal": one_hot[:3], "reduce": one_hot})


def test_mixed_op_one_hot_is_that_op():
    x = _x((4, 8, 8, 4))
    mixed = MixedOp(4, 2, ("none", "avg_pool_3x3", "skip_connect"))
    v = _fake_init(mixed, x, jnp.ones(3) / 3)
    y = mixed.apply(v, x, jnp.array([0.0, 0.0, 1.0]), True, mutable=["batch_stats"])[0]
    fr = FactorizedReduce(4, affine=False)
    want = fr.apply({"params": v["params"]["skip_connect"], "batch_stats": v["batch_stats"]["skip_connect"]},
                    x, True, mutable=["batch_stats"])[0]
    _close(y, want)
    assert float(jnp.abs(mixed.apply(v, x, jnp.array([1.0, 0.0, 0.0]), False)).max()) == 0.0


def test_masked_batch_norm_ignores_padded_examples(tiny_search, tiny_train):
    net, x, v = tiny_search
    w = {k: jax.nn.softmax(v["arch"][f"alphas_{k}"], axis=-1) for k in ("normal", "reduce")}
    mask = jnp.array([True, True, False, False])
    a, ua = tiny_train(v, x.at[2:].set(1e3), mask, w)
    b, ub = tiny_train(v, x.at[2:].set(-7.0), mask, w)
    _close(a[:2], b[:2], rtol=1e-5, atol=1e-5)  # padded rows never enter batch statistics
    _close(ua, ub, rtol=1e-5, atol=1e-6)
    c, uc = tiny_train(v, x, jnp.ones((4,), bool), w)
    assert float(jnp.abs(c[:2] - a[:2]).max()) > 1e-3  # ...while real rows do
    want, _ = jax.eval_shape(lambda: net.apply(v, x, train=True, mutable=["batch_stats"]))
    assert want.shape == a.shape


def test_scanned_cells_and_edges_equal_unrolled():
    """layers=10 has a scanned pair of cells (8, 9); every cell scans its edges."""
    net = DartsSearchNetwork(C=2, num_classes=3, layers=10, steps=2, multiplier=2, primitives=("skip_connect",))
    ref = net.clone(scan_cells=False, scan_edges=False)
    x = _x((2, 8, 8, 3))
    v = _fake_init(net, x)
    assert "cells_8_9" in v["params"] and "input_edges" in v["params"]["cell_3"]
    vr = {"params": unroll_variables(v["params"]), "batch_stats": unroll_variables(v["batch_stats"]),
          "arch": v["arch"]}
    assert (jax.tree_util.tree_structure(vr["params"])
            == jax.tree_util.tree_structure(jax.eval_shape(lambda: ref.init(jax.random.PRNGKey(0), x))["params"]))
    assert count_params(v["params"]) == count_params(vr["params"])

    def run(n, variables):
        return jax.jit(lambda v, x: n.apply(v, x, train=True, mutable=["batch_stats"]))(variables, x)

    (oa, ua), (ob, ub) = run(net, v), run(ref, vr)
    _close(oa, ob, rtol=1e-4, atol=1e-4)
    _close(unroll_variables(ua["batch_stats"]), ub["batch_stats"], rtol=1e-4, atol=1e-5)


# Parameter counts of the full-size networks (params collection only), through eval_shape.
@pytest.mark.parametrize("make,classes,expected,tol", [
    (lambda n: DartsSearchNetwork(16, n, 8), 10, 1.93e6, 5e3),  # FedNAS Table 2 (1.95M with 100 classes)
    (lambda n: DartsSearchNetwork(16, n, 8, primitives=PRIMITIVES_S2), 10, 0.67e6, 5e3),
    (lambda n: DartsNetwork(DARTS_V2, 36, n, 20), 10, 3.349e6, 5e3),  # DARTS reports 3.3M
])
def test_parameter_counts(make, classes, expected, tol):
    net = make(classes)
    v = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3)), train=False))
    n = count_params(v["params"])
    assert abs(n - expected) <= tol, n
    if isinstance(net, DartsSearchNetwork) and net.primitives == PRIMITIVES:
        width = v["params"]["classifier"]["kernel"].shape[0]
        assert abs(n + 90 * (width + 1) - 1.95e6) <= tol  # the same supernet with 100 classes


def test_auxiliary_head_adds_parameters():
    def n(aux):
        net = DartsNetwork(DARTS_V2, 36, 10, 3, auxiliary=aux)  # same head as with 20 cells
        return count_params(jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3))))["params"])

    # ReLU-pool-1x1 conv 576->128, BN, 2x2 conv 128->768, BN, linear 768->10
    assert n(True) - n(False) == 576 * 128 + 2 * 128 + 4 * 128 * 768 + 2 * 768 + 768 * 10 + 10


# ----------------------------------------------------------------------------- genotypes


def _hand_alphas():
    """Hand-made alphas (PRIMITIVES order: none, max, avg, skip, sep3, sep5, dil3, dil5)."""
    a = np.zeros((14, 8))
    a[0, 0], a[0, 4] = 10.0, 2.0  # node 0: 'none' is the top weight -> still sep_conv_3x3, weak edge
    a[1, 3] = 1.0
    a[2, 5], a[3, 2], a[4, 1] = 3.0, 3.0, 3.0  # node 1: a three-way tie -> inputs 0 and 1
    a[5, 1], a[5, 2] = 4.0, 4.0  # op tie -> the earlier op (max_pool)
    a[8, 3] = 5.0  # node 2: strongest edge from node 1 (input 3)
    return a  # node 3: all zero -> inputs 0, 1 with the first non-none op


def test_derive_hand_made_alphas():
    g = derive(_hand_alphas(), _hand_alphas())
    assert g.normal == (
        ("skip_connect", 1), ("sep_conv_3x3", 0),
        ("sep_conv_5x5", 0), ("avg_pool_3x3", 1),
        ("skip_connect", 3), ("max_pool_3x3", 0),
        ("max_pool_3x3", 0), ("max_pool_3x3", 1),
    )
    assert g.reduce == g.normal and g.normal_concat == (2, 3, 4, 5)
    e = np.exp(_hand_alphas())  # float64: float32 softmax rounds tied rows differently
    w = e / e.sum(axis=1, keepdims=True)
    assert derive_from_weights(w, w) == g


def test_derive_without_none_and_other_steps():
    a = np.zeros((5, 2))
    a[0, 1], a[2, 0], a[4, 1] = 1.0, 2.0, 3.0
    g = derive(a, a, primitives=PRIMITIVES_S2, steps=2, multiplier=2)
    assert g.normal == (("sep_conv_3x3", 0), ("skip_connect", 1), ("sep_conv_3x3", 2), ("skip_connect", 0))
    with pytest.raises(ValueError, match="shape"):
        derive(a, a)


def test_derive_from_supernet(tiny_search):
    _, _, v = tiny_search
    g = derive(v["arch"]["alphas_normal"], v["arch"]["alphas_reduce"], TINY_PRIMS, steps=2, multiplier=2)
    assert len(g.normal) == len(g.reduce) == 4 and g.normal_concat == (2, 3)
    assert all(op in TINY_PRIMS for op, _ in g.normal + g.reduce)


def test_genotype_json_round_trip_and_hash():
    for g in (DARTS_V1, DARTS_V2, FEDNAS_V1):
        assert Genotype.from_json(g.to_json()) == g
        assert Genotype.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    assert len({DARTS_V2, Genotype.from_json(DARTS_V2.to_json()), DARTS_V1}) == 2
    from_lists = Genotype([list(p) for p in DARTS_V2.normal], [2, 3, 4, 5], list(DARTS_V2.reduce), [2, 3, 4, 5])
    assert from_lists == DARTS_V2 and hash(from_lists) == hash(DARTS_V2)
    assert DARTS_V2.normal[7] == ("dil_conv_3x3", 2) and DARTS_V1.reduce[7] == ("avg_pool_3x3", 0)
    with pytest.raises(ValueError, match="can only read"):
        Genotype((("skip_connect", 2), ("skip_connect", 0)), (2,), DARTS_V2.reduce, (2,))
    with pytest.raises(ValueError, match="unknown op"):
        Genotype((("conv_9x9", 0), ("skip_connect", 0)), (2,), DARTS_V2.reduce, (2,))


# ----------------------------------------------------------------------------- evaluation network


def test_eval_network_train_eval_aux_and_drop_path():
    net = DartsNetwork(DARTS_V2, C=4, num_classes=3, layers=3, auxiliary=True, drop_path_prob=0.3)
    x = _x((2, 32, 32, 3))
    v = _fake_init(net, x)
    assert "auxiliary_head" in v["params"]  # created at init even though init runs in eval mode
    tr = jax.jit(lambda v, x, k: net.apply(v, x, train=True, rngs={"dropout": k}, mutable=["batch_stats"])[0])
    ev = jax.eval_shape(lambda: net.apply(v, x))  # eval mode: logits only, no dropout rng needed
    assert ev.shape == (2, 3)
    (l1, a1), (l2, _) = tr(v, x, jax.random.PRNGKey(1)), tr(v, x, jax.random.PRNGKey(2))
    assert l1.shape == a1.shape == (2, 3)
    assert float(jnp.abs(l1 - l2).max()) > 0  # drop path depends on the dropout rng
    no_aux = net.clone(auxiliary=False, drop_path_prob=0.0)
    v2 = _fake_init(no_aux, x)
    assert "auxiliary_head" not in v2["params"]
    out, _ = jax.eval_shape(lambda: no_aux.apply(v2, x, train=True, mutable=["batch_stats"]))  # no rng needed
    assert out.shape == (2, 3)


def test_drop_path_statistics():
    x = jnp.ones((4000, 1, 1, 1))
    y = drop_path(x, 0.25, jax.random.PRNGKey(0))
    y = np.asarray(y)
    assert np.all((y == 0) | np.isclose(y, 1 / 0.75))
    assert abs(float(y.mean()) - 1.0) < 0.05


def test_drop_path_skips_identity_ops():
    ident = Genotype([("skip_connect", 0), ("skip_connect", 1)] * 4, (2, 3, 4, 5), DARTS_V2.reduce, (2, 3, 4, 5))
    cell = EvalCell(ident, C=2, reduction=False, reduction_prev=False)
    s = _x((3, 4, 4, 2))
    v = _fake_init(cell, s, s)

    def run(k):
        return cell.apply(v, s, s, True, None, 0.9, rngs={"dropout": k}, mutable=["batch_stats"])[0]

    _close(run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(2)))


# ----------------------------------------------------------------------------- plots


def test_plots_written_and_deterministic(tmp_path):
    a, b = plot_genotype(DARTS_V2, tmp_path / "darts_v2")
    assert a.endswith("darts_v2_normal.png") and b.endswith("darts_v2_reduce.png")
    for p in (a, b):
        data = open(p, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    again = plot_cell(DARTS_V2, "normal", tmp_path / "again.png")
    assert open(again, "rb").read() == open(a, "rb").read()
    with pytest.raises(ValueError, match="kind"):
        plot_cell(DARTS_V2, "other", tmp_path / "x.png")
