"""jaxfednas — federated neural architecture search in JAX/Flax.

The engine: data (:mod:`jaxfednas.data`), the runtime that places clients on
devices and aggregates them (:mod:`jaxfednas.runtime`), evaluation, run
management (:mod:`jaxfednas.experiment`) and the algorithm contract
(:class:`FederatedAlgorithm`). Algorithms live in the top-level ``algorithms``
package, search spaces in ``search_spaces``.
"""
from jaxfednas.algorithm import FederatedAlgorithm
from jaxfednas.config import ConfigError, DataConfig, ExperimentConfig, RunConfig
from jaxfednas.data import DataInfo, FederatedData, load_dataset, make_federated_data
from jaxfednas.runtime import (
    Placement,
    gather_rows,
    map_clients,
    masked_weighted_mean,
    sample_clients,
    scatter_rows,
    weighted_mean,
)

__version__ = "0.1.0"

__all__ = [
    "FederatedAlgorithm", "ConfigError", "DataConfig", "ExperimentConfig", "RunConfig", "DataInfo",
    "FederatedData", "load_dataset", "make_federated_data", "Placement", "gather_rows", "map_clients",
    "masked_weighted_mean", "sample_clients", "scatter_rows", "weighted_mean",
]
