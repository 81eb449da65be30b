"""Atomic, checksummed msgpack checkpoints of a whole algorithm state (never pickle).

A checkpoint file is one header line and a msgpack payload::

    jaxfednas-checkpoint-v2 bytes=<payload length> sha256=<hex digest of the payload>\\n
    <payload>

The payload is ``{"format", "round", "config_sha256", "schema", "state"}``, where
``state`` is ``flax.serialization.to_state_dict`` of the algorithm state pulled to host
(``tail -n +2 FILE | sha256sum`` checks it by hand). Files from before the header
(the payload alone) are still read; only their msgpack structure can be checked.

``schema`` numbers the state's field names. Schema 1 (a payload without the key) is
every checkpoint written before the fields were named by meaning; a state class lists
its former names with :func:`renamed_fields`, and :func:`read_checkpoint` reads an
older schema's fields under today's names, so every older run directory resumes.

Writes go to a temporary file in the same directory, are fsynced and renamed over
the old file. Because a rename is not atomic everywhere (some network file
systems, a copy cut short), :func:`save_checkpoint` also keeps the previous
``keep - 1`` good checkpoints beside the newest, named by their round
(``checkpoint.msgpack`` -> ``checkpoint.<round>.msgpack``), and
:func:`load_checkpoint` verifies each file and falls back to the newest good one
with a one-line warning naming the bad ones.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import flax.serialization
import jax
import numpy as np

from jaxfednas.files import write_bytes, write_text

FORMAT = "jaxfednas-checkpoint-v1"  # the payload's layout (unchanged since v1)
SCHEMA = 2  # the state's field names: 1 before renamed_fields (no "schema" key), 2 since
HEADER = "jaxfednas-checkpoint-v2"  # the checksummed file around it
KEEP = 2  # checkpoints kept: the newest and the one before it
_HEADER_RE = re.compile(rb"jaxfednas-checkpoint-v2 bytes=(\d+) sha256=([0-9a-f]{64})\n")
# Test-only: "ROUND:POINT" makes save_checkpoint SIGKILL its own process at POINT of the
# save of ROUND ("partial": half the temporary file written; "rotated": the previous
# checkpoint renamed aside, the new one not yet renamed into place; "torn": then half the
# new file written in place, as a non-atomic rename or a copy cut short leaves it).
# See tests/unit/jaxfednas/test_checkpoint_robustness.py.
_KILL_ENV = "JAXFEDNAS_TEST_KILL_IN_SAVE"


class CheckpointError(FileNotFoundError, ValueError):
    """No usable checkpoint: every candidate file is missing or damaged.

    A ``FileNotFoundError`` (the CLI and example scripts print it as one line) and a
    ``ValueError`` (what :func:`load_checkpoint` raised for a bad file before)."""


# (the library's writers: see jaxfednas.files; these names are kept for existing callers)
atomic_write_bytes = write_bytes
atomic_write_text = write_text


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The existing checkpoints of ``path`` newest first: ``path`` itself, then the
    older ``<stem>.<round><suffix>`` kept beside it by decreasing round."""
    path = Path(path)
    older = []
    for p in path.parent.glob(f"{path.stem}.*{path.suffix}"):
        r = _round_in_name(path, p)
        if r is not None:
            older.append((r, p))
    return ([path] if path.exists() else []) + [p for _, p in sorted(older, reverse=True)]


def _round_in_name(path: Path, older: Path) -> int | None:
    middle = older.name[len(path.stem) + 1:len(older.name) - len(path.suffix)]
    return int(middle) if middle.isdigit() else None


def _read(path: Path) -> dict:
    """The verified payload of one checkpoint file; ``ValueError`` saying what is wrong."""
    data = path.read_bytes()
    if not data:
        raise ValueError("empty file")
    m = _HEADER_RE.match(data)
    if m is not None:
        payload, size = data[m.end():], int(m.group(1))
        if len(payload) != size:
            raise ValueError(f"truncated ({len(payload)} of {size} payload bytes)" if len(payload) < size
                             else f"{len(payload) - size} bytes after the payload")
        if hashlib.sha256(payload).hexdigest() != m.group(2).decode():
            raise ValueError("sha256 mismatch")
    elif data.startswith(HEADER.encode()[:12]):
        raise ValueError("damaged header")
    else:
        payload = data  # written before checksums: only the msgpack structure can be checked
    try:
        raw = flax.serialization.msgpack_restore(payload)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for damaged input
        raise ValueError(f"unreadable msgpack ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("round"), int):
        raise ValueError(f"not a {FORMAT} payload")
    return raw


def _kill_hook(round: int, point: str) -> bool:
    return os.environ.get(_KILL_ENV) == f"{round}:{point}"


def _die() -> None:
    import signal  # noqa: PLC0415

    os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(path: str | os.PathLike, state: Any, *, round: int, config_sha256: str,
                    keep: int = KEEP) -> None:
    """Serialise ``state`` (any flax-serialisable pytree) after ``round`` completed rounds
    to ``path``, keeping the ``keep - 1`` newest earlier good checkpoints beside it.

    The new file is written to a temporary file first; only then is the previous ``path``
    verified and renamed to ``<stem>.<its round><suffix>`` (a damaged one is simply
    replaced) and the new one renamed into place, so ``path`` holds a complete
    checkpoint except between those two renames, and a good one exists at every
    instant. Then older ones beyond ``keep`` and any of a round >= ``round`` (left by a
    run that fell back) are removed.
    """
    path = Path(path)
    from jaxfednas.distributed import to_host  # noqa: PLC0415

    host = to_host(state)
    payload = flax.serialization.msgpack_serialize({
        "format": FORMAT,
        "round": int(round),
        "config_sha256": config_sha256,
        "schema": SCHEMA,
        "state": flax.serialization.to_state_dict(host),
    })
    data = f"{HEADER} bytes={len(payload)} sha256={hashlib.sha256(payload).hexdigest()}\n".encode() + payload
    for stale in path.parent.glob(f".{path.name}.*"):  # temporary files of a killed save
        stale.unlink()
    if _kill_hook(round, "partial"):
        fd, _ = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.write(fd, data[:len(data) // 2])
        os.fsync(fd)
        _die()

    def set_previous_aside():
        if keep > 1 and path.exists():
            try:
                previous = _read(path)["round"]
            except ValueError:
                previous = None
            if previous is not None and previous < round:
                os.replace(path, path.with_name(f"{path.stem}.{previous}{path.suffix}"))
        if _kill_hook(round, "rotated"):
            _die()
        if _kill_hook(round, "torn"):
            path.write_bytes(data[:len(data) // 2])
            _die()

    write_bytes(path, data, before_replace=set_previous_aside)
    kept = 1
    for p in checkpoint_files(path)[1:]:
        if _round_in_name(path, p) >= round or kept >= keep:
            p.unlink()
        else:
            kept += 1


def load_checkpoint(path: str | os.PathLike, template: Any, *, config_sha256: str | tuple[str, ...] | None = None,
                    max_round: int | None = None, warn: Callable[[str], None] | None = None) -> tuple[Any, int]:
    """Restore a state shaped like ``template`` and placed like it (the shardings of its
    ``jax.Array`` leaves) from the newest good checkpoint of ``path`` (see
    :func:`read_checkpoint`, which this places); returns ``(state, completed_rounds)``."""
    from jaxfednas.distributed import put_like  # noqa: PLC0415

    state, r = read_checkpoint(path, shape_template(template), config_sha256=config_sha256, max_round=max_round,
                               warn=warn)
    # Each leaf goes where the template's lives (e.g. replicated over the clients mesh),
    # so the first round after a resume runs the already-compiled program.
    return put_like(state, template), r


def shape_template(tree: Any) -> Any:
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` (what :func:`read_checkpoint` needs;
    nothing is copied from the devices)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None) or np.asarray(x).dtype),
                        tree)


def checkpoint_config_hash(path: str | os.PathLike) -> str | None:
    """The configuration hash the checkpoint file at ``path`` was written for; None when the
    file is missing or does not verify."""
    try:
        return _read(Path(path)).get("config_sha256")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_checkpoint(path: str | os.PathLike, template: Any, *, config_sha256: str | tuple[str, ...] | None = None,
                    max_round: int | None = None, warn: Callable[[str], None] | None = None) -> tuple[Any, int]:
    """The state (NumPy leaves, structured like ``template``, whose leaves need only a
    shape and dtype) from the newest good checkpoint of ``path`` (see
    :func:`checkpoint_files`), and its completed rounds.

    A damaged file (truncated, empty, checksum mismatch, unreadable), one of a round above
    ``max_round``, one written for another configuration (``config_sha256``: the hash or
    hashes it must carry, None: any) or one whose state does not fit the template is
    skipped for the next older one, and ``warn`` (default: a ``warning:`` line on stderr)
    gets one line naming what was skipped. Raises :class:`CheckpointError` when no file
    is usable.
    """
    path = Path(path)
    accepted = (config_sha256,) if isinstance(config_sha256, str) else config_sha256
    skipped, found = [], None
    for p in checkpoint_files(path):
        try:
            raw = _read(p)
            raw["state"]  # noqa: B018 - a payload without its state is damaged
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = e if isinstance(e, ValueError) else e.strerror if isinstance(e, OSError) else f"no {e}"
            skipped.append(f"{p.name}: {why}")
            continue
        if max_round is not None and raw["round"] > max_round:
            skipped.append(f"{p.name}: round {raw['round']} is past the {max_round} rounds of metrics.jsonl")
            continue
        if accepted is not None and raw.get("config_sha256") not in accepted:
            skipped.append(f"{p.name}: written for another configuration (config sha256 "
                           f"{str(raw.get('config_sha256'))[:12]} != {accepted[0][:12]})")
            continue
        try:
            state = _fit(template, migrate(template, raw["state"], raw.get("schema", 1)))
        except (ValueError, KeyError, TypeError) as e:
            skipped.append(f"{p.name}: {e if isinstance(e, ValueError) else f'does not fit the state ({e!r})'}")
            continue
        found = p
        break
    if found is None:
        why = "; ".join(skipped) if skipped else f"{path.name} does not exist"
        raise CheckpointError(f"no usable checkpoint in {path.parent} ({why})")
    if skipped or found != path:
        if not path.exists():
            skipped.insert(0, f"{path.name}: missing")
        msg = f"{path.parent}: skipped {'; '.join(skipped)}; using {found.name} (round {raw['round']})"
        (warn or (lambda s: print(f"warning: {s}", file=sys.stderr)))(msg)
    return state, int(raw["round"])


def renamed_fields(**former: str) -> Callable[[type], type]:
    """Class decorator of a state dataclass whose fields were renamed: ``former`` maps a
    field's former name to where its value lives now (a field, or ``field.key`` inside
    a dict field). Checkpoints of an older schema are read under the new names
    (:func:`migrate`), and reading the former attribute still works for one release,
    with a ``DeprecationWarning``::

        @renamed_fields(policy="policy_logits")
        @flax.struct.dataclass
        class State:
            policy_logits: jax.Array
    """
    def alias(old: str, new: str) -> property:
        field, *key = new.split(".")
        now = f".{field}" + (f"[{key[0]!r}]" if key else "")

        def get(self):
            warnings.warn(f"{type(self).__name__}.{old} is now {now}", DeprecationWarning, stacklevel=2)
            value = getattr(self, field)
            return value[key[0]] if key else value
        return property(get)

    def decorate(cls: type) -> type:
        fields = {f.name for f in dataclasses.fields(cls)}
        for old, new in former.items():
            if new.split(".")[0] not in fields or old in fields:
                raise TypeError(f"renamed_fields: {old!r} -> {new!r} does not match {cls.__name__}'s fields")
            setattr(cls, old, alias(old, new))
        cls.RENAMED = {**getattr(cls, "RENAMED", {}), **former}
        return cls
    return decorate


def migrate(template: Any, state_dict: Any, schema: int) -> Any:
    """``state_dict`` (a checkpoint's state, written under ``schema``) with the field names
    of ``template``'s class today (its :func:`renamed_fields`). A state dict already of
    ``SCHEMA`` is returned as it is; one of a later schema cannot be read."""
    if schema > SCHEMA:
        raise ValueError(f"written by a newer jaxfednas (state schema {schema} > {SCHEMA})")
    renamed = getattr(type(template), "RENAMED", {})
    if schema == SCHEMA or not renamed or not isinstance(state_dict, dict):
        return state_dict
    out = dict(state_dict)
    for old, new in renamed.items():
        if old not in out:
            continue
        field, *key = new.split(".")
        if key:
            out[field] = {**out.get(field, {}), key[0]: out.pop(old)}
        else:
            out[field] = out.pop(old)
    return out


def _fit(template: Any, state_dict: Any) -> Any:
    """``state_dict`` restored into ``template``'s structure, NumPy leaves of its shapes and
    dtypes; ValueError when it does not fit."""
    try:
        state = flax.serialization.from_state_dict(template, state_dict)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"its state does not fit this algorithm's ({type(e).__name__}: {e})") from None
    for a, b in zip(jax.tree.leaves(template), jax.tree.leaves(state)):
        if np.shape(a) != np.shape(b) or np.dtype(a.dtype) != np.asarray(b).dtype:
            raise ValueError(f"a leaf {np.shape(b)}/{np.asarray(b).dtype} does not match the state's "
                             f"{np.shape(a)}/{np.dtype(a.dtype)}")
    return jax.tree.map(np.asarray, state)
