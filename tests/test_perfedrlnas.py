"""PerFedRLNAS (algorithms/perfedrlnas.py): the policy gradient of Eqs. 5-7 (each cell type
with its own probabilities, and the code's variant), count-normalised aggregation on
constructed masks (and the code's masked deltas), a whole round's REINFORCE step against
its hand computation, Eq. 9's memory budget, the resource model's determinism, the DARTS
choice space's subnets and costs against hand-built single-op networks, new-client
adaptation, and one-line config errors.

One compilation per round and bit-exact resume (policies and their Adam states included)
are checked in tests/test_contract.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from algorithms import perfedrlnas as pf
from jaxfednas.config import ConfigError
from jaxfednas.cost import count_macs, count_params
from jaxfednas.registry import algorithm_module, make_config
from jaxfednas.rng import init_key, policy_keys, round_key
from jaxfednas.runtime import round_clients
from search_spaces.choice import choice_mask
from search_spaces.darts.masks import CELLS

TINY = {"data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2, "algo.C": 4,
        "algo.layers": 1, "algo.steps": 1, "algo.primitives": "tiny", "algo.local_epochs": 1}


def _cfg(**over):
    return make_config("perfedrlnas", overrides={**TINY, **{f"algo.{k}": v for k, v in over.items()}})


@pytest.fixture(scope="module")
def built(tiny_data):
    cfg = _cfg(lambda_time=0.0)
    algo = algorithm_module("perfedrlnas").build(cfg, tiny_data.info)
    state0 = algo.init(init_key(0))
    state1, metrics = algo.round(state0, tiny_data, round_key(0, 0))
    return cfg, algo, state0, state1, metrics


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
    """Round 0 from α = 0 with λ_time = 0: r_i = Acc_i − mean of the sampled clients' Acc
    (the only ones seen), and α_i becomes one Adam step (lr 0.5, β1 0.5) along r_i (δ_i − p)."""
    cfg, algo, state0, state1, metrics = built
    idx, keys = round_clients(round_key(0, 0), 4, 2)
    valid = choice_mask(pf.make_space(cfg.algo, tiny_data.info).dims)
    choices = jax.vmap(lambda k, a: jax.random.categorical(k, pf.masked_logits(a, valid)))(
        policy_keys(keys), state0.policy[idx])
    acc = np.asarray(state1.acc)[np.asarray(idx)]
    assert np.asarray(state1.seen).sum() == 2 and np.asarray(state1.seen)[np.asarray(idx)].all()
    r = acc - acc.mean()
    tx = optax.adam(0.5, b1=0.5, b2=0.999)
    for j, i in enumerate(np.asarray(idx)):
        g = pf.policy_gradient(state0.policy[i], choices[j], jnp.float32(r[j]), valid)
        u, _ = tx.update(-g, tx.init(state0.policy[i]))
        np.testing.assert_allclose(state1.policy[i], state0.policy[i] + u, atol=1e-6)
    others = np.setdiff1d(np.arange(4), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(state1.policy)[others], 0.0)  # unsampled policies untouched
    assert float(metrics["acc_baseline"]) == pytest.approx(acc.mean(), abs=1e-6)
    assert float(metrics["server_update_skipped"]) == 0.0


def test_memory_budget_zeroes_accuracy_and_skips_clients_that_do_not_fit(tiny_data):
    """Eq. 9 with every budget at the smallest subnet's memory (budget_range (0, 0)): a sampled
    subnet needing more scores Acc = 0, φ = 1 and is not aggregated; the count matches the
    sampled subnets' memory computed by hand."""
    cfg = _cfg(memory_budget=True, budget_range=(0.0, 0.0))
    algo = algorithm_module("perfedrlnas").build(cfg, tiny_data.info)
    space = pf.make_space(cfg.algo, tiny_data.info)
    s0 = algo.init(init_key(0))
    idx, keys = round_clients(round_key(0, 0), 4, 2)
    valid = choice_mask(space.dims)
    choices = np.asarray(jax.vmap(lambda k, a: jax.random.categorical(k, pf.masked_logits(a, valid)))(
        policy_keys(keys), s0.policy[idx]))
    memory = np.array([space.cost(c).memory_bytes(cfg.algo.batch_size) for c in choices])
    m_min = space.cost(pf.smallest_choice(space)).memory_bytes(cfg.algo.batch_size)
    np.testing.assert_allclose(s0.resources.memory_budget, m_min, rtol=1e-6)
    over = memory > np.asarray(s0.resources.memory_budget)[np.asarray(idx)]
    s1, m = algo.round(s0, tiny_data, round_key(0, 0))
    assert int(m["over_budget"]) == over.sum()
    np.testing.assert_array_equal(np.asarray(s1.acc)[np.asarray(idx)][over], 0.0)
    assert float(m["server_update_skipped"]) == float(over.all())
    if over.all():
        jax.tree.map(np.testing.assert_array_equal, s1.variables, s0.variables)


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
    assert pf.PersonalArchitectures.from_json(arch.to_json()).clients == arch.clients
    policies, curve = pf.adapt_new_clients(cfg.algo, tiny_data.info, state1, tiny_data, [2, 3], rounds=3,
                                           key=jax.random.key(5))
    assert policies.shape[0] == 2 and curve.shape == (3,) and ((curve >= 0) & (curve <= 1)).all()
    assert np.abs(np.asarray(policies)).sum() > 0
    again, _ = pf.adapt_new_clients(cfg.algo, tiny_data.info, state1, tiny_data, [2, 3], rounds=3,
                                    key=jax.random.key(5))
    np.testing.assert_array_equal(again, policies)


@pytest.mark.parametrize("over, match", [
    ({"algo.reduce_probs": "normal", "algo.space": "elastic"}, "reduce_probs"),
    ({"algo.budget_range": (0.5, 0.1)}, "budget_range"),
    ({"algo.C": 5}, "algo.C"),
    ({"algo.baseline": "mean"}, "algo.baseline"),
])
def test_bad_settings_fail_with_one_line_naming_them(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_config("perfedrlnas", overrides=over)
    assert "\n" not in str(e.value)


def test_single_path_darts_subnet_equals_the_masked_supernet(tiny_data):
    """``single_path=True`` (each op under a cond) gives the masked supernet's loss and
    gradients, the same BatchNorm statistics on the ops it keeps, and leaves the others'
    statistics untouched."""
    x, y = tiny_data.info.normalize(tiny_data.server_x[:32]), tiny_data.server_y[:32]
    out = {}
    for flag in (True, False):
        space = pf.make_space(_cfg(steps=2, single_path=flag).algo, tiny_data.info)
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


@pytest.mark.parametrize("space", ["elastic"])
def test_a_round_on_the_elastic_space(space, tiny_data):
    """The same algorithm over another space (tiny preset; its dimensions have 2 or 3 choices,
    so policies are padded): one round trains the sampled subnets, moves only the sampled
    clients' policies, and exports costed architectures. (The hybrid space runs through the
    same code; its own tests are tests/test_hybrid.py, a round of it ~27 s to compile.)"""
    cfg = _cfg(space=space, space_preset="tiny")
    algo = algorithm_module("perfedrlnas").build(cfg, tiny_data.info)
    s0 = algo.init(init_key(0))
    s1, m = algo.round(s0, tiny_data, round_key(0, 0))
    idx, _ = round_clients(round_key(0, 0), 4, 2)
    moved = np.abs(np.asarray(s1.policy - s0.policy)).sum((1, 2)) > 0
    assert moved[np.asarray(idx)].all() and moved.sum() == 2
    assert all(np.isfinite(float(v)) for v in m.values()), m  # dimensions of unequal size: padded policies
    assert float(m["subnet_params"]) > 0
    arch = algo.export(s1).clients["0"]
    assert arch["params"] > 0 and len(arch["architecture"]) == len(pf.make_space(cfg.algo, tiny_data.info).dims)
