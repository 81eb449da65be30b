"""Federated algorithms, each a factory returning a :class:`jaxfednas.FederatedAlgorithm`."""
from algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg
from algorithms.local_only import LocalOnlyConfig, LocalOnlyState, local_only

__all__ = ["FedAvgConfig", "FedAvgState", "fedavg", "LocalOnlyConfig", "LocalOnlyState", "local_only"]
