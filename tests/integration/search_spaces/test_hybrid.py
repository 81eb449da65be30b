"""The hybrid conv / transformer choice space (NASViT-style, PerFedRLNAS Table 1): a
subnet with a traced choice equals a child network written directly in Flax with the
sliced weights (eval and train, BatchNorm statistics, gradients); costs against
count_params / count_macs / count_conv_outputs of that child and a hand formula;
nothing outside the variable mask is read or updated; one-line errors."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

from jaxfednas.cost import count_conv_outputs, count_macs, count_params
from jaxfednas.search_spaces.choice import check_space
from jaxfednas.search_spaces.hybrid import BN_EPS, BN_MOMENTUM, get_space, HybridViT, LN_EPS, SPACES

SPACE = SPACES["tiny"]
B = 6


class Child(nn.Module):
    """The subnet ``cfg`` (``describe``'s items) of a :class:`HybridViT`, written plainly."""

    space: HybridViT
    cfg: tuple

    @nn.compact
    def __call__(self, x, *, train: bool = False, mask=None):
        sp, v = self.space, dict(self.cfg)
        m = None if mask is None else mask[:, None, None, None]

        def bn(name, h):
            return nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM, epsilon=BN_EPS, name=name)(h, mask=m)

        h = nn.Conv(sp.stem_channels, (3, 3), sp.stem_stride, padding="SAME", use_bias=False, name="stem")(x)
        h = nn.relu(bn("stem_bn", h))
        for i, st in enumerate(sp.conv_stages, 1):
            w, k = v[f"conv{i}.width"], v[f"conv{i}.kernel"]
            h = nn.Conv(w, (3, 3), st.stride, padding="SAME", use_bias=False, name=f"c{i}_entry")(h)
            h = nn.relu(bn(f"c{i}_entry_bn", h))
            for j in range(v[f"conv{i}.depth"]):
                y = nn.Conv(w, (k, k), padding="SAME", use_bias=False, name=f"c{i}_{j}")(h)
                h = nn.relu(h + bn(f"c{i}_{j}_bn", y))
        for t, _st in enumerate(sp.vit_stages, 1):
            e, heads, r = v[f"vit{t}.width"], v[f"vit{t}.heads"], v[f"vit{t}.mlp_ratio"]
            if t == 1:
                h = nn.Conv(e, (sp.patch, sp.patch), sp.patch, padding="VALID", name="patch")(h)
                h = h.reshape(h.shape[0], -1, e) + self.param("pos", nn.initializers.zeros, (sp.num_tokens, e))
            else:
                h = nn.Dense(e, name=f"v{t}_entry")(h)
            for j in range(v[f"vit{t}.depth"]):
                z = nn.LayerNorm(LN_EPS, name=f"v{t}_{j}_ln1")(h)
                h = h + nn.MultiHeadDotProductAttention(heads, qkv_features=heads * sp.head_dim, out_features=e,
                                                        name=f"v{t}_{j}_attn")(z)
                z = nn.LayerNorm(LN_EPS, name=f"v{t}_{j}_ln2")(h)
                z = nn.gelu(nn.Dense(r * e, name=f"v{t}_{j}_fc1")(z), approximate=False)
                h = h + nn.Dense(e, name=f"v{t}_{j}_fc2")(z)
        h = nn.LayerNorm(LN_EPS, name="norm")(h).mean(1)
        return nn.Dense(sp.num_classes, name="head")(h)


def child_variables(sp: HybridViT, cfg: dict, variables: dict) -> dict:
    """The child's variables cut out of the supernet's (first channels / blocks / heads,
    centre kernels), in the child's own layout."""
    P = jax.tree.map(np.asarray, variables["params"])
    S = jax.tree.map(np.asarray, variables["batch_stats"])
    p, s, dh = {}, {}, sp.head_dim

    def bn(name, pp, ss, sl):
        p[name] = {"scale": pp["scale"][sl], "bias": pp["bias"][sl]}
        s[name] = {"mean": ss["mean"][sl], "var": ss["var"][sl]}

    p["stem"] = {"kernel": P["stem"]["conv"]}
    bn("stem_bn", P["stem"]["bn"], S["stem"]["bn"], slice(None))
    c = sp.stem_channels
    for i, st in enumerate(sp.conv_stages, 1):
        w, k, km = cfg[f"conv{i}.width"], cfg[f"conv{i}.kernel"], max(st.kernels)
        pc, sc = P[f"conv{i}"], S[f"conv{i}"]
        p[f"c{i}_entry"] = {"kernel": pc["entry"]["conv"][:, :, :c, :w]}
        bn(f"c{i}_entry_bn", pc["entry"]["bn"], sc["entry"]["bn"], slice(0, w))
        lo = km // 2 - k // 2
        for j in range(cfg[f"conv{i}.depth"]):
            p[f"c{i}_{j}"] = {"kernel": pc["blocks"]["conv"][j, lo:lo + k, lo:lo + k, :w, :w]}
            bn(f"c{i}_{j}_bn", pc["blocks"]["bn"], sc["blocks"]["bn"], (j, slice(0, w)))
        c = w
    for t, _st in enumerate(sp.vit_stages, 1):
        e, heads, r = cfg[f"vit{t}.width"], cfg[f"vit{t}.heads"], cfg[f"vit{t}.mlp_ratio"]
        pv, q = P[f"vit{t}"], heads * dh
        if t == 1:
            p["patch"] = {"kernel": pv["entry"]["kernel"][:, :, :c, :e], "bias": pv["entry"]["bias"][:e]}
            p["pos"] = pv["entry"]["pos"][:, :e]
        else:
            p[f"v{t}_entry"] = {"kernel": pv["entry"]["kernel"][:c, :e], "bias": pv["entry"]["bias"][:e]}
        blk = pv["blocks"]
        for j in range(cfg[f"vit{t}.depth"]):
            for ln in ("ln1", "ln2"):
                p[f"v{t}_{j}_{ln}"] = {"scale": blk[ln]["scale"][j, :e], "bias": blk[ln]["bias"][j, :e]}
            p[f"v{t}_{j}_attn"] = {
                **{n: {"kernel": blk[n]["kernel"][j, :e, :q].reshape(e, heads, dh),
                       "bias": blk[n]["bias"][j, :q].reshape(heads, dh)} for n in ("query", "key", "value")},
                "out": {"kernel": blk["out"]["kernel"][j, :q, :e].reshape(heads, dh, e), "bias": blk["out"]["bias"][j, :e]}}
            p[f"v{t}_{j}_fc1"] = {"kernel": blk["fc1"]["kernel"][j, :e, :r * e], "bias": blk["fc1"]["bias"][j, :r * e]}
            p[f"v{t}_{j}_fc2"] = {"kernel": blk["fc2"]["kernel"][j, :r * e, :e], "bias": blk["fc2"]["bias"][j, :e]}
        c = e
    p["norm"] = {"scale": P["norm"]["scale"][:c], "bias": P["norm"]["bias"][:c]}
    p["head"] = {"kernel": P["head"]["kernel"][:c], "bias": P["head"]["bias"]}
    return {"params": p, "batch_stats": s}


def hand_cost(sp: HybridViT, cfg: dict) -> tuple[int, int]:
    """(MACs, conv/matmul outputs) per example, layer by layer, for the "tiny" geometry."""
    layers = []  # (outputs, contraction length)
    hw = 8 * 8
    layers.append((hw * sp.stem_channels, 9 * 1))
    c = sp.stem_channels
    for i, hw in ((1, 64), (2, 16)):  # conv2 has stride 2: 8x8 -> 4x4
        w, k = cfg[f"conv{i}.width"], cfg[f"conv{i}.kernel"]
        layers.append((hw * w, 9 * c))
        layers += [(hw * w, k * k * w)] * cfg[f"conv{i}.depth"]
        c = w
    n, dh = 4, sp.head_dim  # 4x4 maps, 2x2 patches
    for t in (1, 2):
        e, h, r = cfg[f"vit{t}.width"], cfg[f"vit{t}.heads"], cfg[f"vit{t}.mlp_ratio"]
        layers.append((n * e, (4 if t == 1 else 1) * c))
        for _ in range(cfg[f"vit{t}.depth"]):
            layers += [(n * h * dh, e)] * 3 + [(h * n * n, dh), (n * h * dh, n), (n * e, h * dh),
                                               (n * r * e, e), (n * e, r * e)]
        c = e
    layers.append((sp.num_classes, c))
    return sum(o * k for o, k in layers), sum(o for o, _ in layers)


def _choices(sp):
    k = np.array([len(d.choices) for d in sp.dims])
    rng = np.random.default_rng(0)
    rand = [rng.integers(0, k).astype(np.int32) for _ in range(2)]
    return [np.zeros(len(k), np.int32), (k - 1).astype(np.int32)] + rand


CHOICES = _choices(SPACE)
IDS = ["min", "max", "rand0", "rand1"]


@pytest.fixture(scope="module")
def setup():
    sp = SPACE
    x = jax.random.normal(jax.random.key(0), (B, 8, 8, 1))
    mask = jnp.array([True, True, False, True, True, False])
    v = sp.init(jax.random.key(1), x)
    # distinct values everywhere (scales != 1, running stats != 0 / 1) so a wrong slice shows
    rng = np.random.default_rng(2)  # on the host: op by op, every leaf's draw would compile
    v = jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + rng.uniform(0, 0.3, a.shape).astype(np.float32)), v)

    def loss(params, stats, c):
        logits, new = sp.subnet(c).apply({"params": params, "batch_stats": stats}, x, train=True, mask=mask,
                                         mutable=["batch_stats"])
        return (jnp.sin(logits).sum(-1) * mask).sum(), (logits, new["batch_stats"])

    fns = {
        "eval": jax.jit(lambda v, c: sp.subnet(c).apply(v, x, train=False)),
        "train": jax.jit(lambda v, c: jax.value_and_grad(loss, has_aux=True)(v["params"], v["batch_stats"], c)),
        "mask": jax.jit(lambda v, c: sp.variable_mask(c, v)),
        "cost": jax.jit(jax.vmap(sp.traced_cost)),
    }
    return sp, x, mask, v, fns


def _child(sp, c):
    cfg = sp.describe(c)
    return Child(sp, tuple(cfg.items())), cfg


def _child_outputs(child, cv, x, mask, grad: bool):
    """Eval logits, train logits, new statistics (and the parameter gradient) of the
    child, in one compiled program."""

    def loss(p):
        out, new = child.apply({"params": p, "batch_stats": cv["batch_stats"]}, x, train=True, mask=mask,
                               mutable=["batch_stats"])
        return (jnp.sin(out).sum(-1) * mask).sum(), (out, new["batch_stats"])

    @jax.jit
    def run(cv):
        (_, (logits, stats)), grads = jax.value_and_grad(loss, has_aux=True)(cv["params"]) if grad else \
            ((None, loss(cv["params"])[1]), None)
        return child.apply(cv, x), logits, stats, grads

    return run(cv)


@pytest.mark.parametrize("c", CHOICES, ids=IDS)
def test_subnet_equals_child(setup, c):
    sp, x, mask, v, fns = setup
    child, cfg = _child(sp, c)
    cv = child_variables(sp, cfg, v)
    shapes = jax.eval_shape(lambda: child.init(jax.random.key(0), x))
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(np.shape, cv)
    grad = c is CHOICES[1]  # the child's gradient compiles slowly: compared for the largest subnet
    c_eval, c_logits, c_stats, c_grads = _child_outputs(child, cv, x, mask, grad)

    np.testing.assert_allclose(fns["eval"](v, c), c_eval, rtol=1e-4, atol=1e-5)
    (_, (logits, stats)), grads = fns["train"](v, c)
    np.testing.assert_allclose(logits, c_logits, rtol=1e-4, atol=1e-5)
    got = child_variables(sp, cfg, {"params": grads, "batch_stats": stats})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got["batch_stats"], c_stats)
    if grad:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5), got["params"], c_grads)

    # nothing outside the variable mask is read (zero gradient) or updated (statistics)
    keep = fns["mask"](v, c)
    for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(keep["params"])):
        assert not np.any(np.asarray(g) * (1 - np.asarray(m)))
    for new, old, m in zip(jax.tree.leaves(stats), jax.tree.leaves(v["batch_stats"]), jax.tree.leaves(keep["batch_stats"])):
        off = np.broadcast_to(np.asarray(m), old.shape) == 0
        np.testing.assert_array_equal(np.asarray(new)[off], np.asarray(old)[off])
        assert np.all(np.asarray(new)[~off] != np.asarray(old)[~off])  # and every kept entry is


@pytest.mark.parametrize("c", CHOICES, ids=IDS)
def test_cost_is_exact(setup, c):
    sp, x, _, v, fns = setup
    child, cfg = _child(sp, c)
    cv = child_variables(sp, cfg, v)
    cost = sp.cost(c)
    keep = fns["mask"](v, c)["params"]
    in_mask = sum(int(np.broadcast_to(m, p.shape).sum()) for m, p in zip(jax.tree.leaves(keep), jax.tree.leaves(v["params"])))
    assert cost.params == in_mask == count_params(cv["params"])

    def fwd(cv, x):
        return child.apply(cv, x)

    macs, outputs = hand_cost(sp, cfg)
    assert cost.macs == macs == count_macs(fwd, cv, x[:1])
    assert cost.activation_floats == outputs == count_conv_outputs(fwd, cv, x[:1])
    np.testing.assert_array_equal(fns["cost"](np.stack([c, c]))[1], np.array(cost, np.float32))
    # a concrete choice traces the child alone: the supernet program counts the same
    sub = sp.subnet(c)
    assert count_macs(lambda v, x: sub.apply(v, x), v, x[:1]) == macs
    assert count_conv_outputs(lambda v, x: sub.apply(v, x), v, x[:1]) == outputs


def test_one_program_for_every_choice(setup, count_traces):
    sp, _, _, v, fns = setup
    fns["eval"](v, CHOICES[0])
    with count_traces() as traced:
        for c in CHOICES[1:]:
            fns["eval"](v, c)
    assert traced == []


def test_bad_choices_are_one_line_errors(setup):
    sp, x, _, v, _ = setup
    bad = CHOICES[1].copy()
    bad[2] = len(sp.dims[2].choices)
    for call, match in [
        (lambda: sp.subnet(bad), "conv1.kernel"),
        (lambda: sp.cost(bad), "conv1.kernel"),
        (lambda: sp.variable_mask(bad, v), "conv1.kernel"),
        (lambda: sp.subnet(bad[:-1]), "integer choices"),
        (lambda: sp.subnet(bad.astype(np.float32)), "integer choices"),
        (lambda: jax.jit(lambda c: sp.subnet(c).apply(v, x))(bad[:-1]), "integer choices"),
        (lambda: sp.subnet(CHOICES[0]).apply(v, x[..., :0]), "takes"),
        (lambda: get_space("huge"), "unknown hybrid space"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_presets_follow_table_1():
    check_space(SPACES["cifar"])
    for sp in SPACES.values():
        assert sp.single_path and len({d.name for d in sp.dims}) == len(sp.dims)
    small, cifar = SPACES["small"].describe, SPACES["cifar"]
    dims = {d.name: d.choices for d in cifar.dims}
    assert dims["conv1.width"] == (16, 24) and dims["conv1.kernel"] == (3, 5, 7)  # Table 1, convolution
    assert dims["vit1.width"] == (16, 24, 32) and dims["vit1.depth"] == (1, 2, 3, 4, 5)  # Table 1, transformer
    assert cifar.num_tokens == 64 and SPACES["small"].num_tokens == 16
    assert small(np.zeros(len(SPACES["small"].dims), np.int32))["vit1.width"] == 16
    mnist = HybridViT.from_preset("cifar", num_classes=7, image_shape=(28, 28, 1))
    assert mnist.num_tokens == 49 and mnist.dims == cifar.dims and mnist.num_classes == 7
    with pytest.raises(ValueError, match="patches"):
        HybridViT.from_preset("small", image_shape=(9, 9, 1))
    with pytest.raises(ValueError, match="odd"):
        HybridViT("bad", (8, 8, 1), 10, (cifar.conv_stages[0]._replace(kernels=(3, 4)),), cifar.vit_stages)
