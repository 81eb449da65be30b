"""Atomic msgpack checkpoints of a whole algorithm state (never pickle).

A checkpoint holds ``{"format", "round", "config_sha256", "state"}``, where
``state`` is ``flax.serialization.to_state_dict`` of the algorithm state pulled
to host. Writes go to a temporary file in the same directory, are fsynced and
renamed over the old file, so an interruption leaves the previous checkpoint
intact.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import numpy as np

FORMAT = "jaxfednas-checkpoint-v1"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def save_checkpoint(path: str | os.PathLike, state: Any, *, round: int, config_sha256: str) -> None:
    """Serialise ``state`` (any flax-serialisable pytree) after ``round`` completed rounds."""
    host = jax.tree.map(np.asarray, jax.device_get(state))
    payload = {
        "format": FORMAT,
        "round": int(round),
        "config_sha256": config_sha256,
        "state": flax.serialization.to_state_dict(host),
    }
    atomic_write_bytes(path, flax.serialization.msgpack_serialize(payload))


def load_checkpoint(path: str | os.PathLike, template: Any, *, config_sha256: str | None = None) -> tuple[Any, int]:
    """Restore a state shaped like ``template`` and placed like it (the shardings of its
    ``jax.Array`` leaves); returns ``(state, completed_rounds)``.

    Raises ``ValueError`` if the file is not a jaxfednas checkpoint, was written
    for a different configuration, or does not match the template's structure.
    """
    raw = flax.serialization.msgpack_restore(Path(path).read_bytes())
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    if config_sha256 is not None and raw["config_sha256"] != config_sha256:
        raise ValueError(
            f"{path} was written for a different configuration (config sha256 {raw['config_sha256'][:12]} "
            f"!= {config_sha256[:12]}); resume with the run directory's own config"
        )
    template_host = jax.device_get(template)
    state = flax.serialization.from_state_dict(template_host, raw["state"])
    for a, b in zip(jax.tree.leaves(template_host), jax.tree.leaves(state)):
        if np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype:
            raise ValueError(f"{path}: checkpoint leaf {np.shape(b)}/{np.asarray(b).dtype} does not match "
                             f"the state {np.shape(a)}/{np.asarray(a).dtype}")
    # Each leaf goes where the template's lives (e.g. replicated over the clients mesh),
    # so the first round after a resume runs the already-compiled program.
    leaves, treedef = jax.tree.flatten(state)
    where = [t.sharding if isinstance(t, jax.Array) else None for t in jax.tree.leaves(template)]
    return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in zip(leaves, where)]), int(raw["round"])
