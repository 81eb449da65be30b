"""The process around a run: the compilation cache, SIGTERM, one-line errors for faults of
the machine, and the exit status of the command line and the example scripts."""
from __future__ import annotations

import errno
import os
from typing import Any
from collections.abc import Callable

import jax

from jaxfednas.config import ConfigError
from jaxfednas.experiment import NonFiniteError
from jaxfednas.files import WriteError
from jaxfednas.rundir import RunDirectoryError


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for runs from the CLI and examples.

    A DARTS supernet takes tens of seconds to compile on a CPU; with the cache a
    repeated or resumed run reuses the executables. ``path`` defaults to
    ``$JAXFEDNAS_CACHE`` or ``~/.cache/jaxfednas/xla``; ``JAXFEDNAS_CACHE=off``
    disables it. Returns the directory in use (None when disabled). Results do
    not depend on it: a cached executable is the one XLA would compile.
    """
    path = os.environ.get("JAXFEDNAS_CACHE") if path is None else os.fspath(path)
    if path is not None and path.lower() in ("off", "0", "none", ""):
        return None
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "jaxfednas", "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler's stop), handled as Ctrl-C is: the last completed
    round is checkpointed and the run says how to resume."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (the CLI and the example
    scripts call this; a library caller keeps its own handlers)."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    def handler(signum, frame):
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def out_of_memory(e: BaseException) -> str | None:
    """The one-line error for XLA's out-of-memory (``RESOURCE_EXHAUSTED``, e.g. a batch or a
    number of clients in flight that does not fit), or None for any other exception."""
    if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or "RESOURCE_EXHAUSTED" not in str(e):
        return None
    first = str(e).strip().splitlines()[0]
    return (f"the device ran out of memory ({first}); lower algo.batch_size or run.clients_per_round, or set "
            "run.placement=map (one client at a time); `jaxfednas plan ALGO` estimates a configuration's memory")


_OS_ADVICE = {
    errno.ENAMETOOLONG: "a shorter --out (or run name)",
    errno.EACCES: "a directory you may write (--out)",
    errno.EPERM: "a directory you may write (--out)",
    errno.EROFS: "a writable file system for --out",
    errno.ENOSPC: "free space on its disk, or another --out",
    errno.EDQUOT: "free space within your quota, or another --out",
}


def environment_error(e: BaseException) -> str | None:
    """The one-line error for a fault of the machine rather than of the program: XLA's
    out-of-memory (:func:`out_of_memory`) or an ``OSError`` about a named file that the user
    can act on (a name too long, no permission, a read-only or full disk); None for any
    other exception, which propagates with its traceback."""
    oom = out_of_memory(e)
    if oom is not None:
        return oom
    if isinstance(e, OSError) and e.errno in _OS_ADVICE and e.filename is not None:
        name = str(e.filename)
        shown = name if len(name) <= 100 else f"{name[:60]}...{name[-30:]} ({len(name)} characters)"
        return f"{shown}: {e.strerror}; use {_OS_ADVICE[e.errno]}"
    return None


INTERRUPTED_CODES = (130, 143)
"""Exit statuses after Ctrl-C (130) and SIGTERM (143)."""


def exit_process(code: int) -> None:
    """End the process with ``code`` (a script's ``__main__`` calls this with what
    :func:`run_script` or ``jaxfednas.cli.main`` returned). After Ctrl-C or SIGTERM (130,
    143) the interpreter's own shutdown is skipped (the standard streams are flushed, then
    ``os._exit``): a signal that arrives while XLA is compiling leaves its compiler threads
    running, and finalizing the interpreter under them ended in a segmentation fault (exit
    139) after the run had said how to resume. Every file of a run is written atomically and
    closed by then, and the run directory's lock goes with the process."""
    import sys  # noqa: PLC0415

    if code in INTERRUPTED_CODES:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


def run_script(script: str, job: Callable[[], Any]) -> int:
    """Exit status of an example script's ``job()`` (with the compilation cache on): 0 when
    it finishes; 2 and a one-line error for bad input (configuration, missing data, an
    existing or unusable run directory, a failed write, a NaN loss); 130 on Ctrl-C and 143 on
    SIGTERM, with the command that resumes."""
    import sys  # noqa: PLC0415

    from jaxfednas.data.datasets import DatasetUnavailableError  # noqa: PLC0415

    enable_compilation_cache()
    stop_on_sigterm()
    try:
        job()
    except (ConfigError, DatasetUnavailableError, FileNotFoundError, RunDirectoryError, NonFiniteError,
            WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - out of memory or a file-system fault is one line; the rest propagates
        message = environment_error(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        args = " ".join(a for a in sys.argv[1:] if a != "--resume")
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"\n{how}; continue with: python {script} {args} --resume", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    return 0
