"""Federated algorithms, each a factory returning a :class:`jaxfednas.FederatedAlgorithm`.

The five papers (FedNAS, DP-FNAS, DFNAS, SPIDER, PerFedRLNAS), FedNAS' retraining of a
derived genotype, and the baselines (FedAvg, local-only, local adaptation, Ditto,
Per-FedAvg). Each algorithm is a module named after it whose factory has the module's name
(``jaxfednas.algorithms.fednas.fednas``) and takes its config and a
:class:`jaxfednas.DataInfo`; the module also holds the paper's building blocks. This
package exports every algorithm module and every config and state class::

    from jaxfednas.algorithms import FedNASConfig, fednas
    algo = fednas.fednas(FedNASConfig(), info)

Names resolve lazily: importing ``jaxfednas.algorithms`` imports no algorithm.
"""
import importlib

from jaxfednas.registry import ALGORITHMS

# The library's algorithm modules: the registry's list (one list), those that live here.
_MODULES = tuple(name for name, path in ALGORITHMS.items() if path == f"jaxfednas.algorithms.{name}")
# The config and state classes this package exports, by the module that defines them (a
# factory shares its module's name, and the name is the module).
_EXPORTS = {name: f"jaxfednas.algorithms.{module}" for module, names in {
    "fednas": ("FedNASConfig", "FedNASState"),
    "fednas_train": ("FedNASTrainConfig",),
    "dp_fnas": ("DPFNASConfig", "DPFNASState"),
    "dfnas": ("DFNASConfig", "DFNASState"),
    "spider": ("SpiderConfig", "SpiderState"),
    "perfedrlnas": ("PerFedRLNASConfig", "PerFedRLNASState"),
    "fedavg": ("FedAvgConfig", "FedAvgState"),
    "local_only": ("LocalOnlyConfig", "LocalOnlyState"),
    "local_adaptation": ("LocalAdaptationConfig",),
    "ditto": ("DittoConfig", "DittoState"),
    "perfedavg": ("PerFedAvgConfig", "PerFedAvgState"),
}.items() for name in names}

__all__ = ["common", *_MODULES, *_EXPORTS]


def __getattr__(name):
    if name in _MODULES or name == "common":
        return importlib.import_module(f"jaxfednas.algorithms.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxfednas.algorithms' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
