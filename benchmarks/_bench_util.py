"""Small helpers shared by the benchmark scripts (timing, machine facts, RESULTS.md)."""
from __future__ import annotations

import datetime
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "RESULTS.md"


def ensure_repo_on_path() -> None:
    """Make ``jaxfednas`` and ``algorithms`` importable without ``PYTHONPATH=.``."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def peak_rss_mib() -> float:
    """High-water resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds for ``fn()`` with its result blocked on, and the result."""
    import jax

    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def machine_info() -> dict[str, Any]:
    import jax

    d = jax.devices()
    return {
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": d[0].device_kind,
        "device_count": len(d),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"{info['cpu_count']} CPU cores ({info['machine']}), jax {info['jax']} on {info['backend']} "
        f"({info['device_kind']}), python {info['python']}"
    )


def command_line(script: str) -> str:
    """The command that produced this run, as a user would type it from the repo root."""
    return "PYTHONPATH=. python " + shlex.join([f"benchmarks/{script}", *sys.argv[1:]])


def load_line() -> str:
    try:
        a, b, c = os.getloadavg()
        return f"{a:.2f} {b:.2f} {c:.2f}"
    except OSError:
        return "n/a"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def append_results(title: str, command: str, info: dict[str, Any], body: str, path: Path = RESULTS) -> None:
    """Append one section (heading = the exact command) to ``RESULTS.md``."""
    today = datetime.date.today().isoformat()
    section = [
        f"## `{command}`",
        "",
        f"**{title}**",
        "",
        f"Machine: {machine_line(info)}; measured {today}.",
        "",
        body.rstrip(),
        "",
        "",
    ]
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a") as f:
        if new:
            f.write(
                "# Benchmark results\n\n"
                "Sections are appended by the scripts in this folder (see README.md). Absolute\n"
                "times are noisy on a shared machine; the ratios are measured within one run.\n\n"
            )
        f.write("\n".join(section))
