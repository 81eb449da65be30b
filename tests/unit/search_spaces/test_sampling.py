"""Random architectures (search_spaces/sampling.py): every sample valid, the same key the same
architecture, the distribution uniform over the space (10,000 draws), and cost matching."""
import itertools
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxfednas.rng import host_generator, random_arch_key
from jaxfednas.search_spaces.choice import Dimension
from jaxfednas.search_spaces.darts import FEDNAS_V1, Genotype, network_params, PRIMITIVES, PRIMITIVES_S2
from jaxfednas.search_spaces.darts.masks import CELLS, genotype_from_mask
from jaxfednas.search_spaces.sampling import matched, random_choice, random_genotype, random_mask, random_shuffle_arch
from jaxfednas.search_spaces.shufflenet.network import get_space

N = 10_000


@pytest.fixture(scope="module")
def genotypes():
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), N)))  # raw keys: no dispatch per draw
    return [random_genotype(k) for k in keys]


def test_random_genotypes_are_valid_and_a_function_of_the_key(genotypes):
    ops = [p for p in PRIMITIVES if p != "none"]
    for g in genotypes[:500]:
        assert isinstance(g, Genotype) and g.steps == 4 and g.normal_concat == (2, 3, 4, 5)
        for c in CELLS:
            pairs = getattr(g, c)
            for node in range(4):
                (op_a, a), (op_b, b) = pairs[2 * node: 2 * node + 2]
                assert a < b < 2 + node, (c, node, a, b)  # two distinct inputs, earlier nodes only
                assert op_a in ops and op_b in ops
    key = random_arch_key(3, 7)
    assert random_genotype(key) == random_genotype(key)
    assert random_genotype(key) != random_genotype(random_arch_key(3, 8))
    assert len(set(genotypes)) == N  # ~10^20 cell pairs: no repeats expected
    # a raw uint32 key and its typed twin draw the same architecture
    assert random_genotype(jax.random.PRNGKey(5)) == random_genotype(jax.random.wrap_key_data(jax.random.PRNGKey(5)))


def test_random_genotypes_are_uniform_over_ops_and_input_pairs(genotypes):
    """Op frequencies within 0.006 of 1/7 (160,000 draws: ~7 standard errors); for each node,
    its input pair uniform over the C(2 + i, 2) pairs within 3 points; both cells alike."""
    ops = [p for p in PRIMITIVES if p != "none"]
    for c in CELLS:
        drawn = [op for g in genotypes for op, _ in getattr(g, c)]
        freq = np.array([drawn.count(op) for op in ops]) / len(drawn)
        np.testing.assert_allclose(freq, 1 / len(ops), atol=0.006)
        for node in range(4):
            pairs = list(itertools.combinations(range(2 + node), 2))
            seen = [tuple(i for _, i in getattr(g, c)[2 * node: 2 * node + 2]) for g in genotypes]
            freq = np.array([seen.count(p) for p in pairs]) / N
            np.testing.assert_allclose(freq, 1 / len(pairs), atol=0.03, err_msg=f"{c} node {node}")
    # the normal and reduction cells are drawn independently
    same = np.mean([g.normal == g.reduce for g in genotypes])
    assert same < 0.01


def test_random_genotype_settings_and_errors():
    g = random_genotype(jax.random.key(1), PRIMITIVES_S2, steps=2, multiplier=1)
    assert g.steps == 2 and g.normal_concat == (3,) and {op for op, _ in g.normal + g.reduce} <= set(PRIMITIVES_S2)
    with pytest.raises(ValueError, match="'none'"):
        random_genotype(jax.random.key(1), ("none",))
    with pytest.raises(ValueError, match="multiplier"):
        random_genotype(jax.random.key(1), steps=2, multiplier=3)


def test_random_mask_is_the_random_genotype_as_a_spider_mask():
    prims = ("none", "skip_connect", "sep_conv_3x3")
    for i in range(20):
        key = jax.random.key(i)
        mask = random_mask(key, prims, steps=3)
        for c in CELLS:
            assert mask[c].shape == (9, 3) and mask[c][:, 0].sum() == 0  # never the zero op
            assert mask[c].sum() == 6  # two kept edges per node, one op each
        assert genotype_from_mask(mask, prims, 3) == random_genotype(key, prims, 3)


def test_random_shuffle_paths_are_uniform_per_block():
    sp = get_space("small")
    choices = np.array([random_shuffle_arch(k, "small").choices for k in jax.random.split(jax.random.key(2), 4000)])
    assert choices.shape == (4000, sp.num_blocks)
    for b in range(sp.num_blocks):
        freq = np.bincount(choices[:, b], minlength=sp.num_candidates) / 4000
        np.testing.assert_allclose(freq, 1 / sp.num_candidates, atol=0.035, err_msg=f"block {b}")
    assert random_shuffle_arch(jax.random.key(9), "small") == random_shuffle_arch(jax.random.key(9), "small")


def test_random_choice_is_uniform_per_dimension_of_a_choice_space():
    dims = (Dimension("a", (3, 5, 7)), Dimension("b", ("x",)), Dimension("c", tuple(range(8))))
    space = SimpleNamespace(dims=dims)
    draws = np.array([random_choice(k, space) for k in jax.random.split(jax.random.key(4), 4000)])
    assert draws.dtype == np.int32 and draws.shape == (4000, 3)
    for d, dim in enumerate(dims):
        freq = np.bincount(draws[:, d], minlength=len(dim.choices)) / 4000
        np.testing.assert_allclose(freq, 1 / len(dim.choices), atol=0.03, err_msg=dim.name)
    np.testing.assert_array_equal(random_choice(jax.random.key(4), dims), random_choice(jax.random.key(4), space))


def test_matched_returns_the_first_draw_within_tolerance():
    def sample(k):
        return int(host_generator(k).integers(0, 100))

    key, target = jax.random.key(6), 50.0
    arch, tries = matched(key, sample, float, target, rel_tol=0.1)
    draws = [sample(jax.random.fold_in(key, i)) for i in range(tries)]
    assert arch == draws[-1] and 45 <= arch <= 55
    assert all(abs(d - target) > 5 for d in draws[:-1])
    assert matched(key, sample, float, target, rel_tol=0.1) == (arch, tries)
    with pytest.raises(ValueError, match="no sample within 10% of cost 500 in 20 draws"):
        matched(key, sample, float, 500.0, max_tries=20)
    with pytest.raises(ValueError, match="target"):
        matched(key, sample, float, 0.0)


def test_a_random_darts_cell_matched_to_a_searched_cells_parameters():
    size = dict(C=4, num_classes=10, layers=2, image_shape=(8, 8, 1))
    target = network_params(FEDNAS_V1, **size)
    g, tries = matched(random_arch_key(0, 0), random_genotype, lambda g: network_params(g, **size), target)
    assert abs(network_params(g, **size) - target) <= 0.1 * target and g != FEDNAS_V1 and tries >= 1
