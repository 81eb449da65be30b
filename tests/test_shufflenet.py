"""The ShuffleNetV2 choice-block space: unit shapes, child == supernet on its path,
parameter counts and multiply-adds against hand formulas, architecture type."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.cost import count_macs
from search_spaces.shufflenet import (
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
    v = net.init(jax.random.key(0), x)
    assert v["arch"]["alpha"].shape == (3, 4)
    assert abs(float(v["arch"]["alpha"].mean()) - 1.0) < 0.02  # N(1, 0.01)
    arch = ShuffleArch("tiny", (3, 1, 2))
    child = build(arch, 10, dw_impl="grouped")
    cv = child_variables(v, arch)
    for train in (False, True):
        ys = net.apply(v, x, jnp.array(arch.choices), train=train, mutable=["batch_stats"] if train else False)
        yc = child.apply(cv, x, train=train, mutable=["batch_stats"] if train else False)
        ys, yc = (ys[0], yc[0]) if train else (ys, yc)
        np.testing.assert_allclose(np.asarray(ys), np.asarray(yc), rtol=1e-5, atol=1e-6)
    # the child holds exactly its units' weights
    n_child = sum(l.size for l in jax.tree.leaves(cv["params"]))
    assert n_child == child_cost(arch, 10, (8, 8, 1))["params"]
    n_super = sum(l.size for l in jax.tree.leaves(v["params"]))
    assert n_super > 2 * n_child
    # all-paths mode computes the same function
    allp = ShuffleNetwork(space, 10, dw_impl="grouped", all_paths=True)
    np.testing.assert_allclose(np.asarray(allp.apply(v, x, jnp.array(arch.choices))),
                               np.asarray(net.apply(v, x, jnp.array(arch.choices))), rtol=1e-5, atol=1e-6)


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
