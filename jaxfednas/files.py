"""Every file the library writes goes through here: atomic writes, figures and folders,
with a failed write turned into one :class:`WriteError` line naming the path, the cause
and what to do about it (never an ``OSError`` traceback).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text(d / "a" / "b.txt", "hello")
>>> (d / "a" / "b.txt").read_text()
'hello'
>>> try:
...     write_text(d / "a", "a folder is in the way")
... except WriteError as e:
...     print(e.reason)
is a directory
"""
from __future__ import annotations

import errno
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

# errno -> (the cause in a few words, the advice); the advice names no flag so that the
# caller can add its own (--out, --json, --resume)
_CAUSES = {
    errno.EACCES: ("permission denied", "choose a location you can write to or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a location you can write to or fix its permissions"),
    errno.ENOSPC: ("no space left on the device", "free space on that device"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota"),
    errno.EROFS: ("read-only file system", "choose a location on a writable file system"),
    errno.EISDIR: ("is a directory", "give the path of a file, not of a directory"),
    errno.ENOTDIR: ("a file is in the way of a directory", "choose another path or remove the file"),
    errno.EEXIST: ("a file is in the way of a directory", "choose another path or remove the file"),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
}


class WriteError(RuntimeError):
    """Writing ``path`` failed; ``str(e)`` is one line with the cause and advice.

    ``reason`` is the cause in words (``"permission denied"``, ``"no space left on the
    device"``), ``advice`` what to do, ``errno`` the OS error number (None if unknown)."""

    def __init__(self, path: os.PathLike | str, reason: str, advice: str, err: int | None = None,
                 what: str = ""):
        self.path, self.reason, self.advice, self.errno = Path(path), reason, advice, err
        where = f"{what} {path}" if what else str(path)
        super().__init__(f"could not write {where}: {reason}; {advice}")


def write_error(path: os.PathLike | str, e: OSError | WriteError, what: str = "") -> WriteError:
    """The :class:`WriteError` for ``e`` raised while writing ``path`` (``e`` itself if it
    already is one)."""
    if isinstance(e, WriteError):
        return e
    reason, advice = _CAUSES.get(e.errno, (e.strerror or type(e).__name__, "check the path and try again"))
    if e.filename is not None and os.fspath(e.filename) != os.fspath(path) and e.errno in (errno.ENOTDIR, errno.EEXIST):
        reason = f"{reason} ({e.filename})"
    return WriteError(path, reason, advice, e.errno, what)


def make_dirs(path: os.PathLike | str) -> Path:
    """``mkdir -p path``; a :class:`WriteError` when it cannot be a directory."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (mkdir -p over a file: EEXIST)
        raise write_error(path, e) from None
    return path


def write_bytes(path: os.PathLike | str, data: bytes, *, before_replace: Callable[[], None] | None = None) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, call
    ``before_replace()`` (if given) and rename the file over ``path``: a reader sees the
    old file or the new one, never half of one. Failures are :class:`WriteError`\\ s."""
    path = Path(path)
    if path.is_dir():
        raise write_error(path, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    make_dirs(path.parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.fchmod(fd, new_file_mode())  # mkstemp's 0600 would hide a shared results folder from the group
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise write_error(path, e) from None
    except BaseException:
        _remove(tmp)
        raise


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file: ``0o666`` less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _remove(tmp: str | None) -> None:
    if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)


def write_text(path: os.PathLike | str, text: str) -> None:
    """:func:`write_bytes` of UTF-8 ``text``."""
    write_bytes(path, text.encode())


def save_figure(fig, path: os.PathLike | str, **savefig_kwargs) -> None:
    """Render a matplotlib figure to PNG bytes (no timestamp in its metadata) and write
    them with :func:`write_bytes`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None}, **savefig_kwargs)
    write_bytes(path, buf.getvalue())
