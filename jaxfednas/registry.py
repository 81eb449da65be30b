"""Algorithm names -> modules, looked up lazily (the engine never imports ``algorithms``
at import time).

An algorithm module provides ``CONFIG`` (its config dataclass), ``PRESETS``
(``{"smoke": {...}, "paper": {...}}`` flat overrides), ``DESCRIPTION`` and
``build(config: ExperimentConfig, info: DataInfo) -> FederatedAlgorithm``, and
optionally ``DEFAULTS`` (flat overrides of the shared sections that the algorithm
needs by default, e.g. a validation split; applied before any preset).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from jaxfednas.config import ConfigError, DataConfig, ExperimentConfig, RunConfig, apply_overrides

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


def algorithm_module(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return importlib.import_module(ALGORITHMS[name])


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
        if preset not in mod.PRESETS:
            raise ConfigError(f"unknown preset {preset!r} for {name}; available: {sorted(mod.PRESETS)}")
        cfg = apply_overrides(cfg, mod.PRESETS[preset])
    return apply_overrides(cfg, overrides or {}, warn_renamed=warn_renamed)


def config_from_dict(d: dict) -> ExperimentConfig:
    """Inverse of ``ExperimentConfig.to_dict`` (e.g. a run directory's config.json, whose
    former field names are read as today's without a warning)."""
    flat = {f"{s}.{k}": v for s in ("data", "run", "algo") for k, v in d.get(s, {}).items()}
    return make_config(d["algorithm"], overrides=flat, warn_renamed=False)
