"""Tests for jaxfednas.privacy: CLT (GDP) accounting, PLD/RDP via dp-accounting, calibration.

Reference values are computed here independently of the module: the privacy-loss
integral of a Gaussian mechanism, dp-accounting's analytic Gaussian mechanism
(Balle & Wang 2018), and dp-accounting's PLD on an un-subsampled Gaussian.
"""
import argparse
import doctest
import math
import os
import subprocess
from pathlib import Path
import sys
import warnings

import numpy as np
import pytest
from scipy import integrate, stats

import dp_accounting
from jaxfednas import cli
from jaxfednas import privacy as P
from jaxfednas.privacy import accounting

ROOT = str(Path(__file__).resolve().parents[4])
PRIVACY_FILE = os.path.join(ROOT, "jaxfednas", "privacy", "accounting.py")


def test_doctests():
    result = doctest.testmod(accounting, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15
    assert result.failed == 0


def test_public_api_is_keyword_only():
    with pytest.raises(TypeError):
        P.gdp_mu_poisson(0.01, 1.0, 1000)  # noqa
    with pytest.raises(TypeError):
        P.gdp_epsilon(1.0, 1e-5)  # noqa
    with pytest.raises(TypeError):
        P.MechanismSpec("w", 0.01, 1.0, None, 10)  # noqa


# ---------------------------------------------------------------------------
# CLT mu
# ---------------------------------------------------------------------------
def test_gdp_mu_poisson_formula():
    # DP-FNAS Theorem 3.1 with B / N = 0.01, sigma = 1, T = 1000, by hand.
    want = 0.01 * math.sqrt(1000 * (math.e - 1.0))
    assert P.gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1.0, steps=1000) == \
        pytest.approx(want, rel=1e-13)
    for p, s, t in [(0.004, 0.8, 12_500), (0.2, 3.0, 7), (1.0, 0.5, 1)]:
        want = p * math.sqrt(t * (math.exp(s ** -2) - 1.0))
        got = P.gdp_mu_poisson(sampling_prob=p, noise_multiplier=s, steps=t)
        assert got == pytest.approx(want, rel=1e-12)


def test_gdp_mu_poisson_tiny_sigma_no_overflow():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # exp(1/sigma^2) overflows but mu (~e^400) does not: log-space keeps it finite.
        mu = P.gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1 / math.sqrt(800), steps=100)
        assert math.isfinite(mu)
        assert math.log(mu) == pytest.approx(math.log(0.01) + 0.5 * math.log(100) + 400, rel=1e-12)
        assert P.gdp_mu_poisson(sampling_prob=0.5, noise_multiplier=0.01, steps=10) == math.inf
        assert P.gdp_mu_uniform(sampling_prob=0.5, noise_multiplier=0.01, steps=10) == math.inf
        assert P.gdp_epsilon(mu=math.inf, delta=1e-5) == math.inf
        assert P.gdp_delta(mu=math.inf, epsilon=3.0) == 1.0


def _naive_mu_uniform(p, s, t):
    g = math.exp(s ** -2) * stats.norm.cdf(1.5 / s) + 3 * stats.norm.cdf(-0.5 / s) - 2
    return math.sqrt(2.0) * p * math.sqrt(t * g)


@pytest.mark.parametrize("sigma", [0.15, 1 / math.sqrt(30) * 0.999, 1 / math.sqrt(30) * 1.001,
                                   0.5, 1.0, 2.0, 10.0])
def test_gdp_mu_uniform_matches_direct_formula(sigma):
    got = P.gdp_mu_uniform(sampling_prob=0.02, noise_multiplier=sigma, steps=500)
    assert got == pytest.approx(_naive_mu_uniform(0.02, sigma, 500), rel=1e-9)


def test_gdp_mu_uniform_large_sigma_tends_to_poisson():
    # Both CLT numbers tend to p sqrt(T) / sigma; the stable form keeps this at sigma = 1e7,
    # where the direct formula has cancelled to noise.
    for sigma in [1e2, 1e4, 1e7]:
        uni = P.gdp_mu_uniform(sampling_prob=0.01, noise_multiplier=sigma, steps=10_000)
        poi = P.gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=sigma, steps=10_000)
        # expansion in x = 1/sigma: mu_uniform = p sqrt(T) x (1 + x / sqrt(2 pi) + O(x^2))
        assert uni * sigma == pytest.approx(1.0 + 1.0 / (sigma * math.sqrt(2 * math.pi)),
                                            rel=1.0 / sigma ** 2 + 1e-9)
        assert poi == pytest.approx(1.0 / sigma, rel=1e-4)
        assert uni > poi
    # fixed batches cost more than Poisson batches at small sigma
    assert P.gdp_mu_uniform(sampling_prob=0.01, noise_multiplier=1.0, steps=1000) > \
        P.gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=1.0, steps=1000)


# ---------------------------------------------------------------------------
# mu-GDP <-> (epsilon, delta)
# ---------------------------------------------------------------------------
def _delta_by_integration(mu, eps):
    """delta(eps) of N(0,1) vs N(mu,1): E_{Y~N(mu,1)}[(1 - exp(eps - L(Y)))_+], L(y) = mu y - mu^2/2.

    The hockey-stick divergence written as an integral; nothing shared with the module.
    """
    y0 = (eps + mu * mu / 2) / mu  # L(y) >= eps  <=>  y >= y0

    def integrand(y):
        return stats.norm.pdf(y, loc=mu) * -math.expm1(eps - (mu * y - mu * mu / 2))

    val, _ = integrate.quad(integrand, y0, y0 + 40.0, epsabs=0.0, epsrel=1e-12, limit=200)
    return val


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 8.0])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 3.0])
def test_gdp_delta_is_the_gaussian_mechanism_curve(sigma, eps):
    # A Gaussian mechanism with sensitivity 1 and noise sigma is (1/sigma)-GDP; its exact
    # delta(eps) (Balle & Wang 2018) is the hockey-stick integral below.
    want = _delta_by_integration(1.0 / sigma, eps)
    got = P.gdp_delta(mu=1.0 / sigma, epsilon=eps)
    assert got == pytest.approx(want, rel=1e-8, abs=1e-300)


@pytest.mark.parametrize("sigma", [0.3, 0.7, 1.0, 2.5, 10.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-10])
def test_gdp_epsilon_matches_analytic_gaussian_mechanism(sigma, delta):
    want = dp_accounting.get_epsilon_gaussian(sigma, delta)
    assert P.gdp_epsilon(mu=1.0 / sigma, delta=delta) == pytest.approx(want, rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("mu", [0.01, 0.5, 1.0, 5.0, 20.0, 50.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-10])
def test_gdp_epsilon_inverts_gdp_delta(mu, delta):
    eps = P.gdp_epsilon(mu=mu, delta=delta)
    assert 0.0 < eps < math.inf
    assert P.gdp_delta(mu=mu, epsilon=eps) == pytest.approx(delta, rel=1e-9)
    # smallest such epsilon: a hair less leaves delta above the target
    assert P.gdp_delta(mu=mu, epsilon=eps * (1 - 1e-7)) > delta


def test_gdp_epsilon_large_mu_beyond_fixed_bracket():
    # A [0, 500] root bracket cannot hold these; the expanding bracket does.
    eps50 = P.gdp_epsilon(mu=50.0, delta=1e-10)
    assert eps50 == pytest.approx(1567.1258, rel=1e-6)
    eps_k = P.gdp_epsilon(mu=1000.0, delta=1e-5)
    # eps = mu (s + mu/2) with Phi(-s) ~ delta for large mu
    assert eps_k > 1000.0 ** 2 / 2
    assert P.gdp_delta(mu=1000.0, epsilon=eps_k) == pytest.approx(1e-5, rel=1e-8)
    assert P.gdp_delta(mu=5.0, epsilon=1e4) == 0.0  # e^eps would overflow naively
    # monotone in mu and in delta, and stays finite up to the float range
    mus = [1e-3, 0.1, 1.0, 10.0, 1e3, 1e6, 1e12]
    eps = [P.gdp_epsilon(mu=m, delta=1e-6) for m in mus]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    assert P.gdp_epsilon(mu=1e160, delta=1e-5) == math.inf
    assert P.gdp_epsilon(mu=1.0, delta=1e-10) > P.gdp_epsilon(mu=1.0, delta=1e-5)


def test_gdp_epsilon_zero_when_delta0_below_target():
    mu = 1e-7
    assert P.gdp_delta(mu=mu, epsilon=0.0) < 1e-5
    assert P.gdp_epsilon(mu=mu, delta=1e-5) == 0.0
    # delta(0) = 2 Phi(mu/2) - 1
    assert P.gdp_delta(mu=0.3, epsilon=0.0) == pytest.approx(2 * stats.norm.cdf(0.15) - 1, rel=1e-12)


# ---------------------------------------------------------------------------
# dp-accounting PLD / RDP
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 1), (0.8, 10), (3.0, 100)])
def test_pld_without_subsampling_is_exact_gaussian_composition(sigma, steps):
    # T Gaussian steps compose to a (sqrt(T)/sigma)-GDP mechanism exactly; PLD is a
    # pessimistic discretisation, so it may sit a hair above, never noticeably below.
    exact = P.gdp_epsilon(mu=math.sqrt(steps) / sigma, delta=1e-5)
    got = P.pld_epsilon(sampling_prob=1.0, noise_multiplier=sigma, steps=steps, delta=1e-5)
    assert exact * (1 - 1e-6) <= got <= exact * 1.005 + 1e-3


def test_pld_and_rdp_use_dp_accounting_event():
    p, s, t, d = 0.02, 1.1, 300, 1e-6
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(s)), t)
    pld_acc = dp_accounting.pld.PLDAccountant()  # dp-accounting's own default interval
    pld_acc.compose(event)
    rdp_acc = dp_accounting.rdp.RdpAccountant()
    rdp_acc.compose(event)
    assert P.pld_epsilon(sampling_prob=p, noise_multiplier=s, steps=t, delta=d) == \
        pytest.approx(pld_acc.get_epsilon(d), rel=1e-12)
    assert P.rdp_epsilon(sampling_prob=p, noise_multiplier=s, steps=t, delta=d) == \
        pytest.approx(rdp_acc.get_epsilon(d), rel=1e-12)
    # finer discretisation only lowers the (pessimistic) PLD bound, and only slightly
    fine = P.pld_epsilon(sampling_prob=p, noise_multiplier=s, steps=t, delta=d)
    coarse = P.pld_epsilon(sampling_prob=p, noise_multiplier=s, steps=t, delta=d,
                           value_discretization_interval=1e-3)
    assert fine < coarse <= fine * 1.03


def test_cli_default_is_dp_accountings_pld(capsys):
    """The issue's case: p = 0.00128, sigma = 1, T = 1000, delta = 1e-5 prints dp-accounting's
    0.1955 (its default interval), not the 2 % looser 0.1994 of a 1e-3 grid; the interval
    is printed and --pld-interval keeps the coarse option."""
    from jaxfednas.cli import main

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.00128, dp_accounting.GaussianDpEvent(1.0)), 1000)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    want = acc.get_epsilon(1e-5)
    args = ["privacy", "--sampling-prob", "0.00128", "--noise-multiplier", "1", "--steps", "1000", "--delta", "1e-5"]
    assert main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("PLD"))
    assert f"{want:.4f}" in line and "interval 0.0001" in line
    assert main(args + ["--pld-interval", "1e-3"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("PLD"))
    assert "0.1994" in line and "interval 0.001" in line


def test_compare_accountants_reference_case():
    r = P.compare_accountants(sampling_prob=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5)
    assert r.mu_clt == pytest.approx(0.41452, abs=1e-5)
    assert r.epsilon_clt == pytest.approx(1.6180, abs=1e-3)
    assert r.epsilon_pld == pytest.approx(1.829, abs=5e-3)
    assert r.epsilon_rdp == pytest.approx(2.101, abs=5e-3)
    assert r.clt_optimistic and r.ratio_pld_over_clt == pytest.approx(r.epsilon_pld / r.epsilon_clt)
    assert r.epsilon_pld <= r.epsilon_rdp
    table = r.to_table()
    for needle in ("CLT (Bu et al.)", "PLD (dp-accounting)", "RDP (dp-accounting)", "0.4145",
                   "OPTIMISTIC", "add/remove one example"):
        assert needle in table
    with pytest.raises(dataclasses_frozen_error()):
        r.epsilon_pld = 0.0


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_clt_is_optimistic_for_small_T_or_small_sigma():
    # Concrete cases (delta = 1e-5):
    #   p=0.01, sigma=0.7, T=100:  CLT eps 0.96 vs PLD 2.37 (2.5x)
    #   p=0.1,  sigma=1.0, T=10:   CLT eps 1.62 vs PLD 2.85 (1.8x)
    #   p=0.01, sigma=1.0, T=1000: CLT eps 1.62 vs PLD 1.83 (1.13x)
    cases = [((0.01, 0.7, 100), 2.2), ((0.1, 1.0, 10), 1.6), ((0.01, 1.0, 1000), 1.08)]
    for (p, s, t), min_ratio in cases:
        r = P.compare_accountants(sampling_prob=p, noise_multiplier=s, steps=t, delta=1e-5)
        assert r.clt_optimistic
        assert r.ratio_pld_over_clt > min_ratio
    # ... and the gap closes (slowly) as T grows with p sqrt(T) fixed, the CLT's regime:
    # p=0.001, T=1e5 has the same mu as p=0.01, T=1e3 and a ratio of 1.07 instead of 1.13.
    r = P.compare_accountants(sampling_prob=0.001, noise_multiplier=1.0, steps=100_000,
                              delta=1e-5)
    assert 1.0 < r.ratio_pld_over_clt < 1.09
    # at a large mu the two agree: p=0.01, sigma=1, T=1e5 gives 25.59 both ways
    r = P.compare_accountants(sampling_prob=0.01, noise_multiplier=1.0, steps=100_000,
                              delta=1e-5)
    assert r.ratio_pld_over_clt == pytest.approx(1.0, abs=0.01)


def test_clt_overstates_without_subsampling():
    # p = 1 is outside the CLT's regime: the formula gives sqrt(T (e^{1/s^2} - 1)) > sqrt(T)/s.
    r = P.compare_accountants(sampling_prob=1.0, noise_multiplier=1.0, steps=1, delta=1e-5)
    assert not r.clt_optimistic and r.epsilon_clt > r.epsilon_pld


# ---------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["pld", "rdp", "clt"])
def test_calibrate_noise_multiplier_round_trip(accountant):
    p, t, target, d, tol = 0.02, 200, 2.0, 1e-5, 1e-3
    sigma = P.calibrate_noise_multiplier(sampling_prob=p, steps=t, target_epsilon=target,
                                         delta=d, accountant=accountant, tolerance=tol)
    eps = accounting._epsilon(accountant, p, sigma, t, d)
    assert eps <= target
    assert eps >= 0.98 * target  # tight, not just feasible
    # slightly less noise misses the target
    assert accounting._epsilon(accountant, p, sigma / (1 + 2 * tol), t, d) > target


def test_calibrate_orders_accountants():
    kw = dict(sampling_prob=0.02, steps=200, target_epsilon=2.0, delta=1e-5)
    clt = P.calibrate_noise_multiplier(accountant="clt", **kw)
    pld = P.calibrate_noise_multiplier(accountant="pld", **kw)
    rdp = P.calibrate_noise_multiplier(accountant="rdp", **kw)
    assert clt < pld < rdp  # the optimistic CLT asks for the least noise


def test_calibrate_out_of_range():
    with pytest.raises(ValueError, match="target_epsilon"):
        P.calibrate_noise_multiplier(sampling_prob=0.01, steps=10, target_epsilon=0.0, delta=1e-5)
    with pytest.raises(ValueError, match="is met even at noise_multiplier"):
        P.calibrate_noise_multiplier(sampling_prob=0.01, steps=1, target_epsilon=1e300,
                                     delta=1e-5, accountant="clt")
    with pytest.raises(ValueError, match="is not met even at noise_multiplier"):
        P.calibrate_noise_multiplier(sampling_prob=1.0, steps=10**12, target_epsilon=1.0,
                                     delta=1e-5, accountant="clt")


@pytest.mark.parametrize("accountant,p,sigma,target", [("clt", 0.01, 1.0, 1.0),
                                                       ("rdp", 0.01, 1.0, 1.0),
                                                       ("pld", 0.05, 1.0, 2.0)])
def test_max_steps_boundary(accountant, p, sigma, target):
    d = 1e-5
    t = P.max_steps(sampling_prob=p, noise_multiplier=sigma, target_epsilon=target, delta=d,
                    accountant=accountant)
    assert t >= 1
    assert accounting._epsilon(accountant, p, sigma, t, d) <= target < accounting._epsilon(accountant, p, sigma,
                                                                         t + 1, d)


def test_max_steps_zero_when_one_step_is_too_much():
    assert P.max_steps(sampling_prob=1.0, noise_multiplier=0.5, target_epsilon=0.1, delta=1e-5,
                       accountant="pld") == 0


# ---------------------------------------------------------------------------
# DP-FNAS: two mechanisms on disjoint data
# ---------------------------------------------------------------------------
def test_dpfnas_report_takes_max_over_disjoint_splits():
    train = P.MechanismSpec(name="weights/train", sampling_prob=0.01, noise_multiplier=1.0,
                            clip_norm=0.01, steps=1000)
    val = P.MechanismSpec(name="arch/val", sampling_prob=0.02, noise_multiplier=0.9,
                          clip_norm=0.1, steps=1000)
    r = P.dpfnas_report(train=train, val=val, delta=1e-5)
    for name in ("mu_clt", "epsilon_clt", "epsilon_pld", "epsilon_rdp"):
        assert getattr(r, name) == max(getattr(r.train, name), getattr(r.val, name))
    assert r.epsilon_pld == r.val.epsilon_pld > r.train.epsilon_pld  # val is the weaker one
    # not the sum: that would be sequential composition on the same data
    assert r.epsilon_pld < r.train.epsilon_pld + r.val.epsilon_pld
    single = P.compare_accountants(sampling_prob=0.02, noise_multiplier=0.9, steps=1000,
                                   delta=1e-5)
    assert r.val == single
    text = r.to_table()
    assert "weights/train" in text and "arch/val" in text and "parallel composition" in text
    assert "clip_norm = 0.01" in text


def test_mechanism_spec_validation():
    with pytest.raises(ValueError, match="noise_multiplier"):
        P.MechanismSpec(name="w", sampling_prob=0.1, noise_multiplier=0.0, steps=5)
    with pytest.raises(ValueError, match="steps"):
        P.MechanismSpec(name="w", sampling_prob=0.1, noise_multiplier=1.0, steps=0)
    with pytest.raises(ValueError, match="clip_norm"):
        P.MechanismSpec(name="w", sampling_prob=0.1, noise_multiplier=1.0, steps=5, clip_norm=-1)
    with pytest.raises(ValueError, match="name"):
        P.MechanismSpec(name="", sampling_prob=0.1, noise_multiplier=1.0, steps=5)
    with pytest.raises(ValueError, match="train"):
        P.dpfnas_report(train="w", val=None, delta=1e-5)


# ---------------------------------------------------------------------------
# argument validation
# ---------------------------------------------------------------------------
GOOD = dict(sampling_prob=0.01, noise_multiplier=1.0, steps=10, delta=1e-5)


def _calls(**override):
    """(function, kwargs) for every public accounting function, with `override` applied."""
    mech = {k: override.get(k, v) for k, v in GOOD.items() if k != "delta"}
    full = {k: override.get(k, v) for k, v in GOOD.items()}
    calib = {k: override.get(k, v) for k, v in GOOD.items() if k != "noise_multiplier"}
    budget = {k: override.get(k, v) for k, v in GOOD.items() if k != "steps"}
    eps = override.get("target_epsilon", 1.0)
    out = [(P.gdp_mu_poisson, mech), (P.gdp_mu_uniform, mech), (P.pld_epsilon, full),
           (P.rdp_epsilon, full), (P.compare_accountants, full),
           (P.calibrate_noise_multiplier, dict(calib, target_epsilon=eps)),
           (P.max_steps, dict(budget, target_epsilon=eps))]
    return [(f, kw) for f, kw in out if all(k in kw for k in override)]


BAD = [
    ("sampling_prob", 0.0), ("sampling_prob", -0.1), ("sampling_prob", 1.5),
    ("sampling_prob", float("nan")), ("sampling_prob", "0.1"),
    ("noise_multiplier", 0.0), ("noise_multiplier", -1.0), ("noise_multiplier", float("inf")),
    ("steps", 0), ("steps", -3), ("steps", 10.5), ("steps", True), ("steps", "10"),
    ("delta", 0.0), ("delta", 1.0), ("delta", -1e-5),
    ("target_epsilon", -1.0), ("target_epsilon", float("inf")),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_arguments_raise_naming_the_argument(name, value):
    calls = _calls(**{name: value})
    assert calls
    for fn, kw in calls:
        with pytest.raises(ValueError, match=name):
            fn(**kw)


def test_more_argument_errors():
    with pytest.raises(ValueError, match="no privacy"):
        P.pld_epsilon(sampling_prob=0.1, noise_multiplier=0.0, steps=1, delta=1e-5)
    with pytest.raises(ValueError, match=r"epsilon must be in \[0, inf\)"):
        P.gdp_delta(mu=1.0, epsilon=-0.5)
    for mu in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="mu"):
            P.gdp_delta(mu=mu, epsilon=1.0)
        with pytest.raises(ValueError, match="mu"):
            P.gdp_epsilon(mu=mu, delta=1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        P.gdp_epsilon(mu=1.0, delta=1.0)
    with pytest.raises(ValueError, match="accountant"):
        P.max_steps(sampling_prob=0.1, noise_multiplier=1.0, target_epsilon=1.0, delta=1e-5,
                    accountant="moments")
    with pytest.raises(ValueError, match="value_discretization_interval"):
        P.pld_epsilon(value_discretization_interval=0.0, **GOOD)
    # an integral float is accepted as a step count (e.g. epochs / p computed in floats)
    assert P.gdp_mu_poisson(sampling_prob=0.1, noise_multiplier=1.0, steps=20.0) == \
        P.gdp_mu_poisson(sampling_prob=0.1, noise_multiplier=1.0, steps=np.int64(20))


# ---------------------------------------------------------------------------
# CLI and import hygiene
# ---------------------------------------------------------------------------
def test_cli_main_prints_table_and_calibration(capsys):
    rc = cli.main(["privacy", "--sampling-prob", "0.01", "--noise-multiplier", "1.0", "--steps", "1000",
                 "--delta", "1e-5", "--target-epsilon", "3", "--accountant", "rdp"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "PLD (dp-accounting)" in out and "0.4145" in out
    assert "smallest noise_multiplier for T = 1000" in out
    assert "largest T for noise_multiplier = 1" in out


def test_a_pld_grid_too_large_for_memory_is_one_line(capsys):
    """A tiny noise multiplier (or interval) asks dp-accounting for a privacy-loss grid of
    petabytes: numpy's MemoryError becomes a ValueError naming the setting, one line in the CLI."""
    with pytest.raises(ValueError, match=r"value_discretization_interval=1e-09 needs a grid of ~2.9e\+11 points per "
                       r"PLD table at noise_multiplier=0.1"):
        P.pld_epsilon(sampling_prob=0.01, noise_multiplier=0.1, steps=10, delta=1e-5,
                      value_discretization_interval=1e-9)
    rc = cli.main(["privacy", "--sampling-prob", "0.01", "--noise-multiplier", "0.1", "--steps", "1000",
                   "--delta", "1e-5", "--pld-interval", "1e-9"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "value_discretization_interval=1e-09 needs a grid" in err, err


def test_the_default_pld_interval_keeps_small_noise_computable(capsys):
    """No interval given: 1e-4, or coarser so that one step's loss grid has at most
    PLD_MAX_POINTS points; coarser stays an upper bound; too small a noise is one line."""
    assert P.pld_interval(1.0) == accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL
    for sigma in (0.3, 0.03, 0.003):  # the grid the interval allows: the loss range over max_points
        v = P.pld_interval(sigma)
        k = 9.75  # -ndtri(exp(-50) / 2)
        assert (2 * k * sigma + 1) / sigma**2 / v <= 1.01 * accounting.PLD_MAX_POINTS
    assert P.pld_interval(0.03) > 10 * accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL
    # a coarser interval only raises epsilon (and not by much at this noise)
    args = dict(sampling_prob=0.5, noise_multiplier=0.5, steps=3, delta=1e-5)
    fine = P.pld_epsilon(**args)
    coarse = P.pld_epsilon(**args, value_discretization_interval=P.pld_interval(0.5, max_points=2_000))
    assert fine < coarse < 1.05 * fine
    assert P.gdp_mu_poisson(sampling_prob=0.5, noise_multiplier=1e-300, steps=10) == float("inf")
    for sigma in ("1e-300", "5e-4"):  # the table leaves PLD out and says why; RDP is still shown
        rc = cli.main(["privacy", "--sampling-prob", "0.5", "--noise-multiplier", sigma, "--steps", "10",
                       "--delta", "1e-5"])
        captured = capsys.readouterr()
        assert rc == 0 and captured.err == "", captured.err
        pld_row = next(line for line in captured.out.splitlines() if line.startswith("PLD"))
        assert "not computed: too small a noise" in pld_row and "RDP bound below holds" in pld_row
        with pytest.raises(ValueError, match="too small for the PLD accountant"):
            P.pld_epsilon(sampling_prob=0.5, noise_multiplier=float(sigma), steps=10, delta=1e-5)
    with pytest.raises(ValueError, match=r"value_discretization_interval must be in \(0, 100\]"):
        P.pld_epsilon(**args, value_discretization_interval=1e3)


def test_cli_plugs_into_subparser_and_reports_errors(capsys):
    parser = argparse.ArgumentParser(prog="jaxfednas")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_privacy_arguments(sub.add_parser("privacy"))
    args = parser.parse_args(["privacy", "--sampling-prob", "0", "--noise-multiplier", "1",
                              "--steps", "10", "--delta", "1e-5"])
    assert cli.run_privacy_command(args) == 2
    assert "error: sampling_prob must be in (0, 1]" in capsys.readouterr().err


def _run_python(code):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_privacy_imports_without_jax():
    # The module file on its own (no package __init__), used end to end.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('privacy_alone', {PRIVACY_FILE!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m\n"
        "spec.loader.exec_module(m)\n"
        "m.compare_accountants(sampling_prob=0.1, noise_multiplier=1.0, steps=3, delta=1e-5)\n"
        "assert 'jax' not in sys.modules, 'privacy/accounting.py imported jax'\n"
        # and through the package (accounting + DP-FNAS accounting; the mechanism is not imported)
        "import jaxfednas.privacy\n"
        "assert 'jax' not in sys.modules, 'import jaxfednas.privacy imported jax'\n"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_the_former_module_name_still_imports_with_a_warning():
    import importlib
    import sys

    from jaxfednas.privacy import dp_fnas

    sys.modules.pop("jaxfednas.privacy.dpfnas", None)
    with pytest.warns(DeprecationWarning, match="jaxfednas.privacy.dpfnas is now jaxfednas.privacy.dp_fnas"):
        former = importlib.import_module("jaxfednas.privacy.dpfnas")
    assert former.__all__ == dp_fnas.__all__
    assert all(getattr(former, n) is getattr(dp_fnas, n) for n in dp_fnas.__all__)


def test_a_noise_multiplier_beyond_the_float_range_is_refused_in_one_line():
    """sigma = 1e200: sigma^2 overflows; every accountant refused with OverflowError or
    'math domain error' before. Now one ValueError naming the argument; 1e150 still works."""
    from jaxfednas import privacy as P

    calls = (lambda s: P.gdp_mu_poisson(sampling_prob=0.01, noise_multiplier=s, steps=100),
             lambda s: P.pld_epsilon(sampling_prob=0.01, noise_multiplier=s, steps=100, delta=1e-5),
             lambda s: P.rdp_epsilon(sampling_prob=0.01, noise_multiplier=s, steps=100, delta=1e-5))
    for call in calls:
        with pytest.raises(ValueError, match="noise_multiplier 1e.200 is above 1e.150"):
            call(1e200)
        assert call(1e150) == pytest.approx(0.0, abs=1e-100)


def test_a_pld_interval_too_fine_to_build_is_refused_before_any_table():
    """--pld-interval 1e-7 at sigma 1 (a grid of ~2e8 points) grew to GiBs for minutes and printed
    nothing; it is refused at once with the finest interval that would be built."""
    import re
    import time

    from jaxfednas import privacy as P

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="needs a grid of ~2e\\+08 points") as e:
        P.pld_epsilon(sampling_prob=0.01, noise_multiplier=1.0, steps=100, delta=1e-5,
                      value_discretization_interval=1e-7)
    assert time.perf_counter() - t0 < 5
    finest = float(re.search(r"an interval of at least ([0-9.e+-]+)", str(e.value)).group(1))
    assert 1e-6 < finest < 1.1e-6


def test_a_step_count_beyond_the_pld_accountant_is_one_line_or_left_out(capsys):
    """T = 1e9: the comparison table leaves PLD out and says so (it took minutes before, even
    with --accountant rdp); a PLD calibration refuses with advice that works."""
    import time

    from jaxfednas import privacy as P

    t0 = time.perf_counter()
    argv = ["privacy", "--sampling-prob", "0.01", "--noise-multiplier", "1", "--steps", "1000000000", "--delta",
            "1e-5", "--target-epsilon", "2"]
    assert cli.main(argv + ["--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    assert "not computed: T > 1e+08 steps" in out and "calibration (rdp)" in out and time.perf_counter() - t0 < 30
    assert cli.main(argv) == 2  # (the PLD calibration)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "steps=1000000000 is beyond what the PLD accountant composes" in err, err
    assert "--accountant rdp" in err
    with pytest.raises(ValueError, match="beyond what the PLD accountant composes"):
        P.pld_epsilon(sampling_prob=0.01, noise_multiplier=1.0, steps=10**9, delta=1e-5)


def _smallest_pld_noise_advised(P) -> float:
    """The noise multiplier PLD's refusal of noise 1e-300 names (sampling 0.5, 10 steps, interval 100)."""
    import re

    for interval in (None, 1e-2, 100.0):
        with pytest.raises(ValueError, match="at any interval it allows") as e:
            P.pld_epsilon(sampling_prob=0.5, noise_multiplier=1e-300, steps=10, delta=1e-5,
                          value_discretization_interval=interval)
        assert "inf" not in str(e.value).split("losses", 1)[1], str(e.value)
    return float(re.search(r"a noise multiplier of at least ([0-9.e+-]+)", str(e.value)).group(1))


@pytest.mark.slow  # the advised noise fills the largest PLD grid allowed: ~100 s on one core
def test_the_smallest_noise_pld_advises_then_works():
    from jaxfednas import privacy as P

    smallest = _smallest_pld_noise_advised(P)
    assert math.isfinite(P.pld_epsilon(sampling_prob=0.5, noise_multiplier=smallest, steps=10, delta=1e-5,
                                       value_discretization_interval=100.0))


def test_a_noise_below_any_pld_grid_gets_advice_that_works(capsys):
    """noise 1e-300: PLD advised "an interval of at least inf" and RDP raised ZeroDivisionError from
    dp-accounting; now PLD names the smallest noise it can take (finite and positive here; that it
    then works is the slow test above), RDP gives inf, and `--accountant rdp` prints no
    dp-accounting warnings."""
    import re

    from jaxfednas import privacy as P

    smallest = _smallest_pld_noise_advised(P)
    assert 0 < smallest < 1e-3, smallest
    assert P.rdp_epsilon(sampling_prob=0.5, noise_multiplier=1e-300, steps=10, delta=1e-5) == math.inf
    rc = cli.main(["privacy", "--sampling-prob", "0.5", "--noise-multiplier", "1e-300", "--steps", "10",
                   "--delta", "1e-5", "--accountant", "rdp", "--target-epsilon", "1"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == "", captured.err
    assert re.search(r"RDP \(dp-accounting\)\s+inf", captured.out)
    assert "largest T for noise_multiplier = 1e-300: 0" in captured.out
    # --pld-interval reaches the step budget too (it used the default interval and refused)
    rc = cli.main(["privacy", "--sampling-prob", "0.5", "--noise-multiplier", "5e-4", "--steps", "10",
                   "--delta", "1e-5", "--target-epsilon", "1", "--pld-interval", "10"])
    captured = capsys.readouterr()
    assert rc == 0 and "largest T for noise_multiplier = 0.0005: 0" in captured.out, captured.err
