"""XLA:CPU scheduler A/B: one round of FedNAS, DP-FNAS and DFNAS compiled with the
memory-optimised scheduler (``JAXFEDNAS_CPU_SCHEDULER=memory``, what ``jaxfednas.runtime.jit``
uses unless a program asks for XLA's own) and with XLA's default scheduler
(``JAXFEDNAS_CPU_SCHEDULER=default``), in one process per algorithm.

For each algorithm: the round is built twice through the registry (``build(config,
info)``, the same code path as ``jaxfednas run``), both programs are AOT-compiled (timed),
warmed up once, then run alternately ``--repeats`` times from the same state and round
key, so machine load hits both alike. Reported: compile time, median s/round and s per
local step, XLA's temporary buffer (``memory_analysis()``) and whether both programs
return bitwise-equal states and metrics (the scheduler only orders operations).

Data: synthetic 32x32x3 inputs, 10 classes, ``--clients`` IID clients of ``2 * --train-per-client``
examples (split by the config's ``data.split``), all sampled.
Algorithm settings (``--set``-style overrides in ``CONFIGS``): FedNAS C=8, 5 cells,
batch 32 (config (a) of ``fednas_search.py``); DP-FNAS a C=4, 2-cell supernet with its
per-example GroupNorm, 1 iteration per round (one iteration takes ~30 s here; at C=8,
5 cells its per-example passes compile and run for over 10 minutes); DFNAS the ``small`` space at batch 32.

    PYTHONPATH=. python benchmarks/scheduler_ab.py
    PYTHONPATH=. python benchmarks/scheduler_ab.py --algorithms dp_fnas --repeats 5 --no-write
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _bench_util import (command_line, ensure_repo_on_path, load_line, machine_info, markdown_table, median, serve_worker,
                         write_results)

ALGORITHMS = ("fednas", "dp_fnas", "dfnas")
CONFIGS = {
    "fednas": {"algo.C": 8, "algo.layers": 5, "algo.batch_size": 32, "algo.local_epochs": 1},
    "dp_fnas": {"algo.C": 4, "algo.layers": 2, "algo.iterations_per_round": 1, "algo.per_example_chunk": 8},
    "dfnas": {"algo.space": "small", "algo.batch_size": 32, "algo.local_epochs": 1},
}
LABELS = {"fednas": "FedNAS (MiLeNAS, Eq. 4), C=8, 5 cells, B=32",
          "dp_fnas": "DP-FNAS (per-example clipping in chunks of 8, 2nd-order FD), C=4, 2 cells, p=0.1",
          "dfnas": "DFNAS (single path), `small` space, B=32"}
SCHEDULERS = ("memory", "default")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma list from {ALGORITHMS}")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--train-per-client", type=int, default=96,
                   help="half the examples per client (split into train / val / test by the config's data.split)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per scheduler (alternated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [a for a in args.algorithms.split(",") if a not in ALGORITHMS]
    if bad:
        p.error(f"unknown algorithm(s) {bad}; choose from {ALGORITHMS}")
    if args.clients < 1 or args.repeats < 1 or args.train_per_client < 8:
        p.error("--clients and --repeats must be >= 1, --train-per-client >= 8")
    return args


def worker(args) -> dict:
    ensure_repo_on_path()
    import jax
    import numpy as np

    from jaxfednas.data import make_federated_data, partition
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import algorithm_module, make_config
    from jaxfednas.rng import init_key, round_key

    name = args.worker
    cfg = make_config(name, overrides={
        "data.dataset": "synthetic", "data.num_clients": args.clients, "data.partition": "iid",
        "run.seed": args.seed, "run.clients_per_round": args.clients, **CONFIGS[name]})
    ds = load_dataset("synthetic", seed=args.seed, num_train=2 * args.clients * args.train_per_client,
                      image_shape=(32, 32, 3))
    data = make_federated_data(ds, partition.manifest_splits(make_partition(cfg, ds)))
    res = {"algorithm": name, "machine": machine_info(), "load_start": load_line(), "rounds": {}}
    algos = {}
    for sched in SCHEDULERS:  # the options are read when the round is built
        os.environ["JAXFEDNAS_CPU_SCHEDULER"] = sched
        algos[sched] = algorithm_module(name).build(cfg, data.info)
    os.environ.pop("JAXFEDNAS_CPU_SCHEDULER")
    state = algos["memory"].init(init_key(args.seed))
    key = round_key(args.seed, 0)
    compiled, out = {}, {}
    for sched, algo in algos.items():
        t0 = time.perf_counter()
        c = algo.round.lower(state, data, key).compile()
        res[f"compile_s_{sched}"] = time.perf_counter() - t0
        res[f"temp_mib_{sched}"] = c.memory_analysis().temp_size_in_bytes / 2**20
        out[sched] = jax.block_until_ready(c(state, data, key))  # warm-up
        compiled[sched] = c
    metrics = out["memory"][1]
    res["local_steps"] = int(metrics.get("local_steps", metrics.get("iterations_run", 0)))
    times = {s: [] for s in SCHEDULERS}
    for _ in range(args.repeats):
        for sched, c in compiled.items():
            t0 = time.perf_counter()
            out[sched] = jax.block_until_ready(c(state, data, key))
            times[sched].append(time.perf_counter() - t0)
    leaves = [jax.tree.leaves(out[s]) for s in SCHEDULERS]
    res["bitwise_equal"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves))
    res["times"] = times
    res["load_end"] = load_line()
    return res


def spawn(name: str, argv: list[str]) -> dict:
    out = f"/tmp/scheduler_ab_{os.getpid()}_{name}.json"
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name, "--json-out", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


def report(args, results: list[dict]) -> str:
    rows = []
    for r in results:
        steps = r["local_steps"]
        med = {s: median(r["times"][s]) for s in SCHEDULERS}
        per_step = {s: (f"{med[s] / steps:.3f}" if steps else "-") for s in SCHEDULERS}
        rows.append([
            LABELS[r["algorithm"]], steps,
            f"{r['compile_s_memory']:.1f} / {r['compile_s_default']:.1f}",
            f"{med['memory']:.2f} / {med['default']:.2f}", f"{per_step['memory']} / {per_step['default']}",
            f"{med['default'] / med['memory']:.2f}x",
            f"{r['temp_mib_memory']:.0f} / {r['temp_mib_default']:.0f}",
            f"{r['temp_mib_default'] / max(r['temp_mib_memory'], 1e-9):.2f}x",
            "yes" if r["bitwise_equal"] else "**no**"])
    table = markdown_table(
        ["round", "local steps / iterations", "compile s (memory / default)", "s/round median (memory / default)",
         "s per step", "speed of memory vs default", "XLA temp MiB (memory / default)", "temp saved",
         "bitwise-equal results"], rows)
    loads = "; ".join(f"{r['algorithm']} {r['load_start']} / {r['load_end']}" for r in results)
    return "\n\n".join([
        f"One round per algorithm, {args.clients} synthetic 32x32x3 IID clients ({2 * args.train_per_client} examples "
        f"each before the config's train / val / test split), all sampled, built through the registry twice (`memory` = `JAXFEDNAS_CPU_SCHEDULER=memory`, "
        f"`default` = `JAXFEDNAS_CPU_SCHEDULER=default`), compiled, warmed up, then {args.repeats} rounds "
        f"each, alternated, from the same state and key. Speed above 1: the memory scheduler is faster.",
        table, f"Load average (1/5/15 min) at start / end of each worker: {loads}."])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if serve_worker(args, worker):
        return
    results = []
    for name in args.algorithms.split(","):
        print(f"[scheduler_ab] {name} ...", flush=True)
        r = spawn(name, argv)
        print(f"  compile {r['compile_s_memory']:.1f} / {r['compile_s_default']:.1f} s, rounds memory "
              f"{[round(t, 2) for t in r['times']['memory']]} default {[round(t, 2) for t in r['times']['default']]}, "
              f"temp {r['temp_mib_memory']:.0f} / {r['temp_mib_default']:.0f} MiB, bitwise equal {r['bitwise_equal']}",
              flush=True)
        results.append(r)
    body = report(args, results)
    print(body)
    if not args.no_write:
        where = write_results("XLA:CPU scheduler A/B: FedNAS, DP-FNAS and DFNAS rounds, memory-optimised vs default",
                              command_line("scheduler_ab.py"), results[0]["machine"], body)
        print(f"{where} {os.path.relpath(os.path.join(os.path.dirname(__file__), 'RESULTS.md'))}")


if __name__ == "__main__":
    main()
