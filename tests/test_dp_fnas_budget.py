"""DP-FNAS with noise (sigma = tau = 1): the privacy budget stops the search before
it is exceeded, the accountant's mu / epsilon per mechanism, one compile per round,
noise, evaluate and export. Set-up in dp_fnas_setup.py."""
import jax
import numpy as np
import pytest
from dp_fnas_setup import TINY, make_data2, make_s0

from algorithms.dp_fnas import DPFNASConfig, dp_fnas, max_iterations, physical_batch, privacy_report
from jaxfednas import privacy
from jaxfednas.runtime import Placement
from search_spaces.darts import Genotype
from conftest import assert_accuracy


@pytest.fixture(scope="module")
def data2():
    return make_data2()


@pytest.fixture(scope="module")
def s0(data2):
    return make_s0(data2)


@pytest.fixture(scope="module")
def dp_run(data2, s0):
    """sigma = tau = 1 with a budget that allows exactly 3 iterations (PLD, delta 1e-5)."""
    p = 0.5
    e3, e4 = (privacy.pld_epsilon(sampling_prob=p, noise_multiplier=1.0, steps=t, delta=1e-5) for t in (3, 4))
    cfg = DPFNASConfig(**TINY, sampling_prob=p, noise_multiplier=1.0, clip_norm=1.0, arch_clip_norm=1.0,
                       iterations_per_round=2, target_epsilon=(e3 + e4) / 2)
    algo = dp_fnas(cfg, data2.info, placement=Placement("map"))
    states, metrics = [s0], []
    for r in range(3):
        s, m = algo.round(states[-1], data2, jax.random.PRNGKey(r))
        states.append(s)
        metrics.append(algo.with_host_metrics(s, data2, m))  # the accountant, on the host
    return cfg, algo, states, metrics, (e3, e4)


def test_target_epsilon_stops_before_the_budget_is_exceeded(dp_run):
    cfg, algo, states, metrics, (e3, e4) = dp_run
    assert e3 <= cfg.target_epsilon < e4 and max_iterations(cfg) == 3
    assert [int(m["iterations"]) for m in metrics] == [2, 3, 3]
    assert [int(m["iterations_run"]) for m in metrics] == [2, 1, 0]
    assert [int(m["budget_exhausted"]) for m in metrics] == [0, 1, 1]
    assert all(int(m["max_iterations"]) == 3 for m in metrics)
    # past the budget nothing is released: the state no longer changes
    for a, b in zip(jax.tree.leaves(states[2].variables), jax.tree.leaves(states[3].variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # but it did change before
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0
               for a, b in zip(jax.tree.leaves(states[1].variables), jax.tree.leaves(states[2].variables)))
    # the reported epsilon is that of the iterations done, within the budget
    m = metrics[-1]
    assert m["eps_pld_train"] == m["eps_pld_val"] == m["epsilon"] == pytest.approx(e3, rel=1e-9)
    assert m["epsilon"] <= cfg.target_epsilon
    assert m["mu_train"] == pytest.approx(privacy.gdp_mu_poisson(sampling_prob=0.5, noise_multiplier=1.0, steps=3))
    assert m["eps_clt_val"] == pytest.approx(privacy.gdp_epsilon(mu=m["mu_val"], delta=1e-5))
    assert metrics[0]["eps_pld_train"] == pytest.approx(
        privacy.pld_epsilon(sampling_prob=0.5, noise_multiplier=1.0, steps=2, delta=1e-5))
    assert 0 <= m["overflow_bound_train"] < 1e-8 and int(m["train_overflow"]) == 0
    rep = privacy_report(cfg, 3)
    assert rep.epsilon_pld == pytest.approx(e3, rel=1e-9)


def test_one_compile_per_round_noise_export_and_evaluate(data2, dp_run, count_traces):
    cfg, algo, states, metrics, _ = dp_run
    for m in metrics:
        for k in ("train_loss", "search_val_acc", "train_clipped_frac", "arch_entropy", "xi"):
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
    assert out["epsilon"] == metrics[-1]["epsilon"]
    g = algo.export(states[-1])
    assert isinstance(g, Genotype) and g.steps == 1
    assert {op for op, _ in g.normal} <= {"skip_connect", "avg_pool_3x3", "sep_conv_3x3"}
    # 32 training rows per party at p = 0.5: the auto physical batch never overflows in practice
    assert 16 < physical_batch(cfg, 32, 0.5) <= 33
