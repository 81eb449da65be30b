"""The elastic MobileNetV3 choice space (search_spaces/elastic): a subnet under a traced
choice equals a child network built by hand from sliced weights (plain convolutions,
eval and train mode, BatchNorm statistics included); costs equal the variable mask's
count, the child's weight count and its traced multiply-adds / conv outputs; gradients
and statistics stay inside the variable mask; bad input fails with one line.

Everything runs on the "tiny" preset; the two compiled programs (eval forward, train
step with gradient) are shared by the module and traced once for every choice.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxfednas.cost import count_conv_outputs, count_macs, count_params
from jaxfednas.search_spaces.choice import check_space
from jaxfednas.search_spaces.elastic import ElasticMobileNet, SPACES

IMAGE = (8, 8, 1)
CLASSES = 10
BATCH = 6
DN = ("NHWC", "HWIO", "NHWC")
ACT = {"relu": jax.nn.relu, "hswish": jax.nn.hard_swish}


@pytest.fixture(scope="module")
def space():
    return ElasticMobileNet.from_preset("tiny", num_classes=CLASSES, image_shape=IMAGE)


@pytest.fixture(scope="module")
def setup(space):
    """Variables with random BatchNorm affine parameters and running statistics (so the
    eval-mode comparison reads them), a batch with two padded examples, and the jitted
    programs, each taking the choice as a traced argument."""
    k_init, k_x, k_bn = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k_x, (BATCH,) + IMAGE)
    v = jax.jit(lambda k1, k2: {c: randomize_bn(t, jax.random.fold_in(k2, n))
                                 for n, (c, t) in enumerate(space.init(k1, x[:1]).items())})(k_init, k_bn)
    mask = jnp.array([True, True, False, True, True, False])
    y = jnp.arange(BATCH) % CLASSES

    def eval_fn(variables, choice):
        return space.subnet(choice).apply(variables, x, train=False)

    def step_fn(variables, choice):
        def loss(params):
            logits, new = space.subnet(choice).apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                                                     train=True, mask=mask, mutable=["batch_stats"])
            ce = -jax.nn.log_softmax(logits)[jnp.arange(BATCH), y] * mask
            return ce.sum() / mask.sum(), (logits, new["batch_stats"])

        (_, (logits, stats)), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        return logits, stats, grads

    return {"x": x, "v": v, "mask": mask, "y": y, "eval": jax.jit(eval_fn), "step": jax.jit(step_fn),
            "vmask": jax.jit(space.variable_mask)}


def randomize_bn(tree, key):
    """BatchNorm scale / shift / running statistics moved off their initial 1 and 0."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for n, (path, a) in enumerate(flat):
        k, name = jax.random.fold_in(key, n), path[-1].key
        if name == "var":
            a = 0.5 + jax.random.uniform(k, a.shape)
        elif name in ("mean", "scale", "bias"):
            a = a + 0.3 * jax.random.normal(k, a.shape)
        out.append(a)
    return jax.tree.unflatten(treedef, out)


def choices(space) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    k = np.array([len(d.choices) for d in space.dims])
    return [space.smallest_choice(), space.largest_choice()] + [rng.integers(0, k).astype(np.int32) for _ in range(2)]


# ---- the hand-built child: sliced weights, plain convolutions ---------------------------


def child_variables(space, variables, choice) -> tuple[dict, dict]:
    """The child network's own weights and statistics, sliced out of the supernet's."""
    arch, g = space.describe(choice), space.geometry
    P, S = variables["params"], variables["batch_stats"]
    cp, cs = {"stem": P["stem"]}, {"stem": S["stem"]}
    w_in = g.stem_channels
    for i in range(1, len(g.stages) + 1):
        d, k, e, w = (arch[f"stage{i}.{f}"] for f in ("depth", "kernel", "expand", "width"))
        for j in range(1, d + 1):
            p, s = P[f"stage{i}"][f"block{j}"], S[f"stage{i}"][f"block{j}"]
            h, c = e * w_in, (p["dw"]["kernel"].shape[0] - k) // 2
            first = lambda t, n: {name: a[:n] for name, a in t.items()}  # noqa: E731
            cp[f"stage{i}/block{j}"] = {
                "expand": p["expand"]["kernel"][:w_in, :h], "expand_bn": first(p["expand_bn"], h),
                "dw": p["dw"]["kernel"][c:c + k, c:c + k, :, :h], "dw_bn": first(p["dw_bn"], h),
                "project": p["project"]["kernel"][:h, :w], "project_bn": first(p["project_bn"], w)}
            cs[f"stage{i}/block{j}"] = {n: first(s[n], h if n != "project_bn" else w) for n in s}
            w_in = w
    cp["head"] = {"conv": P["head"]["conv"]["kernel"][:w_in], "bn": P["head"]["bn"],
                  "classifier": P["head"]["classifier"]}
    cs["head"] = S["head"]
    return cp, cs


def child_forward(space, cp, cs, x, *, train, mask=None, sizes=None):
    """``(logits, new child statistics)``; appends every conv/matmul output's size per
    example to ``sizes``."""
    g = space.geometry
    mask = jnp.ones(x.shape[0], bool) if mask is None else mask
    new = {}

    def conv(y, w, stride=1, groups=1):
        k = w.shape[0]
        out = lax.conv_general_dilated(y, w, (stride, stride), ((k // 2, k // 2),) * 2, dimension_numbers=DN,
                                       feature_group_count=groups)
        if sizes is not None:
            sizes.append(out[0].size)
        return out

    def bn(y, p, s):
        if not train:
            return (y - s["mean"]) / jnp.sqrt(s["var"] + 1e-5) * p["scale"] + p["bias"], s
        m = mask.astype(y.dtype)[:, None, None, None]
        n = m.sum() * y.shape[1] * y.shape[2]
        mean = (y * m).sum((0, 1, 2)) / n
        var = (((y - mean) ** 2) * m).sum((0, 1, 2)) / n
        s = {"mean": 0.9 * s["mean"] + 0.1 * mean, "var": 0.9 * s["var"] + 0.1 * var}
        return (y - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"], s

    y = conv(x, cp["stem"]["conv"]["kernel"], g.stem_stride)
    y, s = bn(y, cp["stem"]["bn"], cs["stem"]["bn"])
    new["stem"] = {"bn": s}
    y = ACT[g.stem_act](y)
    for i, st in enumerate(g.stages, 1):
        j = 1
        while f"stage{i}/block{j}" in cp:
            p, s, out = cp[f"stage{i}/block{j}"], cs[f"stage{i}/block{j}"], {}
            z, out["expand_bn"] = bn(conv(y, p["expand"][None, None]), p["expand_bn"], s["expand_bn"])
            z = ACT[st.act](z)
            z, out["dw_bn"] = bn(conv(z, p["dw"], st.stride if j == 1 else 1, groups=z.shape[-1]), p["dw_bn"], s["dw_bn"])
            z = ACT[st.act](z)
            z, out["project_bn"] = bn(conv(z, p["project"][None, None]), p["project_bn"], s["project_bn"])
            y = z if j == 1 else y + z
            new[f"stage{i}/block{j}"] = out
            j += 1
    z, s = bn(conv(y, cp["head"]["conv"][None, None]), cp["head"]["bn"], cs["head"]["bn"])
    new["head"] = {"bn": s}
    z = ACT[g.head_act](z).mean((1, 2))
    logits = z @ cp["head"]["classifier"]["kernel"]
    if sizes is not None:
        sizes.append(logits[0].size)
    return logits + cp["head"]["classifier"]["bias"], new


def scatter_stats(stats, child_stats) -> dict:
    """The supernet's statistics with the child's written into their leading entries."""
    out = jax.tree.map(np.array, stats)
    for name, blk in child_stats.items():
        target = out[name] if "/" not in name else out[name.split("/")[0]][name.split("/")[1]]
        for bn_name, s in blk.items():
            for k, a in s.items():
                target[bn_name][k][: a.shape[0]] = np.asarray(a)
    return out


def assert_tree_close(a, b, **kw):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw), a, b)


# ---- tests ------------------------------------------------------------------------------------


def test_protocol_and_dims(space):
    check_space(space)
    assert space.single_path
    assert [d.name for d in space.dims[:4]] == ["stage1.depth", "stage1.kernel", "stage1.expand", "stage1.width"]
    assert len(space.dims) == 4 * len(SPACES["tiny"].stages)
    assert space.describe(space.largest_choice()) == {
        "stage1.depth": 2, "stage1.kernel": 5, "stage1.expand": 4, "stage1.width": 16,
        "stage2.depth": 2, "stage2.kernel": 5, "stage2.expand": 4, "stage2.width": 24}


def test_traced_subnet_equals_hand_built_child(space, setup):
    """Eval and train mode, logits and the whole statistics tree, for min, max and
    random subnets, all through the same two compiled programs."""
    v, x, mask = setup["v"], setup["x"], setup["mask"]
    # the hand-built child compiled whole per subnet (eagerly: ~150 small programs)
    forward = jax.jit(functools.partial(child_forward, space), static_argnames="train")
    for c in choices(space):
        cp, cs = child_variables(space, v, c)
        want, _ = forward(cp, cs, x, train=False)
        np.testing.assert_allclose(setup["eval"](v, jnp.asarray(c)), want, rtol=1e-4, atol=1e-4, err_msg=str(c))
        logits, stats, _ = setup["step"](v, jnp.asarray(c))
        want, want_stats = forward(cp, cs, x, train=True, mask=mask)
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4, err_msg=str(c))
        assert_tree_close(stats, scatter_stats(v["batch_stats"], want_stats), rtol=1e-5, atol=1e-5)


def test_gradient_equals_hand_built_child(space, setup):
    """The supernet gradient of the subnet's loss is the child's gradient, scattered."""
    v, x, mask, y = setup["v"], setup["x"], setup["mask"], setup["y"]
    c = choices(space)[2]
    _, _, grads = setup["step"](v, jnp.asarray(c))
    cp, cs = child_variables(space, v, c)

    def loss(cp):
        logits, _ = child_forward(space, cp, cs, x, train=True, mask=mask)
        return (-jax.nn.log_softmax(logits)[jnp.arange(BATCH), y] * mask).sum() / mask.sum()

    want = jax.jit(jax.grad(loss))(cp)
    got, _ = child_variables(space, {"params": grads, "batch_stats": v["batch_stats"]}, c)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-6)


def test_costs_are_exact(space, setup):
    v = setup["v"]
    x1 = setup["x"][:1]
    grouped = ElasticMobileNet.from_preset("tiny", num_classes=CLASSES, image_shape=IMAGE, dw_impl="grouped")
    for c in choices(space):
        cost = space.cost(c)
        keep = space.variable_mask(c, v)["params"]
        n_mask = sum(int(np.broadcast_to(m, p.shape).sum()) for m, p in zip(jax.tree.leaves(keep), jax.tree.leaves(v["params"])))
        cp, cs = child_variables(space, v, c)
        assert cost.params == n_mask == count_params(cp), c
        fwd = lambda cp, x: child_forward(space, cp, cs, x, train=False)[0]  # noqa: E731
        assert cost.macs == count_macs(fwd, cp, x1), c
        # a concrete choice traces the child alone: its multiply-adds are exact too
        assert cost.macs == count_macs(lambda v, x: grouped.subnet(c).apply(v, x), v, x1), c
        sizes = []
        child_forward(space, cp, cs, x1, train=False, sizes=sizes)
        assert cost.activation_floats == sum(sizes) == count_conv_outputs(fwd, cp, x1), c
    small, large = space.cost(space.smallest_choice()), space.cost(space.largest_choice())
    assert small.params < large.params and small.macs < large.macs and small.activation_floats < large.activation_floats


def test_gradient_and_statistics_stay_inside_the_variable_mask(space, setup):
    v = setup["v"]
    for c in choices(space):
        _, stats, grads = setup["step"](v, jnp.asarray(c))
        keep = setup["vmask"](jnp.asarray(c), v)
        assert_tree_close(keep, space.variable_mask(c, v), rtol=0, atol=0)  # traced == concrete
        for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(keep["params"])):
            m = np.broadcast_to(np.asarray(m), g.shape)
            assert np.all(np.asarray(g)[m == 0] == 0.0), c
            assert not m.any() or np.any(np.asarray(g)[m == 1] != 0.0), c
        for new, old, m in zip(jax.tree.leaves(stats), jax.tree.leaves(v["batch_stats"]),
                               jax.tree.leaves(keep["batch_stats"])):
            m = np.broadcast_to(np.asarray(m), new.shape)
            assert np.array_equal(np.asarray(new)[m == 0], np.asarray(old)[m == 0]), c
            assert np.all(np.asarray(new)[m == 1] != np.asarray(old)[m == 1]), c


def test_no_retrace_across_choices(space, setup, count_traces):
    v = setup["v"]
    setup["step"](v, jnp.asarray(space.largest_choice()))
    with count_traces() as traced:
        for c in choices(space):
            jax.block_until_ready(setup["step"](v, jnp.asarray(c)))
    assert traced == []


def test_bad_input_one_line_errors(space, setup):
    v, x = setup["v"], setup["x"]
    bad = space.largest_choice().copy()
    bad[5] = 7
    cases = [
        (lambda: space.subnet(bad), re.escape("dimension 5 (stage2.kernel) has 2 choices, got index 7")),
        (lambda: space.cost(np.zeros(3, np.int32)), "8 integer choices"),
        (lambda: space.variable_mask(np.zeros(8, np.float32), v), "8 integer choices"),
        (lambda: jax.jit(lambda c: space.subnet(c).apply(v, x))(jnp.zeros(7, jnp.int32)), "8 integer choices"),
        (lambda: space.subnet(space.largest_choice()).apply(v, jnp.zeros((2, 9, 8, 1))), "takes \\[B, 8, 8, 1\\]"),
        (lambda: ElasticMobileNet.from_preset("huge", num_classes=10, image_shape=IMAGE), "unknown elastic"),
        (lambda: ElasticMobileNet.from_preset("tiny", num_classes=10, image_shape=(8, 8)), "image_shape"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            fn()
        assert "\n" not in str(e.value)


def test_depthwise_taps_matches_grouped_convolution():
    """The CPU depthwise form (hand-written backward) against a grouped convolution:
    values and both gradients, 7x7 kernel, stride 2, odd input size."""
    from jaxfednas.search_spaces.elastic import depthwise_taps

    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, (2, 7, 7, 3)), jax.random.normal(kw, (7, 7, 1, 3))

    def grouped(x, w):
        return lax.conv_general_dilated(x, w, (2, 2), ((3, 3), (3, 3)), dimension_numbers=DN, feature_group_count=3)

    g = jax.random.normal(kg, grouped(x, w).shape)

    @jax.jit
    def both(x, w, g):
        out = []
        for f in (grouped, lambda x, w: depthwise_taps(x, w, 2)):
            y, vjp = jax.vjp(f, x, w)
            out.append((y, *vjp(g)))
        return out

    got, want = both(x, w, g)[::-1]
    assert_tree_close(got, want, rtol=1e-5, atol=1e-5)
