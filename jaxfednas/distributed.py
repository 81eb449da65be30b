"""One run across several processes and hosts: JAX's multi-controller runtime.

Every process runs the same program (``jaxfednas run ...`` with the same flags); after
:func:`initialize`, ``jax.devices()`` lists the devices of every process, so the
``clients`` mesh of :mod:`jaxfednas.runtime` spans them all and a round's aggregation
is a collective over that axis (gloo on CPU, NCCL on GPUs). Nothing here is an RPC
layer of our own: it is ``jax.distributed`` plus four host-side helpers.

* :func:`initialize` — from explicit arguments (the CLI's ``--coordinator``,
  ``--num-processes``, ``--process-id``), from ``JAX_COORDINATOR_ADDRESS`` /
  ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or from a cluster JAX detects by itself
  (SLURM with more than one task, Open MPI, ...). With none of them: one process,
  nothing changes.
* :func:`is_main` — process 0 writes the run directory (metrics, checkpoints, plots);
  the others compute the same rounds and write nothing.
* :func:`on_main` — run a host-side step (file checks, reading a checkpoint) on process
  0 only and give its result, or its exception, to every process.
* :func:`to_host` / :func:`put_like` — global arrays to NumPy (a collective for the
  sharded ones) and back to the template's placement.

A process that dies is noticed by the others through the coordination service's
heartbeats: within ``heartbeat_s`` seconds (30, or ``$JAXFEDNAS_HEARTBEAT_S``) they
abort with JAX's "Terminating process because the JAX distributed service detected
fatal errors ... stopped sending heartbeats: <ids>" (exit status 134) instead of
waiting forever. The run directory keeps the last checkpoint process 0 saved.
"""
from __future__ import annotations

import json
import os
from typing import Any
from collections.abc import Callable

import jax
import numpy as np

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
HEARTBEAT_S = int(os.environ.get("JAXFEDNAS_HEARTBEAT_S", 30))  # a silent process is declared dead after this long
INIT_TIMEOUT_S = 300  # how long processes wait for each other at start-up


class DistributedError(RuntimeError):
    """Bad multi-process arguments, or an error raised on process 0 and re-raised here."""


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"{name}={v!r} is not an integer") from None


def _cluster_detected() -> bool:
    """A launcher JAX recognises by itself with several tasks: a SLURM job step (``srun``;
    a bare ``salloc`` shell has no step and stays single-process) or Open MPI's ``mpirun``."""
    def count(name):
        try:
            return int(os.environ.get(name, "1"))
        except ValueError:
            return 1
    slurm_step = "SLURM_STEP_NODELIST" in os.environ and count("SLURM_STEP_NUM_TASKS") > 1
    return slurm_step or count("OMPI_COMM_WORLD_SIZE") > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               heartbeat_s: int = HEARTBEAT_S, init_timeout_s: int = INIT_TIMEOUT_S) -> bool:
    """Join a multi-process run; returns whether one was joined (False: a single process).

    Arguments left None are read from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID``; if none is set either, a SLURM / Open MPI job with several
    tasks is detected by JAX itself, and otherwise nothing happens. Call it before any
    other JAX work (it fixes the set of devices). Calling it again is a no-op."""
    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if all(v is None for v in given.values()):
        if not _cluster_detected():
            return False
        jax.distributed.initialize(initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_s)
        return True
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise DistributedError(
            f"a multi-process run needs the coordinator address, the number of processes and this process's id; "
            f"missing {', '.join(missing)} (--coordinator HOST:PORT --num-processes N --process-id I, or "
            f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID})")
    if ":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit():
        raise DistributedError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got "
                               f"num_processes={num_processes}, process_id={process_id}")
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=init_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_s)
    return True


def is_main() -> bool:
    """Whether this process writes the run directory (process 0)."""
    return jax.process_index() == 0


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's ``data`` in every process (others pass None)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(data) if is_main() else 0)))
    buf = np.frombuffer(data, np.uint8) if is_main() else np.zeros(n, np.uint8)
    return multihost_utils.broadcast_one_to_all(buf).astype(np.uint8).tobytes()


def on_main(fn: Callable[[], Any], *, errors: tuple[type[BaseException], ...] = ()) -> Any:
    """``fn()`` run on process 0 only; every process returns its (JSON-able) result.

    An exception in ``fn`` is raised on process 0 as is and on the others as the class
    of ``errors`` it is an instance of (else :class:`DistributedError`) with the same
    message, so every process stops together. One process: just ``fn()``."""
    if jax.process_count() == 1:
        return fn()
    payload, error = None, None
    if is_main():
        try:
            payload = json.dumps({"ok": fn()}).encode()
        except BaseException as e:  # noqa: BLE001 - handed on to the other processes, then re-raised
            error = e
            kind = next((i for i, c in enumerate(errors) if isinstance(e, c)), -1)
            payload = json.dumps({"error": str(e), "kind": kind}).encode()
    msg = json.loads(_broadcast_bytes(payload))
    if error is not None:
        raise error
    if "error" in msg:
        cls = errors[msg["kind"]] if msg["kind"] >= 0 else DistributedError
        raise cls(msg["error"])
    return msg["ok"]


def broadcast(tree: Any) -> Any:
    """Process 0's values of ``tree`` (NumPy leaves; same structure and shapes in every
    process) in every process."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils  # noqa: PLC0415

    # as bytes: broadcast_one_to_all sums process 0's values with zeros, which would turn
    # -0.0 into +0.0; integer sums of the bytes are exact
    leaves, treedef = jax.tree.flatten(jax.tree.map(np.asarray, tree))
    raw = multihost_utils.broadcast_one_to_all([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves])
    return jax.tree.unflatten(treedef, [np.asarray(r).astype(np.uint8).view(x.dtype).reshape(x.shape)
                                        for r, x in zip(raw, leaves)])


def _leaf_to_host(x: Any) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_host(tree: Any) -> Any:
    """Every leaf as a NumPy array holding the whole global value. Arrays sharded across
    processes are gathered (a collective: every process must call this at the same
    point); replicated ones are read from a local copy."""
    return jax.tree.map(_leaf_to_host, tree)


def put(x: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Host value ``x`` (the same in every process) placed with ``sharding``: each
    process fills only its own devices' shards."""
    if sharding is None:
        return jax.device_put(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def put_like(host: Any, template: Any) -> Any:
    """``host`` (NumPy leaves) placed like ``template``'s ``jax.Array`` leaves."""
    leaves, treedef = jax.tree.flatten(host)
    where = [t.sharding if isinstance(t, jax.Array) else None for t in jax.tree.leaves(template)]
    return jax.tree.unflatten(treedef, [put(x, s) for x, s in zip(leaves, where)])
