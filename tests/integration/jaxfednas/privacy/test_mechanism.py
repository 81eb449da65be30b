"""The per-example Gaussian mechanism (jaxfednas.privacy.mechanism) against hand-written loops and
statistics; the DARTS second-order architecture gradient (jaxfednas.optim)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas import privacy
from jaxfednas.privacy import mechanism as dp
from jaxfednas.optim import arch_hessian_vector as _arch_hessian_vector
from jaxfednas.optim import darts_arch_grad as _darts_arch_grad


def _tree_grads(b=7, seed=0):
    """Per-example gradients of a two-leaf pytree; row 3 is zero, rows 0/5 are large."""
    rng = np.random.default_rng(seed)
    g = {"w": rng.standard_normal((b, 3, 4)).astype(np.float32), "b": rng.standard_normal((b, 5)).astype(np.float32)}
    g["w"][0] *= 50.0
    g["b"][5] *= 30.0
    g["w"][3] = 0.0
    g["b"][3] = 0.0
    return jax.tree.map(jnp.asarray, g)


def _manual_clipped_sum(g, clip, mask=None):
    g = jax.tree.map(np.asarray, g)
    b = g["w"].shape[0]
    out = {"w": np.zeros(g["w"].shape[1:], np.float64), "b": np.zeros(g["b"].shape[1:], np.float64)}
    for i in range(b):
        if mask is not None and not mask[i]:
            continue
        norm = np.sqrt(np.sum(g["w"][i].astype(np.float64) ** 2) + np.sum(g["b"][i].astype(np.float64) ** 2))
        f = 1.0 if norm <= clip else clip / norm
        out["w"] += f * g["w"][i]
        out["b"] += f * g["b"][i]
    return out


def test_clipped_per_example_norms_are_at_most_R():
    g = _tree_grads()
    for clip in (0.1, 1.0, 3.0, 1e3):
        clipped, norms = dp.clip_per_example(g, clip)
        after = np.asarray(dp.per_example_norms(clipped))
        assert np.all(after <= clip * (1 + 1e-6))
        before = np.asarray(norms)
        # examples already within R are untouched; the others land on the sphere of radius R
        small = before <= clip
        np.testing.assert_array_equal(np.asarray(clipped["w"])[small], np.asarray(g["w"])[small])
        np.testing.assert_allclose(after[~small], clip, rtol=1e-5)
    assert float(dp.per_example_norms(dp.clip_per_example(g, 1.0)[0])[3]) == 0.0  # zero row stays zero
    with pytest.raises(ValueError, match="clip_norm"):
        dp.clip_per_example(g, 0.0)


def test_clipped_sum_equals_a_manual_per_example_loop_and_optax():
    g = _tree_grads()
    mask = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    for clip in (0.5, 2.0):
        got, n_clip = dp.clipped_sum(g, jnp.asarray(mask), clip)
        want = _manual_clipped_sum(g, clip, mask)
        for k in ("w", "b"):
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6)
        norms = np.asarray(dp.per_example_norms(g))
        assert int(n_clip) == int(((norms > clip) & mask).sum())
        # without a mask it agrees with optax's own per-example clipping
        ours, _ = dp.clipped_sum(g, None, clip)
        theirs, _ = optax.per_example_global_norm_clip(jax.tree.leaves(g), clip)
        for a, b in zip(jax.tree.leaves(ours), theirs):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # clip_norm=None: the plain sum (the non-private case)
    plain, _ = dp.clipped_sum(g, jnp.asarray(mask), None)
    np.testing.assert_allclose(np.asarray(plain["b"]), np.asarray(g["b"])[mask].sum(0), rtol=1e-6)


def _mlp_loss(params, example):
    h = jnp.tanh(example["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])


def _mlp(seed=0, b=8):
    rng = np.random.default_rng(seed)
    params = {"w1": rng.standard_normal((5, 6)), "b1": rng.standard_normal(6), "w2": rng.standard_normal((6, 3))}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    ex = {"x": jnp.asarray(rng.standard_normal((b, 5)) * 3, jnp.float32), "y": jnp.asarray(rng.integers(0, 3, b))}
    return params, ex


# compiled whole (run eagerly, the vmapped gradients compile ~150 small programs per test)
_clipped_sum = jax.jit(dp.per_example_clipped_sum, static_argnums=(0, 3), static_argnames="chunk")
_mlp_grad = jax.jit(jax.grad(_mlp_loss))


def test_per_example_clipped_sum_matches_a_loop_over_examples_and_chunks_agree():
    params, ex = _mlp()
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 0], bool)
    clip = 0.3

    def example_fn(e):
        loss, g = jax.value_and_grad(_mlp_loss)(params, e)
        return g, {"loss": loss}

    total, aux, n_clip = _clipped_sum(example_fn, ex, mask, clip)
    want = jax.tree.map(jnp.zeros_like, params)
    want_loss = 0.0
    for i in range(8):
        if not bool(mask[i]):
            continue
        e = jax.tree.map(lambda a: a[i], ex)
        g = _mlp_grad(params, e)
        f = min(1.0, clip / float(optax.tree.norm(g)))
        want = jax.tree.map(lambda a, b: a + f * b, want, g)
        want_loss += float(_mlp_loss(params, e))
    for a, b in zip(jax.tree.leaves(total), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux["loss"]), want_loss, rtol=1e-5)
    assert 0 < int(n_clip) <= 6
    chunked = _clipped_sum(example_fn, ex, mask, clip, chunk=2)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves((total, aux, n_clip))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of chunk"):
        dp.per_example_clipped_sum(example_fn, ex, mask, clip, chunk=3)


def test_padded_examples_contribute_nothing():
    params, ex = _mlp(b=6)
    clip = 0.5

    def example_fn(e):
        loss, g = jax.value_and_grad(_mlp_loss)(params, e)
        return g, {"loss": loss, "n": jnp.ones(())}

    mask = jnp.array([1, 1, 1, 1, 0, 0], bool)
    # Same shape, same mask, same program: benign padding (copies of a real row) vs garbage
    # padding (huge values, NaN). Masked rows must have exactly no effect, so these are
    # bitwise equal on any processor (identical shapes reduce in an identical order).
    benign = {"x": ex["x"].at[4].set(ex["x"][0]).at[5].set(ex["x"][1]), "y": ex["y"]}
    garbage = {"x": ex["x"].at[4].set(1e30).at[5].set(jnp.nan), "y": ex["y"]}
    ref = _clipped_sum(example_fn, benign, mask, clip)
    got = _clipped_sum(example_fn, garbage, mask, clip)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(got[1]["n"]) == 4.0
    # ... and equal to the sum over the 4 real rows alone. A sum over 6 rows (two of them
    # zero) and one over 4 may be reduced in a different order by XLA's CPU code (which
    # differs between processors): equal up to a few float32 ulp, not bitwise.
    real = jax.tree.map(lambda a: a[:4], ex)
    unpadded = _clipped_sum(example_fn, real, jnp.ones(4, bool), clip)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(unpadded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7, atol=1e-7)
    # a whole privatised average with padding equals the benign one (same noise key)
    k = jax.random.PRNGKey(3)
    avg_ref = dp.noisy_average(ref[0], k, noise_std=0.7, expected_batch_size=4.5)
    avg_got = dp.noisy_average(got[0], k, noise_std=0.7, expected_batch_size=4.5)
    for a, b in zip(jax.tree.leaves(avg_got), jax.tree.leaves(avg_ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_noise_std_matches_sigma_R_over_expected_batch():
    """2000 releases of a 64-dim gradient through the optax transformation (its key in
    the state): 128 000 noise draws, so the sample std is within ~0.2 % (one standard
    error) of the truth; the test allows 2 % and checks the mean too."""
    sigma, clip, b_exp = 1.3, 0.5, 12.5
    g = {"a": jnp.zeros((5, 64)).at[:, 0].set(10.0)}  # 5 examples, each clipped to norm 0.5 on coord 0
    tx = dp.dp_aggregate(clip, sigma, b_exp, jax.random.PRNGKey(0))

    def step(state, _):
        out, state = tx.update(g, state)
        return state, out["a"]

    state, draws = jax.lax.scan(step, tx.init(None), None, length=2000)
    draws = np.asarray(draws)
    noise = draws[:, 1:]  # coordinates whose clipped sum is zero
    want = sigma * clip / b_exp
    assert abs(noise.std() / want - 1.0) < 0.02
    assert abs(noise.mean()) < 4 * want / np.sqrt(noise.size)
    # coordinate 0 carries the clipped sum 5 * 0.5 divided by the EXPECTED batch (not 5)
    assert abs(draws[:, 0].mean() - 5 * clip / b_exp) < 4 * want / np.sqrt(len(draws))
    assert len(np.unique(draws[:, 1])) == len(draws)  # the key advances: fresh noise every release
    # optax.contrib divides by the physical batch (5) instead
    contrib = optax.contrib.differentially_private_aggregate(clip, 0.0, 0)  # an int seed
    theirs, _ = contrib.update(g, contrib.init(None))
    ours, _ = dp.dp_aggregate(clip, 0.0, b_exp, jax.random.PRNGKey(0)).update(g, tx.init(None))
    np.testing.assert_allclose(np.asarray(theirs["a"]) * 5, np.asarray(ours["a"]) * b_exp, rtol=1e-6)


def test_poisson_sample_inclusion_padding_and_overflow():
    m, count, p = 40, 30, 0.3
    keys = jax.random.split(jax.random.PRNGKey(0), 3000)
    samples = jax.vmap(lambda k: dp.poisson_sample(k, count, m, p, 25))(keys)
    idx, mask = np.asarray(samples.idx), np.asarray(samples.mask)
    hits = np.zeros(m)
    for i, mk in zip(idx, mask):
        used = i[mk]
        assert len(set(used)) == len(used)  # no example twice
        hits[used] += 1
    assert hits[count:].sum() == 0  # padding rows are never sampled
    freq = hits[:count] / len(keys)
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / len(keys)))
    n = np.asarray(samples.num_sampled)
    assert abs(n.mean() - p * count) < 0.2
    np.testing.assert_array_equal(mask.sum(1), np.minimum(n, 25))
    assert np.asarray(samples.overflow).sum() == 0  # Binomial(30, 0.3) > 25 never happens here

    # overflow: p = 1 draws all 30 rows into 12 slots; 18 are dropped and reported
    s = dp.poisson_sample(jax.random.PRNGKey(1), count, m, 1.0, 12)
    assert int(s.num_sampled) == 30 and int(s.overflow) == 18 and bool(s.mask.all())
    kept = np.asarray(s.idx)
    assert len(set(kept)) == 12 and kept.max() < count
    # the kept rows are a uniformly random subset of the drawn ones
    kept_counts = np.zeros(count)
    for k in keys[:600]:
        kept_counts[np.asarray(dp.poisson_sample(k, count, m, 1.0, 12).idx)] += 1
    assert np.all(np.abs(kept_counts / 600 - 12 / 30) < 0.1)
    # a physical batch larger than the data: slots past the data are masked
    s = dp.poisson_sample(jax.random.PRNGKey(2), 5, 6, 1.0, 9)
    assert int(s.num_sampled) == 5 and np.asarray(s.mask).sum() == 5 and int(s.overflow) == 0
    with pytest.raises(ValueError, match="sampling_prob"):
        dp.poisson_sample(keys[0], count, m, 0.0, 10)


def test_overflow_probability_and_auto_physical_batch():
    from scipy.stats import binom

    b = dp.auto_physical_batch(1000, 0.05, tail=1e-9)
    assert binom.sf(b, 1001, 0.05) <= 1e-9 < binom.sf(b - 1, 1001, 0.05)
    assert privacy.overflow_probability(1001, 0.05, b) <= 1e-9
    assert dp.auto_physical_batch(20, 0.9) == 21  # capped at the data size + 1: never overflows
    assert privacy.overflow_probability(10, 0.5, 10) == 0.0
    np.testing.assert_allclose(privacy.overflow_probability(10, 0.5, 8), 11 / 1024)


# --- DARTS second-order architecture gradient ------------------------------------------


def _supernet_loss(params, arch, batch):
    """Two candidate ops (tanh-linear, linear) mixed by softmax(α), then a linear head."""
    w = jax.nn.softmax(arch["a"])
    h = w[0] * jnp.tanh(batch["x"] @ params["w1"]) + w[1] * batch["x"] @ params["w2"]
    logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _supernet(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    params = {"w1": f(4, 5), "w2": f(4, 5), "head": f(5, 3)}
    arch = {"a": f(2) * 0.5}
    tr = {"x": f(16, 4), "y": jnp.asarray(rng.integers(0, 3, 16))}
    va = {"x": f(16, 4), "y": jnp.asarray(rng.integers(0, 3, 16))}
    return params, arch, tr, va


def test_second_order_fd_agrees_with_exact_hvp_and_xi_zero_is_first_order():
    params, arch, tr, va = _supernet()
    xi = 0.1
    # every call compiled whole (run eagerly, its ops compile ~230 small programs: ~8 s)
    darts_arch_grad = jax.jit(_darts_arch_grad, static_argnums=0, static_argnames=("xi", "method", "eps_scale"))
    arch_hessian_vector = jax.jit(_arch_hessian_vector, static_argnums=0, static_argnames=("method", "eps_scale"))
    grad_a, grad_w = jax.jit(jax.grad(_supernet_loss, 1)), jax.jit(jax.grad(_supernet_loss, 0))
    exact = darts_arch_grad(_supernet_loss, params, arch, tr, va, xi=xi, method="hvp")
    fd = darts_arch_grad(_supernet_loss, params, arch, tr, va, xi=xi, method="fd", eps_scale=0.01)
    first = grad_a(params, arch, va)
    # the Hessian term matters here (so agreement is not just the first-order part) ...
    assert float(jnp.abs(exact["a"] - first["a"]).max()) > 1e-3
    # ... and the finite difference reproduces it
    np.testing.assert_allclose(np.asarray(fd["a"]), np.asarray(exact["a"]), rtol=2e-3, atol=2e-5)

    # the Hessian-vector product itself, against an explicit mixed Hessian (jacfwd of grad)
    v = jax.tree.map(lambda w: jnp.ones_like(w) * 0.3, params)
    mixed = jax.jit(jax.jacfwd(lambda w: jax.grad(_supernet_loss, 1)(w, arch, tr)["a"]))(params)
    want = sum(jnp.tensordot(mixed[k], v[k], axes=v[k].ndim) for k in params)
    for method in ("hvp", "fd"):
        got = arch_hessian_vector(_supernet_loss, params, arch, tr, v, method=method)
        np.testing.assert_allclose(np.asarray(got["a"]), np.asarray(want), rtol=2e-3, atol=2e-5)
    zero = arch_hessian_vector(_supernet_loss, params, arch, tr, jax.tree.map(jnp.zeros_like, v), method="fd")
    assert float(jnp.abs(zero["a"]).max()) == 0.0

    # xi = 0: the first-order DARTS gradient, for either method
    for method in ("fd", "hvp"):
        g0 = darts_arch_grad(_supernet_loss, params, arch, tr, va, xi=0.0, method=method)
        np.testing.assert_allclose(np.asarray(g0["a"]), np.asarray(first["a"]), rtol=1e-6)

    # the pt.darts / DP-FNAS precedence bug (term * eps^2 instead of / (2 eps)) would be
    # indistinguishable from first order; ours is not
    g_w = grad_w(params, arch, tr)
    w_prime = jax.tree.map(lambda w, g: w - xi * g, params, g_w)
    a_val = grad_a(w_prime, arch, va)
    assert float(jnp.abs(exact["a"] - a_val["a"]).max()) > 1e-3

    # params_prime overrides the plain virtual step
    same = darts_arch_grad(_supernet_loss, params, arch, tr, va, xi=xi, method="hvp", params_prime=w_prime)
    np.testing.assert_allclose(np.asarray(same["a"]), np.asarray(exact["a"]), rtol=1e-6)
    with pytest.raises(ValueError, match="method"):
        _arch_hessian_vector(_supernet_loss, params, arch, tr, v, method="nope")


# --- Per-example normalisation of the DARTS search network (DP mode) -------------------


def _host_init(net, x, seed=0):
    """Variables of ``net`` with host-drawn values (compiling a real ``init`` costs seconds)."""
    shapes = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), x, train=False))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        if "'var'" in jax.tree_util.keystr(path):
            return jnp.ones(s.shape, s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape) * 0.5, s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.mark.parametrize("norm", ["group", "layer"])
def test_search_network_with_per_example_norm_does_not_couple_examples(norm):
    from jaxfednas.search_spaces.darts import DartsSearchNetwork

    # two reduction cells: FactorizedReduce and ReLUConvBN preprocessing, pool + norm, sep conv
    net = DartsSearchNetwork(C=4, num_classes=3, layers=2, steps=2, multiplier=2, norm=norm,
                             primitives=("max_pool_3x3", "skip_connect", "sep_conv_3x3"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8, 8, 1)), jnp.float32)
    other = x.at[1:].set(jnp.asarray(rng.standard_normal((3, 8, 8, 1)) * 5 + 2, jnp.float32))
    variables = _host_init(net, x)
    assert set(variables) == {"params", "arch"}  # no batch statistics to share

    @jax.jit
    def outputs(v):
        run = lambda x, train=True: net.apply(v, x, train=train)  # noqa: E731
        return run(x), run(other), run(x[:1]), run(x, False)

    out, out_other, out_alone, out_eval = outputs(variables)
    # other examples replaced, or absent: row 0 is unchanged
    np.testing.assert_allclose(np.asarray(out_other[0]), np.asarray(out[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_alone[0]), np.asarray(out[0]), rtol=1e-5, atol=1e-5)
    # training and evaluation mode agree (no running statistics)
    np.testing.assert_allclose(np.asarray(out_eval), np.asarray(out), rtol=1e-5, atol=1e-5)

    if norm == "group":  # the default BatchNorm network does couple them (what DP mode avoids)
        bn = net.clone(norm="batch")
        vb = _host_init(bn, x)
        f = jax.jit(lambda x: bn.apply(vb, x, train=True, mutable=["batch_stats"])[0])
        assert float(jnp.abs(f(other)[0] - f(x)[0]).max()) > 1e-3
        with pytest.raises(ValueError, match="norm"):
            jax.eval_shape(lambda: net.clone(norm="instance").init(jax.random.PRNGKey(0), x))
