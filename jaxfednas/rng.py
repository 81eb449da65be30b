"""Named random streams: every random draw of a run, and where its key comes from.

A run's randomness is one tree of keys grown from ``PRNGKey(seed)`` with
``jax.random.fold_in``; each branch is a *stream* named here, so that two draws never
share randomness by accident and a resumed run draws exactly what an uninterrupted one
draws (everything is a function of ``(seed, round, client, step)``)::

    PRNGKey(seed)
    ├─ INIT                                  init_key(seed): the initial state
    │   └─ PERSONALIZE                       personalize_key(seed): FedNAS §2.5 after search
    └─ ROUNDS ─ r                            round_key(seed, r): round r
        ├─ SAMPLE                            sample_key(round key): which clients run
        ├─ DROPOUT ─ k                       dropout_key(round key): whether client k reports
        ├─ CLIENT ─ k                        client_keys(round key, ids): client k's key
        │   ├─ e                             local epoch e's data permutation (data.federated)
        │   ├─ STEP ─ t                      step_key(client key, t): minibatch slot t
        │   │   │                            (augmentation, sampled paths, ...)
        │   │   └─ DROP_PATH                 drop_path_key(step key): DARTS drop path
        │   ├─ PERSONAL                      Ditto's personal update (other minibatches)
        │   ├─ SEARCH                        search_keys(client keys): SPIDER's random edge / node
        │   └─ POLICY                        policy_keys(client keys): PerFedRLNAS's sampled subnet
        └─ DP_ITERATIONS ─ j                 dp_iteration_key(round key, j): DP-FNAS
            └─ (client_keys of it) ─ DP_*    a party's Poisson samples, noise, augmentation
    PRNGKey(ADAPT_SEED) ─ CLIENT ─ k         evaluation-time fine-tuning (no round: evaluating
                                             a state twice gives the same numbers)
    PRNGKey(RANDOM_ARCH_SEED) ─ seed ─ i     random_arch_key(seed, i): the i-th random
                                             architecture of an experiment's control
                                             (jaxfednas.search_spaces.sampling; drawn on the host)

The tag values are part of every result — changing one changes every number of every
run — so they keep the values the library has always used. One pair shares a value
under the same parent: ``CLIENT`` and ``DP_ITERATIONS`` both fold 1 into a round key,
so DP-FNAS's iteration j key equals client j's round key. DP-FNAS never uses the
round's client keys (its parties' keys are drawn one level down, from the iteration
key), so no two of its draws share randomness; an algorithm that used both streams
would have to give one of them a new tag (tests/unit/jaxfednas/test_rng.py pins this).
"""
from __future__ import annotations

import jax
import numpy as np

# Under PRNGKey(seed)
INIT = 0x7FFFFFFF
ROUNDS = 1
AVAILABILITY = 0x0A7A11  # the availability groups of the "available" client sampler (jaxfednas.server)
# Under the initial-state key
PERSONALIZE = 1
# Under a round key
SAMPLE = 0
CLIENT = 1
DROPOUT = 2
DP_ITERATIONS = 1  # DP-FNAS only; equal to CLIENT by value (see the module docstring)
# Under a client's key (local epochs fold their index 0, 1, ... into it directly)
STEP = 1_000_003  # far above any local-epoch index
PERSONAL = 0x7D177000  # Ditto
SEARCH = 0x5E4C0000  # SPIDER-Searcher's random choices
POLICY = 0x501C0000  # PerFedRLNAS: the subnet sampled from a client's policy
# Under a step key (augmentation uses the step key itself)
DROP_PATH = 0xD409A000  # per-example path dropping of the DARTS evaluation network
# Under a DP-FNAS party's iteration key
DP_TRAIN_SAMPLE, DP_TRAIN_NOISE, DP_VAL_SAMPLE, DP_VAL_NOISE, DP_TRAIN_AUG, DP_VAL_AUG = range(6)
# A seed of its own: evaluation-time adaptation of the personalization baselines
ADAPT_SEED = 0x0ADA
# A seed of its own: the random architectures a search is compared with
RANDOM_ARCH_SEED = 0x0A4C


def init_key(seed: int) -> jax.Array:
    """The key of the initial state (weights, architecture parameters)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), INIT)


def round_key(seed: int, r: int) -> jax.Array:
    """The key of round ``r`` (0-based): a function of ``(seed, r)`` only."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), ROUNDS), r)


def personalize_key(seed: int) -> jax.Array:
    """The key of a personalization pass run after training (e.g. FedNAS §2.5)."""
    return jax.random.fold_in(init_key(seed), PERSONALIZE)


def sample_key(round_key: jax.Array) -> jax.Array:
    """The key that picks this round's clients."""
    return jax.random.fold_in(round_key, SAMPLE)


def dropout_key(round_key: jax.Array) -> jax.Array:
    """Whether a round's clients report (``run.dropout_rate``); client k folds in k."""
    return jax.random.fold_in(round_key, DROPOUT)


def client_keys(round_key: jax.Array, client_ids: jax.Array) -> jax.Array:
    """One key per client, derived from ``(round key, client id)`` only: a client's
    draws do not depend on which other clients were sampled."""
    base = jax.random.fold_in(round_key, CLIENT)
    return jax.vmap(lambda c: jax.random.fold_in(base, c))(client_ids)


def step_key(client_key: jax.Array, t: jax.Array | int) -> jax.Array:
    """The key of a client's minibatch slot ``t`` (counted over all its local epochs)."""
    return jax.random.fold_in(jax.random.fold_in(client_key, STEP), t)


def drop_path_key(step_key: jax.Array) -> jax.Array:
    """The ``"dropout"`` rng of a minibatch slot's drop path (DARTS evaluation network)."""
    return jax.random.fold_in(step_key, DROP_PATH)


def personal_keys(client_keys: jax.Array) -> jax.Array:
    """Ditto: keys of the personal updates, one per client key."""
    return jax.vmap(lambda k: jax.random.fold_in(k, PERSONAL))(client_keys)


def search_keys(client_keys: jax.Array) -> jax.Array:
    """SPIDER: keys of the searcher's random edge / node choices, one per client key."""
    return jax.vmap(lambda k: jax.random.fold_in(k, SEARCH))(client_keys)


def policy_keys(client_keys: jax.Array) -> jax.Array:
    """PerFedRLNAS: keys of the subnets sampled from the clients' policies."""
    return jax.vmap(lambda k: jax.random.fold_in(k, POLICY))(client_keys)


def dp_iteration_key(round_key: jax.Array, j: jax.Array | int) -> jax.Array:
    """DP-FNAS: the key of iteration ``j`` of a round (its parties' keys are
    :func:`client_keys` of it)."""
    return jax.random.fold_in(jax.random.fold_in(round_key, DP_ITERATIONS), j)


def adaptation_keys(client_ids: jax.Array) -> jax.Array:
    """Evaluation-time adaptation: one fixed key per client, independent of the round."""
    return client_keys(jax.random.PRNGKey(ADAPT_SEED), client_ids)


def random_arch_key(seed: int, index: int) -> jax.Array:
    """The key of the ``index``-th random architecture of a run with ``seed`` (the control a
    search is compared with): independent of every training stream."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(RANDOM_ARCH_SEED), seed), index)


def host_generator(key: jax.Array) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key's bits (typed or raw ``uint32`` keys), for
    draws made on the host (discrete architectures): the same key, the same draws."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
