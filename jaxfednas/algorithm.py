"""The contract every federated algorithm fulfils: a frozen record of pure functions."""
from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

import jax

from jaxfednas.data.federated import FederatedData


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions over an explicit state.

    Attributes:
      name: registry name (``"fedavg"``, ``"local_only"``, ...).
      init: ``init(key) -> state``; the state is a pytree (a ``flax.struct``
        dataclass) holding everything a checkpoint must restore, including
        per-client rows with a leading client axis.
      round: ``round(state, data, key) -> (state, metrics)``, one jit-compiled
        federated round. ``key`` is the round key (the runner derives it from
        ``(seed, round)``); metrics are scalars.
      evaluate: ``evaluate(state, data) -> metrics``, jit-compiled; scalars
        plus per-client arrays (e.g. ``client_test_acc`` of shape ``[K]``).
      export: ``export(state) -> architecture`` for NAS algorithms, else None.
      personalize: ``personalize(state, data, key) -> (per-client state rows,
        metrics)`` where the paper adapts the global result to every client
        (e.g. FedNAS §2.5), else None. Metrics hold per-client arrays such as
        ``client_test_acc`` of shape ``[K]`` and their summaries.
      host_metrics: ``host_metrics(state, data) -> metrics`` computed on the host,
        outside jit, from a state that ``round`` returned or ``evaluate`` was given
        (e.g. a privacy accountant's μ and ε for the iterations done so far). The
        runner merges them into both the round's and the evaluation's metrics;
        ``round`` and ``evaluate`` themselves stay pure compiled functions. None:
        no host-side metrics.
      write_architecture: ``write_architecture(architecture, out_dir)`` writes
        pictures of an exported architecture into ``out_dir`` (e.g. DARTS cell
        diagrams); the runner calls it beside ``architecture.json``. None: nothing
        beyond the JSON.
    """

    name: str
    init: Callable[[jax.Array], Any]
    round: Callable[[Any, FederatedData, jax.Array], tuple[Any, dict[str, jax.Array]]]
    evaluate: Callable[[Any, FederatedData], dict[str, jax.Array]]
    export: Callable[[Any], Any] | None = None
    personalize: Callable[[Any, FederatedData, jax.Array], tuple[Any, dict[str, jax.Array]]] | None = None
    host_metrics: Callable[[Any, FederatedData], dict[str, Any]] | None = None
    write_architecture: Callable[[Any, Any], None] | None = None

    def with_host_metrics(self, state: Any, data: FederatedData, metrics: dict) -> dict:
        """``metrics`` plus :attr:`host_metrics` of ``state`` (unchanged when there are none)."""
        if self.host_metrics is None:
            return metrics
        return {**metrics, **self.host_metrics(state, data)}
