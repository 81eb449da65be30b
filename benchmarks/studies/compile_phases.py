"""Where the XLA:CPU compile of FedNAS's paper-size round goes, and what some XLA options buy.

One FedNAS round (``fednas(...).round``, the public API) of ``--clients`` synthetic 32x32x3
IID clients at config (b) of ``benchmarks/fednas_search.py`` (C=16, 8 cells, batch 64, E=1,
``--steps`` local steps per client), lowered and compiled ahead of time in a fresh process
per measurement, with XLA's own timers logged (``TF_CPP_VMODULE``: ``cpu_compiler``,
``hlo_pass_pipeline``, ``thunk_emitter``). The variants run alternately, ``--repeats`` times
each, so machine load hits them alike:

* ``default`` -- what jaxfednas compiled with when the study was run (since then FedNAS'
  round keeps the calls itself where its cells run grouped, so ``default`` is
  ``no-call-inliner`` today; ``JAXFEDNAS_CPU_KEEP_CALLS=0`` in front of the command gives
  the earlier default);
* ``no-call-inliner`` -- ``XLA_FLAGS=--xla_disable_hlo_passes=call-inliner``: XLA keeps the
  calls of the nested ``jax.jit`` s (the grouped DARTS cell, ``search_spaces/darts/wide.py``)
  instead of inlining them;
* ``O1`` -- ``JAXFEDNAS_CPU_OPT_LEVEL=1`` (LLVM -O1 instead of jaxfednas' -O2).

Phases of the round's XLA compile, from the log: ``HLO passes`` (XLA's timer "Running HLO
passes"), ``backend`` (XLA's timer "Compiling ... using JIT": scheduling, buffer
assignment, kernel emission and LLVM), split by log timestamps into ``schedule + buffers``
(to the first kernel emitted), ``kernel emission`` (to the last LLVM verifier run) and
``LLVM codegen`` (to "Compilation finished"); ``rest`` = XLA's wall time minus the two timers
(StableHLO -> HLO conversion and the like). Trace + lower is JAX (Python). Also the HLO
passes that took longest (summed over their runs, the default variant's first measurement).

    PYTHONPATH=. python benchmarks/studies/compile_phases.py              # ~8 min
    PYTHONPATH=. python benchmarks/studies/compile_phases.py --variants default --repeats 1 --no-write

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
from _bench_util import (REPO_ROOT, RESULTS, check_choices, command_line, ensure_repo_on_path, load_line, machine_info,
                         markdown_table, median, write_results)

VARIANTS = {"default": {}, "no-call-inliner": {"XLA_FLAGS": "--xla_disable_hlo_passes=call-inliner"},
            "O1": {"JAXFEDNAS_CPU_OPT_LEVEL": "1"}}
VMODULE = "cpu_compiler=1,hlo_pass_pipeline=1,thunk_emitter=1"
MODULE = "jit_round_fn"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {tuple(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=2, help="fresh-process compiles per variant (alternated)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="local steps per client (batch 64 each)")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_choices(p, args.variants, tuple(VARIANTS), "variant(s)")
    if args.repeats < 1 or args.clients < 1 or args.steps < 1:
        p.error("--repeats, --clients and --steps must be >= 1")
    return args


def worker(args) -> dict:
    ensure_repo_on_path()
    from jaxfednas.algorithms.fednas import FedNASConfig, fednas
    from jaxfednas.run_options import RunOptions
    from jaxfednas.data import make_federated_data, partition
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import make_config
    from jaxfednas.rng import init_key, round_key

    K, B = args.clients, 64
    ecfg = make_config("fednas", overrides={"data.dataset": "synthetic", "data.num_clients": K,
                                            "data.partition": "iid", "data.split": (0.5, 0.5, 0.0)})
    ds = load_dataset("synthetic", seed=0, num_train=K * 2 * args.steps * B, image_shape=(32, 32, 3))
    data = make_federated_data(ds, partition.manifest_splits(make_partition(ecfg, ds)))
    algo = fednas(FedNASConfig(C=16, layers=8, batch_size=B, local_epochs=1), data.info, run=RunOptions(clients_per_round=K))
    state = algo.init(init_key(0))
    t0 = time.perf_counter()
    lowered = algo.round.lower(state, data, round_key(0, 0))
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"trace_lower_s": t1 - t0, "xla_s": t2 - t1, "load": load_line()}


def _seconds(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]


def _stamp(line: str) -> float | None:
    m = re.match(r"[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
    return None if m is None else int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))


def phases(log: str) -> dict:
    """XLA's timers and log timestamps of the round's compile (see the module docstring)."""
    out: dict = {"passes": collections.Counter()}
    lines, on = log.splitlines(), False
    first_emit = last_verify = start = finished = None
    for line in lines:
        if f"module {MODULE}" in line or f"[{MODULE}]" in line or f"Compiling: {MODULE}" in line:
            on = True
        if not on:
            continue
        m = re.search(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s|min) \(", line)
        if m:
            out["passes"][m.group(1)] += _seconds(m.group(2), m.group(3))
        m = re.search(rf"Running HLO passes on \[{MODULE}\] for CPU time: ([\d.]+) (us|ms|s|min) ", line)
        if m:
            out["hlo_passes_s"] = _seconds(*m.groups())
        m = re.search(rf"Compiling \[{MODULE}\] for CPU using JIT time: ([\d.]+) (us|ms|s|min) ", line)
        if m:
            out["backend_s"] = _seconds(*m.groups())
        if f"Compiling: {MODULE}" in line:
            start = _stamp(line)
        elif "thunk_emitter" in line and first_emit is None and start is not None:
            first_emit = _stamp(line)
        elif "LLVM verifier" in line and start is not None:
            last_verify = _stamp(line)
        elif "Compilation finished" in line and start is not None and finished is None:
            finished = _stamp(line)
    if None not in (start, first_emit, last_verify, finished):
        wrap = lambda d: d + 86400 if d < 0 else d  # noqa: E731  (a compile across midnight)
        out.update(schedule_s=wrap(first_emit - start), emit_s=wrap(last_verify - first_emit),
                   llvm_s=wrap(finished - last_verify))
    out["passes"] = dict(out["passes"])
    return out


def spawn(variant: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, **VARIANTS[variant], "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": VMODULE,
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", "--json-out", out]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise RuntimeError(f"{variant} worker failed:\n{proc.stdout[-3000:]}")
        with open(out) as f:
            res = json.load(f)
    res.update(phases(proc.stdout), variant=variant)
    return res


def report(args, runs: list[dict]) -> str:
    cols = [("trace_lower_s", "trace + lower"), ("xla_s", "XLA compile"), ("hlo_passes_s", "HLO passes"),
            ("backend_s", "backend"), ("schedule_s", "schedule + buffers"), ("emit_s", "kernel emission"),
            ("llvm_s", "LLVM codegen")]
    rows = []
    for v in args.variants.split(","):
        mine = [r for r in runs if r["variant"] == v]
        med = {k: median([r[k] for r in mine if k in r]) if any(k in r for r in mine) else None for k, _ in cols}
        rest = med["xla_s"] - (med["hlo_passes_s"] or 0) - (med["backend_s"] or 0)
        total = med["trace_lower_s"] + med["xla_s"]
        rows.append([v, len(mine), *(f"{med[k]:.1f}" if med[k] is not None else "-" for k, _ in cols),
                     f"{rest:.1f}", f"{total:.1f}", ", ".join(f"{r['trace_lower_s'] + r['xla_s']:.1f}" for r in mine)])
    table = markdown_table(["variant", "runs", *(f"{name} s" for _, name in cols), "rest s", "total s (median)",
                            "total s (each run)"], rows)
    first = next(r for r in runs if r["variant"] == args.variants.split(",")[0])
    top = sorted(first["passes"].items(), key=lambda kv: -kv[1])[:12]
    passes = markdown_table(["HLO pass (or pipeline)", "s (summed over its runs)"], [[k, f"{s:.2f}"] for k, s in top])
    loads = "; ".join(f"{r['variant']} {r['load']}" for r in runs)
    return "\n\n".join([
        f"FedNAS round (`fednas(...).round`), {args.clients} synthetic 32x32x3 clients x {args.steps} local steps, "
        f"C=16, 8 cells, batch 64; AOT lower + compile in a fresh process per run, variants alternated, "
        f"medians over {args.repeats} run(s) each. Phases from XLA's own log (see the script's docstring); the "
        "VLOG logging itself adds about a second.", table,
        f"Longest HLO passes, `{first['variant']}` (pipelines include their passes):", passes,
        f"Load average (1/5/15 min) when each compile ended: {loads}."])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        with open(args.json_out, "w") as f:
            json.dump(worker(args), f)
        return
    runs = []
    for i in range(args.repeats):
        for v in args.variants.split(","):
            print(f"[compile_phases] {v} run {i + 1} ({datetime.datetime.now():%H:%M:%S}) ...", flush=True)
            r = spawn(v, argv)
            print(f"  trace + lower {r['trace_lower_s']:.1f} s, XLA {r['xla_s']:.1f} s "
                  f"(HLO passes {r.get('hlo_passes_s', float('nan')):.1f}, backend {r.get('backend_s', float('nan')):.1f})",
                  flush=True)
            runs.append(r)
    body = report(args, runs)
    print(body)
    if not args.no_write:
        info = machine_info()
        where = write_results("Compile phases of FedNAS's 8-cell round on XLA:CPU", command_line("studies/compile_phases.py"),
                              info, body)
        print(f"{where} {RESULTS}")


if __name__ == "__main__":
    main()
