"""Federated data on device: every client's examples stacked into padded arrays.

A split (train, val or test) of ``K`` clients becomes ``x: [K, M, H, W, C]``,
``y: [K, M]`` and ``counts: [K]``, where ``M`` is the largest client's size; rows
past a client's count are padding and never reach a loss, a gradient or a
BatchNorm statistic. Minibatches are drawn on device from per-client
permutations (:func:`epoch_permutation`), so a whole local epoch, and a whole
round, stays inside one compiled function.

A client's local epoch is ``ceil(n_k / B)`` steps; the last batch may be partial
and is masked. Clients of different sizes run in lock-step under ``vmap``: the
steps a small client does not have are skipped with ``lax.cond`` (a select under
``vmap``), so they leave its state untouched.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas import rng
from jaxfednas.data.datasets import Dataset
from jaxfednas.data.partition import SPLIT_NAMES as SPLITS
from jaxfednas.runtime import is_every_client, step_if


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """Static facts about a federated dataset (hashable: safe as jit-static metadata)."""

    name: str
    num_clients: int
    num_classes: int
    image_shape: tuple[int, ...]
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, dataset: Dataset, num_clients: int) -> DataInfo:
        """The facts of ``dataset`` split over ``num_clients`` clients (what
        :func:`make_federated_data` records; also enough to build a model)."""
        return cls(
            name=dataset.name,
            num_clients=int(num_clients),
            num_classes=int(dataset.num_classes),
            image_shape=tuple(int(d) for d in dataset.x_train.shape[1:]),
            scale=float(dataset.scale),
            mean=tuple(float(v) for v in dataset.mean),
            std=tuple(float(v) for v in dataset.std),
        )

    def normalize(self, x: jax.Array) -> jax.Array:
        """Raw pixels (any dtype) -> float32 ``(x / scale - mean) / std``."""
        mean = jnp.asarray(self.mean, jnp.float32)
        std = jnp.asarray(self.std, jnp.float32)
        return (x.astype(jnp.float32) / self.scale - mean) / std


@flax.struct.dataclass
class ClientSplit:
    """One split of every client, padded to a common length ``M``."""

    x: jax.Array  # [K, M, H, W, C], raw pixel dtype
    y: jax.Array  # [K, M] int32
    counts: jax.Array  # [K] int32, valid rows per client

    @property
    def max_examples(self) -> int:
        return self.y.shape[-1]


@flax.struct.dataclass
class ClientData:
    """One client's view of a split (what a per-client function receives)."""

    x: jax.Array  # [M, H, W, C]
    y: jax.Array  # [M]
    count: jax.Array  # [] int32


@flax.struct.dataclass
class FederatedData:
    """All clients' train/val/test splits plus the server's global test set."""

    train: ClientSplit
    val: ClientSplit
    test: ClientSplit
    server_x: jax.Array  # [N_test, H, W, C] global test set
    server_y: jax.Array  # [N_test]
    info: DataInfo = flax.struct.field(pytree_node=False)

    def clients(self, split: str, idx: jax.Array) -> ClientData:
        """Rows ``idx`` of ``split`` as a batch of :class:`ClientData` (leading axis); every
        client in order (:func:`jaxfednas.runtime.sample_clients` under full participation):
        the arrays in place, not gathered (clients split over devices stay where they are)."""
        s = getattr(self, split)
        if is_every_client(idx, s.counts.shape[0]):
            return ClientData(x=s.x, y=s.y, count=s.counts)
        return ClientData(x=s.x[idx], y=s.y[idx], count=s.counts[idx])

    def all_clients(self, split: str) -> ClientData:
        s = getattr(self, split)
        return ClientData(x=s.x, y=s.y, count=s.counts)


def stack_clients(x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], max_examples: int | None = None) -> ClientSplit:
    """Stack per-client index lists into one padded :class:`ClientSplit` (host arrays).

    Padding rows repeat the client's first example (or zeros for an empty client)
    so they hold finite values; they are masked by ``counts`` everywhere. Clients are
    padded to ``max_examples`` (default: the largest of ``parts``).
    """
    counts = np.array([len(p) for p in parts], np.int32)
    m = max(1, int(counts.max(initial=0))) if max_examples is None else max_examples
    xs = np.zeros((len(parts), m) + x.shape[1:], x.dtype)
    ys = np.zeros((len(parts), m), np.int32)
    for k, p in enumerate(parts):
        p = np.asarray(p, np.int64)
        if len(p):
            xs[k, : len(p)] = x[p]
            ys[k, : len(p)] = y[p]
            xs[k, len(p):] = x[p[0]]
    return ClientSplit(x=xs, y=ys, counts=counts)


def _sharded_split(x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], sharding) -> ClientSplit:
    """:func:`stack_clients` as global arrays split along the client axis by ``sharding``:
    each process stacks only the clients of its own devices."""
    m = max(1, max((len(p) for p in parts), default=0))
    k = len(parts)

    def rows(index):
        sl = index[0] if index else slice(None)
        return stack_clients(x, y, list(parts)[sl], max_examples=m)

    def leaf(name, shape):
        return jax.make_array_from_callback(
            shape, sharding, lambda index: getattr(rows(index), name)[(slice(None),) + tuple(index[1:])])

    return ClientSplit(x=leaf("x", (k, m) + x.shape[1:]), y=leaf("y", (k, m)), counts=leaf("counts", (k,)))


def make_federated_data(dataset: Dataset, splits: Mapping[str, Sequence[np.ndarray]], *,
                        sharding: jax.sharding.Sharding | None = None) -> FederatedData:
    """Place a partition (``{"train": [...], "val": [...], "test": [...]}`` of
    indices into ``dataset.x_train``) on device as :class:`FederatedData`.

    ``sharding`` (e.g. ``NamedSharding(client_mesh(), P("clients"))``) splits the
    clients' arrays along their leading axis over the devices, and each process builds
    only its own devices' rows (a multi-process run never holds every client's examples
    in every process); the server's test set is replicated. None: everything on the
    default device."""
    missing = [s for s in SPLITS if s not in splits]
    if missing:
        raise ValueError(f"splits is missing {missing}; expected keys {SPLITS}")
    sizes = {len(splits[s]) for s in SPLITS}
    if len(sizes) != 1:
        raise ValueError(f"splits must list the same number of clients, got {sizes}")
    num_clients = sizes.pop()
    info = DataInfo.of(dataset, num_clients)
    server = {"server_x": dataset.x_test, "server_y": dataset.y_test.astype(np.int32)}
    if sharding is None:
        stacked = {s: stack_clients(dataset.x_train, dataset.y_train, splits[s]) for s in SPLITS}
        return jax.device_put(FederatedData(info=info, **server, **stacked))
    stacked = {s: _sharded_split(dataset.x_train, dataset.y_train, splits[s], sharding) for s in SPLITS}
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    server = {k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index]) for k, v in server.items()}
    return FederatedData(info=info, **server, **stacked)


# --- On-device minibatches ----------------------------------------------------------


def epoch_permutation(key: jax.Array, count: jax.Array, max_examples: int) -> jax.Array:
    """A permutation of ``range(max_examples)`` whose first ``count`` entries are a
    uniformly random order of the valid rows ``0..count-1``."""
    r = jax.random.uniform(key, (max_examples,))
    r = jnp.where(jnp.arange(max_examples) < count, r, 2.0)
    return jnp.argsort(r)


def num_steps(count: jax.Array, batch_size: int) -> jax.Array:
    """Steps in one local epoch: ``ceil(count / batch_size)``."""
    return (count + batch_size - 1) // batch_size


def get_batch(client: ClientData, perm: jax.Array, step: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """Batch ``step`` of an epoch: ``{"x", "y", "mask"}``; ``mask`` marks real examples."""
    pos = step * batch_size + jnp.arange(batch_size)
    idx = jnp.take(perm, pos, mode="clip")
    return {"x": client.x[idx], "y": client.y[idx], "mask": pos < client.count}


def random_batch(client: ClientData, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """``batch_size`` examples drawn without replacement from a client's split (the first
    batch of a fresh epoch permutation); ``mask`` marks real rows when the split is short."""
    return get_batch(client, epoch_permutation(key, client.count, client.y.shape[0]), jnp.int32(0), batch_size)


def tree_where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda u, v: jnp.where(pred, u, v), a, b)


def run_local_epochs(
    step_fn: Callable[[Any, dict[str, jax.Array], jax.Array], tuple[Any, dict[str, jax.Array]]],
    carry: Any,
    client: ClientData,
    key: jax.Array,
    *,
    epochs: int,
    batch_size: int,
    epoch_end: Callable[[Any, jax.Array], tuple[Any, Any]] | None = None,
) -> tuple[Any, dict[str, jax.Array]]:
    """Run ``epochs`` local epochs of ``step_fn(carry, batch, key) -> (carry, metrics)``.

    ``batch`` holds ``x``, ``y``, ``mask`` and ``epoch`` (the local epoch index).
    Scans over ``epochs * ceil(M / B)`` slots; a slot past this client's
    ``ceil(n_k / B)`` steps leaves ``carry`` unchanged and contributes zero
    metrics. Returns the final carry and the metrics summed over real steps plus
    ``"steps"``, the number of real steps taken.

    ``epoch_end(carry, epoch) -> (carry, out)``, if given, runs after each epoch (to score
    the model on held-out data, keep the best one, ...); its ``out`` come back stacked
    over epochs as ``metrics["epoch_end"]``. The steps, keys and batches are the same.
    """
    m = client.y.shape[0]
    slots = math.ceil(m / batch_size)
    perms = jax.vmap(lambda e: epoch_permutation(jax.random.fold_in(key, e), client.count, m))(
        jnp.arange(epochs)
    )
    n_steps = num_steps(client.count, batch_size)

    def body(carry, t):
        epoch, step = t // slots, t % slots
        batch = get_batch(client, perms[epoch], step, batch_size)
        batch["epoch"] = epoch  # for per-epoch schedules (e.g. cosine over local epochs)
        step_key = rng.step_key(key, t)
        active = step < n_steps

        return step_if(active, lambda c: step_fn(c, batch, step_key), carry)

    if epoch_end is None:
        carry, metrics = jax.lax.scan(body, carry, jnp.arange(epochs * slots))
        summed = jax.tree.map(lambda v: v.sum(0), metrics)
    else:
        def epoch(carry, e):
            carry, metrics = jax.lax.scan(body, carry, e * slots + jnp.arange(slots))
            carry, out = epoch_end(carry, e)
            return carry, (jax.tree.map(lambda v: v.sum(0), metrics), out)

        carry, (metrics, outs) = jax.lax.scan(epoch, carry, jnp.arange(epochs))
        summed = jax.tree.map(lambda v: v.sum(0), metrics)
        summed["epoch_end"] = outs
    summed["steps"] = jnp.minimum(n_steps * epochs, epochs * slots).astype(jnp.int32)
    return carry, summed


def run_local_epochs_selected(
    step_fn: Callable[[Any, dict[str, jax.Array], jax.Array], tuple[Any, dict[str, jax.Array]]],
    carry: Any,
    client: ClientData,
    key: jax.Array,
    *,
    epochs: int,
    batch_size: int,
    model_of: Callable[[Any], Any],
    select: Callable[[Any], tuple[jax.Array, Any]],
) -> tuple[Any, dict[str, jax.Array]]:
    """:func:`run_local_epochs` that keeps the best of its models: ``select(model) ->
    (score, record)`` scores the starting model (candidate 0) and the model after every
    epoch (candidates 1..``epochs``; ``model_of(carry)`` extracts it). Returns the model
    with the highest score, the **later** one among ties (the rule of
    :func:`jaxfednas.evaluation.select_by_validation`), and the metrics of
    :func:`run_local_epochs` plus ``"selected"`` (its candidate index) and
    ``"candidates"`` (every candidate's ``record``, stacked). The steps are the same as
    :func:`run_local_epochs`'s. Holds one extra copy of the model."""
    def tracked_step(c, batch, k):
        inner, best = c
        inner, metrics = step_fn(inner, batch, k)
        return (inner, best), metrics

    def epoch_end(c, e):
        inner, (best, best_score, best_epoch) = c
        model = model_of(inner)
        score, record = select(model)
        take = score >= best_score  # ties: the later candidate
        best = tree_where(take, model, best)
        return (inner, (best, jnp.where(take, score, best_score), jnp.where(take, e + 1, best_epoch))), record

    start = model_of(carry)
    score0, record0 = select(start)
    (_, (best, _, selected)), metrics = run_local_epochs(
        tracked_step, (carry, (start, score0, jnp.int32(0))), client, key, epochs=epochs, batch_size=batch_size,
        epoch_end=epoch_end)
    records = metrics.pop("epoch_end")
    metrics["candidates"] = jax.tree.map(lambda a, r: jnp.concatenate([a[None], r]), record0, records)
    metrics["selected"] = selected
    return best, metrics
