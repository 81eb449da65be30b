"""The server's side of a round: which clients run, how their models combine, how the
global model moves. One object, :class:`Server`, built from ``run.*`` like
:class:`~jaxfednas.runtime.Placement` and injected into every algorithm's builder.

* **Client samplers** (``run.sampler``), each a function of ``(seed, round)`` only, so a
  resumed run samples the same clients:

  - ``uniform`` (the default): :func:`jaxfednas.runtime.round_clients`, ``m`` clients
    uniformly without replacement, aggregated with weights ``n_k`` (exactly today's).
  - ``proportional``: ``m`` draws *with* replacement, client ``k`` with probability
    ``n_k / n`` (``n_k`` its training examples; the FedAvg convergence analysis of
    Li et al. 2020, scheme I), aggregated with *uniform* weights, one per draw (a client
    drawn twice counts twice): ``E[(1/m) Σ_j x_{k_j}] = Σ_k (n_k / n) x_k``, the same
    expectation as full participation's n_k-weighted mean. A client drawn twice trains
    twice from the same key (the same update); its persistent rows get that one update.
  - ``available``: clients that are online only part of the time. Each round samples ``m``
    clients uniformly without replacement among the online ones, aggregated with weights
    ``n_k`` (the n_k-weighted mean over the online clients in expectation). Which clients
    are online, ``run.availability_pattern``:

    * ``cyclic`` (the default; diurnal cross-device training): the clients are split into
      ``run.availability_period`` = P groups by a permutation drawn from the seed; client
      ``k`` of group ``g_k`` is online in round ``r`` when ``(r − g_k) mod P <
      run.availability_on``. The configuration is refused when a round could have fewer
      than ``m`` clients online.
    * ``markov``: each client's on/off trace is its own seeded two-state Markov chain
      (:func:`markov_online`), a function of ``(seed, round)``: online with probability
      ``π = run.availability_fraction`` in every round, its state carried over from the
      previous round with probability ``ρ = run.availability_persistence`` and otherwise
      redrawn (``P(on → off) = (1 − ρ)(1 − π)``; ρ = 0: independent Bernoulli rounds).
      Refused when ``π K < m``; a round that still has fewer than ``m`` online takes every
      online client and tops up with offline ones drawn uniformly.

  ``run.dropout_rate`` applies after sampling whatever the sampler (a sampled client may
  still fail to report).

* **Aggregators** (``run.aggregator``) over the clients that report (weight > 0):
  ``mean`` (the default: :func:`jaxfednas.runtime.weighted_mean`, ``Σ w_k x_k / Σ w_k``,
  unchanged), ``median`` (coordinate-wise median, the mean of the two middle values for an
  even count) and ``trimmed_mean`` (coordinate-wise: the ``⌊β c⌋`` largest and ``⌊β c⌋``
  smallest of the ``c`` reporting values dropped, the rest averaged unweighted,
  ``β = run.trim_fraction``); the robust pair as in Yin et al. 2018 (unweighted: a client's
  ``n_k`` only decides whether it reports). :meth:`Server.masked_aggregate`: the same per
  entry over the clients whose mask covers it (PerFedRLNAS' subnets). Each is a function
  of one leaf in the registry of ``jaxfednas.aggregators``; :func:`register_aggregator`
  adds one of your own under a name ``run.aggregator`` then accepts.

* **Server optimizers** (``run.server_optimizer`` for the weights,
  ``run.arch_server_optimizer`` for the architecture parameters α where the server
  averages them; Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): the
  aggregate ``x̄`` of the clients' models gives the pseudo-gradient ``g = x − x̄`` of the
  global model ``x``, an optax transformation turns it into the step:

  - ``none`` (the default): the new model is the aggregate itself (no arithmetic).
  - ``sgd``: ``x ← x − η g`` (``η = run.server_lr``; η = 1 is FedAvg).
  - ``avgm``: FedAvgM (Hsu et al. 2019), ``v ← μ v + g``, ``x ← x − η v``
    (``μ = run.server_momentum``).
  - ``adagrad``, ``adam``, ``yogi``: FedAdagrad, FedAdam, FedYogi exactly as Algorithm 2
    (no bias correction): ``m ← β₁ m + (1 − β₁) Δ`` with ``Δ = −g``;
    ``v ← v + Δ²`` (adagrad), ``β₂ v + (1 − β₂) Δ²`` (adam),
    ``v − (1 − β₂) Δ² sign(v − Δ²)`` (yogi); ``x ← x + η m / (√v + τ)``; ``m`` starts at 0,
    ``v`` at ``τ²`` (``β₁, β₂, τ = run.server_b1, run.server_b2, run.server_tau``).

  Only trained parameters move this way; BatchNorm statistics are the aggregate. The
  optimizer's state is a field of the algorithm's state (``server``), checkpointed and
  resumed with it; a round where no client reports leaves model and optimizer state as
  they were. With ``none`` the field is an empty dict.

Where an option does not apply (no server: local-only training; DP-FNAS, whose privacy
accountant assumes every party in every iteration), the builder raises
:class:`~jaxfednas.errors.ConfigError` naming the option (:meth:`Server.refuse`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfednas import rng
from jaxfednas.aggregators import aggregator_rule, register_aggregator, unknown_message
from jaxfednas.config import (AGGREGATORS, AVAILABILITY_PATTERNS, SAMPLERS, SERVER_OPTIMIZERS, ConfigError,
                              RunConfig)
from jaxfednas.runtime import nothing_to_aggregate, round_clients, weighted_mean


AVAILABILITY = rng.AVAILABILITY  # under PRNGKey(seed): the availability groups of sampler "available"


# --- Samplers ---------------------------------------------------------------------


def proportional_clients(key: jax.Array, sizes: jax.Array, m: int) -> jax.Array:
    """Sorted ids of ``m`` draws with replacement, client ``k`` with probability
    ``sizes[k] / Σ sizes`` (uniform if every size is 0)."""
    s = jnp.asarray(sizes, jnp.float32)
    total = s.sum()
    p = jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), 1.0 / s.shape[0])
    idx = jax.random.choice(key, s.shape[0], (m,), replace=True, p=p)
    return jnp.sort(idx).astype(jnp.int32)


def availability_groups(seed: int, num_clients: int, period: int) -> np.ndarray:
    """``[K]`` int: each client's group ``0..period-1`` (a seeded permutation cut into
    near-equal groups; host constant, also when called inside a traced round)."""
    with jax.ensure_compile_time_eval():
        key = jax.random.fold_in(jax.random.PRNGKey(seed), AVAILABILITY)
    return (rng.host_generator(key).permutation(num_clients) % period).astype(np.int32)


def online(groups: Any, round: Any, period: int, on: int) -> Any:
    """``[K]`` bool: whether each client is online in ``round``: ``(round − g_k) mod period
    < on``."""
    return (round - groups) % period < on


def markov_online(seed: int, round: Any, num_clients: int, fraction: float, persistence: float) -> jax.Array:
    """``[K]`` bool: whether each client is online in ``round`` (traced or not) under the
    ``markov`` availability pattern. Each client's on/off trace is its own two-state Markov
    chain: in round 0 on with probability ``fraction``; in each later round its state is
    kept with probability ``persistence`` and otherwise redrawn (on with probability
    ``fraction``). So ``P(on → off) = (1 − persistence)(1 − fraction)``, ``P(off → on) =
    (1 − persistence) fraction``, every round is on with probability ``fraction``, and
    ``persistence`` 0 is an independent Bernoulli trace. The state is that of the client's
    last redraw, found by walking back from ``round`` with the redraw coins of
    ``(seed, round, client)``: a function of ``(seed, round)`` only, computed without the
    earlier rounds (on average ``1 / (1 − persistence)`` steps back)."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), AVAILABILITY)
    redraw_key, state_key = jax.random.fold_in(base, 1), jax.random.fold_in(base, 2)
    clients = jnp.arange(num_clients)

    def uniform(key, t):  # [K]: the uniform of (round t[k], client k)
        return jax.vmap(lambda t, k: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, t), k)))(t, clients)

    def redrawn(t):
        return (t <= 0) | (uniform(redraw_key, t) >= persistence)

    def back(carry):
        t, done = carry
        t = jnp.where(done, t, t - 1)
        return t, redrawn(t)

    t0 = jnp.broadcast_to(jnp.asarray(round, jnp.int32), (num_clients,))
    t, _ = jax.lax.while_loop(lambda c: ~c[1].all(), back, (t0, redrawn(t0)))
    return uniform(state_key, t) < fraction


def available_clients(key: jax.Array, is_online: jax.Array, m: int) -> jax.Array:
    """Sorted ids of ``m`` clients drawn uniformly without replacement among those where
    ``is_online`` holds; with fewer than ``m`` online, every online client and the rest
    drawn uniformly among the others."""
    u = jax.random.uniform(key, is_online.shape)
    _, idx = jax.lax.top_k(jnp.where(is_online, u, u - 2.0), m)
    return jnp.sort(idx).astype(jnp.int32)


# --- Aggregators ------------------------------------------------------------------
#
# Every aggregator is a function of one leaf in the registry of jaxfednas.aggregators (see
# there for the arguments): the built-ins below and any a user registers.


@register_aggregator("mean")
def weighted_mean_rule(x: jax.Array, weights: jax.Array, valid: jax.Array, server: Server) -> jax.Array:
    """``Σ w_k x_k / Σ w_k`` over the values that count (per entry): in the masked form the
    arithmetic of :func:`jaxfednas.runtime.masked_weighted_mean`, bit for bit. (Unmasked,
    :meth:`Server.aggregate` computes ``mean`` with :func:`jaxfednas.runtime.weighted_mean`:
    the same value, its own arithmetic.)"""
    wm = valid.astype(jnp.float32) * weights
    den = wm.sum(0)
    return (wm * x).sum(0) / jnp.where(den > 0, den, 1.0)


@register_aggregator("median")
def coordinate_median(x: jax.Array, weights: jax.Array, valid: jax.Array, server: Server) -> jax.Array:
    """Coordinate-wise median of the values that count (the mean of the two middle ones for
    an even count); unweighted."""
    s = jnp.sort(jnp.where(valid, x, jnp.inf), axis=0)  # the values that count first
    n = valid.sum(0)
    lo = jnp.take_along_axis(s, jnp.maximum(n - 1, 0)[None] // 2, 0)[0]
    hi = jnp.take_along_axis(s, jnp.minimum(n // 2, x.shape[0] - 1)[None], 0)[0]
    return (lo + hi) / 2


@register_aggregator("trimmed_mean")
def coordinate_trimmed_mean(x: jax.Array, weights: jax.Array, valid: jax.Array, server: Server) -> jax.Array:
    """Coordinate-wise: of the ``c`` values that count, the ``⌊β c⌋`` largest and ``⌊β c⌋``
    smallest dropped, the rest averaged unweighted (``β = server.trim_fraction``)."""
    s = jnp.sort(jnp.where(valid, x, jnp.inf), axis=0)
    n = valid.sum(0)
    b = jnp.floor(n * server.trim_fraction + 1e-4).astype(n.dtype)
    pos = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    keep = (pos >= b) & (pos < n - b)
    return jnp.where(keep, s, 0.0).sum(0) / jnp.maximum(n - 2 * b, 1)


def _apply_rule(server: Server, x: jax.Array, weights: jax.Array, valid: jax.Array, fallback: jax.Array) -> jax.Array:
    """Aggregator ``server.aggregator`` on one leaf ``x`` ``[m, ...]``, ``fallback`` where no
    value counts (``valid``, broadcastable to ``x``)."""
    valid = jnp.broadcast_to(valid, x.shape)
    w = jnp.asarray(weights, jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1))
    out = aggregator_rule(server.aggregator)(x.astype(jnp.float32), w, valid, server)
    if jnp.shape(out) != x.shape[1:]:
        raise ValueError(f"aggregator {server.aggregator!r} returned shape {jnp.shape(out)} for a leaf of shape "
                         f"{x.shape} (clients first): expected {x.shape[1:]}")
    n = valid.sum(0)
    return jnp.where(n > 0, jnp.asarray(out, jnp.float32), fallback.astype(jnp.float32)).astype(x.dtype)


def robust_mean(tree: Any, weights: jax.Array, kind: str, trim: float = 0.0, fallback: Any = None) -> Any:
    """Aggregator ``kind`` (e.g. ``"median"`` or ``"trimmed_mean"``, ``trim`` = β from each
    end) of every leaf over its leading client axis, among clients with weight > 0;
    ``fallback`` (or zeros) where no client has."""
    return Server(aggregator=kind, trim_fraction=trim).aggregate_by_rule(tree, weights, fallback)


def masked_robust_mean(tree: Any, masks: Any, weights: jax.Array, kind: str, trim: float, fallback: Any) -> Any:
    """:func:`robust_mean` per entry over the clients whose mask (``{0, 1}``, broadcastable
    to the leaf) covers it; ``fallback`` where none does."""
    return Server(aggregator=kind, trim_fraction=trim).masked_aggregate(tree, masks, weights, fallback)


# --- Server optimizers ------------------------------------------------------------


class FedOptState(NamedTuple):
    m: Any
    v: Any


def scale_by_fedopt(rule: str, b1: float, b2: float, tau: float) -> optax.GradientTransformation:
    """Reddi et al. 2021's Algorithm 2 (FedAdagrad / FedAdam / FedYogi) on the
    pseudo-gradient ``g`` (``Δ = −g``): the *ascent* direction ``m / (√v + τ)`` negated,
    i.e. the optax update before the learning rate (``optax.scale(-η)`` follows)."""
    if rule not in ("adagrad", "adam", "yogi"):
        raise ValueError(f"rule must be adagrad, adam or yogi, got {rule!r}")

    def init(params):
        return FedOptState(m=jax.tree.map(jnp.zeros_like, params),
                           v=jax.tree.map(lambda p: jnp.full_like(p, tau * tau), params))

    def update(g, state, params=None):
        del params
        m = jax.tree.map(lambda m, d: b1 * m + (1 - b1) * d, state.m, g)
        if rule == "adagrad":
            v = jax.tree.map(lambda v, d: v + d * d, state.v, g)
        elif rule == "adam":
            v = jax.tree.map(lambda v, d: b2 * v + (1 - b2) * d * d, state.v, g)
        else:
            v = jax.tree.map(lambda v, d: v - (1 - b2) * d * d * jnp.sign(v - d * d), state.v, g)
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v), FedOptState(m, v)

    return optax.GradientTransformation(init, update)


def server_transform(name: str, lr: float, momentum: float = 0.9, b1: float = 0.9, b2: float = 0.99,
                     tau: float = 1e-3) -> optax.GradientTransformation | None:
    """The optax transformation of server optimizer ``name`` (None for ``"none"``). It is
    fed the pseudo-gradient ``current − aggregate``; its update is added to ``current``."""
    if name == "none":
        return None
    if name == "sgd":
        return optax.sgd(lr)
    if name == "avgm":
        return optax.sgd(lr, momentum=momentum)
    if name in ("adagrad", "adam", "yogi"):
        return optax.chain(scale_by_fedopt(name, b1, b2, tau), optax.scale(-lr))
    raise ValueError(f"server optimizer must be one of {SERVER_OPTIMIZERS}, got {name!r}")


def server_step(tx: optax.GradientTransformation | None, current: Any, aggregate: Any, opt_state: Any,
                skipped: jax.Array | None = None) -> tuple[Any, Any]:
    """``(new, opt_state)``: one server step from ``current`` toward the clients'
    ``aggregate``. ``tx`` None: ``aggregate`` itself (bit for bit). ``skipped`` (a scalar,
    > 0 when no client reported): ``current`` and ``opt_state`` unchanged."""
    if tx is None:
        return aggregate, opt_state
    g = jax.tree.map(lambda c, a: c - a, current, aggregate)  # pseudo-gradient
    updates, new_state = tx.update(g, opt_state, current)
    new = optax.apply_updates(current, updates)
    if skipped is None:
        return new, new_state
    keep = skipped > 0
    pick = lambda old, upd: jnp.where(keep, old, upd)  # noqa: E731
    return jax.tree.map(pick, current, new), jax.tree.map(pick, opt_state, new_state)


# --- The server -------------------------------------------------------------------


_RUN = RunConfig()

#: Each field of :class:`Server` and the ``run`` setting it is read from (its default too).
RUN_FIELDS: dict[str, str] = {
    "sampler": "sampler", "aggregator": "aggregator", "trim_fraction": "trim_fraction",
    "optimizer": "server_optimizer", "lr": "server_lr", "momentum": "server_momentum", "b1": "server_b1",
    "b2": "server_b2", "tau": "server_tau", "arch_optimizer": "arch_server_optimizer", "arch_lr": "arch_server_lr",
    "availability_period": "availability_period", "availability_on": "availability_on",
    "availability_pattern": "availability_pattern", "availability_fraction": "availability_fraction",
    "availability_persistence": "availability_persistence", "seed": "seed",
}


@dataclasses.dataclass(frozen=True)
class Server:
    """What the server does in a round (see the module docstring). ``Server()`` is
    today's behaviour: uniform sampling, n_k-weighted mean, no server optimizer. Each
    field is a ``run`` setting (:data:`RUN_FIELDS`; its meaning and default are those of
    :class:`jaxfednas.config.RunConfig`)."""

    sampler: str = _RUN.sampler
    aggregator: str = _RUN.aggregator
    trim_fraction: float = _RUN.trim_fraction
    optimizer: str = _RUN.server_optimizer
    lr: float = _RUN.server_lr
    momentum: float = _RUN.server_momentum
    b1: float = _RUN.server_b1
    b2: float = _RUN.server_b2
    tau: float = _RUN.server_tau
    arch_optimizer: str = _RUN.arch_server_optimizer
    arch_lr: float = _RUN.arch_server_lr
    availability_period: int = _RUN.availability_period
    availability_on: int = _RUN.availability_on
    availability_pattern: str = _RUN.availability_pattern
    availability_fraction: float = _RUN.availability_fraction
    availability_persistence: float = _RUN.availability_persistence
    seed: int = _RUN.seed

    def __post_init__(self):
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(unknown_message(self.aggregator))
        for name, value, choices in (("sampler", self.sampler, SAMPLERS),
                                     ("availability_pattern", self.availability_pattern, AVAILABILITY_PATTERNS),
                                     ("server_optimizer", self.optimizer, SERVER_OPTIMIZERS),
                                     ("arch_server_optimizer", self.arch_optimizer, SERVER_OPTIMIZERS)):
            if value not in choices:
                raise ConfigError(f"run.{name}={value!r} is not allowed: choose one of {list(choices)}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"run.trim_fraction={self.trim_fraction} must be in [0, 0.5)")
        if not 1 <= self.availability_on <= self.availability_period:
            raise ConfigError(f"run.availability_on={self.availability_on} must be in [1, run.availability_period="
                              f"{self.availability_period}]")
        if not 0.0 < self.availability_fraction <= 1.0 or not 0.0 <= self.availability_persistence < 1.0:
            raise ConfigError(f"run.availability_fraction={self.availability_fraction} must be in (0, 1] and "
                              f"run.availability_persistence={self.availability_persistence} in [0, 1)")

    @classmethod
    def from_run(cls, run: Any) -> Server:
        """The server a run's config asks for (``run.sampler``, ``run.aggregator``, ...)."""
        return cls(**{name: getattr(run, setting) for name, setting in RUN_FIELDS.items()})

    # -- what applies where

    def refuse(self, algorithm: str, why: str, *, sampler: bool = False, aggregator: bool = False,
               optimizer: bool = False, arch_optimizer: bool = True) -> None:
        """Raise :class:`ConfigError` if an option flagged True here is not its default
        (``algorithm`` cannot honour it, for the reason ``why``). ``arch_optimizer``
        defaults to True: only algorithms that average α accept it."""
        asked = [(sampler and self.sampler != "uniform", f"run.sampler={self.sampler!r}"),
                 (aggregator and self.aggregator != "mean", f"run.aggregator={self.aggregator!r}"),
                 (optimizer and self.optimizer != "none", f"run.server_optimizer={self.optimizer!r}"),
                 (arch_optimizer and self.arch_optimizer != "none",
                  f"run.arch_server_optimizer={self.arch_optimizer!r}")]
        for bad, option in asked:
            if bad:
                raise ConfigError(f"{option} does not apply to {algorithm}: {why}")

    def check_clients(self, num_clients: int, m: int) -> None:
        """ConfigError when sampler ``available`` could leave fewer than ``m`` clients online
        (pattern ``cyclic``) or would on average (``markov``: ``fraction · K < m``)."""
        if self.sampler != "available":
            return
        if self.availability_pattern == "markov":
            if self.availability_fraction * num_clients < m:
                raise ConfigError(
                    f"run.sampler='available' with run.availability_pattern='markov' has on average "
                    f"{self.availability_fraction * num_clients:g} of {num_clients} clients online "
                    f"(run.availability_fraction={self.availability_fraction}), fewer than the {m} clients per round "
                    f"(run.clients_per_round): raise availability_fraction or lower clients_per_round")
            return
        groups = availability_groups(self.seed, num_clients, self.availability_period)
        fewest = min(int(online(groups, r, self.availability_period, self.availability_on).sum())
                     for r in range(self.availability_period))
        if fewest < m:
            raise ConfigError(
                f"run.sampler='available' with run.availability_period={self.availability_period} and "
                f"run.availability_on={self.availability_on} has only {fewest} of {num_clients} clients online in "
                f"some rounds, fewer than the {m} clients per round (run.clients_per_round): raise availability_on "
                f"or lower clients_per_round")

    # -- sampling

    def sample(self, round_key: jax.Array, round: jax.Array, data: Any, num_clients: int,
               m: int) -> tuple[jax.Array, jax.Array]:
        """``(ids, keys)`` of the round's clients, as :func:`jaxfednas.runtime.round_clients`
        (which the ``uniform`` sampler is). ``data``: the
        :class:`~jaxfednas.data.federated.FederatedData` (``proportional`` reads its training
        sizes); ``round``: the round index (``available``)."""
        if self.sampler == "uniform":
            return round_clients(round_key, num_clients, m)
        key = rng.sample_key(round_key)
        if self.sampler == "proportional":
            ids = proportional_clients(key, data.all_clients("train").count, m)
        else:
            ids = available_clients(key, self.online_clients(round, num_clients, m), m)
        return ids, rng.client_keys(round_key, ids)

    def online_clients(self, round: Any, num_clients: int, m: int) -> jax.Array:
        """``[K]`` bool: the clients online in ``round`` for sampler ``available`` (its
        pattern, ``run.availability_pattern``)."""
        self.check_clients(num_clients, m)
        if self.availability_pattern == "markov":
            return markov_online(self.seed, round, num_clients, self.availability_fraction,
                                 self.availability_persistence)
        groups = availability_groups(self.seed, num_clients, self.availability_period)
        return online(jnp.asarray(groups), round, self.availability_period, self.availability_on)

    def weights(self, counts: jax.Array, reported: jax.Array) -> jax.Array:
        """Aggregation weights of the sampled clients: ``counts * reported`` (``n_k``, 0 for a
        client that failed), or for ``proportional`` one per reporting non-empty draw."""
        if self.sampler == "proportional":
            return ((counts > 0) & reported).astype(jnp.float32)
        return counts * reported

    # -- aggregation

    def aggregate(self, tree: Any, weights: jax.Array, fallback: Any = None) -> Any:
        """The clients' ``tree`` (leading client axis) combined by ``run.aggregator`` over
        the clients with weight > 0; ``fallback`` (or zeros) where none has. ``mean``:
        :func:`jaxfednas.runtime.weighted_mean` itself."""
        if self.aggregator == "mean":
            return weighted_mean(tree, weights, fallback=fallback)
        return self.aggregate_by_rule(tree, weights, fallback)

    def aggregate_by_rule(self, tree: Any, weights: jax.Array, fallback: Any = None) -> Any:
        """:meth:`aggregate` through the registered function of ``run.aggregator`` (also for
        ``mean``)."""
        valid = jnp.asarray(weights) > 0
        if fallback is None:
            fallback = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], x.dtype), tree)

        def one(x, fb):
            return _apply_rule(self, x, weights, valid.reshape((-1,) + (1,) * (x.ndim - 1)), fb)

        return jax.tree.map(one, tree, fallback)

    def masked_aggregate(self, tree: Any, masks: Any, weights: jax.Array, fallback: Any) -> Any:
        """Per entry over the clients with weight > 0 whose mask (``{0, 1}``, leaves
        broadcastable to ``tree``'s) covers it; ``fallback`` where none does (PerFedRLNAS'
        subnets). ``mean``: :func:`jaxfednas.runtime.masked_weighted_mean`'s value, bit for bit."""
        w = jnp.asarray(weights) > 0

        def one(x, m, fb):
            valid = (jnp.broadcast_to(m, x.shape) > 0) & w.reshape((-1,) + (1,) * (x.ndim - 1))
            return _apply_rule(self, x, weights, valid, fb)

        return jax.tree.map(one, tree, masks, fallback)

    # -- server optimizer

    def transform(self, part: str = "params") -> optax.GradientTransformation | None:
        """The optax transformation of ``part`` (``"params"`` or ``"arch"``), None if none."""
        if part == "arch":
            return server_transform(self.arch_optimizer, self.arch_lr, self.momentum, self.b1, self.b2, self.tau)
        return server_transform(self.optimizer, self.lr, self.momentum, self.b1, self.b2, self.tau)

    def init(self, variables: dict, parts: tuple[str, ...] = ("params",)) -> dict:
        """The optimizer state of ``variables[part]`` for each part with an optimizer
        (an empty dict when none has one: the state of ``none``)."""
        return {p: self.transform(p).init(variables[p]) for p in parts if self.transform(p) is not None}

    def step(self, current: dict, aggregate: dict, opt_state: dict, weights: jax.Array,
             parts: tuple[str, ...] = ("params",)) -> tuple[dict, dict]:
        """``(variables, opt_state)``: ``aggregate`` with each of ``parts`` that has an
        optimizer replaced by the optimizer's step from ``current`` (other entries, e.g.
        BatchNorm statistics, are the aggregate's). Nothing to aggregate (all ``weights``
        0): those parts and their optimizer state stay as they were."""
        out, state = dict(aggregate), dict(opt_state)
        skipped = nothing_to_aggregate(weights)
        for p in parts:
            tx = self.transform(p)
            if tx is not None:
                out[p], state[p] = server_step(tx, current[p], aggregate[p], opt_state[p], skipped)
        return out, state


def tolerate_missing_server_state(cls: type) -> type:
    """Register flax serialization for state class ``cls`` that restores a state dict
    without the ``server`` field (a checkpoint written before server optimizers existed)
    with the template's value (the empty state of ``none``)."""
    names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True)]

    def to_state_dict(x):
        return {n: flax.serialization.to_state_dict(getattr(x, n)) for n in names}

    def from_state_dict(x, state):
        state = dict(state)
        if "server" not in state:
            state["server"] = flax.serialization.to_state_dict(x.server)
        unknown = set(state) - set(names)
        if unknown:
            raise ValueError(f"Unknown field(s) {sorted(unknown)} in state dict while restoring an instance of "
                             f"{cls.__name__}")
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"Missing field {missing[0]} in state dict while restoring an instance of {cls.__name__}")
        return x.replace(**{n: flax.serialization.from_state_dict(getattr(x, n), state[n], name=n) for n in names})

    flax.serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)
    return cls


__all__ = ["SAMPLERS", "AGGREGATORS", "SERVER_OPTIMIZERS", "RUN_FIELDS", "Server", "register_aggregator", "proportional_clients",
           "availability_groups", "online", "markov_online", "available_clients", "weighted_mean_rule",
           "coordinate_median", "coordinate_trimmed_mean", "robust_mean", "masked_robust_mean", "scale_by_fedopt",
           "server_transform", "server_step", "tolerate_missing_server_state"]
