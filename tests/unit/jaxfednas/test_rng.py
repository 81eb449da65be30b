"""Named random streams (jaxfednas.rng): pinned values, independence, and the round's
clients and keys from one call (jaxfednas.runtime.round_clients)."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas import rng
from jaxfednas.runtime import round_clients, sample_clients


def _data(k):
    return tuple(np.asarray(k).tolist())


def test_stream_values_are_pinned():
    # The tags are part of every result: a changed tag changes every run's numbers. These
    # raw threefry keys were computed once; a change to the tree of streams breaks them.
    r = rng.round_key(0, 3)
    c = rng.client_keys(r, jnp.array([2]))[0]
    assert _data(rng.init_key(0)) == (3380239599, 3343201961)
    assert _data(r) == (2488719848, 3371676629)
    assert _data(rng.sample_key(r)) == (1107538117, 2979898446)
    assert _data(c) == (2650736636, 4188947870)
    assert _data(rng.step_key(c, 5)) == (3251675296, 1408081856)


def test_seed_level_tags_are_distinct():
    assert len({rng.INIT, rng.ROUNDS, rng.AVAILABILITY}) == 3


def test_streams_of_a_round_are_distinct():
    r = rng.round_key(1, 0)
    ids = jnp.arange(50)
    ck = rng.client_keys(r, ids)
    keys = [rng.sample_key(r), *ck, *rng.personal_keys(ck), *rng.search_keys(ck), *rng.policy_keys(ck),
            *[rng.step_key(ck[0], t) for t in range(20)], *rng.adaptation_keys(ids), rng.personalize_key(1),
            *[rng.drop_path_key(rng.step_key(ck[0], t)) for t in range(20)]]
    keys += [jax.random.fold_in(ck[0], e) for e in range(20)]  # local epochs' permutations
    assert len({_data(k) for k in keys}) == len(keys)


def test_dp_iteration_keys_coincide_with_round_client_keys_by_value():
    # DP_ITERATIONS and CLIENT fold the same value into the round key (kept for unchanged
    # results), so iteration j's key IS client j's round key. DP-FNAS is safe only because
    # it never uses the round's client keys: its parties' keys are client_keys of the
    # iteration key, one level down, and differ from the round's client keys.
    r = rng.round_key(1, 0)
    ids = jnp.arange(50)
    assert _data(rng.dp_iteration_key(r, 7)) == _data(rng.client_keys(r, ids)[7])
    parties = {_data(k) for j in range(5) for k in rng.client_keys(rng.dp_iteration_key(r, j), ids)}
    assert len(parties) == 5 * 50 and not parties & {_data(k) for k in rng.client_keys(r, ids)}


def test_client_keys_do_not_depend_on_the_other_sampled_clients():
    r = rng.round_key(0, 0)
    a = rng.client_keys(r, jnp.array([1, 4, 6]))
    b = rng.client_keys(r, jnp.array([4]))
    assert _data(a[1]) == _data(b[0])


def test_round_clients_is_sampling_and_client_keys():
    r = rng.round_key(2, 5)
    ids, keys = round_clients(r, 20, 5)
    np.testing.assert_array_equal(ids, sample_clients(rng.sample_key(r), 20, 5))
    assert ids.shape == (5,) and bool(jnp.all(ids[1:] > ids[:-1]))
    for i, k in zip(np.asarray(ids), keys):
        assert _data(k) == _data(rng.client_keys(r, jnp.array([i]))[0])
    # a round of the same seed draws the same clients; another round (almost surely) not
    np.testing.assert_array_equal(round_clients(rng.round_key(2, 5), 20, 5)[0], ids)
    assert any(not np.array_equal(round_clients(rng.round_key(2, q), 20, 5)[0], ids) for q in range(6, 9))
