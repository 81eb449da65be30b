"""Datasets, partitions and on-device federated data.

Partitioners live in :mod:`jaxfednas.data.partition` (``partition.partition(labels, method, ...)``).
"""
import importlib

_EXPORTS = {
    "Augment": "augment", "augment_batch": "augment",
    "DATASETS": "datasets", "Dataset": "images", "DatasetUnavailableError": "datasets", "load_dataset": "datasets",
    "ClientData": "federated", "ClientSplit": "federated", "DataInfo": "federated", "FederatedData": "federated",
    "epoch_permutation": "federated", "get_batch": "federated", "make_federated_data": "federated",
    "num_steps": "federated", "random_batch": "federated", "run_local_epochs": "federated",
    "PARTITION_METHODS": "partition", "build_manifest": "partition", "label_counts": "partition",
    "load_manifest": "partition", "split_client_indices": "partition",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    # Lazy, so that jaxfednas.config can take its choice lists from datasets.py and
    # partition.py (NumPy only) without importing JAX.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jaxfednas.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jaxfednas.data' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
