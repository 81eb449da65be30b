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


def _is(module: str, name: str, value: Any) -> bool:
    import importlib  # noqa: PLC0415  (jaxfednas.runtime and .server import this module's users)

    return isinstance(value, getattr(importlib.import_module(module), name))


def _real(value: Any) -> bool:
    import numbers  # noqa: PLC0415

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# argument name -> (what it must be, check): the factory's own arguments and the run's options
_FACTORY_ARGUMENTS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "info": ("a jaxfednas.data.DataInfo (FederatedData.info)", lambda v: _is("jaxfednas.data.federated", "DataInfo", v)),
    "run": ("a jaxfednas.run_options.RunOptions", lambda v: _is("jaxfednas.run_options", "RunOptions", v)),
    "placement": ("a jaxfednas.runtime.Placement", lambda v: _is("jaxfednas.runtime", "Placement", v)),
    "server": ("a jaxfednas.server.Server", lambda v: _is("jaxfednas.server", "Server", v)),
    "clients_per_round": ("an int count or a float fraction", _real),
    "dropout_rate": ("a number (its range is checked by the factory)", _real),
    "precision": ("a precision name (str)", lambda v: isinstance(v, str)),
    "rounds": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "model": ("None or a flax module (e.g. jaxfednas.search_spaces.models.make_model(name, classes, dataset); "
              "to name a bundled model, set the config's model field)",
              lambda v: v is None or _is("flax.linen.module", "Module", v)),
}

LEGACY_RUN_KEYWORDS = ("rounds", "clients_per_round", "placement", "server", "dropout_rate", "precision")
"""The run's options as separate keywords, which factories took before they all took ``run``:
still accepted by every bundled factory for one release (folded into ``run``, with a
``DeprecationWarning``)."""


def _fold_legacy_keywords(factory_name: str, kwargs: dict) -> dict:
    """``kwargs`` with any :data:`LEGACY_RUN_KEYWORDS` folded into ``run`` (checked, warned)."""
    legacy = {k: kwargs.pop(k) for k in LEGACY_RUN_KEYWORDS if k in kwargs}
    if not legacy:
        return kwargs
    import dataclasses  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    from jaxfednas.run_options import RunOptions  # noqa: PLC0415  (jax-heavy; this module is imported early)

    for name, value in legacy.items():
        want = _FACTORY_ARGUMENTS[name]
        if not want[1](value):
            raise TypeError(f"{factory_name}(): {name} must be {want[0]}, got {value!r:.60}")
    names = ", ".join(f"{k}=" for k in legacy)
    warnings.warn(f"{factory_name}({names}...) is deprecated: pass run=RunOptions({names}...) "
                  f"(jaxfednas.run_options); the separate keywords go in the next release", DeprecationWarning,
                  stacklevel=3)
    run = kwargs.get("run")
    if run is None:
        run = RunOptions()
    elif not _FACTORY_ARGUMENTS["run"][1](run):
        raise TypeError(f"{factory_name}(): run must be {_FACTORY_ARGUMENTS['run'][0]}, got {run!r:.60}")
    kwargs["run"] = dataclasses.replace(run, **legacy)
    return kwargs


def checked_factory(config_cls: type) -> Callable[[Callable[..., FederatedAlgorithm]], Callable[..., FederatedAlgorithm]]:
    """Decorator for an algorithm factory ``factory(cfg, info, *, run: RunOptions, ...its own)``:
    an argument of the wrong type -- a config of another algorithm or a string as ``cfg``, a
    string as ``run`` -- is a ``TypeError`` naming the factory, the argument and what it must
    be, before any work (instead of an ``AttributeError`` deep inside). The run's options
    given as separate keywords (:data:`LEGACY_RUN_KEYWORDS`, the former signature) are
    folded into ``run`` with a ``DeprecationWarning``. The algorithm returned refuses data
    other than the data ``info`` describes in every function taking ``(state, data, ...)``
    (a ``ValueError`` naming what differs; see :func:`data_mismatch`).

    A config of a subclass with fields the factory does not read (Ditto's config given to
    ``fedavg``) is refused too; an algorithm built on another, reading those fields itself,
    calls ``factory.extended(cfg, info, ...)``."""
    import functools  # noqa: PLC0415
    import inspect  # noqa: PLC0415

    def wrap(factory: Callable[..., FederatedAlgorithm]) -> Callable[..., FederatedAlgorithm]:
        signature = inspect.signature(factory)

        def build(args, kwargs, *, extended: bool):
            kwargs = _fold_legacy_keywords(factory.__name__, dict(kwargs))
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{factory.__name__}(): {e}") from None
            for name, value in bound.arguments.items():
                if name == "cfg" and not isinstance(value, config_cls):
                    raise TypeError(f"{factory.__name__}(): cfg must be a {config_cls.__name__}, got "
                                    f"{type(value).__name__}")
                unread = _unread_fields(value, config_cls) if name == "cfg" and not extended else []
                if unread:
                    raise TypeError(f"{factory.__name__}(): cfg is a {type(value).__name__}, whose fields "
                                    f"{', '.join(unread)} {factory.__name__} does not read: "
                                    f"pass a {config_cls.__name__}, or build the algorithm that config is for")
                want = _FACTORY_ARGUMENTS.get(name)
                if want is not None and not want[1](value):
                    raise TypeError(f"{factory.__name__}(): {name} must be {want[0]}, got {value!r:.60}")
            algo = factory(*args, **kwargs)
            info = bound.arguments.get("info")
            if info is None or not isinstance(algo, FederatedAlgorithm):
                return algo
            _refuse_unsupported_options(factory, algo.name, bound.arguments.get("run"), info)
            state_type = _StateType(algo.init)
            return algo._replace(**{f: _ForData(getattr(algo, f), info, f"{algo.name}.{f}", state_type)
                                    for f in _DATA_FUNCTIONS if getattr(algo, f) is not None})

        @functools.wraps(factory)
        def checked(*args, **kwargs):
            return build(args, kwargs, extended=False)

        # An algorithm built on this one (Ditto on FedAvg) passes its own config, a subclass whose
        # extra fields it reads itself: ``factory.extended(cfg, info, ...)``.
        checked.extended = lambda *args, **kwargs: build(args, kwargs, extended=True)
        return checked
    return wrap


def _unread_fields(cfg: Any, config_cls: type) -> list[str]:
    """The fields of ``cfg``, an instance of a subclass of ``config_cls``, that ``config_cls`` lacks."""
    import dataclasses  # noqa: PLC0415

    if type(cfg) is config_cls or not dataclasses.is_dataclass(cfg):
        return []
    own = {f.name for f in dataclasses.fields(config_cls)}
    return [f.name for f in dataclasses.fields(cfg) if f.name not in own]


def _refuse_unsupported_options(factory: Callable, name: str, run: Any, info: Any) -> None:
    """Called directly, a factory refuses a run option its module does not list in
    ``RUN_OPTIONS`` as the runner does (after the factory's own refusals, with their reasons)."""
    import sys  # noqa: PLC0415

    supported = getattr(sys.modules.get(factory.__module__), "RUN_OPTIONS", None)
    if run is None or supported is None:
        return
    from jaxfednas.run_options import refuse_unsupported  # noqa: PLC0415

    refuse_unsupported(name, run, num_clients=info.num_clients, supported=supported)


# the functions called as fn(state, data, ...): each refuses data of another dataset or client count
_DATA_FUNCTIONS = ("round", "evaluate", "personalize", "host_metrics")


def data_mismatch(built: Any, given: Any) -> str | None:
    """What differs between the ``DataInfo`` an algorithm was built with and the one of the data it
    is given (``"num_clients: 8 built, 6 given"``), or None when they agree."""
    if given == built:
        return None
    fields = [f for f in type(built).__dataclass_fields__ if getattr(built, f) != getattr(given, f, None)]
    return "; ".join(f"{f}: {getattr(built, f)!r} built, {getattr(given, f, None)!r} given" for f in fields)


class _StateType:
    """The class of the state an algorithm's ``init`` returns, found once from shapes
    (``jax.eval_shape``: nothing computed) when a function first needs it; None where that
    cannot be found (nothing is then checked)."""

    def __init__(self, init: Callable):
        self.init, self.found, self.cls = init, False, None

    def get(self) -> type | None:
        if not self.found:
            self.found = True
            try:
                self.cls = type(jax.eval_shape(self.init, jax.random.PRNGKey(0)))
            except Exception:  # noqa: BLE001 - (an init that needs more than a key: no check)
                self.cls = None
        return self.cls


class _ForData:
    """An algorithm's ``fn(state, data, ...)`` that first checks ``data.info`` against the
    ``info`` the factory was given: data split over another number of clients (or another
    dataset) would otherwise run, its client indices clamped by the gathers, and return wrong
    numbers silently. Everything else (``lower``, ``clear_cache``, ...) is ``fn``'s."""

    def __init__(self, fn: Callable, info: Any, name: str, state_type: _StateType | None = None):
        self.fn, self.info, self.name, self.state_type = fn, info, name, state_type
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", name)
        self.__doc__ = getattr(fn, "__doc__", None)

    def check(self, data: Any) -> None:
        given = getattr(data, "info", None)
        if given is None:
            return  # not a FederatedData (e.g. a test's stand-in): nothing to compare
        diff = data_mismatch(self.info, given)
        if diff is not None:
            raise ValueError(f"{self.name}(): the data is not the data the algorithm was built for ({diff}); "
                             "build the algorithm with this data's info (FederatedData.info)")

    def check_state(self, state: Any) -> None:
        want = self.state_type.get() if self.state_type is not None else None
        if want is not None and type(state) is not want:
            raise TypeError(f"{self.name}(): state must be the {want.__name__} this algorithm's init returns, got "
                            f"{type(state).__name__}")

    def __call__(self, state: Any, data: Any, *args, **kwargs):
        self.check(data)
        self.check_state(state)
        return self.fn(state, data, *args, **kwargs)

    @property
    def lower(self) -> Callable:
        lower = self.fn.lower  # (an AttributeError where fn is not jitted, as without this wrapper)

        def checked(state: Any, data: Any, *args, **kwargs):
            self.check(data)
            self.check_state(state)
            return lower(state, data, *args, **kwargs)
        return checked

    def __getattr__(self, name: str) -> Any:
        if name == "fn":  # (not set yet: copy/pickle probing a bare instance)
            raise AttributeError(name)
        return getattr(self.fn, name)
