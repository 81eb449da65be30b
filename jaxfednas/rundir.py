"""The run directory: where a run may be written, the lock held while it is, and its
``config.json`` read back.

A run directory's layout is described in :mod:`jaxfednas.experiment`.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from collections.abc import Callable

from jaxfednas.checkpoint import checkpoint_files, CheckpointError
from jaxfednas.config import ConfigError
from jaxfednas.files import make_dirs, write_error, WriteError
from jaxfednas.registry import config_from_dict

CHECKPOINT = "checkpoint.msgpack"


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used: ``--out`` names a file (or lies under one), or
    writing into it failed (a full disk, no permission). The message names the path and,
    for a failed checkpoint, the last good one and ``--resume``."""


class PartitionChangedError(RunDirectoryError, ValueError):
    """The partition recomputed now from a run's configuration is not the one its
    ``partition/manifest.json`` records (the dataset, or the code that partitions it,
    changed since): the run cannot continue on other clients' data."""


class RunExistsError(RunDirectoryError):
    """``out_dir`` already holds a run and ``resume`` was not requested."""


def _exists(path: Path) -> bool:
    """``path.exists()`` as before Python 3.14: False where nothing is there, and an
    ``OSError`` the user can act on (a name too long, no permission) raised, not taken for
    "missing" (3.14's ``Path.exists`` returns False for every OS error)."""
    try:
        path.stat()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return False
        raise
    return True


def check_run_directory(out: Path) -> None:
    """Fail with one line when ``out`` cannot be a directory: it, or a folder above it,
    exists and is not a directory."""
    for p in (out, *out.parents):
        if _exists(p):
            if not p.is_dir():
                what = "is a file" if p == out else f"lies under {p}, which is a file"
                raise RunDirectoryError(f"--out {out} {what}, not a directory: choose another --out")
            return


RUN_LOCK = ".lock"
"""Name of the lock file in a run directory, ``flock``-ed by the process writing the run
(process 0 of a multi-process run) for the whole run; the kernel releases it when that
process ends, however it ends. It holds the holder's PID, host and start time."""


class RunInUseError(RunDirectoryError):
    """Another process is writing the run directory (it holds :data:`RUN_LOCK`)."""


class _RunLock:
    """An exclusive ``fcntl.flock`` on ``out/.lock`` (no-op where fcntl does not exist)."""

    def __init__(self, out: Path, log: Callable[[str], None]):
        self.path, self.log, self.file = out / RUN_LOCK, log, None

    def acquire(self) -> None:
        try:
            import fcntl  # noqa: PLC0415
        except ImportError:  # (Windows) no lock; runs are deterministic, so a clash loses no results
            return
        make_dirs(self.path.parent)
        try:
            f = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        except OSError as e:
            raise write_error(self.path, e, "the run's lock file") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not yet written its PID"
            f.close()
            raise RunInUseError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end "
                                "or choose another --out") from None
        except OSError as e:  # a file system without locks: go on, saying so
            self.log(f"warning: could not lock {self.path} ({e.strerror}); nothing stops a second process "
                     "from writing this run directory")
        f.seek(0)
        f.truncate()
        f.write(f"PID {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # (closing the last descriptor releases the flock)
            self.file = None


# errors process 0 may raise while reading the run directory, re-raised as such by the others
_ERRORS = (CheckpointError, RunInUseError, RunDirectoryError, WriteError, ConfigError, FileNotFoundError, ValueError)


def holds_run(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` already holds a run (its ``config.json`` or a checkpoint)."""
    return (Path(out_dir) / "config.json").exists() or bool(checkpoint_files(Path(out_dir) / CHECKPOINT))


def _refuse_non_file(path: Path) -> None:
    """A one-line :class:`RunDirectoryError` where something other than a file (a directory)
    sits at ``path``, a name at which a run keeps a file."""
    if path.exists() and not path.is_file():
        raise RunDirectoryError(f"--resume: {path} is not a file (a run keeps a file of that name there): it was "
                                "not written by a run; move it away or start afresh in another --out")


def _read_config_json(cfg_path: Path) -> dict:
    """A run directory's ``config.json`` as a dict, or a one-line :class:`RunDirectoryError`
    when it is not one a run wrote (not a file, not JSON, not a configuration)."""
    _refuse_non_file(cfg_path)
    try:
        raw = json.loads(cfg_path.read_text())
        if not isinstance(raw, dict) or not raw:
            raise ValueError("an empty or non-object JSON value")
        config_from_dict(raw)
    except OSError as e:
        raise RunDirectoryError(f"--resume: cannot read {cfg_path}: {e.strerror or e}") from None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # (JSONDecodeError: a ValueError)
        what = str(e).splitlines()[0] if str(e) and not isinstance(e, RecursionError) else type(e).__name__
        raise RunDirectoryError(f"--resume: {cfg_path} is not a run's configuration ({what}); it was not written "
                                "by a run: start afresh in another --out") from None
    return raw


def read_json(path: str | os.PathLike, kind: type, advice: str):
    """The JSON value of ``path``, a file a run or an example wrote, of type ``kind`` (``dict``,
    ``list``); a one-line :class:`RunDirectoryError` naming the file and ``advice`` (what to do)
    when it cannot be read, is not JSON, is nested too deep or holds another type."""
    path = Path(path)
    _refuse_non_file(path)
    try:
        value = json.loads(path.read_text())
    except OSError as e:
        raise RunDirectoryError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        what = "nested too deep" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise RunDirectoryError(f"{path} is damaged ({what}): {advice}") from None
    if not isinstance(value, kind):
        raise RunDirectoryError(f"{path} holds a JSON {type(value).__name__}, not the {kind.__name__} written there: "
                                f"{advice}")
    return value
