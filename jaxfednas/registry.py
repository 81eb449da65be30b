"""Algorithm names -> modules, looked up lazily (the engine never imports ``algorithms``
at import time).

An algorithm module provides ``CONFIG`` (its config dataclass), ``PRESETS``
(``{"smoke": {...}, "paper": {...}}`` flat overrides), ``DESCRIPTION``, a factory
``(algo_config, info, *, run: RunOptions) -> FederatedAlgorithm`` (named ``FACTORY``, or
decorated with :func:`register_algorithm`, which also registers a module from outside the
library) and ``RUN_OPTIONS`` (the options of :data:`jaxfednas.run_options.OPTIONS` it
honours; the runner refuses the others), and optionally ``DEFAULTS`` (flat overrides of
the shared sections that the algorithm needs by default, e.g. a validation split; applied
before any preset) and ``check(config)`` (refusals that need the whole configuration, e.g. a validation split
the algorithm cannot run without). :func:`build_algorithm` is the one place where an
algorithm is built from a configuration.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxfednas.config import ConfigError, DataConfig, ExperimentConfig, RunConfig, apply_overrides
from jaxfednas.errors import RegistrationError

if TYPE_CHECKING:
    import jaxfednas.algorithm
    import jaxfednas.config
    import jaxfednas.data.federated
    import jaxfednas.run_options

ALGORITHMS: dict[str, str] = {
    "fedavg": "jaxfednas.algorithms.fedavg",
    "local_only": "jaxfednas.algorithms.local_only",
    "fednas": "jaxfednas.algorithms.fednas",
    "fednas_train": "jaxfednas.algorithms.fednas_train",
    "dp_fnas": "jaxfednas.algorithms.dp_fnas",
    "dfnas": "jaxfednas.algorithms.dfnas",
    "local_adaptation": "jaxfednas.algorithms.local_adaptation",
    "ditto": "jaxfednas.algorithms.ditto",
    "perfedavg": "jaxfednas.algorithms.perfedavg",
    "spider": "jaxfednas.algorithms.spider",
    "perfedrlnas": "jaxfednas.algorithms.perfedrlnas",
}


_FACTORIES: dict[str, Callable[..., Any]] = {}  # registered with register_algorithm


def register_algorithm(name: str, *, replace: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that makes a factory's module algorithm ``name``: a CLI command
    (``jaxfednas run NAME``, its module ``--import``ed) and a name for
    :func:`make_config` and :func:`build_algorithm`, with the decorated function as the
    module's ``FACTORY``. The module provides the rest (``CONFIG``, ``PRESETS``,
    ``DESCRIPTION``, ``RUN_OPTIONS``). A name already taken by another module is
    refused unless ``replace``; the same module registering again replaces itself."""
    if not isinstance(name, str) or not name.isidentifier():
        raise RegistrationError(f"algorithm name must be a Python identifier, got {name!r}")

    def add(factory: Callable[..., Any]) -> Callable[..., Any]:
        import inspect  # noqa: PLC0415

        params = inspect.signature(factory).parameters
        if "run" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise RegistrationError(f"algorithm {name!r}: its factory {factory.__name__}{inspect.signature(factory)} "
                                    "takes no run: every factory has the shape f(cfg, info, *, run: RunOptions = "
                                    "RunOptions(), ...its own) (jaxfednas.run_options)")
        old = ALGORITHMS.get(name)
        if old is not None and old != factory.__module__ and not replace:
            raise RegistrationError(f"algorithm {name!r} is already registered (module {old}); pass replace=True to "
                             "replace it")
        ALGORITHMS[name] = factory.__module__
        _FACTORIES[name] = factory
        return factory

    return add


def algorithm_module(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return importlib.import_module(ALGORITHMS[name])


def build_algorithm(config: jaxfednas.config.ExperimentConfig, info: jaxfednas.data.federated.DataInfo, *,
                    run: jaxfednas.run_options.RunOptions | None = None) -> jaxfednas.algorithm.FederatedAlgorithm:
    """The algorithm ``config`` names, built for data described by ``info``: its module's
    ``check(config)`` if any, then ``FACTORY(config.algo, info, run=...)`` given the run's
    options (:class:`jaxfednas.run_options.RunOptions`, built here once unless ``run`` gives
    them; the same call for a bundled algorithm and a user's registered one), then a refusal,
    one line, of any run option set away from its default that the module does not list
    in ``RUN_OPTIONS`` (a factory's own refusals, with its reasons, come first)."""
    from jaxfednas.run_options import RunOptions, refuse_unsupported  # noqa: PLC0415  (jax, at build time only)

    mod = algorithm_module(config.algorithm)
    check = getattr(mod, "check", None)
    if check is not None:
        check(config)
    factory = _FACTORIES.get(config.algorithm) or mod.FACTORY
    if run is None:
        run = RunOptions.from_run(config.run)
    algorithm = factory(config.algo, info, run=run)  # every factory's one shape
    refuse_unsupported(config.algorithm, config.run, num_clients=info.num_clients,
                       supported=getattr(mod, "RUN_OPTIONS", ()))
    return algorithm


def presets(name: str) -> dict[str, dict]:
    return dict(algorithm_module(name).PRESETS)


def make_config(name: str, *, preset: str | None = None, overrides: dict | None = None,
                warn_renamed: bool = True) -> ExperimentConfig:
    """Defaults, then the named preset, then ``overrides`` (flat ``section.field`` keys;
    former field names accepted, with a warning unless ``warn_renamed`` is false)."""
    mod = algorithm_module(name)
    cfg = ExperimentConfig(algorithm=name, data=DataConfig(), run=RunConfig(), algo=mod.CONFIG())
    cfg = apply_overrides(cfg, getattr(mod, "DEFAULTS", {}))
    if preset is not None:
        cfg = apply_overrides(cfg, preset_overrides(name, preset))
    return apply_overrides(cfg, overrides or {}, warn_renamed=warn_renamed)


def preset_overrides(name: str, preset: str) -> dict:
    """The settings algorithm ``name``'s preset ``preset`` sets (flat ``section.field`` keys), or a
    one-line ``ConfigError`` naming the presets there are."""
    presets = algorithm_module(name).PRESETS
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} for {name}; available: {sorted(presets)}")
    return presets[preset]


def config_from_dict(d: dict) -> ExperimentConfig:
    """Inverse of ``ExperimentConfig.to_dict`` (e.g. a run directory's config.json, whose
    former field names are read as today's without a warning)."""
    flat = {f"{s}.{k}": v for s in ("data", "run", "algo") for k, v in d.get(s, {}).items()}
    return make_config(d["algorithm"], overrides=flat, warn_renamed=False)
