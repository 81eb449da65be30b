"""Federated algorithms, each a factory returning a :class:`jaxfednas.FederatedAlgorithm`."""
from algorithms.ditto import DittoConfig, DittoState, ditto
from algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg
from algorithms.local_adaptation import LocalAdaptationConfig, local_adaptation
from algorithms.local_only import LocalOnlyConfig, LocalOnlyState, local_only
from algorithms.perfedavg import PerFedAvgConfig, PerFedAvgState, perfedavg

__all__ = [
    "FedAvgConfig", "FedAvgState", "fedavg", "LocalOnlyConfig", "LocalOnlyState", "local_only",
    "LocalAdaptationConfig", "local_adaptation", "DittoConfig", "DittoState", "ditto",
    "PerFedAvgConfig", "PerFedAvgState", "perfedavg",
]
