"""The ShuffleNetV2 choice-block space: unit shapes, child == supernet on its path,
parameter counts and multiply-adds against hand formulas, architecture type."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.cost import count_macs
from jaxfednas.search_spaces.shufflenet import (
    build,
    channel_split,
    child_cost,
    child_variables,
    derive,
    get_space,
    macs_table,
    ShuffleArch,
    ShuffleNetwork,
    ShuffleSpace,
    ShuffleUnit,
    SPACES,
    uniform_arch,
)


def test_channel_split_is_spos_shuffle():
    x = jnp.arange(8.0).reshape(1, 1, 1, 8)
    even, odd = channel_split(x)
    np.testing.assert_array_equal(np.asarray(even).ravel(), [0, 2, 4, 6])
    np.testing.assert_array_equal(np.asarray(odd).ravel(), [1, 3, 5, 7])


@pytest.mark.parametrize("cand", ["k3", "k5", "k7", "xception"])
@pytest.mark.parametrize("first,stride", [(True, 2), (False, 1)])
def test_unit_shapes_passthrough_and_macs(cand, first, stride):
    inp, oup, hw = (8, 16, 8) if first else (8, 16, 8)
    cin = inp if first else oup
    unit = ShuffleUnit(cand, inp, oup, stride, first, dw_impl="grouped")
    x = jax.random.normal(jax.random.key(0), (2, hw, hw, cin))
    v = unit.init(jax.random.key(1), x)
    y = unit.apply(v, x)
    ho = hw // stride
    assert y.shape == (2, ho, ho, oup)
    if not first:  # the even channels pass through untouched
        np.testing.assert_array_equal(np.asarray(y[..., :oup // 2]), np.asarray(x[..., 0::2]))
    # multiply-adds by hand (ShuffleNetV2 unit, mid = oup / 2, main output oup - inp)
    mid, out, k = oup // 2, oup - inp, {"k3": 3, "k5": 5, "k7": 7, "xception": 3}[cand]
    hi, o = hw * hw, ho * ho
    if cand == "xception":
        main = o * 9 * inp + o * inp * mid + o * 9 * mid + o * mid * mid + o * 9 * mid + o * mid * out
    else:
        main = hi * inp * mid + o * k * k * mid + o * mid * out
    proj = (o * k * k * inp + o * inp * inp) if first else 0
    assert count_macs(lambda v, x: unit.apply(v, x), v, x[:1]) == main + proj


def test_space_geometry_and_paper_sizes():
    cs = SPACES["cross_silo"]
    assert cs.num_blocks == 20 and cs.num_candidates == 4  # 4^20
    cd = SPACES["cross_device"]
    assert cd.num_blocks == 12 and cd.num_candidates == 3  # 3^12
    assert cs.downsampling() == 8  # 32x32 -> 4x4 at the last stage
    k3 = child_cost(uniform_arch("cross_silo", "k3"), 10, (32, 32, 3))
    assert 2.0e6 < k3["params"] < 2.2e6  # the paper's "2.1M"
    # the SPOS/DSNAS ImageNet space: children span ~290M-360M multiply-adds (SPOS' range)
    lo = child_cost(uniform_arch("imagenet", "k3"), 1000, (224, 224, 3))["macs"]
    hi = child_cost(uniform_arch("imagenet", "xception"), 1000, (224, 224, 3))["macs"]
    assert 285e6 < lo < 300e6 and 350e6 < hi < 365e6
    with pytest.raises(ValueError, match="multiples of 4"):
        ShuffleSpace("bad", ("k3",), (1,), (6,), (1,))
    with pytest.raises(ValueError, match="unknown ShuffleNet space"):
        get_space("nope")


def test_child_equals_supernet_on_its_path_and_counts():
    space = SPACES["tiny"]
    net = ShuffleNetwork(space, 10, dw_impl="grouped")
    x = jax.random.normal(jax.random.key(1), (6, 8, 8, 1))
    # every init and apply compiled whole (eagerly their ops compile ~130 small programs: ~6 s)
    v = jax.jit(net.init)(jax.random.key(0), x)
    assert v["arch"]["alpha"].shape == (3, 4)
    assert abs(float(v["arch"]["alpha"].mean()) - 1.0) < 0.02  # N(1, 0.01)
    arch = ShuffleArch("tiny", (3, 1, 2))
    child = build(arch, 10, dw_impl="grouped")
    cv = child_variables(v, arch)
    for train in (False, True):
        mutable = ["batch_stats"] if train else False
        ys = jax.jit(lambda v: net.apply(v, x, jnp.array(arch.choices), train=train, mutable=mutable))(v)
        yc = jax.jit(lambda cv: child.apply(cv, x, train=train, mutable=mutable))(cv)
        ys, yc = (ys[0], yc[0]) if train else (ys, yc)
        np.testing.assert_allclose(np.asarray(ys), np.asarray(yc), rtol=1e-5, atol=1e-6)
    # the child holds exactly its units' weights
    n_child = sum(l.size for l in jax.tree.leaves(cv["params"]))
    assert n_child == child_cost(arch, 10, (8, 8, 1))["params"]
    n_super = sum(l.size for l in jax.tree.leaves(v["params"]))
    assert n_super > 2 * n_child
    # all-paths mode computes the same function
    allp = ShuffleNetwork(space, 10, dw_impl="grouped", all_paths=True)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda v: allp.apply(v, x, jnp.array(arch.choices)))(v)),
                               np.asarray(jax.jit(lambda v: net.apply(v, x, jnp.array(arch.choices)))(v)),
                               rtol=1e-5, atol=1e-6)


def test_gates_scale_block_outputs():
    net = ShuffleNetwork(SPACES["tiny"], 10, dw_impl="grouped")
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    v = net.init(jax.random.key(0), x)
    path = jnp.array([0, 1, 2])
    base = net.apply(v, x, path, jnp.ones(3))
    np.testing.assert_allclose(np.asarray(base), np.asarray(net.apply(v, x, path)), rtol=1e-6)
    # a zero gate on the last block removes its contribution -> the head sees zeros
    zero_last = net.apply(v, x, path, jnp.array([1.0, 1.0, 0.0]))
    assert not np.allclose(np.asarray(zero_last), np.asarray(base))


def test_arch_type_derive_and_json():
    alpha = np.array([[0.1, 0.5, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    arch = derive(alpha, "tiny")
    assert arch.choices == (1, 0, 3)  # tie -> lower index
    assert arch.names == ("k5", "k3", "xception")
    assert ShuffleArch.from_json(arch.to_json()) == arch
    assert hash(arch) == hash(ShuffleArch("tiny", [1, 0, 3]))
    with pytest.raises(ValueError, match="needs 3 indices"):
        ShuffleArch("tiny", (0, 1))
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        ShuffleArch("tiny", (0, 1, 4))
    with pytest.raises(ValueError, match="not in space"):
        uniform_arch("cross_device", "xception")


def test_shufflenetv2_models_are_each_spaces_all_k3_child():
    from jaxfednas.search_spaces.models import make_model, SHUFFLENET_SPACES

    def arch(name, dataset):
        m = make_model(name, 10, dataset)
        return ShuffleArch(m.space.name, m.choices)

    assert sorted(SHUFFLENET_SPACES) == sorted(SPACES)
    assert arch("shufflenetv2_tiny", "digits") == uniform_arch("tiny", "k3")
    assert arch("shufflenetv2_cross_device", "cifar10") == uniform_arch("cross_device", "k3")
    assert arch("shufflenetv2", "digits") == uniform_arch("small", "k3")  # by the image size
    assert arch("shufflenetv2", "cifar10") == uniform_arch("cross_silo", "k3")
    with pytest.raises(ValueError, match="model must be one of"):
        make_model("shufflenetv2_nope", 10, "digits")


def test_macs_table_sums_to_child_cost():
    """A child's multiply-adds are the fixed stem + head plus one table entry per block;
    on the ImageNet space the entries are DSNAS' own FLOPs table (its network.py)."""
    for space, shape, choices in (("tiny", (8, 8, 1), (3, 0, 2)), ("small", (8, 8, 1), (2, 3, 0, 1, 3, 2, 0))):
        table = macs_table(space, 10, shape)
        assert table.blocks.shape == (get_space(space).num_blocks, 4) and (table.blocks > 0).all()
        want = child_cost(ShuffleArch(space, choices), 10, shape)["macs"]
        assert table.of(choices) == want == table.fixed + sum(table.blocks[l, c] for l, c in enumerate(choices))
    imagenet = macs_table("imagenet", 1000, (224, 224, 3))
    np.testing.assert_array_equal(imagenet.blocks[0], [13396992, 15805440, 19418112, 13146112])
    np.testing.assert_array_equal(imagenet.blocks[8], [30670080, 31673600, 33178880, 21199360])
    np.testing.assert_array_equal(imagenet.blocks[19], [10176320, 10427200, 10803520, 15476160])



# 4 blocks: stage 1 (block 0), stage 2 (block 1 first, then the identical blocks 2 and 3,
# which scan_blocks runs as one lax.scan); two candidates keep the programs small.
SCAN_SPACE = ShuffleSpace("scan_test", ("k3", "xception"), (1, 3), (8, 16), (1, 2), stem_channels=8,
                          last_channels=32)


def _close(a, b):  # float rounding: relative to the largest entry (sums in another order)
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(float(np.abs(b).max(initial=0.0)), 1e-1))


def _compile(fn, *args):
    """(compiled, has a scan): the lowered program's text says whether a loop is left."""
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(), "stablehlo.while" in lowered.as_text()


@pytest.mark.slow
def test_scanned_blocks_equal_unrolled():
    """``scan_blocks``: the identical blocks of a stage as one ``lax.scan`` over their
    stacked variables give the unrolled network's logits, new BatchNorm statistics and
    gradients (w.r.t. weights and block gates) for a random path, train and eval, with
    padded rows masked out; init builds the same variables either way."""
    on = ShuffleNetwork(SCAN_SPACE, 10, dw_impl="grouped", scan_blocks=True)
    off = ShuffleNetwork(SCAN_SPACE, 10, dw_impl="grouped", scan_blocks=False)
    assert on.block_runs() == ((0,), (1,), (2, 3))
    x = jax.random.normal(jax.random.key(1), (6, 8, 8, 1))
    v = off.init(jax.random.key(0), x)
    v_on = on.init(jax.random.key(0), x)
    assert jax.tree.structure(v_on) == jax.tree.structure(v)
    for a, b in zip(jax.tree.leaves(v_on), jax.tree.leaves(v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # distinct running statistics per block, so a block reading its neighbour's would show
    leaves, tdef = jax.tree.flatten(v["batch_stats"])
    stats = tdef.unflatten([s * (1 + 0.5 * u) + 1e-3 * u for s, u in
                            ((s, jax.random.uniform(jax.random.key(i), s.shape)) for i, s in enumerate(leaves))])
    path = jnp.array([1, 0, 1, 0])
    gates = 1.0 + 0.2 * jax.random.normal(jax.random.key(4), (4,))
    mask = jnp.array([True, True, True, True, False, False])
    cot = jax.random.normal(jax.random.key(5), (6, 10))  # random cotangent (see DESIGN: BN sharp edge)

    def loss(model, train):
        def f(params, gates):
            out = model.apply({"params": params, "batch_stats": stats}, x, path, gates, train=train, mask=mask,
                              mutable=["batch_stats"] if train else False)
            logits, new = out if train else (out, {})
            return jnp.sum(logits * cot), (logits, new)
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)

    for train in (True, False):
        (run_on, scanned), (run_off, unrolled) = (_compile(loss(m, train), v["params"], gates) for m in (on, off))
        assert scanned and not unrolled
        (_, (logits, new)), (g_w, g_gate) = run_on(v["params"], gates)
        (_, (logits0, new0)), (g_w0, g_gate0) = run_off(v["params"], gates)
        _close(logits, logits0)
        assert jax.tree.structure(new) == jax.tree.structure(new0)
        if train:  # the scanned blocks' sampled units moved their statistics
            assert not np.allclose(np.asarray(new0["batch_stats"]["block3"]["units_0"]["BatchNorm_0"]["mean"]),
                                   np.asarray(stats["block3"]["units_0"]["BatchNorm_0"]["mean"]))
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new0)):
            _close(a, b)
        assert jax.tree.structure(g_w) == jax.tree.structure(g_w0)
        for a, b in zip(jax.tree.leaves(g_w), jax.tree.leaves(g_w0)):
            _close(a, b)
        assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(g_w0["block2"]["units_1"])) > 0  # sampled unit
        _close(g_gate, g_gate0)
        assert np.abs(np.asarray(g_gate0)).min() > 0


@pytest.mark.slow
def test_scanned_blocks_child_all_paths_and_remat():
    """Children scan runs of equal consecutive choices; ``all_paths`` and ``remat``
    supernets scan too; all equal their unrolled forms (train mode: logits and new
    statistics; remat: gradients as well)."""
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    path = jnp.array([0, 1, 1, 1])
    v = ShuffleNetwork(SCAN_SPACE, 10, dw_impl="grouped").init(jax.random.key(0), x)
    child = {c: {**v[c], **{f"block{l}": {"units_0": v[c][f"block{l}"][f"units_{int(path[l])}"]} for l in range(4)}}
             for c in ("params", "batch_stats")}
    for kw, variables, p in ((dict(choices=tuple(int(c) for c in path)), child, None),
                             (dict(all_paths=True), v, path), (dict(remat=True), v, path)):
        on, off = (ShuffleNetwork(SCAN_SPACE, 10, dw_impl="grouped", scan_blocks=s, **kw) for s in (True, False))
        assert on.block_runs() == ((0,), (1,), (2, 3))

        def f(m):
            def run(params):
                logits, new = m.apply({**variables, "params": params}, x, p, train=True, mutable=["batch_stats"])
                return jnp.sum(logits * jnp.arange(10.0)), (logits, new)
            return jax.value_and_grad(run, has_aux=True) if kw.get("remat") else run

        (run_on, scanned), (run_off, _) = (_compile(f(m), variables["params"]) for m in (on, off))
        assert scanned
        for a, b in zip(jax.tree.leaves(run_on(variables["params"])), jax.tree.leaves(run_off(variables["params"]))):
            _close(a, b)


def test_equal_shaped_blocks_share_one_trace(monkeypatch):
    from jaxfednas.search_spaces.shufflenet import network
    calls = []
    real = network.ChoiceBlock.__call__
    monkeypatch.setattr(network.ChoiceBlock, "__call__", lambda self, *a, **k: calls.append(self.spec) or real(self, *a, **k))
    net = ShuffleNetwork(SCAN_SPACE, 10, dw_impl="grouped")
    x = jnp.zeros((5, 20, 20, 3))  # shapes no other test traces (the trace cache is per process)
    variables = jax.eval_shape(lambda k: net.init(k, x), jax.random.key(0))
    calls.clear()
    path = jnp.zeros(SCAN_SPACE.num_blocks, jnp.int32)
    jax.eval_shape(lambda v: net.apply(v, x, path, train=True, mutable=["batch_stats"]), variables)
    plan = SCAN_SPACE.plan()
    assert len(plan) > len(set(plan))  # the space repeats block shapes ...
    assert sorted(calls) == sorted(set(plan))  # ... and each distinct block is traced once
