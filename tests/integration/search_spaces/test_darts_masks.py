"""search_spaces/darts/masks.py: architectures as (edge, op) masks over the supernet."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.search_spaces.darts import DARTS_V2, FEDNAS_V1, PRIMITIVE_SETS, PRIMITIVES, DartsSearchNetwork, Genotype
from jaxfednas.search_spaces.darts.masks import check_mask, full_mask, genotype_from_mask, mask_from_genotype, mask_weights
from jaxfednas.search_spaces.darts.operations import ReLUConvBN, make_op
from jaxfednas.search_spaces.darts.search import SearchCell, edge_table, unroll_variables

TINY = PRIMITIVE_SETS["tiny"]  # skip_connect, avg_pool_3x3, sep_conv_3x3


def _by_node(cell):
    return [sorted(cell[2 * i:2 * i + 2], key=lambda p: p[1]) for i in range(len(cell) // 2)]


@pytest.mark.parametrize("genotype", [DARTS_V2, FEDNAS_V1])
def test_genotype_mask_round_trip(genotype):
    m = mask_from_genotype(genotype, PRIMITIVES, 4)
    # exactly 2 edges per node, one op per kept edge: 8 ones per cell
    assert m["normal"].shape == (14, len(PRIMITIVES)) and m["normal"].sum() == 8 and m["reduce"].sum() == 8
    # DARTS_V2 normal node 0 = sep_conv_3x3 on inputs 0 and 1 (edges 0 and 1)
    if genotype is DARTS_V2:
        k = PRIMITIVES.index("sep_conv_3x3")
        assert m["normal"][0, k] == 1 and m["normal"][1, k] == 1 and m["normal"][:2].sum() == 2
    back = genotype_from_mask(m, PRIMITIVES, 4)
    for c in ("normal", "reduce"):
        assert _by_node(getattr(back, c)) == _by_node(getattr(genotype, c))
    assert back.normal_concat == genotype.normal_concat


def test_non_discrete_masks_are_rejected_with_the_node_named():
    m = full_mask(TINY, 2)
    with pytest.raises(ValueError, match="normal cell, edge 0->0: 3 ops kept"):
        genotype_from_mask(m, TINY, 2)
    m = mask_from_genotype(Genotype([("skip_connect", 0), ("sep_conv_3x3", 1)] * 2, [2, 3],
                                    [("skip_connect", 0), ("sep_conv_3x3", 1)] * 2, [2, 3]), TINY, 2)
    m["reduce"][2] = 0.0  # node 1 keeps only one input
    with pytest.raises(ValueError, match="reduce cell, node 1: 1 incoming edges kept"):
        genotype_from_mask(m, TINY, 2)
    with pytest.raises(ValueError, match="only 0 and 1"):
        check_mask({"normal": np.full((5, 3), 0.5), "reduce": np.ones((5, 3))}, TINY, 2)
    with pytest.raises(ValueError, match=r"end in shape \(5, 3\)"):
        check_mask({"normal": np.ones((14, 3)), "reduce": np.ones((5, 3))}, TINY, 2)
    with pytest.raises(ValueError, match="not a candidate"):
        mask_from_genotype(DARTS_V2, TINY, 4)


def test_masked_cell_equals_the_hand_pruned_cell():
    """A normal cell under a genotype's mask computes exactly the pruned cell: each node
    the sum of its two chosen ops applied to its two inputs, with the supernet's weights."""
    C, steps = 4, 2
    genotype = Genotype([("sep_conv_3x3", 0), ("skip_connect", 1), ("sep_conv_3x3", 2), ("skip_connect", 0)], [2, 3],
                        [("skip_connect", 0), ("skip_connect", 1), ("skip_connect", 0), ("skip_connect", 2)], [2, 3])
    cell = SearchCell(C, False, False, steps, 2, TINY, None, False)
    k0, k1, k2 = jax.random.split(jax.random.PRNGKey(0), 3)
    s0, s1 = jax.random.normal(k0, (2, 8, 8, C)), jax.random.normal(k1, (2, 8, 8, C))
    w_full = jnp.ones((5, len(TINY)))
    v = cell.init({"params": k2}, s0, s1, w_full)
    m = mask_from_genotype(genotype, TINY, steps)
    got = cell.apply(v, s0, s1, mask_weights(m)["normal"])

    def sub(scope):  # the variables under one module's scope
        return {col: tree[scope] for col, tree in v.items() if scope in tree}

    def sub_op(e, name):
        return {col: tree[f"edge_{e}"][name] for col, tree in v.items() if name in tree.get(f"edge_{e}", {})}

    states = [ReLUConvBN(C, 1, 1, 0, affine=False).apply(sub("preprocess0"), s0),
              ReLUConvBN(C, 1, 1, 0, affine=False).apply(sub("preprocess1"), s1)]
    edge_of = {(src, node): e for e, src, node in edge_table(steps)}
    for node in range(steps):
        total = 0.0
        for op, src in genotype.normal[2 * node:2 * node + 2]:
            module = make_op(op, C, 1, False)
            total = total + module.apply(sub_op(edge_of[(src, node)], op), states[src])
        states.append(total)
    want = jnp.concatenate(states[2:], axis=-1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_masked_supernet_ignores_removed_ops_and_matches_the_unrolled_layout():
    net = DartsSearchNetwork(C=4, num_classes=3, layers=3, steps=2, multiplier=2, primitives=TINY)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 3))
    # compiled whole (eagerly, flax's init and apply compile ~150 small programs: ~10 s)
    v = jax.jit(net.init)({"params": jax.random.PRNGKey(2)}, x)
    genotype = Genotype([("sep_conv_3x3", 0), ("skip_connect", 1), ("avg_pool_3x3", 2), ("skip_connect", 0)], [2, 3],
                        [("sep_conv_3x3", 1), ("avg_pool_3x3", 0), ("skip_connect", 2), ("sep_conv_3x3", 1)], [2, 3])
    w = mask_weights(mask_from_genotype(genotype, TINY, 2))
    out = jax.jit(lambda v: net.apply(v, x, arch_weights=w))(v)
    # the same mask on the unrolled supernet gives the same logits
    flat = DartsSearchNetwork(C=4, num_classes=3, layers=3, steps=2, multiplier=2, primitives=TINY,
                              scan_cells=False, scan_edges=False)
    flat_apply = jax.jit(lambda v: flat.apply(v, x, arch_weights=w))
    vf = {"params": unroll_variables(v["params"]), "batch_stats": unroll_variables(v["batch_stats"]), "arch": v["arch"]}
    np.testing.assert_allclose(np.asarray(flat_apply(vf)), np.asarray(out), rtol=1e-5, atol=1e-6)
    base = flat_apply(vf)

    def perturb(kept: bool):  # scale every sep_conv weight of the edges where it is (not) kept
        params = jax.tree.map(lambda a: a, vf["params"])
        for i in range(3):
            m = np.asarray(w["reduce" if i in (1, 2) else "normal"])
            for e in range(5):
                edge = params[f"cell_{i}"][f"edge_{e}"]
                if bool(m[e, TINY.index("sep_conv_3x3")]) == kept:
                    edge["sep_conv_3x3"] = jax.tree.map(lambda a: 3.0 * a + 1.0, edge["sep_conv_3x3"])
        return np.asarray(flat_apply({**vf, "params": params}))

    np.testing.assert_array_equal(perturb(kept=False), np.asarray(base))  # removed ops do not matter
    assert np.abs(perturb(kept=True) - np.asarray(base)).max() > 1e-4  # kept ones do
