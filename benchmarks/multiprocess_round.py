"""Multi-process overhead: one run over P processes x D fake CPU devices each (loopback,
gloo collectives) vs one process with the same devices, through ``jaxfednas run``.

For each algorithm and layout ``PxD`` the CLI runs ``--rounds`` rounds into a fresh
directory (every process a subprocess, compilation cache off); the table reports
``summary.json``'s mean seconds of the rounds after the first (evaluation included,
``run.eval_every`` = 1), the first round (with compilation) and the wall time, each
layout's per-round ratio to the one-process layout of the same device count, and
whether ``metrics.jsonl`` and the checkpoint equal that layout's bytes.

    PYTHONPATH=. python benchmarks/multiprocess_round.py [--algos fedavg,fednas] [--layouts 1x2,2x1,1x4,2x2,4x1]
    PYTHONPATH=. python benchmarks/multiprocess_round.py --quick   # CI: FedAvg, 1x2 vs 2x1, 2 rounds
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench_util import add_output_args, command_line, machine_info, markdown_table, parse_with_quick, results_path
from _bench_util import write_results

ALGOS = {
    # digits, 8 Dirichlet(0.5) clients, E=1, B=32: the FedAvg CNN
    "fedavg": ["fedavg", "--clients", "8", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"],
    # the main job's search supernet (C=8, 5 cells, 4 nodes, 8 ops), E=1, B=32
    "fednas": ["fednas", "--clients", "8", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"],
}
QUICK = {"algos": "fedavg", "layouts": "1x2,2x1", "rounds": 2}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(args: list[str], out: Path, processes: int, devices: int, rounds: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAXFEDNAS_CACHE="off")
    cmd = [sys.executable, "-m", "jaxfednas.cli", "run", *args, "--rounds", str(rounds), "--out", str(out),
           "--no-progress"]
    if processes > 1:
        coord = f"127.0.0.1:{_port()}"
        cmds = [cmd + ["--coordinator", coord, "--num-processes", str(processes), "--process-id", str(i)]
                for i in range(processes)]
    else:
        cmds = [cmd]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    logs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    for p, log in zip(procs, logs):
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{log[-3000:]}")
    timing = json.loads((out / "summary.json").read_text())["timing"]
    return {"round_s": timing["later_rounds_s_mean"], "first_s": timing["first_round_s_incl_compile"], "wall_s": wall,
            "bytes": ((out / "metrics.jsonl").read_bytes(), (out / "checkpoint.msgpack").read_bytes())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default="fedavg,fednas")
    ap.add_argument("--layouts", default="1x2,2x1,1x4,2x2,4x1", help="PROCESSESxDEVICES, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    add_output_args(ap, "FedAvg only, layouts 1x2 and 2x1, 2 rounds")
    a = parse_with_quick(ap, argv, QUICK)
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algo in a.algos.split(","):
            base: dict[int, dict] = {}
            for p, d in layouts:
                r = run_layout(ALGOS[algo], Path(tmp) / f"{algo}-{p}x{d}", p, d, a.rounds)
                ref = base.setdefault(p * d, r) if p == 1 else base.get(p * d)
                ratio = f"{r['round_s'] / ref['round_s']:.2f}" if ref else "-"
                same = "-" if ref is None or ref is r else ("yes" if r["bytes"] == ref["bytes"] else "no")
                rows.append([algo, f"{p} x {d}", f"{r['round_s']:.3f}", ratio, f"{r['first_s']:.1f}",
                             f"{r['wall_s']:.1f}", same])
                print(rows[-1], flush=True)
    table = markdown_table(["algorithm", "processes x devices", "s/round (after the first)",
                            "vs 1 process, same devices", "first round s (compile)", "wall s",
                            "bytes equal 1 process"], rows)
    print(table)
    if not a.no_write:
        path = results_path(a)
        where = write_results("One run over several processes (loopback, gloo) vs one process",
                              command_line("multiprocess_round.py"),
                              machine_info(), table + f"\n\n{a.rounds} rounds per run; digits, 8 clients; "
                              "every process a subprocess on the same 2-core machine.", path)
        print(f"{where} {path}")


if __name__ == "__main__":
    main()
