"""Small helpers shared by the benchmark scripts (timing, machine facts, RESULTS.md)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "RESULTS.md"
QUICK_RESULTS = Path(tempfile.gettempdir()) / "jaxfednas-bench-quick.md"
QUICK_HELP = ("the smallest configuration that runs every code path of this benchmark in seconds "
              f"(what CI runs: benchmarks/quick.sh); its results go to --out, by default {QUICK_RESULTS}, "
              "never to RESULTS.md")


def ensure_repo_on_path() -> None:
    """Make ``jaxfednas`` and ``algorithms`` importable without ``PYTHONPATH=.``."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def ensure_package_importable() -> None:
    """Make ``jaxfednas.algorithms`` and ``jaxfednas.search_spaces`` importable from a source
    checkout that was never installed (e.g. a bare GPU machine): the repository's top-level
    ``algorithms/`` and ``search_spaces/`` folders install inside the ``jaxfednas`` package,
    so the package's search path gains the repository root when they are not found."""
    ensure_repo_on_path()
    import jaxfednas

    try:
        import jaxfednas.algorithms  # noqa: F401
    except ImportError:
        jaxfednas.__path__.append(str(REPO_ROOT))


def add_output_args(p: Any, quick_help: str = "") -> None:
    """``--quick`` (``quick_help`` says what it shrinks) and ``--out FILE`` (where the results
    section is written: :func:`results_path`) on an ``argparse`` parser."""
    p.add_argument("--quick", action="store_true", help=(quick_help + "; " if quick_help else "") + QUICK_HELP)
    p.add_argument("--out", default=None, metavar="FILE",
                   help=f"results file (default {RESULTS.relative_to(REPO_ROOT)}; with --quick {QUICK_RESULTS})")


def add_torch_python_arg(p: Any) -> None:
    """``--torch-python PYTHON``: the interpreter that runs a benchmark's PyTorch worker."""
    p.add_argument("--torch-python", metavar="PYTHON", default=None,
                   help="Python whose environment has torch, for the PyTorch baseline (default: this one). The "
                   "PyTorch worker imports no jax, so another Python version works, e.g. one for which a CPU "
                   "build of torch exists")


def torch_python(p: Any, args: Any) -> str | None:
    """The interpreter for the PyTorch worker: ``--torch-python`` (``p.error`` where it cannot
    import torch), else this one where it can, else None (the PyTorch rows are skipped)."""
    import subprocess

    exe = args.torch_python or sys.executable
    try:
        proc = subprocess.run([exe, "-c", "import torch"], capture_output=True, text=True)
    except OSError as e:
        proc = None
        why = str(e)
    if proc is not None and proc.returncode == 0:
        return exe
    if args.torch_python:
        if proc is not None:
            why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        p.error(f"--torch-python {args.torch_python} cannot import torch ({why})")
    return None


def check_choices(p: Any, value: str, choices: Sequence[str], what: str) -> list[str]:
    """``value`` split on commas; ``p.error`` names the entries not in ``choices``."""
    items = value.split(",")
    bad = [v for v in items if v not in choices]
    if bad:
        p.error(f"unknown {what} {bad}; choose from {tuple(choices)}")
    return items


def parse_with_quick(p: Any, argv: Sequence[str] | None, quick_defaults: dict[str, Any]) -> Any:
    """``p.parse_args(argv)``; under ``--quick`` the defaults become ``quick_defaults`` (flags given
    on the command line still win)."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick_defaults)
        args = p.parse_args(argv)
    return args


def results_path(args: Any) -> Path:
    """Where a run writes its section: ``--out``, else :data:`QUICK_RESULTS` under ``--quick``,
    else :data:`RESULTS` (the recorded measurements)."""
    if getattr(args, "out", None):
        return Path(args.out)
    return QUICK_RESULTS if getattr(args, "quick", False) else RESULTS


def serve_worker(args: Any, run: Callable[[Any], dict]) -> bool:
    """The ``--worker`` side of a benchmark that runs each configuration in its own
    subprocess: when ``args.worker`` is set, ``run(args)``'s result goes to
    ``args.json_out`` as JSON and this returns True (the caller returns); else False."""
    if not args.worker:
        return False
    res = run(args)
    with open(args.json_out, "w") as f:
        json.dump(res, f)
    return True


def peak_rss_mib() -> float:
    """High-water resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _status_kib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def rss_mib() -> float:
    """This process's resident set size now (Linux /proc)."""
    return _status_kib("VmRSS") / 1024.0


def hwm_mib() -> float:
    """This process's peak resident set size since start or the last :func:`reset_hwm`."""
    return _status_kib("VmHWM") / 1024.0


def reset_hwm() -> bool:
    """Reset this process's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds for ``fn()`` with its result blocked on, and the result."""
    import jax

    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def compiled_flops(fn: Callable, *args) -> float | None:
    """XLA's cost-analysis FLOP count of ``jax.jit(fn)(*args)`` (None where the backend
    gives none). A ``while`` body counts once, so pass a loop-free program (e.g. a
    network's forward)."""
    import jax

    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def matmul_gflops(n: int | None = None, repeats: int = 5) -> float:
    """The device's dense float32 matmul rate, GFLOP/s (best of ``repeats`` ``n x n`` products;
    ``n`` 2048 on CPU, 8192 on accelerators): the attainable peak that achieved FLOP/s are
    compared with, measured in the same process rather than taken from a data sheet."""
    import jax
    import jax.numpy as jnp

    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    best = min(timed(lambda: f(a))[0] for _ in range(repeats))
    return 2.0 * n ** 3 / best / 1e9


def device_peak_mib() -> float | None:
    """Peak bytes in use on the first device (accelerators), MiB; None on CPU (use the
    process RSS there)."""
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats["peak_bytes_in_use"] / 2 ** 20 if stats and "peak_bytes_in_use" in stats else None


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
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"{info['cpu_count']} CPU cores ({info['machine']}), jax {info['jax']} on {info['backend']} "
        f"({info['device_kind']}), python {info['python']}"
        + (f", XLA_FLAGS={info['xla_flags']}" if info.get("xla_flags") else "")
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


HEADER = (
    "# Benchmark results\n\n"
    "Sections are written by the scripts in this folder (see README.md). Absolute\n"
    "times are noisy on a shared machine; the ratios are measured within one run.\n\n"
)


def split_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``(preamble, [(heading line, full section text), ...])`` of a markdown file split at ``## `` lines."""
    preamble, sections, cur = [], [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            cur = [line]
            sections.append(cur)
        elif cur is None:
            preamble.append(line)
        else:
            cur.append(line)
    return "".join(preamble), [(sec[0].rstrip("\n"), "".join(sec)) for sec in sections]


def _join(preamble: str, sections: Sequence[str]) -> str:
    parts = [preamble] + [s if s.endswith("\n\n") else s.rstrip("\n") + "\n\n" for s in sections]
    return "".join(parts)


def write_results(title: str, command: str, info: dict[str, Any], body: str, path: Path = RESULTS) -> str:
    """Write one section (heading = the exact command) to ``RESULTS.md``.

    A section with the same heading is replaced in place (a re-run updates its
    numbers); otherwise the section is appended. Every other section is kept
    byte for byte. The file is re-read immediately before it is written, so
    sections appended by others while the benchmark ran survive.
    Returns ``"replaced in"`` or ``"appended to"``.
    """
    today = datetime.date.today().isoformat()
    heading = f"## `{command}`"
    section = "\n".join([
        heading, "", f"**{title}**", "", f"Machine: {machine_line(info)}; measured {today}.", "", body.rstrip(), "", "",
    ])
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        path.write_text(HEADER + section)
        return "appended to"
    preamble, sections = split_sections(text)
    if any(h == heading for h, _ in sections):
        path.write_text(_join(preamble, [section if h == heading else s for h, s in sections]))
        return "replaced in"
    with path.open("a") as f:
        f.write(("" if text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n") + section)
    return "appended to"


def publish(title: str, script: str, body: str, *, write: bool = True, path: Path = RESULTS) -> None:
    """Print a benchmark's report ``body`` and, unless ``write`` is false (``--no-write``),
    write it to ``path`` under the command that ran ``script`` (:func:`write_results`)."""
    print(body)
    if write:
        where = write_results(title, command_line(script), machine_info(), body, path)
        print(f"{where} {path}")


def remove_sections(commands: Sequence[str], path: Path = RESULTS) -> list[str]:
    """Drop the sections whose heading is exactly one of ``commands`` (stale results); returns those removed."""
    headings = {f"## `{c}`" for c in commands}
    preamble, sections = split_sections(path.read_text())
    removed = [h for h, _ in sections if h in headings]
    if removed:
        path.write_text(_join(preamble, [s for h, s in sections if h not in headings]))
    return removed


def run_worker(cmd: list[str], env: dict, label: dict) -> dict:
    """Run ``cmd + ["--json-out", FILE]`` (a benchmark's worker in a fresh process) and return
    the JSON it wrote with ``wall_s`` added; where it fails, its output's tail goes to stderr
    and the result is ``{**label, "error": "worker exited N", "wall_s": ...}``."""
    import subprocess
    import time

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        proc = subprocess.run([*cmd, "--json-out", out], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            return {**label, "error": f"worker exited {proc.returncode}", "wall_s": wall}
        with open(out) as f:
            res = json.load(f)
        res["wall_s"] = wall
        return res
