"""On-device federated data: permutations, masked batches, skipped steps, augmentation,
the CPU conv kernel gradient, masked BatchNorm."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.search_spaces.models import ResNet
from jaxfednas.data.augment import Augment, augment_batch
from jaxfednas.data.federated import (ClientData, epoch_permutation, run_local_epochs, run_local_epochs_selected,
                                     stack_clients)
from jaxfednas.nn import _native, conv_canonical_grad, conv_patch_grad


def test_epoch_permutation_puts_valid_rows_first():
    perm = np.asarray(epoch_permutation(jax.random.PRNGKey(0), 5, 9))
    assert sorted(perm[:5].tolist()) == [0, 1, 2, 3, 4]
    assert sorted(perm.tolist()) == list(range(9))


def test_stack_clients_pads_and_counts():
    x = np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1)
    y = np.arange(10, dtype=np.int32)
    s = stack_clients(x, y, [np.array([3, 4, 5]), np.array([7]), np.array([], np.int64)])
    assert s.x.shape == (3, 3, 1, 1, 1) and s.counts.tolist() == [3, 1, 0]
    assert s.y[0].tolist() == [3, 4, 5] and s.y[1, 0] == 7


@pytest.mark.parametrize("count, batch, epochs", [(5, 2, 1), (8, 4, 2), (1, 3, 3), (0, 2, 1)])
def test_local_epochs_visit_each_example_once_and_skip_padded_steps(count, batch, epochs):
    m = 8
    values = jnp.where(jnp.arange(m) < count, 2.0 ** jnp.arange(m), 1e6)  # padding would show
    client = ClientData(x=values, y=jnp.zeros(m, jnp.int32), count=jnp.int32(count))

    def step(carry, b, key):
        total, calls = carry
        s = (b["x"] * b["mask"]).sum()
        return (total + s, calls + 1), {"seen": b["mask"].sum()}

    (total, calls), metrics = jax.jit(
        lambda c: run_local_epochs(step, (0.0, 0), c, jax.random.PRNGKey(1), epochs=epochs, batch_size=batch)
    )(client)
    assert float(total) == epochs * float(sum(2.0**i for i in range(count)))
    assert int(calls) == epochs * -(-count // batch)  # ceil(n / B) real steps per epoch
    assert int(metrics["seen"]) == epochs * count
    assert int(metrics["steps"]) == epochs * -(-count // batch)


def test_epoch_end_hook_sees_every_epoch_and_leaves_the_steps_alone():
    m, count = 8, 7
    client = ClientData(x=jnp.arange(m, dtype=jnp.float32), y=jnp.zeros(m, jnp.int32), count=jnp.int32(count))

    def step(carry, b, key):  # order- and key-dependent, so a changed batch or key would show
        total, n = carry
        return (total * 1.5 + (b["x"] * b["mask"]).sum() + jax.random.uniform(key), n + 1), {"seen": b["mask"].sum()}

    def run(hook):
        return jax.jit(lambda c: run_local_epochs(step, (0.0, 0), c, jax.random.PRNGKey(1), epochs=3, batch_size=3,
                                                  epoch_end=hook))(client)

    plain, m_plain = run(None)
    # the hook sees the carry after each epoch (3 steps of ceil(7 / 3)) and may change it
    hooked, m_hooked = run(lambda carry, e: ((carry[0], carry[1] + 100), {"epoch": e, "steps_so_far": carry[1]}))
    assert float(hooked[0]) == float(plain[0]) and int(hooked[1]) == int(plain[1]) + 300
    assert m_hooked["epoch_end"]["epoch"].tolist() == [0, 1, 2]
    assert m_hooked["epoch_end"]["steps_so_far"].tolist() == [3, 106, 209]
    assert int(m_hooked["seen"]) == int(m_plain["seen"]) == 3 * count and int(m_hooked["steps"]) == 9


def test_selected_epochs_keep_the_best_model_and_the_same_steps():
    client = ClientData(x=jnp.arange(8, dtype=jnp.float32), y=jnp.zeros(8, jnp.int32), count=jnp.int32(7))

    def step(carry, b, key):  # the "model" is a number that every step changes
        return carry * 1.5 + (b["x"] * b["mask"]).sum() + jax.random.uniform(key), {"seen": b["mask"].sum()}

    @jax.jit
    def run(c, scores):  # candidate i scores scores[i] (the model after i epochs is looked up by value)
        _, m = run_local_epochs(step, jnp.float32(0.5), c, jax.random.PRNGKey(1), epochs=3, batch_size=3,
                                epoch_end=lambda m, e: (m, m))
        traj = jnp.concatenate([jnp.array([0.5]), m["epoch_end"]])

        def select(model):
            return scores[jnp.argmin(jnp.abs(traj - model))], model
        return run_local_epochs_selected(step, jnp.float32(0.5), c, jax.random.PRNGKey(1), epochs=3, batch_size=3,
                                         model_of=lambda m: m, select=select)

    for scores, want in (([0, 2, 5, 1], 2), ([3, 1, 2, 3], 3), ([7, 1, 2, 3], 0), ([4, 4, 4, 4], 3)):
        best, metrics = run(client, jnp.array(scores))  # ties: the later candidate
        traj = np.asarray(metrics["candidates"])
        assert int(metrics["selected"]) == want and float(best) == traj[want], scores
        assert traj[0] == 0.5 and len(set(traj.tolist())) == 4  # start + 3 epochs, all different
        assert int(metrics["seen"]) == 3 * 7 and int(metrics["steps"]) == 9
    plain, _ = jax.jit(lambda c: run_local_epochs(step, jnp.float32(0.5), c, jax.random.PRNGKey(1), epochs=3,
                                                  batch_size=3))(client)
    assert float(plain) == traj[-1]  # the same steps as without selection


def test_augment_off_is_identity_and_on_keeps_shape():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 3))
    assert augment_batch(jax.random.PRNGKey(1), x, Augment()) is x
    y = augment_batch(jax.random.PRNGKey(1), x, Augment(crop_padding=2, flip=True, cutout=4))
    assert y.shape == x.shape and not np.allclose(x, y)
    flipped = augment_batch(jax.random.PRNGKey(2), x, Augment(flip=True))
    for i in range(4):
        assert np.allclose(flipped[i], x[i]) or np.allclose(flipped[i], x[i, :, ::-1])
    with pytest.raises(ValueError, match="crop_padding"):
        Augment(crop_padding=-1)


@pytest.mark.parametrize("fast", [conv_patch_grad, conv_canonical_grad])
@pytest.mark.parametrize("strides, padding, dilation, n", [
    ((1, 1), "SAME", (1, 1), 9), ((2, 2), "SAME", (1, 1), 9), ((2, 2), "SAME", (1, 1), 8),
    ((1, 1), ((2, 2), (2, 2)), (2, 2), 9), ((2, 2), ((4, 4), (4, 4)), (2, 2), 8), ((2, 2), "VALID", (1, 1), 9),
    ((1, 1), ((0, 0), (0, 0)), (1, 1), 5),
])
def test_fast_conv_gradients_equal_native(fast, strides, padding, dilation, n):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (2, n, n, 3))
    w = jax.random.normal(kw, (3, 3, 3, 5))
    y, vjp_native = jax.vjp(lambda x, w: _native(x, w, strides, padding, dilation), x, w)
    g = jax.random.normal(kg, y.shape)  # random cotangent, not a sum of squares
    y2, vjp_patch = jax.vjp(lambda x, w: fast(x, w, strides, padding, dilation), x, w)
    np.testing.assert_allclose(y, y2, rtol=1e-5)
    for a, b in zip(vjp_native(g), vjp_patch(g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_kernel_grads_if_gates_only_the_kernel_gradient():
    from jaxfednas.nn import kernel_grads_if

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 7, 3))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 4))
    conv = lambda x, w: conv_canonical_grad(x, w, (1, 1), "SAME", (1, 1))  # noqa: E731
    loss = lambda x, w: (conv(x, w) ** 2).sum()  # noqa: E731

    @jax.jit
    def gated(gate):
        with kernel_grads_if(gate):
            return jax.grad(loss, (0, 1))(x, w)

    dx, dw = jax.grad(loss, (0, 1))(x, w)
    on, off = gated(True), gated(False)
    np.testing.assert_allclose(on[0], dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(on[1], dw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(off[0], on[0], rtol=1e-6)  # the input gradient does not depend on the gate
    assert float(np.abs(dw).max()) > 0 and not np.asarray(off[1]).any()


def test_masked_batchnorm_ignores_padded_examples():
    model = ResNet(num_classes=3, stage_sizes=(1,), width=4)
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 8, 8, 3))
    v = model.init(jax.random.PRNGKey(1), x, train=False)
    mask = jnp.array([1, 1, 1, 1, 0, 0], bool)
    garbage = x.at[4:].set(100.0)
    _, s_masked = model.apply(v, garbage, train=True, mask=mask, mutable=["batch_stats"])
    _, s_real = model.apply(v, x[:4], train=True, mutable=["batch_stats"])
    for a, b in zip(jax.tree.leaves(s_masked), jax.tree.leaves(s_real)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
