"""Edges grouped by source (search_spaces/darts/wide.py) against the edge scan: the same
variables, the same logits, gradients, running statistics and evaluation outputs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from search_spaces.darts.operations import PRIMITIVES
from search_spaces.darts.search import DartsSearchNetwork, SearchCell
from search_spaces.darts.wide import max_pool_3x3


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
    ("none", "max_pool_3x3", "skip_connect", "sep_conv_3x3", "dil_conv_5x5", "conv_7x1_1x7"),
    ("none", "avg_pool_3x3", "skip_connect"),  # parameter-free edges only
    pytest.param(PRIMITIVES + ("conv_7x1_1x7",), marks=pytest.mark.slow),  # every op (opt-in: ~40 s)
])
def test_grouped_equals_edge_scan(primitives):
    # 3 cells: a normal cell, a reduction cell, a reduction cell after a reduction
    kw = dict(C=4, num_classes=5, layers=3, steps=2, multiplier=2, primitives=primitives)
    scan, grouped = DartsSearchNetwork(**kw, group_edges=False), DartsSearchNetwork(**kw, group_edges=True)
    x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (6,), 0, 5)
    mask = jnp.arange(6) < 4  # two padded rows stay out of the BatchNorm statistics
    variables = dict(scan.init(jax.random.key(2), x, train=False))
    # the grouped network's variables only need the same structure (its eager init would compile)
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(
        jax.eval_shape(functools.partial(grouped.init, train=False), jax.random.key(2), x))
    # distinct running statistics per edge, so evaluation must use each edge's own
    variables["batch_stats"] = jax.jit(lambda stats: jax.tree_util.tree_map(
        lambda a: a + jax.random.uniform(jax.random.key(a.size), a.shape), stats))(variables["batch_stats"])
    a, b = _run(scan, variables, x, y, mask), _run(grouped, variables, x, y, mask)
    assert jax.tree_util.tree_structure(a[1]) == jax.tree_util.tree_structure(b[1])
    assert _rel(a[0], b[0]) < 1e-5  # logits
    assert _rel(a[1], b[1]) < 1e-5  # every updated running statistic
    assert _rel(a[2], b[2]) < 1e-4  # gradients w.r.t. weights and α
    assert _rel(a[3], b[3]) < 1e-5  # evaluation mode
    changed = jax.tree_util.tree_map(lambda old, new: bool(np.any(np.asarray(old) != np.asarray(new))),
                                     variables["batch_stats"], b[1])
    assert all(jax.tree_util.tree_leaves(changed))  # every BatchNorm of every edge was updated


def test_default_groups_on_cpu_and_falls_back():
    cell = SearchCell(4, False, False)
    assert cell._grouped() == (jax.default_backend() == "cpu")
    assert not SearchCell(4, False, False, single_path=True)._grouped()
    assert not SearchCell(4, False, False, norm="group")._grouped()
    with pytest.raises(ValueError, match="group_edges=True needs scan_edges=True"):
        SearchCell(4, False, False, scan_edges=False, group_edges=True)._grouped()


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
