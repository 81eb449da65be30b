"""Datasets, partitions and on-device federated data.

Partitioners live in :mod:`jaxfednas.data.partition` (``partition.partition(labels, method, ...)``).
"""
from jaxfednas.data.augment import Augment, augment_batch
from jaxfednas.data.datasets import DATASETS, Dataset, DatasetUnavailableError, load_dataset
from jaxfednas.data.federated import (
    ClientData,
    ClientSplit,
    DataInfo,
    FederatedData,
    epoch_permutation,
    get_batch,
    random_batch,
    make_federated_data,
    num_steps,
    run_local_epochs,
)
from jaxfednas.data.partition import (
    PARTITION_METHODS,
    build_manifest,
    label_counts,
    load_manifest,
    split_client_indices,
)

__all__ = [
    "Augment", "augment_batch", "DATASETS", "Dataset", "DatasetUnavailableError", "load_dataset",
    "ClientData", "ClientSplit", "DataInfo", "FederatedData", "epoch_permutation", "get_batch",
    "make_federated_data", "num_steps", "random_batch", "run_local_epochs",
    "PARTITION_METHODS", "build_manifest", "label_counts", "load_manifest", "split_client_indices",
]
