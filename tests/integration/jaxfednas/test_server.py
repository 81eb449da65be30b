"""jaxfednas.server: server optimizers against NumPy by hand, robust aggregators on
constructed updates with outliers, client samplers (determinism, proportionality,
availability), defaults bitwise equal to the plain weighted mean, refusals, and a few cheap
FedAvg rounds on the contract test's tiny federation."""
import dataclasses
import functools

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_federation
from jaxfednas import rng
from jaxfednas.checkpoint import load_checkpoint, save_checkpoint
from jaxfednas.config import ConfigError, RunConfig
from jaxfednas.registry import build_algorithm
from jaxfednas.rng import init_key, round_key
from jaxfednas.runtime import map_clients, masked_weighted_mean, round_clients, weighted_mean
from jaxfednas.server import (Server, availability_groups, available_clients, markov_online, masked_robust_mean, online,
                              proportional_clients, robust_mean, server_step, server_transform)

# --- server optimizers: NumPy by hand ------------------------------------------------

HP = dict(lr=0.3, momentum=0.8, b1=0.7, b2=0.9, tau=0.05)


def numpy_server(name, x0, aggregates, lr, momentum, b1, b2, tau):
    """Reddi et al. 2021, Algorithm 2 (and SGD / FedAvgM), in float64, one list entry per round."""
    x = np.asarray(x0, np.float64)
    buf, m, v = np.zeros_like(x), np.zeros_like(x), np.full_like(x, tau * tau)
    out = []
    for a in aggregates:
        g = x - a  # pseudo-gradient
        if name == "sgd":
            x = x - lr * g
        elif name == "avgm":
            buf = momentum * buf + g
            x = x - lr * buf
        else:
            d = -g
            m = b1 * m + (1 - b1) * d
            if name == "adagrad":
                v = v + d * d
            elif name == "adam":
                v = b2 * v + (1 - b2) * d * d
            else:  # yogi
                v = v - (1 - b2) * d * d * np.sign(v - d * d)
            x = x + lr * m / (np.sqrt(v) + tau)
        out.append(x.copy())
    return out


@pytest.mark.parametrize("name", ["sgd", "avgm", "adagrad", "adam", "yogi"])
def test_server_optimizers_match_numpy_over_three_rounds(name):
    r = np.random.default_rng(0)
    x0 = {"a": r.normal(size=(3,)).astype(np.float32), "b": r.normal(size=(2, 2)).astype(np.float32)}
    aggs = [jax.tree.map(lambda x: (x + r.normal(size=x.shape)).astype(np.float32), x0) for _ in range(3)]
    tx = server_transform(name, **HP)
    x, state = x0, tx.init(x0)
    step = jax.jit(lambda x, a, s: server_step(tx, x, a, s))
    for t, a in enumerate(aggs):
        x, state = step(x, a, state)
        for k in x0:
            want = numpy_server(name, x0[k], [agg[k] for agg in aggs], **HP)[t]
            np.testing.assert_allclose(np.asarray(x[k]), want, rtol=2e-5, atol=2e-6, err_msg=f"{name} round {t} {k}")


def test_no_server_optimizer_returns_the_aggregate_itself_and_a_round_without_reports_changes_nothing():
    agg = {"w": jnp.arange(3.0)}
    assert server_step(None, {"w": jnp.ones(3)}, agg, {})[0] is agg
    s = Server(optimizer="avgm", lr=0.5, momentum=0.9)
    cur = {"params": {"w": jnp.ones(3)}, "batch_stats": {"m": jnp.zeros(2)}}
    new = {"params": {"w": jnp.zeros(3)}, "batch_stats": {"m": jnp.ones(2)}}
    opt = s.init(cur)
    moved, opt1 = s.step(cur, new, opt, jnp.array([3.0, 1.0]))
    np.testing.assert_allclose(moved["params"]["w"], 0.5 * np.ones(3))  # x - lr (x - x̄)
    np.testing.assert_array_equal(moved["batch_stats"]["m"], np.ones(2))  # statistics: the aggregate
    kept, opt2 = s.step(moved, new, opt1, jnp.zeros(2))  # nobody reported
    chex.assert_trees_all_equal(kept["params"], moved["params"])
    chex.assert_trees_all_equal(opt2, opt1)


# --- aggregators ----------------------------------------------------------------------

# six clients, one coordinate each column; client 5 is an outlier in every column
CLIENTS = np.array([[0., 5., -3.], [1., 5., -2.], [2., 5., -1.], [4., 5., 0.], [8., 5., 1.], [1000., -1e6, 50.]],
                   np.float32)


def test_median_and_trimmed_mean_ignore_outliers_by_hand():
    w = jnp.array([10., 1., 1., 1., 1., 1.])  # n_k: the robust aggregators do not weight by them
    med = robust_mean({"x": CLIENTS}, w, "median")["x"]
    np.testing.assert_array_equal(med, [(2 + 4) / 2, 5, (-1 + 0) / 2])
    trim = robust_mean({"x": CLIENTS}, w, "trimmed_mean", 1 / 6)["x"]  # ⌊6/6⌋ = 1 dropped from each end
    np.testing.assert_allclose(trim, [(1 + 2 + 4 + 8) / 4, 5, (-2 - 1 + 0 + 1) / 4], rtol=1e-6)
    mean = weighted_mean({"x": CLIENTS}, w)["x"]
    assert abs(float(mean[0]) - 3.75) > 10  # the mean follows the outlier
    # the outlier fails to report (weight 0): five values, the middle one / 1 trimmed from each end
    w0 = w.at[5].set(0.0)
    np.testing.assert_array_equal(robust_mean({"x": CLIENTS}, w0, "median")["x"], [2, 5, -1])
    np.testing.assert_allclose(robust_mean({"x": CLIENTS}, w0, "trimmed_mean", 0.2)["x"],
                               [(1 + 2 + 4) / 3, 5, -1], rtol=1e-6)
    # nobody reports: the fallback
    fb = {"x": jnp.full((3,), 7.0)}
    np.testing.assert_array_equal(robust_mean({"x": CLIENTS}, jnp.zeros(6), "median", fallback=fb)["x"], 7.0)


def test_masked_robust_mean_per_entry_over_the_covering_clients():
    x = jnp.array([[1., 10., 3., 9.], [2., 20., 4., 9.], [100., 30., 5., 9.]])
    masks = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0]])
    fb = jnp.full((4,), -7.0)
    med = masked_robust_mean(x, masks, jnp.ones(3), "median", 0.0, fb)
    np.testing.assert_array_equal(med, [2, 15, 5, -7])
    trim = masked_robust_mean(x, masks, jnp.ones(3), "trimmed_mean", 0.34, fb)  # ⌊3 · 0.34⌋ = 1 each end
    np.testing.assert_array_equal(trim, [2, 15, 5, -7])
    med = masked_robust_mean(x, masks, jnp.array([1., 0., 1.]), "median", 0.0, fb)  # client 1 failed
    np.testing.assert_array_equal(med, [(1 + 100) / 2, 10, 5, -7])


def test_default_aggregation_is_the_weighted_mean_bit_for_bit():
    r = np.random.default_rng(1)
    tree = {"p": r.normal(size=(4, 5)).astype(np.float32), "s": r.normal(size=(4, 2)).astype(np.float32)}
    w, fb = jnp.array([3., 0., 5., 1.]), jax.tree.map(lambda a: a[0], tree)
    chex.assert_trees_all_equal(Server().aggregate(tree, w, fb), weighted_mean(tree, w, fallback=fb))
    counts, rep = jnp.array([3, 4, 5], jnp.int32), jnp.array([True, False, True])
    np.testing.assert_array_equal(Server().weights(counts, rep), counts * rep)
    masks = jax.tree.map(lambda a: (np.abs(a) > 0.5).astype(np.float32), tree)
    chex.assert_trees_all_equal(Server().masked_aggregate(tree, masks, w, fb),  # the registered "mean", masked
                                masked_weighted_mean(tree, masks, w, fb))


# --- samplers -------------------------------------------------------------------------


def test_uniform_sampler_is_round_clients_and_every_sampler_is_a_function_of_seed_and_round():
    k = round_key(3, 5)
    for a, b in zip(Server().sample(k, 5, None, 10, 4), round_clients(k, 10, 4)):
        np.testing.assert_array_equal(a, b)
    sizes = jnp.array([5, 0, 3, 9, 1, 1, 2, 8, 4, 6], jnp.int32)

    class Data:
        def all_clients(self, split):
            assert split == "train"
            return type("C", (), {"count": sizes})

    for s in (Server(sampler="proportional"), Server(sampler="available", availability_period=3, availability_on=2,
                                                     seed=3)):
        ids, keys = s.sample(k, 5, Data(), 10, 4)
        ids2, keys2 = s.sample(round_key(3, 5), 5, Data(), 10, 4)
        np.testing.assert_array_equal(ids, ids2)
        np.testing.assert_array_equal(keys, keys2)
        np.testing.assert_array_equal(keys, rng.client_keys(k, ids))
        assert (np.diff(np.asarray(ids)) >= 0).all()
        draws = {tuple(np.asarray(s.sample(round_key(3, r), r, Data(), 10, 4)[0])) for r in range(8)}
        assert len(draws) > 1
    assert 1 not in np.asarray(Server(sampler="proportional").sample(k, 5, Data(), 10, 4)[0])  # n_k = 0: never
    # the draws come from the round's SAMPLE stream (jaxfednas.rng.sample_key), as uniform's do
    np.testing.assert_array_equal(Server(sampler="proportional").sample(k, 5, Data(), 10, 4)[0],
                                  proportional_clients(rng.sample_key(k), sizes, 4))
    up = online(jnp.asarray(availability_groups(3, 10, 3)), 5, 3, 2)
    np.testing.assert_array_equal(
        Server(sampler="available", availability_period=3, availability_on=2, seed=3).sample(k, 5, Data(), 10, 4)[0],
        available_clients(rng.sample_key(k), up, 4))


def test_proportional_sampler_frequencies_follow_training_sizes():
    sizes = jnp.array([1, 2, 3, 4, 0, 10], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    ids = np.asarray(jax.vmap(lambda k: proportional_clients(k, sizes, 3))(keys)).ravel()
    freq = np.bincount(ids, minlength=6) / ids.size
    np.testing.assert_allclose(freq, np.asarray(sizes) / 20, atol=0.012)
    # one weight per reporting draw: the aggregate's expectation is the n_k-weighted mean
    w = Server(sampler="proportional").weights(jnp.array([4, 4, 0]), jnp.array([True, False, True]))
    np.testing.assert_array_equal(w, [1.0, 0.0, 0.0])


def test_available_sampler_draws_only_online_clients_uniformly():
    # group g comes online in round g (mod the period) and stays for `on` rounds
    np.testing.assert_array_equal(online(np.arange(4), 1, 4, 2), [True, True, False, False])
    np.testing.assert_array_equal(online(np.arange(4), 4, 4, 2), [True, False, False, True])
    k, period, on, m = 12, 4, 2, 3
    groups = availability_groups(7, k, period)
    assert sorted(np.bincount(groups)) == [3, 3, 3, 3]
    np.testing.assert_array_equal(groups, availability_groups(7, k, period))
    s = Server(sampler="available", availability_period=period, availability_on=on, seed=7)
    for r in range(2 * period):
        up = np.asarray(online(groups, r, period, on))
        assert up.sum() == 6
        keys = jax.random.split(jax.random.PRNGKey(r), 1500)
        ids = np.asarray(jax.vmap(lambda key: available_clients(key, jnp.asarray(up), m))(keys))
        assert up[ids].all()
        assert all(len(set(row)) == m for row in ids[:50])  # without replacement
        freq = np.bincount(ids.ravel(), minlength=k) / ids.shape[0]
        np.testing.assert_allclose(freq[up], m / up.sum(), atol=0.05)
        traced = np.asarray(s.sample(round_key(7, r), jnp.int32(r), None, k, m)[0])
        assert up[traced].all()
    with pytest.raises(ConfigError, match="fewer than the 7 clients per round"):
        s.check_clients(k, 7)


# --- configuration and refusals ------------------------------------------------------


def test_run_config_defaults_are_todays_server_and_bad_values_are_refused():
    assert Server.from_run(RunConfig()) == Server()
    with pytest.raises(ConfigError, match="run.availability_on"):
        RunConfig(sampler="available", availability_period=2, availability_on=3)
    with pytest.raises(ConfigError, match="run.server_optimizer"):
        RunConfig(server_optimizer="adamw")


def test_every_server_field_is_read_from_its_run_setting():
    from jaxfednas.server import RUN_FIELDS

    assert set(RUN_FIELDS) == {f.name for f in dataclasses.fields(Server)}
    run = RunConfig(sampler="available", aggregator="trimmed_mean", trim_fraction=0.2, server_optimizer="adam",
                    server_lr=0.3, server_momentum=0.5, server_b1=0.8, server_b2=0.95, server_tau=0.01,
                    arch_server_optimizer="avgm", arch_server_lr=0.7, availability_period=3, availability_on=2,
                    availability_pattern="markov", availability_fraction=0.6, availability_persistence=0.2, seed=9)
    server = Server.from_run(run)
    for field, setting in RUN_FIELDS.items():
        assert getattr(server, field) == getattr(run, setting) != getattr(Server(), field), field


@pytest.mark.parametrize("name, over, match", [
    ("local_only", {"run.aggregator": "median"}, "run.aggregator='median' does not apply to local_only"),
    ("local_only", {"run.server_optimizer": "adam"}, "run.server_optimizer='adam' does not apply to local_only"),
    ("dp_fnas", {"run.sampler": "proportional"}, "accountant assumes every party in every iteration"),
    ("dp_fnas", {"run.server_optimizer": "sgd"}, "own optimizers"),
    ("perfedrlnas", {"run.server_optimizer": "avgm"}, "does not apply to perfedrlnas"),
    ("fedavg", {"run.arch_server_optimizer": "adam"}, "no architecture parameters"),
    ("fedavg", {"run.sampler": "available", "run.availability_period": 4}, "raise availability_on"),
])
def test_options_that_do_not_apply_raise_a_config_error_naming_them(name, over, match):
    cfg, data = tiny_federation(name, **over)
    with pytest.raises(ConfigError, match=match):
        build_algorithm(cfg, data.info)


# --- FedAvg end to end (the contract test's tiny federation) ---------------------------


@pytest.fixture(scope="module")
def fedavg_run():
    cfg, data = tiny_federation("fedavg")
    algo = build_algorithm(cfg, data.info)
    s0 = algo.init(init_key(0))
    return cfg, data, s0, algo.round(s0, data, round_key(0, 0))


def test_default_fedavg_round_is_the_plain_weighted_mean_bit_for_bit(fedavg_run):
    from jaxfednas.algorithms.common import make_local_train
    from jaxfednas.runtime import Placement, jit, reporting_clients
    from jaxfednas.search_spaces.models import make_model

    cfg, data, s0, (s1, _) = fedavg_run
    assert s1.server == {}
    info = data.info
    local_train = make_local_train(make_model(cfg.algo.model, info.num_classes, info.name), info, cfg.algo)

    @jit
    def by_hand(variables, data, key):
        idx, keys = round_clients(key, info.num_clients, 2)
        clients = data.clients("train", idx)
        new = map_clients(lambda c, v: local_train(v, c[0], c[1], None), (clients, keys), variables,
                          placement=Placement.from_run(cfg.run))[0]
        avg = weighted_mean(new, clients.count * reporting_clients(key, idx, 0.0), fallback=variables)
        params = jax.tree.map(lambda w, a: w + 1.0 * (a - w), variables["params"], avg["params"])
        return {"params": params, "batch_stats": avg["batch_stats"]}

    # Bit for bit under XLA's own libraries (JAXFEDNAS_CPU_CONV=ynn); with oneDNN's custom calls (the
    # x86-64 default) XLA rewrites the softmax of the hand-written program into a oneDNN call and not
    # the round's, so the two programs agree to float rounding.
    from jaxfednas.runtime import cpu_conv_backend

    want = by_hand(s0.variables, data, round_key(0, 0))
    if cpu_conv_backend() == "ynn":
        chex.assert_trees_all_equal(s1.variables, want)
    else:
        chex.assert_trees_all_close(s1.variables, want, rtol=1e-5, atol=1e-7)


def test_fedavg_with_fedadam_steps_from_the_clients_aggregate(fedavg_run, tmp_path):
    cfg, data, s0, (s1, _) = fedavg_run
    hp = {"run.server_optimizer": "adam", "run.server_lr": 0.01, "run.server_b1": 0.9, "run.server_b2": 0.99,
          "run.server_tau": 1e-3}
    cfg_a, _ = tiny_federation("fedavg", **hp)
    algo = build_algorithm(cfg_a, data.info)
    a0 = algo.init(init_key(0))
    chex.assert_trees_all_equal(a0.variables, s0.variables)
    a1, _ = algo.round(a0, data, round_key(0, 0))
    # same clients, same keys, same local training: the default round's result is the aggregate
    for w, agg, got in zip(jax.tree.leaves(s0.variables["params"]), jax.tree.leaves(s1.variables["params"]),
                           jax.tree.leaves(a1.variables["params"])):
        want = numpy_server("adam", w, [np.asarray(agg, np.float64)], lr=0.01, momentum=0.0, b1=0.9, b2=0.99,
                            tau=1e-3)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_equal(a1.variables["batch_stats"], s1.variables["batch_stats"])
    # the optimizer state is checkpointed and resumed; a checkpoint from before it still loads
    save_checkpoint(tmp_path / "c.msgpack", a1, round=1, config_sha256="x")
    back, _ = load_checkpoint(tmp_path / "c.msgpack", a0, config_sha256="x")
    chex.assert_trees_all_equal(back, a1)
    old = flax.serialization.to_state_dict(s1)
    del old["server"]
    restored = flax.serialization.from_state_dict(s0, old)
    chex.assert_trees_all_equal(restored, s1)
    with pytest.raises(ValueError, match="Unknown field"):
        flax.serialization.from_state_dict(s0, {**old, "bogus": 1})
    assert dataclasses.fields(type(s1))[-1].name == "server"


def test_perfedrlnas_aggregation_takes_the_masked_robust_aggregators():
    from jaxfednas.algorithms.perfedrlnas import PerFedRLNASConfig, aggregate

    class Space:  # client with choice c trained entries 0..c of the supernet's one leaf
        def variable_mask(self, choice, old):
            return {"params": {"w": (jnp.arange(4) <= choice).astype(jnp.float32)}}

    cfg = PerFedRLNASConfig(aggregate_bn=False, aggregation="count_normalized")
    old = {"params": {"w": jnp.full((4,), -7.0)}}
    new = {"params": {"w": jnp.array([[1., 10., 3., 9.], [2., 20., 4., 9.], [100., 30., 5., 9.]])}}
    choices, w = jnp.array([1, 1, 2]), jnp.array([5.0, 1.0, 1.0])
    med = aggregate(cfg, Space(), old, new, choices, w, Server(aggregator="median"))
    np.testing.assert_array_equal(med["params"]["w"], [2, 20, 5, -7])
    mean = aggregate(cfg, Space(), old, new, choices, w)
    np.testing.assert_allclose(mean["params"]["w"], [(5 + 2 + 100) / 7, (50 + 20 + 30) / 7, 5, -7], rtol=1e-6)


@pytest.mark.parametrize("name", ["ditto", "fednas_train", "local_adaptation"])
def test_a_refusal_from_an_algorithm_built_on_fedavg_names_that_algorithm(name):

    cfg, data = tiny_federation(name, **{"run.arch_server_optimizer": "adam"})
    with pytest.raises(ConfigError, match=rf"{name}.*arch_server_optimizer|arch_server_optimizer.*{name}"):
        build_algorithm(cfg, data.info)


# --- availability pattern "markov" ---------------------------------------------------


def test_markov_availability_is_a_seeded_function_of_the_round_with_the_documented_chain():
    k, rounds, frac = 300, 40, 0.7
    trace = jax.jit(lambda seed, keep: jax.vmap(lambda r: markov_online(seed, r, k, frac, keep))(jnp.arange(rounds)))
    t = np.asarray(trace(3, 0.6))
    np.testing.assert_array_equal(t, trace(3, 0.6))  # same seed, same trace
    assert (t != np.asarray(trace(4, 0.6))).mean() > 0.2  # another seed, another trace
    np.testing.assert_array_equal(t[17], markov_online(3, 17, k, frac, 0.6))  # round 17 alone: the same
    assert abs(t.mean() - frac) < 0.02  # on in a fraction `frac` of rounds
    on, nxt = t[:-1], t[1:]
    off_after_on = (on & ~nxt).sum() / on.sum()
    on_after_off = (~on & nxt).sum() / (~on).sum()
    assert abs(off_after_on - (1 - 0.6) * (1 - frac)) < 0.02, off_after_on  # 0.12
    assert abs(on_after_off - (1 - 0.6) * frac) < 0.03, on_after_off  # 0.28
    ind = np.asarray(trace(3, 0.0))
    assert abs((ind[:-1] & ~ind[1:]).sum() / ind[:-1].sum() - (1 - frac)) < 0.03  # persistence 0: independent


def test_markov_sampler_draws_online_clients_weighted_by_n_k_and_refuses_too_few():
    k, m, rounds = 10, 3, 30
    s = Server(sampler="available", availability_pattern="markov", availability_fraction=0.5,
               availability_persistence=0.5, seed=5)
    assert Server.from_run(RunConfig(sampler="available", availability_pattern="markov", availability_fraction=0.5,
                                     availability_persistence=0.5, seed=5)) == s
    ids, up = jax.jit(jax.vmap(lambda r: (s.sample(round_key(5, r), r, None, k, m)[0],
                                          markov_online(5, r, k, 0.5, 0.5))))(jnp.arange(rounds))
    ids, up = np.asarray(ids), np.asarray(up)
    np.testing.assert_array_equal(ids[7], s.sample(round_key(5, 7), 7, None, k, m)[0])  # (seed, round) only
    np.testing.assert_array_equal(ids[7], available_clients(rng.sample_key(round_key(5, 7)), up[7], m))
    assert all(len(set(row)) == m for row in ids)  # without replacement
    enough = up.sum(1) >= m
    assert 0 < enough.sum() < rounds
    for i, u in zip(ids, up):
        assert u[i].sum() == min(u.sum(), m)  # only online clients; a short round takes every online one
    many = np.asarray(jax.vmap(lambda key: available_clients(key, jnp.asarray(up[0]), m))(
        jax.random.split(jax.random.PRNGKey(0), 1500)))
    assert up[0].sum() >= m  # uniform among the online ones
    np.testing.assert_allclose(np.bincount(many.ravel(), minlength=k)[up[0]] / 1500, m / up[0].sum(), atol=0.06)
    counts, rep = jnp.array([3, 4, 5], jnp.int32), jnp.array([True, False, True])
    np.testing.assert_array_equal(s.weights(counts, rep), counts * rep)  # n_k-weighted, as documented
    with pytest.raises(ConfigError, match="raise availability_fraction"):
        s.check_clients(k, 6)
    with pytest.raises(ConfigError, match="availability_pattern='poisson' is not allowed"):
        RunConfig(availability_pattern="poisson")


# --- client drop-out with each sampler; a registered aggregator in a FedAvg round ------


@functools.cache
def _local_models():
    """``(variables, data, ids, keys) -> (each client's model after local training, n_k)``:
    FedAvg's clients of the tiny federation, by hand."""
    from jaxfednas.algorithms.common import make_local_train
    from jaxfednas.runtime import Placement, jit
    from jaxfednas.search_spaces.models import make_model

    cfg, data = tiny_federation("fedavg")
    info = data.info
    local_train = make_local_train(make_model(cfg.algo.model, info.num_classes, info.name), info, cfg.algo)

    @jit
    def models(variables, data, ids, keys):
        clients = data.clients("train", ids)
        new = map_clients(lambda c, v: local_train(v, c[0], c[1], None), (clients, keys), variables,
                          placement=Placement.from_run(cfg.run))[0]
        return new, clients.count

    return models


def _fedavg_step(variables, aggregate):
    return {"params": jax.tree.map(lambda w, a: w + 1.0 * (a - w), variables["params"], aggregate["params"]),
            "batch_stats": aggregate["batch_stats"]}


@pytest.mark.parametrize("over", [
    {"run.sampler": "proportional"},
    {"run.sampler": "available"},
    {"run.sampler": "available", "run.availability_pattern": "markov", "run.availability_fraction": 0.75},
], ids=["proportional", "available-cyclic", "available-markov"])
def test_dropout_with_each_sampler_leaves_the_failed_client_out(over):
    from jaxfednas.runtime import reporting_clients

    cfg, data = tiny_federation("fedavg", **{"run.dropout_rate": 0.5, **over})
    server = Server.from_run(cfg.run)
    algo = build_algorithm(cfg, data.info)
    s0 = algo.init(init_key(0))
    # a round key whose two sampled clients are one that reports and one that fails
    reported = jax.jit(jax.vmap(lambda key: reporting_clients(key, server.sample(key, 0, data, 4, 2)[0], 0.5).sum()))
    keys = jax.vmap(lambda r: round_key(0, r))(jnp.arange(32))
    key = keys[int(np.argmax(np.asarray(reported(keys)) == 1))]
    s1, m1 = algo.round(s0, data, key)
    s1b, _ = algo.round(s0, data, key)
    chex.assert_trees_all_equal(s1, s1b)  # deterministic
    assert int(m1["clients_reported"]) == 1 and float(m1["server_update_skipped"]) == 0.0
    ids, keys = server.sample(key, 0, data, 4, 2)
    rep = np.asarray(reporting_clients(key, ids, 0.5))
    new, _ = _local_models()(s0.variables, data, ids, keys)
    # the aggregate is the one reporting client's model: the failed one is left out
    alone = jax.tree.map(lambda x: x[int(np.argmax(rep))], new)
    want = _fedavg_step(s0.variables, alone)
    for a, b in zip(jax.tree.leaves(s1.variables), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    both = _fedavg_step(s0.variables, jax.tree.map(lambda x: x.mean(0), new))
    assert not np.allclose(np.asarray(jax.tree.leaves(both)[0]), np.asarray(jax.tree.leaves(s1.variables)[0]))


def test_a_fedavg_round_with_a_registered_aggregator_is_it_by_hand():
    from jaxfednas.aggregators import unregister_aggregator
    from jaxfednas.server import register_aggregator

    @register_aggregator("max_of_reporting")
    def coordinate_max(x, weights, valid, server):
        return jnp.where(valid, x, -jnp.inf).max(0)

    try:
        cfg, data = tiny_federation("fedavg", **{"run.aggregator": "max_of_reporting"})
        algo = build_algorithm(cfg, data.info)
        s0 = algo.init(init_key(0))
        s1, _ = algo.round(s0, data, round_key(0, 0))
    finally:
        unregister_aggregator("max_of_reporting")
    ids, keys = round_clients(round_key(0, 0), 4, 2)
    new, _ = _local_models()(s0.variables, data, ids, keys)
    want = _fedavg_step(s0.variables, jax.tree.map(lambda x: x.max(0), new))
    for a, b in zip(jax.tree.leaves(s1.variables), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # (fednas ~11 s, dfnas ~40 s cold; the server choices' plumbing: test_contract.py)
@pytest.mark.parametrize("name", ["fednas", "dfnas"])
def test_arch_server_optimizer_steps_alpha_with_its_own_rate(name):
    """run.arch_server_optimizer moves α from the round's start towards the clients' average
    with run.arch_server_lr, while run.server_optimizer moves the weights with run.server_lr:
    against the default round (whose α and weights are the clients' averages), by hand."""
    cfg, data = tiny_federation(name)
    algo = build_algorithm(cfg, data.info)
    s0 = algo.init(init_key(0))
    s1, _ = algo.round(s0, data, round_key(0, 0))
    cfg_o, _ = tiny_federation(name, **{"run.server_optimizer": "sgd", "run.server_lr": 2.0,
                                        "run.arch_server_optimizer": "avgm", "run.arch_server_lr": 0.5,
                                        "run.server_momentum": 0.5})
    opt = build_algorithm(cfg_o, data.info)
    o0 = opt.init(init_key(0))
    chex.assert_trees_all_equal(o0.variables, s0.variables)
    o1, _ = opt.round(o0, data, round_key(0, 0))
    moved = False
    for part, lr in (("params", 2.0), ("arch", 0.5)):
        for start, avg, got in zip(jax.tree.leaves(s0.variables[part]), jax.tree.leaves(s1.variables[part]),
                                   jax.tree.leaves(o1.variables[part])):
            start, avg = np.asarray(start, np.float64), np.asarray(avg, np.float64)
            # one SGD (momentum starts at 0) step on the pseudo-gradient start - avg
            np.testing.assert_allclose(got, start + lr * (avg - start), rtol=1e-5, atol=1e-6)
            moved |= part == "arch" and bool(np.any(avg != start))
    assert moved  # α moved in the default round: the check above saw the arch optimizer's rate
    # the momentum buffer of α is the pseudo-gradient (the first step of heavy ball)
    for buf, start, avg in zip(jax.tree.leaves(o1.server["arch"]), jax.tree.leaves(s0.variables["arch"]),
                               jax.tree.leaves(s1.variables["arch"])):
        np.testing.assert_allclose(buf, np.asarray(start) - np.asarray(avg), rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_equal(o1.variables["batch_stats"], s1.variables["batch_stats"])


def test_a_fedavg_round_with_trimmed_mean_drops_run_trim_fraction_from_each_end_by_hand():
    """run.aggregator=trimmed_mean with run.trim_fraction=0.2 over 6 reporting clients drops
    ⌊0.2 · 6⌋ = 1 value from each end of every coordinate and averages the middle 4,
    unweighted, for the weights and the BatchNorm statistics alike. The default β = 0.1
    would drop none (the unweighted mean), and with 4 clients the trimmed mean of 1 per end
    is the median: 6 clients tell all three apart."""
    over = {"data.num_clients": 6, "run.clients_per_round": 6, "run.aggregator": "trimmed_mean",
            "run.trim_fraction": 0.2}
    cfg, data = tiny_federation("fedavg", **over)
    algo = build_algorithm(cfg, data.info)
    s0 = algo.init(init_key(0))
    s1, _ = algo.round(s0, data, round_key(0, 0))
    ids, keys = round_clients(round_key(0, 0), 6, 6)
    new, _ = _local_models()(s0.variables, data, ids, keys)

    def trimmed(x):  # [6, ...] -> the mean of the middle 4 per coordinate
        return np.sort(np.asarray(x, np.float64), axis=0)[1:-1].mean(0)

    want = _fedavg_step(s0.variables, jax.tree.map(trimmed, new))
    for a, b in zip(jax.tree.leaves(s1.variables), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    x = np.asarray(jax.tree.leaves(new["params"])[0], np.float64)
    for other in (x.mean(0), np.median(x, 0)):  # the untrimmed mean, the median: both differ here
        assert np.abs(other - trimmed(x)).max() > 1e-4
