"""DP-FNAS with noise: the privacy budget stops the search before the enforcing
accountant's epsilon exceeds it, every epsilon named by its accountant, the noise each
party sends against what the accountant assumes, one compile per round, evaluate and
export. Set-up in dp_fnas_setup.py."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_fnas_setup import TINY, make_data2, make_s0

from jaxfednas.algorithms.dp_fnas import (Accountant, DPFNASConfig, dp_fnas, make_parties, max_iterations, physical_batch,
                                privacy_report)
from jaxfednas import privacy, rng
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement
from jaxfednas.search_spaces.darts import Genotype
from conftest import assert_accuracy

DELTA = 1e-5


@functools.cache
def _clt(p, sigma, t):
    return privacy.gdp_epsilon(mu=privacy.gdp_mu_poisson(sampling_prob=p, noise_multiplier=sigma, steps=t),
                               delta=DELTA)


@functools.cache
def _pld(p, sigma, t):
    return privacy.pld_epsilon(sampling_prob=p, noise_multiplier=sigma, steps=t, delta=DELTA)


def _rdp(p, sigma, t):
    return privacy.rdp_epsilon(sampling_prob=p, noise_multiplier=sigma, steps=t, delta=DELTA)


@pytest.fixture(scope="module")
def data2():
    return make_data2()


@pytest.fixture(scope="module")
def s0(data2):
    return make_s0(data2)


@pytest.fixture(scope="module")
def dp_run(data2, s0):
    """sigma = tau = 1, p = 0.5, the budget enforced by the CLT accountant (the paper's
    number) and allowing exactly 3 iterations, where the PLD epsilon exceeds it."""
    p = 0.5
    c3, c4 = _clt(p, 1.0, 3), _clt(p, 1.0, 4)
    cfg = DPFNASConfig(**TINY, sampling_prob=p, noise_multiplier=1.0, clip_norm=1.0, arch_clip_norm=1.0,
                       iterations_per_round=2, target_epsilon=(c3 + c4) / 2, accountant="clt")
    with pytest.warns(UserWarning, match="accountant=clt") as caught:
        algo = dp_fnas(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    states, metrics = [s0], []
    for r in range(3):
        s, m = algo.round(states[-1], data2, jax.random.PRNGKey(r))
        states.append(s)
        metrics.append(algo.with_host_metrics(s, data2, m))  # the accountant, on the host
    return cfg, algo, states, metrics, [str(w.message) for w in caught if "accountant=clt" in str(w.message)]


def test_target_epsilon_stops_before_the_budget_is_exceeded(dp_run):
    cfg, algo, states, metrics, warned = dp_run
    p, t = cfg.sampling_prob, 3
    assert _clt(p, 1.0, t) <= cfg.target_epsilon < _clt(p, 1.0, t + 1) and max_iterations(cfg) == t
    assert [int(m["iterations"]) for m in metrics] == [2, 3, 3]
    assert [int(m["iterations_run"]) for m in metrics] == [2, 1, 0]
    assert sum(int(m["iterations_run"]) for m in metrics) == t  # the steps the accountant composes below
    assert [int(m["budget_exhausted"]) for m in metrics] == [0, 1, 1]
    assert all(int(m["max_iterations"]) == t for m in metrics)
    # past the budget nothing is released: the state no longer changes
    for a, b in zip(jax.tree.leaves(states[2].variables), jax.tree.leaves(states[3].variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # but it did change before
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0
               for a, b in zip(jax.tree.leaves(states[1].variables), jax.tree.leaves(states[2].variables)))
    # the budget figure is the enforcing (CLT) accountant's epsilon and stays within the target,
    # while the PLD guarantee of the same run exceeds it (the CLT is optimistic), and says so
    m = metrics[-1]
    assert m["budget_epsilon"] == m["epsilon_clt"] == pytest.approx(_clt(p, 1.0, t), rel=1e-12)
    assert m["budget_epsilon"] <= cfg.target_epsilon < m["epsilon_pld"]
    assert len(warned) == 1 and f"PLD epsilon = {m['epsilon_pld']:.4g}" in warned[0]
    assert metrics[0]["budget_epsilon"] == pytest.approx(_clt(p, 1.0, 2), rel=1e-12)
    # every epsilon is named by its accountant and equals that accountant called with the run's p, sigma, T
    for mech in ("train", "val"):
        assert m[f"mu_{mech}"] == pytest.approx(
            privacy.gdp_mu_poisson(sampling_prob=p, noise_multiplier=1.0, steps=t), rel=1e-12)
        assert m[f"epsilon_clt_{mech}"] == pytest.approx(_clt(p, 1.0, t), rel=1e-12)
        assert m[f"epsilon_pld_{mech}"] == pytest.approx(_pld(p, 1.0, t), rel=1e-9)
    assert m["epsilon_pld"] == pytest.approx(_pld(p, 1.0, t), rel=1e-9)
    assert metrics[0]["epsilon_pld_train"] == pytest.approx(_pld(p, 1.0, 2), rel=1e-9)
    assert "epsilon" not in m and not any(k.startswith("epsilon_rdp") for k in m)  # RDP: only when it enforces
    assert 0 <= m["overflow_bound_train"] < 1e-8 and int(m["train_overflow"]) == 0
    rep = privacy_report(cfg, t)
    assert rep.epsilon_pld == pytest.approx(m["epsilon_pld"], rel=1e-9)
    assert rep.epsilon_clt == pytest.approx(m["epsilon_clt"], rel=1e-12)


def test_budget_epsilon_is_the_enforcing_accountants(data2, s0):
    """RDP enforcing (host side: the stop itself is the compiled ``cap`` tested above): the
    budget figure is RDP's, within the target, and building warns of nothing."""
    p, sigma, tau = 0.5, 1.0, 1.2  # tau > sigma: the budget binds on M^G, epsilon = max over the two
    target = (_rdp(p, sigma, 3) + _rdp(p, sigma, 4)) / 2
    cfg = DPFNASConfig(**TINY, sampling_prob=p, noise_multiplier=sigma, arch_noise_multiplier=tau,
                       target_epsilon=target, accountant="rdp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        algo = dp_fnas(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    assert not [w for w in caught if "accountant" in str(w.message)]
    m = algo.host_metrics(s0.replace(iteration=jnp.int32(3)), data2)  # 3 = max_iterations(cfg)
    assert m["budget_epsilon"] == m["epsilon_rdp"] == pytest.approx(_rdp(p, sigma, 3), rel=1e-9)
    assert m["budget_epsilon"] <= target
    assert m["epsilon_rdp_val"] == pytest.approx(_rdp(p, tau, 3), rel=1e-9)
    assert m["epsilon_pld_train"] == pytest.approx(_pld(p, sigma, 3), rel=1e-9)
    assert m["epsilon_clt_train"] == pytest.approx(_clt(p, sigma, 3), rel=1e-12)


def _noise_multiplier_sent(x, expected_batch, clip_norm):
    """``[K, d]`` releases over K iteration keys: the std over keys (pooled over the d
    coordinates) times the expected batch over the clip norm — the noise multiplier a
    party's release carries, if its clipped sum were fixed."""
    x = np.asarray(x, np.float64)
    var = ((x - x.mean(0)) ** 2).sum() / (x.shape[0] - 1) / x.shape[1]
    return float(np.sqrt(var)) * expected_batch / clip_norm


def test_what_a_party_sends_has_the_noise_the_accountant_assumes(s0):
    """Theorem 3.1's accounting holds only if each party's G_k carries N(0, (sigma R^G)^2) and
    its H_k N(0, (tau R^H)^2), over the expected batch p N_k, on Poisson samples of rate p
    and p_val. Runs the parties' own release functions (those the compiled round maps over
    the parties), with the keys a round gives them, over many iterations (one compile).
    Over the keys a release varies by its noise and by its Poisson sample; the sample's
    share of the variance, averaged over the d coordinates, is at most
    p (1 - p) N R^2 / d (each clipped example has norm <= R), a fraction of a percent here,
    so the std over keys measures the noise sent. sigma, tau, R^G, R^H, p and p_val are
    distinct so that a swapped or missing factor shows."""
    data = make_data2(num_train=32)  # ~10 / 8 search-train and 3 / 3 search-val examples per party
    sigma, tau, clip, arch_clip, p, p_val = 2.0, 3.0, 0.5, 2.0, 0.5, 0.25
    cfg = DPFNASConfig(**TINY, sampling_prob=p, val_sampling_prob=p_val, noise_multiplier=sigma,
                       arch_noise_multiplier=tau, clip_norm=clip, arch_clip_norm=arch_clip, arch_gradient="first")
    party_G, party_H = make_parties(cfg, data.info)
    w, a = s0.variables["params"], s0.variables["arch"]
    train, val = data.all_clients("train"), data.all_clients("val")
    ids = jnp.arange(data.info.num_clients)

    def keys(n):  # [iterations, parties]: the keys round j gives its parties
        return jax.vmap(lambda j: rng.client_keys(rng.dp_iteration_key(jax.random.PRNGKey(5), j), ids))(
            jnp.arange(n))

    def flat(tree):
        return jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])

    def send_G(tr, key):
        g, st = party_G((tr, key), (w, a))
        return flat(g), st["train_sampled"]

    def send_H(tr, va, key):
        h, st = party_H((tr, va, key), (w, w, a, 0.0))
        return flat(h), st["val_sampled"]

    @jax.jit
    def releases(keys_g, keys_h):  # 1086 weights: few keys suffice; 12 architecture parameters: many
        return (jax.vmap(jax.vmap(send_G), (None, 0))(train, keys_g),
                jax.vmap(jax.vmap(send_H), (None, None, 0))(train, val, keys_h))

    (g, n_tr), (h, n_val) = jax.device_get(releases(keys(32), keys(1024)))  # [K, parties, ...]
    assumed = {name: (q, noise) for name, q, noise in Accountant(cfg).mechanisms()}
    assert assumed == {"train": (p, sigma), "val": (p_val, tau)}
    for k in range(data.info.num_clients):
        for x, sampled, counts, r, name in ((g, n_tr, data.train.counts, clip, "train"),
                                            (h, n_val, data.val.counts, arch_clip, "val")):
            q, mult = assumed[name]
            n_k = int(counts[k])
            x_k = x[:, k]
            sent = _noise_multiplier_sent(x_k, q * n_k, r)  # the expected batch p N_k, by hand
            tol = 5 * np.sqrt(2 / x_k.size)  # ~5 standard errors of a variance estimate
            bias = q * (1 - q) * n_k / x_k.shape[1]
            print(f"{name} party {k}: noise multiplier sent {sent:.4f}, accountant's {mult}")
            assert mult**2 * (1 - tol) <= sent**2 <= mult**2 * (1 + tol) + bias, (name, k, sent, mult)
            # the sampling rate used: the Poisson sample sizes over the keys (~5 standard errors)
            rate = np.asarray(sampled)[:, k].mean() / n_k
            assert rate == pytest.approx(q, abs=5 * np.sqrt(q * (1 - q) / (sampled.shape[0] * n_k))), (name, k)
    # fresh noise per party: the parties' weight noise is uncorrelated
    noise = g - g.mean(0)  # less the mean over keys: what varies from iteration to iteration
    r01 = np.corrcoef(noise[:, 0].ravel(), noise[:, 1].ravel())[0, 1]
    assert abs(r01) < 5 / np.sqrt(g[:, 0].size)


def test_one_compile_per_round_noise_export_and_evaluate(data2, dp_run, count_traces):
    cfg, algo, states, metrics, _ = dp_run
    for m in metrics:
        for k in ("train_loss", "search_val_acc", "train_clipped_frac", "arch_entropy", "lr"):
            assert np.isfinite(float(m[k])), k
    # the noise (and the Poisson sample) depend on the round key; the round is not recompiled
    with count_traces() as traced:
        other, _ = algo.round(states[0], data2, jax.random.PRNGKey(99))
    assert traced == []
    assert np.abs(np.asarray(other.variables["arch"]["alphas_normal"])
                  - np.asarray(states[1].variables["arch"]["alphas_normal"])).max() > 0
    out = algo.with_host_metrics(states[-1], data2, algo.evaluate(states[-1], data2))
    assert_accuracy(out["global_test_acc"], data2.server_y.shape[0])
    assert int(out["iterations"]) == 3
    assert out["budget_epsilon"] == metrics[-1]["budget_epsilon"]
    g = algo.export(states[-1])
    assert isinstance(g, Genotype) and g.steps == 1
    assert {op for op, _ in g.normal} <= {"skip_connect", "avg_pool_3x3", "sep_conv_3x3"}
    # 32 training rows per party at p = 0.5: the auto physical batch never overflows in practice
    assert 16 < physical_batch(cfg, 32, 0.5) <= 33


@pytest.mark.parametrize("accountant,arch", [
    ("clt", {"arch_noise_multiplier": 0.7}),  # τ < σ: the architecture mechanism spends the budget first
    ("rdp", {"arch_noise_multiplier": 0.8}),
    ("rdp", {"val_sampling_prob": 0.1}),  # a validation sampling rate above the training one
])
def test_max_iterations_bound_by_the_architecture_mechanism(accountant, arch):
    """Where M^H (architecture gradients on the validation split: p_val, τ) is the weaker
    mechanism, it bounds the iterations: T is the last whose ε of M^H is within the target,
    computed here by hand with the enforcing accountant; the weights' mechanism alone would
    allow more. The report's budget_epsilon is M^H's."""
    eps = {"clt": _clt, "rdp": _rdp}[accountant]
    p, sigma = 0.05, 1.0
    cfg = DPFNASConfig(**TINY, sampling_prob=p, noise_multiplier=sigma, clip_norm=1.0, arch_clip_norm=1.0,
                       target_epsilon=4.0, accountant=accountant, delta=DELTA, **arch)
    p_val, tau = cfg.p_val, cfg.tau
    t = max_iterations(cfg)
    assert t > 0 and eps(p_val, tau, t) <= 4.0 < eps(p_val, tau, t + 1)
    assert eps(p, sigma, t + 1) <= 4.0  # not the weights' mechanism's bound
    report = Accountant(cfg).report(t)
    assert report["budget_epsilon"] == pytest.approx(eps(p_val, tau, t), rel=1e-9)
    assert report["budget_epsilon"] > eps(p, sigma, t)


def test_a_noise_too_small_for_the_pld_accountant_gets_advice_the_run_can_follow():
    """A DP-FNAS run cannot change the PLD interval or accountant it reports with: the refusal
    names the noise multiplier and what to do with it (calibrate one, or 0), both of which work."""
    from jaxfednas.cli import _parser
    from jaxfednas.config import ConfigError
    from jaxfednas.registry import make_config

    with pytest.raises(ConfigError, match="algo.noise_multiplier=0.0001 is too small for the PLD accountant every "
                                          "DP-FNAS round reports.*--target-epsilon.*or 0") as e:
        make_config("dp_fnas", overrides={"algo.noise_multiplier": 1e-4})
    assert "--pld-interval" not in str(e.value) and "RDP" not in str(e.value)
    assert _parser().parse_args(["privacy", "--sampling-prob", "0.06", "--noise-multiplier", "1", "--steps", "500",
                                 "--delta", "1e-5",
                                 "--target-epsilon", "4"]).target_epsilon == 4  # the calibration it names
    assert make_config("dp_fnas", overrides={"algo.noise_multiplier": 0.0, "algo.clip_norm": 0.0}).algo \
        .noise_multiplier == 0  # (0: the non-private counterpart)
