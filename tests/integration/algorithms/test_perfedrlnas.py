"""PerFedRLNAS (algorithms/perfedrlnas.py): the policy gradient of Eqs. 5-7 (each cell type
with its own probabilities, and the code's variant), count-normalised aggregation on
constructed masks (and the code's masked deltas), the reward's parts (time term, round
time, Eq. 9's φ, the baselines) by hand, two real rounds' REINFORCE steps and a round's
BatchNorm aggregate against hand computations, Eq. 9's memory budget in a round,
evaluation without BatchNorm aggregation, the resource model's determinism, the DARTS
choice space's subnets and costs against hand-built single-op networks, new-client
adaptation by hand, a round on the elastic (and, opt-in, hybrid) space, and one-line
config errors.

One compilation per round and bit-exact resume (policies and their Adam states included)
are checked in tests/integration/algorithms/test_contract.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_federation
from jaxfednas.algorithms import perfedrlnas as pf
from jaxfednas.config import ConfigError
from jaxfednas.cost import count_macs, count_params
from jaxfednas.registry import build_algorithm, make_config
from jaxfednas.rng import init_key, policy_keys, round_key
from jaxfednas.runtime import round_clients
from jaxfednas.search_spaces.choice import choice_mask
from jaxfednas.search_spaces.darts.masks import CELLS

TINY = {"data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2, "algo.C": 4,
        "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny", "algo.local_epochs": 1}


SECOND = 7  # the second round's key (see second_round)


def _cfg(**over):
    return make_config("perfedrlnas", overrides={**TINY, **{f"algo.{k}": v for k, v in over.items()}})


@pytest.fixture(scope="module")
def built(tiny_data):
    """Two rounds with the default time term (relative, λ_time = 0.05)."""
    cfg = _cfg()
    algo = build_algorithm(cfg, tiny_data.info)
    state0 = algo.init(init_key(0))
    state1, metrics = algo.round(state0, tiny_data, round_key(0, 0))
    return cfg, algo, state0, state1, metrics


@pytest.fixture(scope="module")
def second_round(built, tiny_data):
    """The round after round 0, drawn with round key 7: its clients (1, 3) overlap round 0's
    (0, 1), so the paper's baseline, the code's running max and this round's mean differ."""
    _, algo, _, state1, _ = built
    return algo.round(state1, tiny_data, round_key(0, SECOND))


def _sampled(cfg, data, state, t):
    """Round t's clients and the choices their policies sample (Algorithm 1, lines 5-6)."""
    idx, keys = round_clients(round_key(0, t), data.info.num_clients, cfg.run.clients_per_round)
    valid = choice_mask(pf.make_space(cfg.algo, data.info).dims)
    choices = jax.vmap(lambda k, a: jax.random.categorical(k, pf.masked_logits(a, valid)))(
        policy_keys(keys), state.policy_logits[idx])
    return np.asarray(idx), keys, np.asarray(choices), valid


def _round_time(cfg, data, state, idx, choices):
    """RT_i by hand: 3 × forward multiply-adds × training examples × E + one forward per
    test example, over the client's throughput, plus the float32 weights down and up."""
    space = pf.make_space(cfg.algo, data.info)
    res = jax.tree.map(lambda a: np.asarray(a)[idx], state.resources)
    n_tr, n_te = np.asarray(data.train.counts)[idx], np.asarray(data.test.counts)[idx]
    out = []
    for j, c in enumerate(choices):
        cost = space.cost(c)
        bits = 32.0 * cost.params
        out.append((3 * cost.macs * n_tr[j] * cfg.algo.local_epochs + cost.macs * n_te[j]) / res.throughput[j]
                   + bits / res.down_bps[j] + bits / res.up_bps[j])
    return np.array(out)


def _adam_step(state, idx, choices, r, valid):
    """α_i after Algorithm 1, line 16: one step of client i's own Adam (lr 0.5, β1 0.5) up
    r_i (δ_i − p_i), from the Adam state the round started with."""
    tx = optax.adam(0.5, b1=0.5, b2=0.999)
    out = []
    for j, i in enumerate(idx):
        g = pf.policy_gradient(state.policy_logits[i], choices[j], jnp.float32(r[j]), valid)
        u, _ = tx.update(-g, jax.tree.map(lambda a: a[i], state.opt_state))
        out.append(np.asarray(state.policy_logits[i] + u))
    return np.stack(out)


def test_policy_gradient_is_reward_times_onehot_minus_probs_per_dimension():
    """Eqs. 6-7 with padded dimensions (3 and 2 choices): r (δ − p) on the real slots, 0 on padding."""
    valid = np.array([[True, True, True], [True, True, False]])
    alpha = jnp.array([[0.1, -0.4, 0.7], [1.0, -1.0, 0.0]])
    g = pf.policy_gradient(alpha, jnp.array([2, 0]), jnp.float32(0.3), valid)
    p0 = np.exp([0.1, -0.4, 0.7]) / np.exp([0.1, -0.4, 0.7]).sum()
    p1 = np.exp([1.0, -1.0]) / np.exp([1.0, -1.0]).sum()
    np.testing.assert_allclose(g[0], 0.3 * (np.array([0, 0, 1]) - p0), rtol=1e-6)
    np.testing.assert_allclose(g[1], [0.3 * (1 - p1[0]), 0.3 * (0 - p1[1]), 0.0], rtol=1e-6)


def test_each_cell_type_uses_its_own_probabilities_unless_the_codes_variant_is_asked_for():
    """DARTS: dims 0..E-1 normal, E..2E-1 reduce. The paper: each dimension's own softmax;
    ``reduce_probs='normal'`` (the code) puts the normal cell's p into the reduce gradient."""
    valid = np.ones((4, 3), bool)
    alpha = jnp.array([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 0], [0, 0, -3.0]])
    choice, r = jnp.array([0, 1, 2, 2]), jnp.float32(1.0)
    p = np.asarray(jax.nn.softmax(alpha, -1))
    own = pf.policy_gradient(alpha, choice, r, valid)
    code = pf.policy_gradient(alpha, choice, r, valid, probs_from=np.array([0, 1, 0, 1]))
    onehot = np.eye(3)[np.asarray(choice)]
    np.testing.assert_allclose(own, onehot - p, rtol=1e-6)
    np.testing.assert_allclose(code, onehot - p[[0, 1, 0, 1]], rtol=1e-6)
    assert not np.allclose(own[2:], code[2:])


def test_count_normalised_aggregation_on_constructed_masks():
    """Line 14: each entry averaged over the clients whose subnet holds it, weighted by n_i; an
    entry no client used keeps the server's value; the code's masked deltas are n-weighted
    over all clients instead (a weight one of two equal clients trained moves half as far)."""
    class Space:  # one 4-vector "supernet"; a choice keeps the entries it names
        def variable_mask(self, choice, variables):
            return {"params": {"w": jnp.asarray(choice, jnp.float32)}, "batch_stats": {}}

    old = {"params": {"w": jnp.array([1.0, 2.0, 3.0, 4.0])}, "batch_stats": {}}
    choices = jnp.array([[1, 1, 0, 0], [1, 0, 1, 0]])  # entry 3: nobody
    new = {"params": {"w": jnp.array([[10.0, 20.0, 0.0, 0.0], [30.0, 0.0, 40.0, 0.0]])}, "batch_stats": {}}
    weights = jnp.array([1.0, 3.0])
    cfg = _cfg().algo
    out = pf.aggregate(cfg, Space(), old, new, choices, weights)["params"]["w"]
    np.testing.assert_allclose(out, [(10 + 3 * 30) / 4, 20.0, 40.0, 4.0], rtol=1e-6)
    code = pf.aggregate(_cfg(aggregation="masked_delta").algo, Space(), old,
                        {"params": {"w": jnp.array([[10.0, 20.0, 3.0, 4.0], [30.0, 2.0, 40.0, 4.0]])},
                         "batch_stats": {}}, choices, weights)["params"]["w"]
    np.testing.assert_allclose(code, [1 + 0.25 * 9 + 0.75 * 29, 2 + 0.25 * 18, 3 + 0.75 * 37, 4.0], rtol=1e-6)


def test_a_round_takes_the_reinforce_step_of_its_rewards(built, tiny_data):
    """Round 0 from α = 0: r_i = Acc_i − mean of the sampled clients' Acc (the only ones
    seen) − 0.05 (RT_i − min RT) / min RT, RT by hand, and α_i becomes one Adam step along
    r_i (δ_i − p); unsampled policies stay 0."""
    cfg, algo, state0, state1, metrics = built
    idx, _, choices, valid = _sampled(cfg, tiny_data, state0, 0)
    acc = np.asarray(state1.acc)[idx]
    assert np.asarray(state1.seen).sum() == 2 and np.asarray(state1.seen)[idx].all()
    rt = _round_time(cfg, tiny_data, state0, idx, choices)
    time = 0.05 * (rt - rt.min()) / rt.min()
    r = acc - acc.mean() - time
    assert np.abs(r).min() > 1e-3 and time.max() > 1e-3  # the time term moves the rewards
    np.testing.assert_allclose(np.asarray(state1.policy_logits)[idx], _adam_step(state0, idx, choices, r, valid), atol=1e-6)
    others = np.setdiff1d(np.arange(4), idx)
    np.testing.assert_array_equal(np.asarray(state1.policy_logits)[others], 0.0)  # unsampled policies untouched
    assert float(metrics["acc_baseline"]) == pytest.approx(acc.mean(), abs=1e-6)
    assert float(metrics["round_time_s"]) == pytest.approx(rt.max(), rel=1e-5)
    assert float(metrics["reward_time_share"]) == pytest.approx(time.sum() / np.abs(r).sum(), rel=1e-4)
    assert float(metrics["reward_mean"]) == pytest.approx(r.mean(), abs=1e-6)  # = −mean time term here
    assert float(metrics["server_update_skipped"]) == 0.0


def test_second_round_rewards_use_the_papers_baseline(built, second_round, tiny_data):
    """Round 1 after round 0, by hand: mean Acc is the mean of every seen client's latest
    accuracy after this round's are written in (the paper) — not the mean of the seen
    clients' best accuracies before the round (the code's running max) nor this round's
    mean — and α_i takes one more Adam step (its state from round 0) along r_i (δ − p)."""
    cfg, _, _, state1, _ = built
    state2, metrics = second_round
    idx, _, choices, valid = _sampled(cfg, tiny_data, state1, SECOND)
    acc = np.asarray(state2.acc)[idx]
    hist, seen = np.asarray(state1.acc).copy(), np.asarray(state1.seen).copy()
    running_max = np.asarray(state1.best_acc)[seen].mean()
    hist[idx], seen[idx] = acc, True
    latest = hist[seen].mean()
    assert min(abs(latest - running_max), abs(latest - acc.mean())) > 1e-3, "the three baselines coincide"
    assert float(metrics["acc_baseline"]) == pytest.approx(latest, abs=1e-6)
    rt = _round_time(cfg, tiny_data, state1, idx, choices)
    r = acc - latest - 0.05 * (rt - rt.min()) / rt.min()
    np.testing.assert_allclose(np.asarray(state2.policy_logits)[idx], _adam_step(state1, idx, choices, r, valid), atol=1e-6)


def test_round_aggregates_batchnorm_statistics_by_hand(built, tiny_data):
    """Line 14 on a real round: every BatchNorm statistic (and weight) of the new supernet
    is the n_i-weighted mean of the sampled clients' trained values over the clients whose
    subnet holds it (hand-run clients, the round's keys and lr), the old value elsewhere."""
    cfg, _, state0, state1, _ = built
    idx, keys, choices, _ = _sampled(cfg, tiny_data, state0, 0)
    space = pf.make_space(cfg.algo, tiny_data.info)
    train = jax.jit(pf.make_client_train(cfg.algo, tiny_data.info, space))
    data = tiny_data.clients("train", jnp.asarray(idx))
    n = np.asarray(data.count, np.float64)
    new, masks = [], []
    for j in range(len(idx)):
        d = jax.tree.map(lambda a: a[j], data)
        new.append(train(state0.variables, jnp.asarray(choices[j]), d, keys[j], jnp.float32(cfg.algo.lr))[0])
        masks.append(space.variable_mask(jnp.asarray(choices[j]), state0.variables))

    def expect(old, *rows):
        vals, ms = rows[:len(idx)], rows[len(idx):]
        w = sum(n[j] * np.broadcast_to(ms[j], old.shape) for j in range(len(idx)))
        tot = sum(n[j] * np.broadcast_to(ms[j], old.shape) * vals[j] for j in range(len(idx)))
        return np.where(w > 0, tot / np.maximum(w, 1e-30), old)

    for k in ("batch_stats", "params"):
        want = jax.tree.map(expect, state0.variables[k], *[v[k] for v in new], *[mk[k] for mk in masks])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), state1.variables[k], want)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state0.variables["batch_stats"]),
                                                     jax.tree.leaves(state1.variables["batch_stats"]))]
    assert any(moved)


def test_time_penalty_relative_and_seconds():
    """Eq. 8's λ_time (RT_i − min RT), min over the clients that reported: in seconds, or
    relative to the fastest reporting client (the default); 0 for a client that did not report."""
    rt, reported = jnp.array([2.0, 3.0, 6.0, 1.0]), jnp.array([True, True, True, False])
    np.testing.assert_allclose(pf.time_penalty(rt, reported, 0.1, "seconds"), [0.0, 0.1, 0.4, 0.0], rtol=1e-6)
    np.testing.assert_allclose(pf.time_penalty(rt, reported, 0.1, "relative"), [0.0, 0.05, 0.2, 0.0], rtol=1e-6)
    r = pf.rewards(jnp.array([0.5, 0.9, 0.4, 0.0]), 0.6, jnp.array([0.0, 0.05, 0.2, 0.0]), jnp.array([0.25, 0, 0, 0]))
    np.testing.assert_allclose(r, [0.5 - 0.6 - 0.25, 0.9 - 0.6 - 0.05, 0.4 - 0.6 - 0.2, -0.6], rtol=1e-6)


def test_round_time_is_training_and_test_compute_plus_transfer():
    """RT = (3 × multiply-adds × n_train × E + multiply-adds × n_test) / throughput + 32 bits
    per weight down and up."""
    costs = jnp.array([[1000.0, 5e6, 0.0], [10.0, 2e6, 0.0]])
    res = pf.Resources(throughput=jnp.array([1e9, 2e9]), memory_budget=jnp.ones(2), up_bps=jnp.array([1e6, 1e5]),
                       down_bps=jnp.array([2e6, 1e5]))
    rt = pf.round_time(costs, jnp.array([10.0, 20.0]), jnp.array([4.0, 0.0]), 2, res)
    want = [(3 * 5e6 * 10 * 2 + 5e6 * 4) / 1e9 + 32e3 / 2e6 + 32e3 / 1e6,
            (3 * 2e6 * 20 * 2) / 2e9 + 320 / 1e5 + 320 / 1e5]
    np.testing.assert_allclose(rt, want, rtol=1e-6)


def test_eq9_memory_penalty_sets_phi_and_the_rounds_largest_time():
    """Eq. 9: over budget → Acc 0, φ 1, RT = the largest RT of the reporting clients; within
    budget φ = memory / budget (utilisation, the default) or 0 (binary)."""
    acc, rt = jnp.array([0.8, 0.6, 0.7, 0.9]), jnp.array([1.0, 4.0, 2.0, 9.0])
    memory, budget = jnp.array([1.0, 3.0, 5.0, 1.0]), jnp.array([4.0, 4.0, 2.0, 2.0])
    reported = jnp.array([True, True, True, False])
    a, t, phi, fits = pf.memory_penalty(acc, rt, memory, budget, reported, "utilization")
    np.testing.assert_array_equal(fits, [True, True, False, True])
    np.testing.assert_allclose(a, [0.8, 0.6, 0.0, 0.9])
    np.testing.assert_allclose(t, [1.0, 4.0, 4.0, 9.0])  # the non-reporting client's 9 s is not the max
    np.testing.assert_allclose(phi, [0.25, 0.75, 1.0, 0.5])
    _, _, binary, _ = pf.memory_penalty(acc, rt, memory, budget, reported, "binary")
    np.testing.assert_allclose(binary, [0.0, 0.0, 1.0, 0.0])


def test_accuracy_baselines_by_hand():
    """mean Acc of Eq. 8: the paper's (latest accuracies, this round's written in, over every
    seen client) and the code's running max (seen clients' best before the round)."""
    history, best = jnp.array([0.2, 0.4, 0.0, 0.0]), jnp.array([0.6, 0.5, 0.0, 0.0])
    seen = jnp.array([True, True, False, False])
    idx, acc, reported = jnp.array([1, 2]), jnp.array([0.9, 0.7]), jnp.array([True, True])
    latest = pf.accuracy_baseline("latest", history, best, seen, idx, acc, reported)
    assert float(latest) == pytest.approx((0.2 + 0.9 + 0.7) / 3)
    running = pf.accuracy_baseline("running_max", history, best, seen, idx, acc, reported)
    assert float(running) == pytest.approx((0.6 + 0.5) / 2)
    dropped = pf.accuracy_baseline("latest", history, best, seen, idx, acc, jnp.array([True, False]))
    assert float(dropped) == pytest.approx((0.2 + 0.9) / 2)  # a client that did not report is not seen
    first = pf.accuracy_baseline("running_max", history, best, jnp.zeros(4, bool), idx, acc, reported)
    assert float(first) == pytest.approx(0.8)


@pytest.mark.slow
def test_memory_budget_zeroes_accuracy_and_skips_clients_that_do_not_fit(tiny_data):
    """Eq. 9 with every budget 30 % of the way from the smallest to the largest subnet's
    memory (budget_range (0.3, 0.3)): a sampled subnet needing more scores Acc = 0, φ = 1,
    the round's largest RT and is not aggregated; one that fits pays φ = memory / budget;
    the count matches the sampled subnets' memory computed by hand (here one of each), and
    the policies take the step of these rewards."""
    cfg = _cfg(memory_budget=True, budget_range=(0.3, 0.3))
    algo = build_algorithm(cfg, tiny_data.info)
    space = pf.make_space(cfg.algo, tiny_data.info)
    s0 = algo.init(init_key(0))
    idx, _, choices, valid = _sampled(cfg, tiny_data, s0, 0)
    memory = np.array([space.cost(c).memory_bytes(cfg.algo.batch_size) for c in choices])
    m_min, m_max = (space.cost(c(space)).memory_bytes(cfg.algo.batch_size) for c in (pf.smallest_choice,
                                                                                     pf.largest_choice))
    np.testing.assert_allclose(s0.resources.memory_budget, m_min + 0.3 * (m_max - m_min), rtol=1e-6)
    budget = np.asarray(s0.resources.memory_budget)[idx]
    over = memory > budget
    assert over.sum() == 1 and 0 < (memory / budget)[~over][0] < 1
    s1, m = algo.round(s0, tiny_data, round_key(0, 0))
    assert int(m["over_budget"]) == over.sum()
    # the over-budget client could not train: only the other's examples are in train_*
    assert int(m["train_examples"]) == np.asarray(tiny_data.train.counts)[idx][~over].sum()
    acc = np.asarray(s1.acc)[idx]
    np.testing.assert_array_equal(acc[over], 0.0)
    assert float(m["server_update_skipped"]) == float(over.all())
    if over.all():
        jax.tree.map(np.testing.assert_array_equal, s1.variables, s0.variables)
    rt = _round_time(cfg, tiny_data, s0, idx, choices)
    rt = np.where(over, rt.max(), rt)
    phi = np.minimum(memory / budget, 1.0)
    r = acc - acc.mean() - 0.05 * (rt - rt.min()) / rt.min() - phi
    np.testing.assert_allclose(np.asarray(s1.policy_logits)[idx], _adam_step(s0, idx, choices, r, valid), atol=1e-6)
    # the over-budget subnet stays out of the supernet: the same round with every budget
    # unbounded (the same program: budgets are state) aggregates it, and moves entries the
    # round above left at their start values -- those only the over-budget subnet covers
    roomy = s0.replace(resources=s0.resources.replace(memory_budget=jnp.full_like(s0.resources.memory_budget, 1e18)))
    s2, m2 = algo.round(roomy, tiny_data, round_key(0, 0))
    assert int(m2["over_budget"]) == 0
    only_over = 0
    for a, b, c in zip(*(jax.tree.leaves(s.variables["params"]) for s in (s0, s1, s2))):
        a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
        only_over += int(((a == b) & (c != a)).sum())
    assert only_over > 0


@pytest.mark.slow
def test_without_bn_aggregation_evaluation_measures_each_subnets_statistics(tiny_data):
    """``aggregate_bn=false`` leaves the server's BatchNorm statistics at init, so evaluation
    (and new-client adaptation) gives each client's argmax (sampled) subnet the statistics
    of its own training split: by hand, the subnet in training mode over the whole split
    (one batch) from zero statistics, divided by 1 − 0.9. With the init statistics the
    accuracies would differ."""
    cfg = _cfg(aggregate_bn=False)
    algo = build_algorithm(cfg, tiny_data.info)
    s0 = algo.init(init_key(0))
    out = np.asarray(algo.evaluate(s0, tiny_data)["client_test_acc"])
    space = pf.make_space(cfg.algo, tiny_data.info)
    best = pf.policy_argmax(s0.policy_logits, choice_mask(space.dims))
    zeros = jax.tree.map(jnp.zeros_like, s0.variables["batch_stats"])

    @jax.jit
    def hand(choice, train, test):
        x, mask = tiny_data.info.normalize(train.x), jnp.arange(train.x.shape[0]) < train.count
        _, upd = space.subnet(choice).apply({**s0.variables, "batch_stats": zeros}, x, train=True, mask=mask,
                                            mutable=["batch_stats"])
        stats = jax.tree.map(lambda a: a / 0.1, upd["batch_stats"])
        return (pf.subnet_accuracy(space, tiny_data.info, {**s0.variables, "batch_stats": stats}, choice, test, 500),
                pf.subnet_accuracy(space, tiny_data.info, s0.variables, choice, test, 500))

    ids = jnp.arange(4)
    train, test = tiny_data.clients("train", ids), tiny_data.clients("test", ids)
    got = [hand(best[k], *jax.tree.map(lambda a: a[k], (train, test))) for k in range(4)]
    np.testing.assert_allclose(out, [float(a) for a, _ in got], atol=1e-6)
    assert any(abs(float(a) - float(b)) > 1e-3 for a, b in got)
    # adapt_new_clients scores its sampled subnets the same way
    _, curve = pf.adapt_new_clients(cfg.algo, tiny_data.info, s0, tiny_data, [0, 1, 2, 3], rounds=1,
                                    key=jax.random.key(5))
    valid = choice_mask(space.dims)
    choices = jax.vmap(lambda k, a: jax.random.categorical(k, pf.masked_logits(a, valid)))(
        jax.random.split(jax.random.fold_in(jax.random.key(5), 0), 4), s0.policy_logits)
    got = [hand(choices[k], *jax.tree.map(lambda a: a[k], (train, test))) for k in range(4)]
    assert curve[0] == pytest.approx(np.mean([float(a) for a, _ in got]), abs=1e-6)
    assert abs(np.mean([float(a) for a, _ in got]) - np.mean([float(b) for _, b in got])) > 1e-3


def test_resource_model_is_seeded_and_in_range(built, tiny_data):
    cfg, algo, state0, _, _ = built
    again = algo.init(init_key(0))
    jax.tree.map(np.testing.assert_array_equal, again.resources, state0.resources)
    other = algo.init(init_key(1)).resources
    assert not np.array_equal(other.throughput, state0.resources.throughput)
    t = np.asarray(state0.resources.throughput)
    assert (t >= 1e9 * 0.999).all() and (t <= 1e10 * 1.001).all()
    space = pf.make_space(cfg.algo, tiny_data.info)
    lo, hi = (space.cost(c(space)).memory_bytes(cfg.algo.batch_size) for c in (pf.smallest_choice, pf.largest_choice))
    b = (np.asarray(state0.resources.memory_budget) - lo) / (hi - lo)
    assert (b >= 0.25 - 1e-5).all() and (b <= 1.0 + 1e-5).all()
    cands = [space.cost(np.full(len(space.dims), j)).memory_bytes(cfg.algo.batch_size) for j in range(3)]
    assert lo == min(cands) and hi == max(cands)  # the extremes are the single-op subnets here
    np.testing.assert_allclose(state0.resources.up_bps, 100e6)


def test_random_subnets_fit_each_clients_budget_and_policies_for_selects_them(built, tiny_data):
    """The control: random subnets within each client's memory budget (uniform among those that
    fit), a function of the key; policies_for turns them into policies whose argmax is them."""
    cfg, _, state0, _, _ = built
    space = pf.make_space(cfg.algo, tiny_data.info)
    valid = choice_mask(space.dims)
    budgets = np.asarray(state0.resources.memory_budget, np.float64)
    mem = lambda c: space.cost(c).memory_bytes(cfg.algo.batch_size)  # noqa: E731
    tight = np.full(4, np.median([mem(np.full(len(space.dims), j)) for j in range(3)]))  # some subnets do not fit
    draws = np.stack([pf.random_subnets(jax.random.key(i), space, tight, batch_size=cfg.algo.batch_size)
                      for i in range(60)])  # [60, K, D]
    assert all(mem(c) <= tight[0] for c in draws.reshape(-1, len(space.dims)))
    assert any(mem(c) > tight[0] for c in pf.random_subnets(jax.random.key(1), space, num_clients=100))  # it filters
    assert len({tuple(c) for c in draws.reshape(-1, len(space.dims))}) > 3
    np.testing.assert_array_equal(pf.random_subnets(jax.random.key(3), space, budgets),
                                  pf.random_subnets(jax.random.key(3), space, budgets))
    free = pf.random_subnets(jax.random.key(0), space, num_clients=4)
    assert free.shape == (4, len(space.dims)) and free.dtype == np.int32
    np.testing.assert_array_equal(pf.policy_argmax(pf.policies_for(jnp.asarray(free), valid.shape[-1]), valid), free)
    with pytest.raises(ValueError, match="client 0: no random subnet within its memory budget"):
        pf.random_subnets(jax.random.key(0), space, np.zeros(1), max_tries=5)


def test_darts_subnet_and_costs_equal_the_single_op_network(tiny_data):
    """A subnet with op j on every edge is the supernet built with primitives (op_j,): same
    logits from the same weights, and costs = count_params / count_macs of that network."""
    cfg = _cfg().algo
    space = pf.make_space(cfg, tiny_data.info)
    net = space.net
    x = np.asarray(tiny_data.info.normalize(tiny_data.server_x[:16]))
    # inits and applies compiled whole (eagerly their ops compile ~110 small programs)
    v = jax.jit(space.init)(jax.random.key(0), x[:1])
    for j, op in enumerate(net.primitives):
        choice = np.full(len(space.dims), j, np.int32)
        child = net.clone(primitives=(op,), dw_impl="grouped")
        ones = {c: jnp.ones((space.num_edges, 1)) for c in CELLS}
        cv = jax.jit(functools.partial(child.init, arch_weights=ones))(jax.random.key(0), x[:1])
        cv = {"params": _restrict(v["params"], cv["params"]), "batch_stats": _restrict(v["batch_stats"], cv["batch_stats"]),
              "arch": cv["arch"]}
        want = jax.jit(lambda cv: child.apply(cv, x, arch_weights=ones, train=False))(cv)
        got = jax.jit(lambda v: space.subnet(jnp.asarray(choice)).apply(v, x, train=False))(v)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        cost = space.cost(choice)
        assert cost.params == count_params(cv["params"]), op
        assert cost.macs == count_macs(lambda vv, xx: child.apply(vv, xx, arch_weights=ones), cv, x[:1])
        keep = space.variable_mask(jnp.asarray(choice), v)["params"]
        assert cost.params == sum(int(np.broadcast_to(k, p.shape).sum())
                                  for k, p in zip(jax.tree.leaves(keep), jax.tree.leaves(v["params"])))


def _restrict(full: dict, like: dict) -> dict:
    """``full``'s entries at the keys of ``like`` (a sub-network's variable tree)."""
    return {k: _restrict(full[k], sub) if isinstance(sub, dict) else full[k] for k, sub in like.items()}


def test_policy_entropy_ignores_padding():
    valid = np.array([[True, True, False], [True, True, True]])
    h = pf.policy_entropy(jnp.zeros((1, 2, 3)), valid)
    assert float(h) == pytest.approx((np.log(2) + np.log(3)) / 2, rel=1e-6)


def test_argmax_breaks_exact_ties_pseudo_randomly_not_to_the_first_op():
    valid = np.ones((64, 3), bool)
    tied = jnp.tile(jnp.array([0.5, 0.5, -1.0]), (64, 1))
    best = np.asarray(pf.policy_argmax(tied, valid))
    assert set(best) == {0, 1}  # both tied ops are chosen somewhere, never the lower one
    np.testing.assert_array_equal(pf.policy_argmax(tied, valid), best)  # and always the same way
    np.testing.assert_array_equal(pf.policy_argmax(jnp.array([[0.1, 0.3, 0.2]]), valid[:1]), [1])


@pytest.mark.slow
def test_export_personalize_and_new_client_adaptation(built, tiny_data):
    cfg, algo, _, state1, _ = built
    rows, pers = algo.personalize(state1, tiny_data, jax.random.key(3))
    assert rows["choice"].shape == (4, len(pf.make_space(cfg.algo, tiny_data.info).dims))
    acc = np.asarray(pers["client_test_acc"])
    assert acc.shape == (4,) and ((acc >= 0) & (acc <= 1)).all()
    arch = algo.export(state1)
    assert set(arch.clients) == {"0", "1", "2", "3"}
    one = arch.clients["0"]
    assert set(one["architecture"]) == {d.name for d in pf.make_space(cfg.algo, tiny_data.info).dims}
    assert one["params"] > 0 and one["macs"] > 0 and one["inference_latency_s"] > 0
    assert pf.PersonalSubnets.from_json(arch.to_json()).clients == arch.clients
    policies, curve = pf.adapt_new_clients(cfg.algo, tiny_data.info, state1, tiny_data, [2, 3], rounds=3,
                                           key=jax.random.key(5))
    assert policies.shape[0] == 2 and curve.shape == (3,) and ((curve >= 0) & (curve <= 1)).all()
    # two rounds by hand: sampled subnets scored on the test split with the supernet's weights,
    # r_i = Acc_i − mean Acc − 0.05 (RT_i − min RT) / min RT on inference time, one Adam step each
    two, first = pf.adapt_new_clients(cfg.algo, tiny_data.info, state1, tiny_data, [2, 3], rounds=2,
                                      key=jax.random.key(5))
    np.testing.assert_array_equal(first, curve[:2])
    space = pf.make_space(cfg.algo, tiny_data.info)
    valid = choice_mask(space.dims)
    ids = np.array([2, 3])
    test = tiny_data.clients("test", jnp.asarray(ids))
    score = jax.jit(lambda c, d: pf.subnet_accuracy(space, tiny_data.info, state1.variables, c, d, 500))
    zeros = jnp.zeros((2,) + valid.shape)
    state = pf.PerFedRLNASState(policy_logits=zeros, opt_state=jax.vmap(optax.adam(0.5, b1=0.5).init)(zeros), **{
        k: None for k in ("variables", "acc", "best_acc", "seen", "resources", "round")})
    tx = optax.adam(0.5, b1=0.5, b2=0.999)
    for t in range(2):
        choices = np.asarray(jax.vmap(lambda k, a: jax.random.categorical(k, pf.masked_logits(a, valid)))(
            jax.random.split(jax.random.fold_in(jax.random.key(5), t), 2), state.policy_logits))
        acc = np.array([float(score(jnp.asarray(c), jax.tree.map(lambda a: a[j], test)))
                        for j, c in enumerate(choices)])
        assert first[t] == pytest.approx(acc.mean(), abs=1e-6)
        rt = np.array([space.cost(c).macs for c in choices]) * np.asarray(test.count) / np.asarray(
            state1.resources.throughput)[ids]
        r = acc - acc.mean() - 0.05 * (rt - rt.min()) / rt.min()
        if t == 0:  # the direction: the first step moves the sampled choice's logit by +lr sign(r_i)
            picked = np.take_along_axis(_adam_step(state, np.arange(2), choices, r, valid), choices[..., None], -1)
            np.testing.assert_allclose(picked[..., 0], np.broadcast_to(0.5 * np.sign(r)[:, None], picked.shape[:2]),
                                       rtol=1e-4)
        grads = jnp.stack([pf.policy_gradient(state.policy_logits[j], choices[j], jnp.float32(r[j]), valid)
                           for j in range(2)])
        updates, opt = jax.vmap(tx.update)(-grads, state.opt_state)
        state = state.replace(policy_logits=state.policy_logits + updates, opt_state=opt)
    np.testing.assert_allclose(two, state.policy_logits, atol=1e-6)


@pytest.mark.parametrize("over, match", [
    ({"algo.reduce_probs": "normal", "algo.space": "elastic"}, "reduce_probs"),
    ({"algo.budget_range": (0.5, 0.1)}, "budget_range"),
    ({"algo.throughput_range": (1e9, float("inf"))}, "algo.throughput_range must be finite"),
    ({"algo.C": 5}, "algo.C"),
    ({"algo.baseline": "mean"}, "algo.baseline"),
    ({"algo.phi": "linear"}, "algo.phi"),
    ({"algo.time_term": "median"}, "algo.time_term"),
    ({"algo.bn_recalibration_batches": 0}, "algo.bn_recalibration_batches"),
])
def test_bad_settings_fail_with_one_line_naming_them(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_config("perfedrlnas", overrides=over)
    assert "\n" not in str(e.value)
    if "throughput_range" in over:  # the Python API too
        with pytest.raises(ConfigError, match=match):
            pf.PerFedRLNASConfig(throughput_range=over["algo.throughput_range"])


def test_single_path_darts_subnet_equals_the_masked_supernet(tiny_data):
    """``single_path=True`` (each op under a cond) gives the masked supernet's loss and
    gradients, the same BatchNorm statistics on the ops it keeps, and leaves the others'
    statistics untouched."""
    x, y = tiny_data.info.normalize(tiny_data.server_x[:32]), tiny_data.server_y[:32]
    out = {}
    for flag in (True, False):
        space = pf.make_space(_cfg(nodes=2, single_path=flag).algo, tiny_data.info)
        v = space.init(jax.random.key(0), x[:1])
        choice = jnp.asarray(np.random.RandomState(0).randint(0, 3, len(space.dims)), jnp.int32)

        def loss(p, stats, c, space=space):
            logits, upd = space.subnet(c).apply({"params": p, "batch_stats": stats}, x, train=True,
                                                mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd["batch_stats"]

        out[flag] = jax.jit(jax.value_and_grad(loss, has_aux=True))(v["params"], v["batch_stats"], choice)
        keep = space.variable_mask(choice, v)["batch_stats"]
    (l1, s1), g1 = out[True]
    (l0, s0), g0 = out[False]
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)
    jax.tree.map(lambda a, b, k: np.testing.assert_allclose(a * k, b * k, atol=1e-6), s1, s0, keep)
    jax.tree.map(lambda a, b, k: np.testing.assert_array_equal(a * (1 - k), b * (1 - k)), s1, v["batch_stats"], keep)


# the hybrid round compiles for ~90 s on 2 busy cores: opt-in (-m slow)
@pytest.mark.slow
@pytest.mark.parametrize("space", ["elastic", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_a_round_on_another_space(space, tiny_data):
    """The same algorithm over another space (tiny preset; its dimensions have 2 or 3 choices,
    so policies are padded): one round trains the sampled subnets, moves only the sampled
    clients' policies, each one Adam step along its hand-computed reward (the sampled
    choice's logit up where r_i > 0, down where r_i < 0), and exports costed architectures."""
    cfg = _cfg(space=space, space_preset="tiny")
    algo = build_algorithm(cfg, tiny_data.info)
    s0 = algo.init(init_key(0))
    s1, m = algo.round(s0, tiny_data, round_key(0, 0))
    check_round_direction(cfg, tiny_data, s0, s1, m)
    arch = algo.export(s1).clients["0"]
    assert arch["params"] > 0 and len(arch["architecture"]) == len(pf.make_space(cfg.algo, tiny_data.info).dims)


def check_round_direction(cfg, data, s0, s1, m):
    """Round 0 of ``cfg`` from α = 0, by hand: the sampled clients' policies (only theirs) are
    one Adam step along r_i (δ_i − p), r_i = Acc_i − mean Acc − λ_time relative time; the first
    step moves every logit by ± lr, the sampled choice's with the sign of r_i."""
    idx, _, choices, valid = _sampled(cfg, data, s0, 0)
    moved = np.abs(np.asarray(s1.policy_logits - s0.policy_logits)).sum((1, 2)) > 0
    assert moved[idx].all() and moved.sum() == len(idx)
    assert all(np.isfinite(float(v)) for v in m.values()), m  # dimensions of unequal size: padded policies
    acc = np.asarray(s1.acc)[idx]
    rt = _round_time(cfg, data, s0, idx, choices)
    r = acc - acc.mean() - cfg.algo.lambda_time * (rt - rt.min()) / rt.min()
    assert np.abs(r).min() > 1e-3
    np.testing.assert_allclose(np.asarray(s1.policy_logits)[idx], _adam_step(s0, idx, choices, r, valid), atol=1e-6)
    picked = np.take_along_axis(np.asarray(s1.policy_logits)[idx], choices[..., None], -1)[..., 0]
    np.testing.assert_allclose(picked, np.broadcast_to(0.5 * np.sign(r)[:, None], picked.shape), rtol=1e-4)
    assert float(m["subnet_params"]) > 0


def test_a_round_with_validation_rewards_time_in_seconds_and_its_own_policy_optimizer_by_hand():
    """Round 0 with reward_split=val, time_term=seconds, λ_time = 0.2 and policy_lr = 0.1, by
    hand: each sampled client trains its subnet (the round's key and lr), Acc_i is that
    subnet's accuracy on the client's validation split, RT_i counts a forward per
    validation example, r_i = Acc_i − mean Acc − 0.2 (RT_i − min RT) in seconds (the
    reported mean reward and time share), and α_i takes one step of Adam(0.1) along
    r_i (δ_i − p_i)."""
    over = {**{k: v for k, v in TINY.items() if k.startswith("algo.")}, "data.split": (0.5, 0.25, 0.25),
            "algo.reward_split": "val", "algo.time_term": "seconds", "algo.lambda_time": 0.2,
            "algo.policy_lr": 0.1}
    cfg, data = tiny_federation("perfedrlnas", **over)
    algo = build_algorithm(cfg, data.info)
    s0 = algo.init(init_key(0))
    s1, m = algo.round(s0, data, round_key(0, 0))
    idx, keys, choices, valid = _sampled(cfg, data, s0, 0)
    space = pf.make_space(cfg.algo, data.info)
    train = jax.jit(pf.make_client_train(cfg.algo, data.info, space))
    score = jax.jit(lambda v, c, d: pf.subnet_accuracy(space, data.info, v, c, d, cfg.algo.eval_batch_size))
    tr, va, te = (data.clients(s, jnp.asarray(idx)) for s in ("train", "val", "test"))
    acc, acc_test = [], []
    for j in range(len(idx)):
        v = train(s0.variables, jnp.asarray(choices[j]), jax.tree.map(lambda a: a[j], tr), keys[j],
                  jnp.float32(cfg.algo.lr))[0]
        acc.append(float(score(v, jnp.asarray(choices[j]), jax.tree.map(lambda a: a[j], va))))
        acc_test.append(float(score(v, jnp.asarray(choices[j]), jax.tree.map(lambda a: a[j], te))))
    acc = np.array(acc)
    np.testing.assert_allclose(np.asarray(s1.acc)[idx], acc, atol=1e-6)
    assert np.abs(acc - np.array(acc_test)).max() > 1e-3  # the test split would score otherwise
    res = jax.tree.map(lambda a: np.asarray(a)[idx], s0.resources)
    n_tr, n_va = np.asarray(tr.count), np.asarray(va.count)
    rt = np.array([(3 * space.cost(c).macs * n_tr[j] * cfg.algo.local_epochs + space.cost(c).macs * n_va[j])
                   / res.throughput[j] + 2 * 32.0 * space.cost(c).params / 100e6 for j, c in enumerate(choices)])
    time = 0.2 * (rt - rt.min())
    r = acc - acc.mean() - time
    assert time.max() > 1e-6  # the time term is in the rewards
    assert float(m["round_time_s"]) == pytest.approx(rt.max(), rel=1e-5)
    assert float(m["reward_mean"]) == pytest.approx(r.mean(), abs=1e-6)
    assert float(m["reward_time_share"]) == pytest.approx(time.sum() / np.abs(r).sum(), rel=1e-4)
    tx = optax.adam(0.1, b1=0.5, b2=0.999)
    for j, i in enumerate(idx):
        g = pf.policy_gradient(s0.policy_logits[i], choices[j], jnp.float32(r[j]), valid)
        u, _ = tx.update(-g, jax.tree.map(lambda a: a[i], s0.opt_state))
        np.testing.assert_allclose(np.asarray(s1.policy_logits)[i], np.asarray(s0.policy_logits[i] + u), atol=1e-6)
