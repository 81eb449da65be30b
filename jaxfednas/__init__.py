"""jaxfednas — federated neural architecture search in JAX/Flax.

The engine: data (:mod:`jaxfednas.data`), the runtime that places clients on
devices and aggregates them (:mod:`jaxfednas.runtime`), evaluation, run
management (:mod:`jaxfednas.experiment`) and the algorithm contract
(:class:`FederatedAlgorithm`). Algorithms live in :mod:`jaxfednas.algorithms`,
search spaces in :mod:`jaxfednas.search_spaces` (the repository's top-level
``algorithms/`` and ``search_spaces/`` folders, installed inside this package).

Names are resolved lazily, so ``import jaxfednas.privacy`` (host-side
accounting) does not import JAX.
"""
import importlib

__version__ = "0.2.0.dev0"

_EXPORTS = {
    "FederatedAlgorithm": "jaxfednas.algorithm",
    "ConfigError": "jaxfednas.config",
    "DataConfig": "jaxfednas.config",
    "ExperimentConfig": "jaxfednas.config",
    "RunConfig": "jaxfednas.config",
    "DataInfo": "jaxfednas.data.federated",
    "FederatedData": "jaxfednas.data.federated",
    "make_federated_data": "jaxfednas.data.federated",
    "load_dataset": "jaxfednas.data.datasets",
    "Placement": "jaxfednas.runtime",
    "gather_rows": "jaxfednas.runtime",
    "map_clients": "jaxfednas.runtime",
    "masked_weighted_mean": "jaxfednas.runtime",
    "sample_clients": "jaxfednas.runtime",
    "scatter_rows": "jaxfednas.runtime",
    "weighted_mean": "jaxfednas.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxfednas' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
