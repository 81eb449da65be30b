"""The one seam between the runner and the algorithms.

The runner builds, once per run, what every algorithm receives from the ``run`` section of
its configuration — the rounds, the clients per round, the placement of clients on
devices, the server (sampler, aggregator, server optimizers), client drop-out and the
compute precision — as one :class:`RunOptions`, and hands it to the algorithm's factory
(:func:`jaxfednas.registry.build_algorithm`).

An algorithm module declares which of the run options (:data:`OPTIONS`) it honours in
``RUN_OPTIONS``; the runner refuses any other option set away from its default in one line
naming the option and the algorithm, so an option is never ignored silently. Every factory,
bundled or a user's (the README's "Adding an algorithm"), has one shape,
``factory(cfg, info, *, run: RunOptions = RunOptions(), ...its own)``, and the runner builds
every algorithm the same way: ``factory(config.algo, info, run=RunOptions.from_run(config.run))``.

For an algorithm shaped like FedAvg, :meth:`RunOptions.sample` and
:meth:`RunOptions.combine` are the server's half of a round: the run's sampler picks the
clients; drop-out, the aggregator and the server optimizer turn their models into the new
global model.

Example::

    >>> from jaxfednas.config import RunConfig
    >>> run = RunOptions.from_run(RunConfig(aggregator="median", clients_per_round=0.5))
    >>> run.server.aggregator, run.clients(8)
    ('median', 4)
    >>> asked_options(RunConfig(aggregator="median"), num_clients=8)
    {'aggregator': "run.aggregator='median'"}
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from jaxfednas.config import RunConfig
from jaxfednas.errors import ConfigError
from jaxfednas.runtime import (Placement, reported_metrics, reporting_clients, resolve_clients_per_round)
from jaxfednas.server import Server

__all__ = ["OPTIONS", "RunOptions", "asked_options", "refuse_unsupported"]

OPTIONS: dict[str, str] = {
    "clients_per_round": "partial participation: m of the K clients in a round",
    "dropout_rate": "sampled clients that fail to report their update",
    "precision": "client training computed in bfloat16",
    "sampler": "how the server picks a round's clients",
    "aggregator": "how the server combines the clients' models",
    "server_optimizer": "a server optimizer on the combined weights (FedAvgM, FedAdam, ...)",
    "arch_server_optimizer": "a server optimizer on the combined architecture parameters",
}
"""The run options an algorithm may honour or not (``RUN_OPTIONS``), each with what it
changes. The others (rounds, placement, seed, checkpoints, evaluation) apply to every
algorithm."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What an algorithm receives from the run (see the module docstring).

    Attributes:
      rounds: ``run.rounds``, T (schedules over the run, e.g. a cosine learning rate); None:
        not given (an algorithm whose schedules need T refuses it, :meth:`need_rounds`).
      clients_per_round: ``run.clients_per_round``: an integer count or a fraction of K.
      placement: how clients are laid on devices (:class:`jaxfednas.runtime.Placement`).
      server: sampler, aggregator and server optimizers (:class:`jaxfednas.server.Server`).
      dropout_rate: probability that a sampled client fails to report
        (:func:`jaxfednas.runtime.reporting_clients`).
      precision: what client training computes in (:mod:`jaxfednas.precision`).
    """

    rounds: int | None = None
    clients_per_round: int | float = 1.0
    placement: Placement = Placement()
    server: Server = Server()
    dropout_rate: float = 0.0
    precision: str = "fp32"

    def __post_init__(self):
        def real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        checks = (("rounds", self.rounds is None or (isinstance(self.rounds, int) and not isinstance(self.rounds, bool)
                                                      and self.rounds >= 1), "None or an int >= 1"),
                  ("clients_per_round", real(self.clients_per_round) and self.clients_per_round > 0,
                   "an int count >= 1 or a float fraction in (0, 1]"),
                  ("placement", isinstance(self.placement, Placement), "a jaxfednas.runtime.Placement"),
                  ("server", isinstance(self.server, Server), "a jaxfednas.server.Server"),
                  ("dropout_rate", real(self.dropout_rate) and 0.0 <= self.dropout_rate < 1.0, "a number in [0, 1)"),
                  ("precision", isinstance(self.precision, str), "a precision name (str)"))
        for name, ok, what in checks:
            if not ok:
                value = getattr(self, name)
                error = TypeError if name in ("placement", "server", "precision") else ConfigError
                raise error(f"RunOptions: {name} must be {what}, got {value!r:.60}")

    @classmethod
    def from_run(cls, run: RunConfig) -> RunOptions:
        """The options of a run's configuration section (``config.run``)."""
        return cls(rounds=run.rounds, clients_per_round=run.clients_per_round, placement=Placement.from_run(run),
                   server=Server.from_run(run), dropout_rate=run.dropout_rate, precision=run.precision)

    def settings(self) -> dict[str, Any]:
        """The value of each run option of :data:`OPTIONS` in these options."""
        s = self.server
        return {"clients_per_round": self.clients_per_round, "dropout_rate": self.dropout_rate,
                "precision": self.precision, "sampler": s.sampler, "aggregator": s.aggregator,
                "server_optimizer": s.optimizer, "arch_server_optimizer": s.arch_optimizer}

    def need_rounds(self, algorithm: str) -> int:
        """T = :attr:`rounds`, or a one-line ``ConfigError`` naming ``algorithm`` when not given."""
        if self.rounds is None:
            raise ConfigError(f"{algorithm} needs the run's length: pass run=RunOptions(rounds=T, ...) "
                              "(the runner passes run.rounds)")
        return self.rounds

    def clients(self, num_clients: int) -> int:
        """m, the clients of a round among ``num_clients``."""
        return resolve_clients_per_round(self.clients_per_round, num_clients)

    def sample(self, round_key: jax.Array, round: jax.Array, data: Any, num_clients: int) -> tuple[jax.Array, jax.Array]:
        """``(ids, keys)``: the round's clients by the run's sampler and one key each
        (:meth:`jaxfednas.server.Server.sample`); ``round`` is the rounds done so far."""
        return self.server.sample(round_key, round, data, num_clients, self.clients(num_clients))

    def combine(self, new: dict, counts: jax.Array, round_key: jax.Array, ids: jax.Array, variables: dict,
                server_state: dict, parts: tuple[str, ...] = ("params",)) -> tuple[dict, dict, dict]:
        """The server's half of a FedAvg-shaped round: ``(variables, server_state, metrics)``.

        ``new`` holds the sampled clients' variables (leading axis m), ``counts`` their
        example counts n_k, ``ids`` the clients and ``variables`` / ``server_state`` the
        global model and the server optimizer's state (``server.init(variables)``). A
        client that drops out (:attr:`dropout_rate`) weighs 0; the aggregator combines the
        rest (nothing reported: ``variables`` is kept); a server optimizer, if any, steps
        each of ``parts`` towards the combination (``"params"``, the weights, and
        ``"arch"``, the architecture parameters, with ``run.arch_server_optimizer``; other
        entries, e.g. BatchNorm statistics, are the combination's). ``metrics``:
        ``clients_reported`` and ``server_update_skipped``."""
        weights = self.server.weights(counts, reporting_clients(round_key, ids, self.dropout_rate))
        combined = self.server.aggregate(new, weights, fallback=variables)
        combined, server_state = self.server.step(variables, combined, server_state, weights, parts)
        return combined, server_state, reported_metrics(weights, round_key, ids, self.dropout_rate)


def asked_options(run: RunConfig | RunOptions, *, num_clients: int) -> dict[str, str]:
    """The run options of :data:`OPTIONS` that ``run`` (a run's configuration or the options
    built from one) sets away from their defaults, each as ``run.<field>=<value>`` (a
    ``clients_per_round`` that resolves to every client is the default)."""
    default = RunConfig()
    values = run.settings() if isinstance(run, RunOptions) else {o: getattr(run, o) for o in OPTIONS}
    asked = {}
    for option in OPTIONS:
        value = values[option]
        if option == "clients_per_round":
            if resolve_clients_per_round(value, num_clients) == num_clients:
                continue
        elif value == getattr(default, option):
            continue
        asked[option] = f"run.{option}={value!r}"
    return asked


def refuse_unsupported(algorithm: str, run: RunConfig | RunOptions, *, num_clients: int, supported: Iterable[str],
                       why: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError`, one line, for the first run option ``run`` sets that
    ``algorithm`` does not declare among those it honours (``supported``); ``why`` gives
    the algorithm's reason per option, if it has one."""
    supported = set(supported)
    unknown = supported - set(OPTIONS)
    if unknown:
        raise ConfigError(f"{algorithm} declares unknown run option(s) {sorted(unknown)} in RUN_OPTIONS; "
                          f"the options are {list(OPTIONS)}")
    for option, setting in asked_options(run, num_clients=num_clients).items():
        if option not in supported:
            reason = (why or {}).get(option) or (
                f"it honours only {', '.join(sorted(supported)) or 'none of the run options'} "
                f"({OPTIONS[option]} is not among them); leave run.{option} at its default")
            raise ConfigError(f"{setting} does not apply to {algorithm}: {reason}")
