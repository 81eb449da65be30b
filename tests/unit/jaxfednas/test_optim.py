"""MiLeNAS gradients and the NAS optimizer against hand-written formulas."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas import optim
from jaxfednas.optim import arch_labels, cosine_lr, darts_arch_optimizer, darts_weight_optimizer, milenas_grads


def _loss(params, arch, stats, batch):
    # a tiny "supernet": two candidate linear ops mixed by softmax(arch)
    w = jax.nn.softmax(arch["a"])
    pred = w[0] * batch["x"] @ params["w1"] + w[1] * batch["x"] @ params["w2"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, (stats, {"loss": loss})


def test_milenas_update_equals_eq4():
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"w1": jax.random.normal(k[0], (3,)), "w2": jax.random.normal(k[1], (3,))}
    arch = {"a": jax.random.normal(k[2], (2,))}
    tr = {"x": jax.random.normal(k[3], (5, 3)), "y": jnp.arange(5.0)}
    va = {"x": jax.random.normal(k[4], (5, 3)), "y": -jnp.arange(5.0)}
    lam = 0.7
    f = lambda p, a, b: _loss(p, a, {}, b)[0]  # noqa: E731

    @jax.jit  # one program: eagerly, every small op compiles on its own (~8 s)
    def run():
        grads, _, _ = milenas_grads(_loss, params, arch, {}, tr, va, lam=lam)
        return grads, jax.grad(f)(params, arch, tr), jax.grad(f, 1)(params, arch, tr), jax.grad(f, 1)(params, arch, va)

    grads, g_w_tr, g_a_tr, g_a_val = run()
    # the same gradients from differently fused programs: float32 results 1.1e-6 relative apart
    # on some CPUs (jax 0.12.1, AMD EPYC), so a tolerance of a few float32 roundings
    np.testing.assert_allclose(grads["params"]["w1"], g_w_tr["w1"], rtol=1e-5)
    expect_a = g_a_tr["a"] + lam * g_a_val["a"]
    np.testing.assert_allclose(grads["arch"]["a"], expect_a, rtol=1e-5)

    # One optimizer step with plain SGD on both parts equals the formula exactly.
    eta_w, eta_a = 0.1, 0.05
    tx = optax.partition({"weights": optax.sgd(eta_w), "arch": optax.sgd(eta_a)},
                         lambda t: {"params": jax.tree.map(lambda _: "weights", t["params"]),
                                    "arch": jax.tree.map(lambda _: "arch", t["arch"])})
    tree = {"params": params, "arch": arch}
    new = jax.jit(lambda g: optax.apply_updates(tree, tx.update(g, tx.init(tree), tree)[0]))(grads)
    np.testing.assert_allclose(new["arch"]["a"], arch["a"] - eta_a * expect_a, rtol=1e-6)
    np.testing.assert_allclose(new["params"]["w2"], params["w2"] - eta_w * grads["params"]["w2"], rtol=1e-6)


@pytest.mark.slow
def test_milenas_passes_loop_equals_inline_on_a_grouped_darts_cell():
    # the loop form (one compiled pass; the validation pass skips its kernel gradients)
    # against the two inline passes, on a supernet with convolutions, BatchNorm and masks
    from jaxfednas.search_spaces.darts.search import DartsSearchNetwork

    net = DartsSearchNetwork(C=4, num_classes=3, layers=2, steps=2, multiplier=2, group_edges=True,
                             primitives=("none", "max_pool_3x3", "skip_connect", "sep_conv_3x3"))
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    batch = lambda kx, ky: {"x": jax.random.normal(kx, (5, 8, 8, 3)), "y": jax.random.randint(ky, (5,), 0, 3),  # noqa: E731
                            "mask": jnp.arange(5) < 4}
    tr, va = {**batch(k[0], k[1]), "epoch": jnp.int32(0)}, batch(k[2], k[3])
    v = jax.jit(functools.partial(net.init, train=False))(k[4], tr["x"])  # compiled: eagerly ~80 small programs

    def loss(params, arch, stats, b):
        logits, new = net.apply({"params": params, "arch": arch, "batch_stats": stats}, b["x"], train=True,
                                mask=b["mask"], mutable=["batch_stats"])
        ce = -(jax.nn.log_softmax(logits)[jnp.arange(5), b["y"]] * b["mask"]).sum()
        return ce, (new["batch_stats"], {"ce": ce})

    run = jax.jit(lambda passes: milenas_grads(loss, v["params"], v["arch"], v["batch_stats"], tr, va, lam=0.3,
                                               passes=passes), static_argnums=0)
    loop, inline = run("loop"), run("inline")
    for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(inline)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(np.abs(np.asarray(inline[0]["params"]["cell_0"]["preprocess1"]["Conv_0"]["kernel"])).max()) > 0


def test_milenas_passes_checks():
    params, arch = {"w1": jnp.ones(3), "w2": jnp.ones(3)}, {"a": jnp.zeros(2)}
    tr = {"x": jnp.ones((5, 3)), "y": jnp.arange(5.0)}
    with pytest.raises(ValueError, match="passes must be one of"):
        milenas_grads(_loss, params, arch, {}, tr, tr, passes="fast")
    with pytest.raises(ValueError, match="same keys, shapes and dtypes"):
        milenas_grads(_loss, params, arch, {}, tr, {"x": jnp.ones((4, 3)), "y": jnp.arange(4.0)}, passes="loop")
    loop = milenas_grads(_loss, params, arch, {}, tr, {**tr, "y": -tr["y"]}, lam=0.5, passes="loop")
    inline = milenas_grads(_loss, params, arch, {}, tr, {**tr, "y": -tr["y"]}, lam=0.5, passes="inline")
    for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(inline)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_milenas_val_stats_returns_each_pass_update():
    # running statistics: each pass updates the given ones with its own batch's mean of x
    def loss(params, arch, stats, batch):
        value, (_, m) = _loss(params, arch, stats, batch)
        return value, ({"mean": 0.9 * stats["mean"] + 0.1 * batch["x"].mean(0)}, m)

    params, arch, stats = {"w1": jnp.ones(3), "w2": jnp.ones(3)}, {"a": jnp.zeros(2)}, {"mean": jnp.arange(3.0)}
    tr = {"x": jnp.arange(15.0).reshape(5, 3), "y": jnp.arange(5.0)}
    va = {"x": -jnp.arange(15.0).reshape(5, 3) ** 2, "y": -jnp.arange(5.0)}
    want_tr, want_val = (0.9 * stats["mean"] + 0.1 * b["x"].mean(0) for b in (tr, va))
    run = jax.jit(lambda passes, val_stats: milenas_grads(loss, params, arch, stats, tr, va, passes=passes,
                                                          val_stats=val_stats), static_argnums=(0, 1))
    for passes in ("loop", "inline"):
        grads, (got_tr, got_val), _ = run(passes, True)
        np.testing.assert_allclose(got_tr["mean"], want_tr, rtol=1e-6, err_msg=passes)
        np.testing.assert_allclose(got_val["mean"], want_val, rtol=1e-6, err_msg=passes)
        same, only_tr, _ = run(passes, False)  # default: the training pass's statistics only
        np.testing.assert_allclose(only_tr["mean"], want_tr, rtol=1e-6, err_msg=passes)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(same)):
            np.testing.assert_array_equal(a, b)


def test_the_darts_steps_match_pytorch_style_first_step():
    params = {"w": jnp.array([3.0, 4.0])}
    arch = {"a": jnp.array([0.5, -0.5])}
    g = {"params": {"w": jnp.array([30.0, 40.0])}, "arch": {"a": jnp.array([0.1, 0.2])}}
    tx = optax.partition({"weights": darts_weight_optimizer(lr=0.1, momentum=0.9, weight_decay=0.01, clip=5.0),
                          "arch": darts_arch_optimizer(lr=0.001, b1=0.5, b2=0.999, weight_decay=0.1)}, arch_labels)
    tree = {"params": params, "arch": arch}
    upd, _ = tx.update(g, tx.init(tree), tree)
    # weights: clip (norm 50 -> 5) then + wd*w, first momentum step = the gradient
    gw = np.array([3.0, 4.0]) + 0.01 * np.array([3.0, 4.0])
    np.testing.assert_allclose(upd["params"]["w"], -0.1 * gw, rtol=1e-6)
    # arch: Adam's first step moves each coordinate by lr * sign(g + wd*a) (bias-corrected)
    ga = np.array([0.1, 0.2]) + 0.1 * np.array([0.5, -0.5])
    np.testing.assert_allclose(upd["arch"]["a"], -0.001 * np.sign(ga), rtol=1e-4)


def test_the_former_optimizer_names_warn_and_give_the_same_steps():
    with pytest.warns(DeprecationWarning, match="optim.arch_optimizer is deprecated: use darts_arch_optimizer"):
        assert optim.arch_optimizer is darts_arch_optimizer
    with pytest.warns(DeprecationWarning, match="weight_optimizer is deprecated"):
        assert optim.weight_optimizer is darts_weight_optimizer
    with pytest.warns(DeprecationWarning, match="nas_optimizer is deprecated: use optax.partition"):
        former = optim.nas_optimizer(w_lr=0.1, arch_lr=0.01)
    tree = {"params": {"w": jnp.array([3.0, 4.0])}, "arch": {"a": jnp.array([0.5, -0.5])}}
    g = {"params": {"w": jnp.array([30.0, 40.0])}, "arch": {"a": jnp.array([0.1, 0.2])}}
    now = optax.partition({"weights": darts_weight_optimizer(lr=0.1, momentum=0.9, weight_decay=3e-4, clip=5.0),
                           "arch": darts_arch_optimizer(lr=0.01, b1=0.5, b2=0.999, weight_decay=1e-3)}, arch_labels)
    for a, b in zip(jax.tree.leaves(former.update(g, former.init(tree), tree)[0]),
                    jax.tree.leaves(now.update(g, now.init(tree), tree)[0])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(AttributeError):
        getattr(optim, "no_such_optimizer")  # noqa: B009


def test_cosine_lr():
    lr = cosine_lr(0.025, 0.001, 5)
    np.testing.assert_allclose(lr(0), 0.025)
    np.testing.assert_allclose(lr(5), 0.001, rtol=1e-6)
    np.testing.assert_allclose(lr(2.5), 0.013, rtol=1e-6)
    np.testing.assert_allclose(lr(9), 0.001, rtol=1e-6)  # the floor after the horizon
    # PyTorch's CosineAnnealingLR closed form at an interior step
    np.testing.assert_allclose(lr(1), 0.001 + 0.012 * (1 + np.cos(np.pi / 5)), rtol=1e-6)


def test_active_momentum_moves_only_active_leaves():
    from jaxfednas.optim import active_momentum

    tx = optax.chain(active_momentum(0.9), optax.scale_by_learning_rate(0.1))
    params = {"a": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
    state = tx.init(params)
    g1 = {"a": jnp.array([1.0, -1.0]), "b": jnp.array(2.0)}
    upd, state = tx.update(g1, state, params, active={"a": 1.0, "b": 1.0})
    np.testing.assert_allclose(upd["a"], [-0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(upd["b"], -0.2, rtol=1e-6)
    # "b" did not run: its update is zero and its momentum is kept for the next time it runs
    g2 = {"a": jnp.array([0.0, 0.0]), "b": jnp.array(100.0)}
    upd, state = tx.update(g2, state, params, active={"a": 1.0, "b": 0.0})
    np.testing.assert_allclose(upd["a"], [-0.09, 0.09], rtol=1e-6)  # 0.9 m + 0
    assert float(upd["b"]) == 0.0
    g3 = {"a": jnp.array([0.0, 0.0]), "b": jnp.array(1.0)}
    upd, _ = tx.update(g3, state, params, active={"a": 0.0, "b": 1.0})
    np.testing.assert_allclose(upd["b"], -0.1 * (0.9 * 2.0 + 1.0), rtol=1e-6)
    np.testing.assert_array_equal(upd["a"], [0.0, 0.0])
