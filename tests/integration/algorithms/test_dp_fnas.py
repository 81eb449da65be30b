"""DP-FNAS (Algorithm 1, Eq. 5) without noise: one iteration against a hand-written
update (the server sums the parties' H_k), and config validation. Set-up in
dp_fnas_setup.py; the privacy side is in test_dp_fnas_budget.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_fnas_setup import TINY, make_data2, make_s0

from jaxfednas import rng
from jaxfednas.algorithms.dp_fnas import DPFNASConfig, dp_fnas, make_parties, make_supernet
from jaxfednas.config import ConfigError
from jaxfednas.optim import darts_arch_grad
from jaxfednas.registry import build_algorithm, make_config
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement


@pytest.fixture(scope="module")
def data2():
    # ~9 search-train / 3 search-val examples per party: the per-example second-order
    # terms of a 68-example round take ~50 s to run on XLA:CPU, of 18 examples ~1 s
    return make_data2(num_train=32)


@pytest.fixture(scope="module")
def s0(data2):
    return make_s0(data2)


def _party(data, split, k):
    s = getattr(data, split)
    n = int(s.counts[k])
    return {"x": data.info.normalize(s.x[k, :n]), "y": s.y[k, :n]}


def test_nonprivate_iteration_equals_a_manual_update_and_the_server_sums_H(data2, s0):
    """sigma = 0, no clipping, p = 1 (every example sampled): one iteration is
    W' = W - xi sum_k grad_W L_k^tr(W, A) and A' = A - eta sum_k H_k with H_k the
    second-order DARTS gradient of Eq. 5 at W'. The exact Hessian-vector product is
    linear in the validation gradient, so the sum of the algorithm's per-example terms
    equals the batch-level term computed here (the finite difference is compared with
    it on a smooth model in test_dp.py: on a ReLU supernet a W-step of norm 0.01
    crosses kinks, as in DARTS itself)."""
    xi, eta = 0.5, 1.0
    cfg = DPFNASConfig(**TINY, noise_multiplier=0.0, clip_norm=0.0, arch_clip_norm=0.0, sampling_prob=1.0,
                       iterations_per_round=1, server_lr=xi, server_lr_min=xi, arch_server_optimizer="sgd",
                       arch_server_lr=eta, arch_gradient="second_hvp")
    algo = dp_fnas(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    s1, m = algo.round(s0, data2, jax.random.PRNGKey(7))
    m = algo.with_host_metrics(s1, data2, m)
    assert int(m["iterations"]) == 1 and int(m["train_overflow"]) == 0 and float(m["train_clipped_frac"]) == 0
    assert int(m["train_sampled"]) == int(data2.train.counts.sum())  # p = 1: every example, once
    assert not any("epsilon" in k or k.startswith("mu_") for k in m)  # no noise: no finite guarantee to report

    model = make_supernet(cfg, data2.info)

    def loss(params, arch, batch):  # GroupNorm: the batch loss is the mean of per-example losses
        logits = model.apply({"params": params, "arch": arch}, batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    w, a = s0.variables["params"], s0.variables["arch"]
    tr = [_party(data2, "train", k) for k in range(2)]
    va = [_party(data2, "val", k) for k in range(2)]
    grad_w = jax.jit(jax.grad(loss))
    w_new = jax.tree.map(lambda p, g0, g1: p - xi * (g0 + g1), w, grad_w(w, a, tr[0]), grad_w(w, a, tr[1]))

    @jax.jit
    def party_h(t, v):  # Eq. 5 on the party's whole batch
        h = darts_arch_grad(loss, w, a, t, v, xi=xi, params_prime=w_new, method="hvp")
        return h, jax.grad(loss, 1)(w_new, a, v)

    (h0, f0), (h1, f1) = party_h(tr[0], va[0]), party_h(tr[1], va[1])
    hs, first = [h0, h1], [f0, f1]
    for got, want in zip(jax.tree.leaves(s1.variables["params"]), jax.tree.leaves(w_new)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)

    step = jax.tree.map(lambda new, old: (old - new) / eta, s1.variables["arch"], a)  # = sum_k H_k
    h_sum = jax.tree.map(lambda x, y: x + y, *hs)
    first_sum = jax.tree.map(lambda x, y: x + y, *first)
    np.testing.assert_array_equal(np.asarray(step["alphas_normal"]), 0.0)  # one cell: a reduction cell
    for key in ("alphas_reduce",):
        got, want = np.asarray(step[key]), np.asarray(h_sum[key])
        scale = np.abs(want).max()
        # the parties' H_k differ, and the server applies their sum (not one party's)
        assert np.abs(np.asarray(hs[0][key]) - np.asarray(hs[1][key])).max() > 0.1 * scale
        assert np.abs(want - np.asarray(first_sum[key])).max() > 0.1 * scale  # the Hessian term matters
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * scale)


def test_config_errors(data2):
    with pytest.raises(ConfigError, match="clip_norm"):
        DPFNASConfig(noise_multiplier=1.0, clip_norm=0.0)
    with pytest.raises(ConfigError, match="arch_clip_norm"):
        DPFNASConfig(arch_noise_multiplier=0.5, arch_clip_norm=0.0)
    with pytest.raises(ConfigError, match="target_epsilon"):
        DPFNASConfig(noise_multiplier=0.0, clip_norm=0.0, target_epsilon=1.0)
    with pytest.raises(ConfigError, match="single iteration"):
        dp_fnas(DPFNASConfig(**TINY, target_epsilon=1e-3), data2.info)
    # a noise whose epsilon the PLD accountant cannot compute is refused now, not after round 1
    with pytest.raises(ConfigError, match=r"algo.arch_noise_multiplier=0.0005 is too small for the PLD accountant"):
        DPFNASConfig(arch_noise_multiplier=5e-4)
    with pytest.raises(ConfigError, match="validation split"):
        build_algorithm(make_config("dp_fnas", overrides={"data.split": (0.75, 0.0, 0.25)}), data2.info)
    with pytest.raises(ConfigError, match="every party"):
        build_algorithm(make_config("dp_fnas", overrides={"run.clients_per_round": 0.5}), data2.info)
    with pytest.raises(ConfigError, match="split_method"):  # the reported ε needs independent splits
        build_algorithm(make_config("dp_fnas", overrides={"data.split_method": "shuffle"}), data2.info)
    with pytest.raises(ConfigError, match="every party"):
        build_algorithm(make_config("dp_fnas", overrides={"run.dropout_rate": 0.1}), data2.info)
    # JAX cannot vmap the depthwise convolution's second-order gradient inside shard_map: refused, not a
    # NotImplementedError from inside the compiled round
    hvp = {"algo.arch_gradient": "second_hvp", "run.placement": "shard_map"}
    with pytest.raises(ConfigError, match="second_hvp under placement shard_map"):
        build_algorithm(make_config("dp_fnas", overrides=hvp), data2.info)
    build_algorithm(make_config("dp_fnas", overrides={**hvp, "run.placement": "map"}), data2.info)
    assert make_config("dp_fnas").data.split_method == "independent"
    assert make_config("dp_fnas", preset="paper").algo.clip_norm == 0.01


def test_hessian_term_uses_the_weight_gradients_poisson_sample(data2, s0):
    """Eq. 5's L_k^tr is the loss on the examples I sampled for the same iteration's G_k.

    At p = 1 every sample is the whole split, so only p < 1 can tell. Party 0, no noise or
    clipping, exact HVP, p = 0.5 on train and p_val = 1 on val: G_k is checked against
    sum_{i in I} grad_W l_i / (p N^tr) on the explicitly drawn I (the rows with
    u_i < p, u from the party key folded with DP_TRAIN_SAMPLE), then H_k against DARTS'
    second-order gradient on that I, and against the same on the whole split (what a
    Hessian sampled with p_val would use) and on a sample drawn with another key, both of
    which must differ."""
    p, xi = 0.5, 0.5
    cfg = DPFNASConfig(**TINY, noise_multiplier=0.0, clip_norm=0.0, arch_clip_norm=0.0, sampling_prob=p,
                       val_sampling_prob=1.0, arch_gradient="second_hvp")
    party_G, party_H = make_parties(cfg, data2.info)
    train, val = (jax.tree.map(lambda a: a[0], data2.all_clients(s)) for s in ("train", "val"))
    key = jax.random.PRNGKey(3)
    w, a = s0.variables["params"], s0.variables["arch"]
    g_k, st_g = jax.jit(party_G)((train, key), (w, a))
    w_new = jax.tree.map(lambda p_, g: p_ - xi * g, w, g_k)
    h_k, st_h = jax.jit(party_H)((train, val, key), (w, w_new, a, jnp.float32(xi)))

    n_tr, n_val = int(train.count), int(val.count)

    def draw(k):  # Poisson(p) of the party's rows: u_i < p
        u = np.asarray(jax.random.uniform(jax.random.fold_in(k, rng.DP_TRAIN_SAMPLE), (train.y.shape[0],)))
        return np.flatnonzero(u[:n_tr] < p)

    sample = draw(key)
    assert 0 < len(sample) < n_tr and int(st_g["train_sampled"]) == len(sample)
    assert int(st_h["val_sampled"]) == n_val  # p_val = 1: the whole validation split

    model = make_supernet(cfg, data2.info)

    def loss(params, arch, batch):  # sum_i weight_i l_i (GroupNorm: no coupling between examples)
        logits = model.apply({"params": params, "arch": arch}, batch["x"], train=True)
        return (batch["w"] * optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])).sum()

    def rows(split, n, idx, weight):  # every row, weight 0 outside idx: one shape, one compile
        return {"x": data2.info.normalize(split.x[:n]), "y": split.y[:n],
                "w": jnp.zeros(n).at[np.asarray(idx)].set(weight)}

    val_batch = rows(val, n_val, np.arange(n_val), 1.0 / n_val)  # H_k's normaliser p_val N^val
    train_of = lambda idx: rows(train, n_tr, idx, 1.0 / (p * n_tr))  # noqa: E731  (G_k's: p N^tr)
    eq5 = jax.jit(lambda t: darts_arch_grad(loss, w, a, t, val_batch, xi=xi, params_prime=w_new, method="hvp"))

    want_g = jax.jit(jax.grad(loss))(w, a, train_of(sample))
    for got, want in zip(jax.tree.leaves(g_k), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)

    got = np.asarray(h_k["alphas_reduce"])
    want = np.asarray(eq5(train_of(sample))["alphas_reduce"])
    other = draw(jax.random.fold_in(key, 1))
    assert sorted(other) != sorted(sample)
    scale = np.abs(want).max()
    for wrong in (np.arange(n_tr), other):  # the whole split (p_val = 1), another draw
        away = np.asarray(eq5(train_of(wrong))["alphas_reduce"])
        assert np.abs(away - want).max() > 0.05 * scale, wrong
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * scale)


def test_weight_step_follows_the_cosine_decay_of_xi(data2, s0):
    """``lr_decay_iterations`` (the paper preset's cosine from 0.05 to 0.002): xi is lr at
    iteration 0 and lr_min from iteration ``lr_decay_iterations`` = 1 on. Two iterations of a
    round without noise or clipping at p = 1 (first order, SGD on A), by hand:
    W1 = W0 - xi_0 sum_k grad_W L_k^tr(W0, A0), A1 = A0 - eta sum_k grad_A L_k^val(W1, A0),
    W2 = W1 - xi_1 sum_k grad_W L_k^tr(W1, A1); the reported lr is xi_2 = lr_min."""
    xi0, xi1, eta = 0.5, 0.05, 1.0
    cfg = DPFNASConfig(**TINY, noise_multiplier=0.0, clip_norm=0.0, arch_clip_norm=0.0, sampling_prob=1.0,
                       iterations_per_round=2, server_lr=xi0, server_lr_min=xi1, server_lr_decay_iterations=1,
                       arch_gradient="first", arch_server_optimizer="sgd", arch_server_lr=eta)
    algo = dp_fnas(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    s2, m = algo.round(s0, data2, jax.random.PRNGKey(7))
    assert int(m["iterations"]) == 2 and float(m["lr"]) == pytest.approx(xi1)

    model = make_supernet(cfg, data2.info)

    def loss(params, arch, batch):  # GroupNorm: the batch loss is the mean of per-example losses
        logits = model.apply({"params": params, "arch": arch}, batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tr = [_party(data2, "train", k) for k in range(2)]
    va = [_party(data2, "val", k) for k in range(2)]
    grad_w, grad_a = jax.jit(jax.grad(loss)), jax.jit(jax.grad(loss, 1))

    def summed(grad, params, arch, batches):
        return jax.tree.map(lambda *g: sum(g), *(grad(params, arch, b) for b in batches))

    def step(tree, g, lr):
        return jax.tree.map(lambda p, d: p - lr * d, tree, g)

    w0, a0 = s0.variables["params"], s0.variables["arch"]
    w1 = step(w0, summed(grad_w, w0, a0, tr), xi0)
    a1 = step(a0, summed(grad_a, w1, a0, va), eta)
    w2 = step(w1, summed(grad_w, w1, a1, tr), xi1)
    for got, want in zip(jax.tree.leaves(s2.variables["params"]), jax.tree.leaves(w2)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    at_lr = step(w1, summed(grad_w, w1, a1, tr), xi0)  # what a constant xi would give
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(at_lr), jax.tree.leaves(w2))) > 1e-3
