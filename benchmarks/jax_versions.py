"""The FedNAS local-search step on several installs side by side: one interpreter per
jax version, against the same-run PyTorch baseline, on this CPU.

Which jax a fresh ``pip install -e .`` gets depends on the Python (3.11 resolves jax 0.10.x,
3.12 and newer 0.12.x; pyproject.toml), and the XLA:CPU of each version runs the same
program at a different speed. This script runs ``benchmarks/fednas_search.py``'s step
workers (one fresh process each: AOT compile, a warm-up run, then ``--repeats`` timed
runs of a ``--steps``-step scan; the median s/step) under every ``--python`` given, and
its PyTorch worker (``benchmarks/torch_darts.py``, the authors' MiLeNAS step, 2 threads)
under ``--torch-python``, twice: first and last, so that a drift of the machine over the run
shows as a difference between the two (the ratio uses their mean).

Rows: the configs of fednas_search.py, (a) C=8, 5 cells, batch 32 and (b) C=16, 8 cells,
batch 64 (the FedNAS paper's cell); the JAX step is the library's default (Eq. 4, both
gradients at one point; config (a) also in the authors' order, ``alpha_first``).

    PYTHONPATH=. python benchmarks/jax_versions.py \\
        --python .venv/bin/python --python .venv-newest/bin/python --torch-python .venv/bin/python
    PYTHONPATH=. python benchmarks/jax_versions.py --quick   # this interpreter only, config q, in seconds

A ``--python`` may start with ``NAME=VALUE`` settings for that interpreter's workers, e.g.
``--python "XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= .venv/bin/python"`` (an XLA
flag on one install only); its row names them.

Each interpreter needs jaxfednas installed (``pip install -e .``); the torch one needs torch
(``pip install torch``). Results go to benchmarks/RESULTS.md (``--out`` elsewhere).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import _bench_util as bu
from fednas_search import worker_env

SEARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fednas_search.py")
CONFIG_LABEL = {"a": "(a) C=8, 5 cells, B=32", "b": "(b) C=16, 8 cells, B=64 (paper)", "q": "(q) C=4, 1 cell, B=8"}
QUICK = {"configs": "q", "steps": 1, "repeats": 1, "b_steps": 1, "b_repeats": 1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", action="append", default=[], metavar="[NAME=VALUE ...] PATH",
                   help="an interpreter with jaxfednas installed, optionally after environment settings for "
                        "its workers (repeatable; default: this one)")
    bu.add_torch_python_arg(p)
    p.add_argument("--configs", default="a,b", help="comma list of a, b (fednas_search.py's configs)")
    p.add_argument("--steps", type=int, default=3, help="MiLeNAS steps per timed run (one scan)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (median reported)")
    p.add_argument("--b-steps", type=int, default=2, help="--steps for config b")
    p.add_argument("--b-repeats", type=int, default=1, help="--repeats for config b")
    p.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    bu.add_output_args(p, "this interpreter only, config q (C=4, 1 cell of 1 node, B=8), 1 step x 1 run")
    args = bu.parse_with_quick(p, argv, QUICK)
    for c in args.configs.split(","):
        if c not in CONFIG_LABEL:
            p.error(f"unknown config {c!r}; choose from {sorted(CONFIG_LABEL)}")
    for py in args.python:
        path = interpreter(py)[1]
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            p.error(f"{path} is not an executable interpreter")
    if not args.python:
        args.python = [sys.executable]
    args.torch_exe = bu.torch_python(p, args)  # None: the PyTorch rows are skipped
    return args


def interpreter(spec: str) -> tuple[dict, str]:
    """``"NAME=VALUE ... PATH"`` -> ``({NAME: VALUE}, PATH)``: a --python and its workers' settings."""
    words = shlex.split(spec)
    settings = dict(w.split("=", 1) for w in words[:-1] if "=" in w)
    if not words or len(settings) != len(words) - 1:
        raise SystemExit(f"jax_versions.py: --python {spec!r}: expected [NAME=VALUE ...] PATH")
    return settings, words[-1]


def worker(py: str, kind: str, args) -> dict:
    """One fednas_search.py worker ``kind`` in a fresh process of interpreter ``py`` (a --python)."""
    settings, py = interpreter(py)
    cmd = [py, SEARCH, "--configs", args.configs, "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--b-steps", str(args.b_steps), "--b-repeats", str(args.b_repeats), "--no-write", "--worker", kind]
    return bu.run_worker(cmd, {**worker_env(), **settings}, {"kind": kind})


def s_step(r: dict) -> float:
    return bu.median([t / r["steps"] for t in r["times"]])


def main(argv=None):
    args = parse_args(argv)
    configs = args.configs.split(",")
    torch_py = args.torch_exe
    with_torch = torch_py is not None
    jobs = []  # (label, interpreter, kind)
    for c in configs:
        if with_torch:
            jobs.append((f"torch-first:{c}", torch_py, f"torch:{c}"))
        for i, py in enumerate(args.python):
            jobs.append((f"jax{i}:{c}:simultaneous", py, f"jax:{c}:simultaneous"))
            if c == "a":
                jobs.append((f"jax{i}:{c}:alpha_first", py, f"jax:{c}:alpha_first"))
        if with_torch:
            jobs.append((f"torch-last:{c}", torch_py, f"torch:{c}"))
    t_start = time.perf_counter()
    res = {}
    for label, py, kind in jobs:
        print(f"[jax_versions] {label} ({py}) ...", flush=True)
        r = worker(py, kind, args)
        res[label] = r
        if "error" in r:
            print(f"  FAILED: {r['error']}", flush=True)
        else:
            print(f"  median {s_step(r):.2f} s/step, peak rss {r['peak_rss_mib']:.0f} MiB, "
                  f"worker wall {r['wall_s']:.0f} s", flush=True)
    wall = time.perf_counter() - t_start

    header = ["config", "install", "step", "s/step (median)", "compile s", "peak RSS GiB",
              "throughput vs PyTorch (same run)"]
    rows = []
    failed = False
    for c in configs:
        torch_runs = [res.get(f"torch-{w}:{c}") for w in ("first", "last")]
        torch_ok = [r for r in torch_runs if r is not None and "error" not in r]
        t_ref = sum(s_step(r) for r in torch_ok) / len(torch_ok) if len(torch_ok) == len(torch_runs) and torch_ok else None
        for i, _py in enumerate(args.python):
            for order in (("simultaneous", "alpha_first") if c == "a" else ("simultaneous",)):
                r = res.get(f"jax{i}:{c}:{order}")
                if r is None:
                    continue
                if "error" in r:
                    failed = True
                    rows.append([CONFIG_LABEL[c], f"interpreter {i + 1}", order, r["error"], "", "", ""])
                    continue
                m = r["machine"]
                flags = f", XLA_FLAGS=`{m['xla_flags']}`" if m.get("xla_flags") else ""
                rows.append([CONFIG_LABEL[c], f"Python {m['python']}, jax {m['jax']}{flags}",
                             "Eq. 4 (default)" if order == "simultaneous" else "alpha_first (authors' order)",
                             f"{s_step(r):.2f}", f"{r['lower_s'] + r['compile_s']:.0f}",
                             f"{r['peak_rss_mib'] / 1024:.2f}", f"{t_ref / s_step(r):.2f}x" if t_ref else "-"])
        for w, r in zip(("first", "last"), torch_runs):
            if r is None:
                continue
            if "error" in r:
                failed = True
                rows.append([CONFIG_LABEL[c], f"PyTorch ({w})", "authors' MiLeNAS step", r["error"], "", "", ""])
                continue
            rows.append([CONFIG_LABEL[c], f"PyTorch {r['torch']}, Python {r['python']} ({w} of the run)",
                         "authors' MiLeNAS step", f"{s_step(r):.2f}", "- (eager)", f"{r['peak_rss_mib'] / 1024:.2f}",
                         "1.00x (mean of both)"])
    caption = (
        "**The MiLeNAS step by install, against PyTorch in the same run** (one client, 32x32x3 synthetic inputs, 10 "
        "classes, the 8-op DARTS space; fednas_search.py's step workers, each in a fresh process of its "
        f"interpreter: AOT compile, a warm-up run, then timed runs of a scan of steps; config (a) {args.steps} steps x "
        f"{args.repeats} runs, (b) {args.b_steps} x {args.b_repeats}). PyTorch: torch_darts.py, 2 threads, run before "
        "and after the JAX rows of its config; throughput = the mean of its two s/step / the row's s/step. Every row "
        "ran on this machine in this run, one process at a time.")
    if not with_torch:
        caption += " This interpreter has no torch (and no --torch-python): the PyTorch rows are skipped."
    loads = "; ".join(f"{k} {r['load_start']} / {r['load_end']}" for k, r in res.items() if "error" not in r)
    body = "\n".join([caption, "", bu.markdown_table(header, rows), "",
                      f"Load average (1/5/15 min) at start / end of each worker: {loads}.", "",
                      f"Total wall time of this run: {wall / 60:.1f} min."])
    print()
    print(body)
    ok = [r for r in res.values() if "error" not in r and "machine" in r]
    if not args.no_write and ok:
        path = bu.results_path(args)
        how = bu.write_results("FedNAS step by jax version, against PyTorch in the same run",
                               bu.command_line("jax_versions.py"), ok[0]["machine"], body, path)
        print(f"\n{how} {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
