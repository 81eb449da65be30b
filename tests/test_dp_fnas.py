"""DP-FNAS (Algorithm 1, Eq. 5) without noise: one iteration against a hand-written
update (the server sums the parties' H_k), and config validation. Set-up in
dp_fnas_setup.py; the privacy side is in test_dp_fnas_budget.py."""
import jax
import numpy as np
import optax
import pytest
from dp_fnas_setup import TINY, make_data2, make_s0

from jaxfednas.algorithms.dp_fnas import DPFNASConfig, dp_fnas, make_supernet
from jaxfednas.config import ConfigError
from jaxfednas.optim import darts_arch_grad
from jaxfednas.registry import algorithm_module, make_config
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
                       iterations_per_round=1, lr=xi, lr_min=xi, arch_optimizer="sgd", arch_lr=eta,
                       arch_gradient="second_hvp")
    algo = dp_fnas(cfg, data2.info, placement=Placement("map"))
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
    mod = algorithm_module("dp_fnas")
    with pytest.raises(ConfigError, match="validation split"):
        mod.build(make_config("dp_fnas", overrides={"data.split": (0.75, 0.0, 0.25)}), data2.info)
    with pytest.raises(ConfigError, match="every party"):
        mod.build(make_config("dp_fnas", overrides={"run.clients_per_round": 0.5}), data2.info)
    with pytest.raises(ConfigError, match="split_method"):  # the reported ε needs independent splits
        mod.build(make_config("dp_fnas", overrides={"data.split_method": "shuffle"}), data2.info)
    with pytest.raises(ConfigError, match="every party"):
        mod.build(make_config("dp_fnas", overrides={"run.dropout_rate": 0.1}), data2.info)
    # JAX cannot vmap the depthwise convolution's second-order gradient inside shard_map: refused, not a
    # NotImplementedError from inside the compiled round
    hvp = {"algo.arch_gradient": "second_hvp", "run.placement": "shard_map"}
    with pytest.raises(ConfigError, match="second_hvp under placement shard_map"):
        mod.build(make_config("dp_fnas", overrides=hvp), data2.info)
    mod.build(make_config("dp_fnas", overrides={**hvp, "run.placement": "map"}), data2.info)
    assert make_config("dp_fnas").data.split_method == "independent"
    assert make_config("dp_fnas", preset="paper").algo.clip_norm == 0.01
