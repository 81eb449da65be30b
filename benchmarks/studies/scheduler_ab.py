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

``--compare opt_level`` runs the same A/B for LLVM's optimisation level instead
(``JAXFEDNAS_CPU_OPT_LEVEL=2``, what every program compiles with, against XLA's default 3;
:data:`jaxfednas.runtime.CPU_OPT_LEVEL`), each with the program's own scheduler;
``--compare keep_calls`` for XLA keeping the nested jits' calls (``JAXFEDNAS_CPU_KEEP_CALLS=1``,
what FedNAS' search asks for where its cells run grouped) against inlining them (``0``;
:data:`jaxfednas.runtime.KEEP_CALLS_OPTIONS`); the variable sets it in every program, DP-FNAS' and
DFNAS' included.

    PYTHONPATH=. python benchmarks/studies/scheduler_ab.py
    PYTHONPATH=. python benchmarks/studies/scheduler_ab.py --algorithms dp_fnas --repeats 5 --no-write
    PYTHONPATH=. python benchmarks/studies/scheduler_ab.py --compare opt_level
    PYTHONPATH=. python benchmarks/studies/scheduler_ab.py --compare keep_calls

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
from _bench_util import (REPO_ROOT, RESULTS, check_choices, command_line, ensure_repo_on_path, load_line, machine_info,
                         markdown_table, median, serve_worker, write_results)

ALGORITHMS = ("fednas", "dp_fnas", "dfnas")
CONFIGS = {
    "fednas": {"algo.C": 8, "algo.layers": 5, "algo.batch_size": 32, "algo.local_epochs": 1},
    "dp_fnas": {"algo.C": 4, "algo.layers": 2, "algo.iterations_per_round": 1, "algo.per_example_chunk": 8},
    "dfnas": {"algo.space": "small", "algo.batch_size": 32, "algo.local_epochs": 1},
}
LABELS = {"fednas": "FedNAS (MiLeNAS, Eq. 4), C=8, 5 cells, B=32",
          "dp_fnas": "DP-FNAS (per-example clipping in chunks of 8, 2nd-order FD), C=4, 2 cells, p=0.1",
          "dfnas": "DFNAS (single path), `small` space, B=32"}
# --compare: (environment variable, (variant A, variant B), what the comparison is of)
COMPARISONS = {"scheduler": ("JAXFEDNAS_CPU_SCHEDULER", ("memory", "default"),
                             "XLA:CPU scheduler A/B: FedNAS, DP-FNAS and DFNAS rounds, memory-optimised vs default"),
               "opt_level": ("JAXFEDNAS_CPU_OPT_LEVEL", ("2", "3"),
                             "LLVM optimisation level A/B: FedNAS, DP-FNAS and DFNAS rounds, -O2 vs XLA's default -O3"),
               "keep_calls": ("JAXFEDNAS_CPU_KEEP_CALLS", ("1", "0"),
                              "Nested calls kept vs inlined by XLA: FedNAS, DP-FNAS and DFNAS rounds")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma list from {ALGORITHMS}")
    p.add_argument("--compare", default="scheduler", choices=sorted(COMPARISONS),
                   help="what the two programs differ in (default: the XLA:CPU scheduler)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--train-per-client", type=int, default=96,
                   help="half the examples per client (split into train / val / test by the config's data.split)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per scheduler (alternated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_choices(p, args.algorithms, ALGORITHMS, "algorithm(s)")
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
    from jaxfednas.registry import build_algorithm, make_config
    from jaxfednas.rng import init_key, round_key

    name = args.worker
    cfg = make_config(name, overrides={
        "data.dataset": "synthetic", "data.num_clients": args.clients, "data.partition": "iid",
        "run.seed": args.seed, "run.clients_per_round": args.clients, **CONFIGS[name]})
    ds = load_dataset("synthetic", seed=args.seed, num_train=2 * args.clients * args.train_per_client,
                      image_shape=(32, 32, 3))
    data = make_federated_data(ds, partition.manifest_splits(make_partition(cfg, ds)))
    res = {"algorithm": name, "machine": machine_info(), "load_start": load_line(), "rounds": {}}
    env_var, variants, _ = COMPARISONS[args.compare]
    algos = {}
    for variant in variants:  # the options are read when the round is built
        os.environ[env_var] = variant
        algos[variant] = build_algorithm(cfg, data.info)
    os.environ.pop(env_var)
    state = algos[variants[0]].init(init_key(args.seed))
    key = round_key(args.seed, 0)
    compiled, out = {}, {}
    for variant, algo in algos.items():
        t0 = time.perf_counter()
        c = algo.round.lower(state, data, key).compile()
        res[f"compile_s_{variant}"] = time.perf_counter() - t0
        res[f"temp_mib_{variant}"] = c.memory_analysis().temp_size_in_bytes / 2**20
        out[variant] = jax.block_until_ready(c(state, data, key))  # warm-up
        compiled[variant] = c
    metrics = out[variants[0]][1]
    res["local_steps"] = int(metrics.get("local_steps", metrics.get("iterations_run", 0)))
    times = {s: [] for s in variants}
    for _ in range(args.repeats):
        for variant, c in compiled.items():
            t0 = time.perf_counter()
            out[variant] = jax.block_until_ready(c(state, data, key))
            times[variant].append(time.perf_counter() - t0)
    leaves = [jax.tree.leaves(out[s]) for s in variants]
    res["bitwise_equal"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves))
    res["max_abs_diff"] = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
                              for a, b in zip(*leaves))
    res["times"] = times
    res["load_end"] = load_line()
    return res


def spawn(name: str, argv: list[str]) -> dict:
    out = f"/tmp/scheduler_ab_{os.getpid()}_{name}.json"
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name, "--json-out", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


def report(args, results: list[dict]) -> str:
    env_var, (a, b), _ = COMPARISONS[args.compare]
    rows = []
    for r in results:
        steps = r["local_steps"]
        med = {s: median(r["times"][s]) for s in (a, b)}
        per_step = {s: (f"{med[s] / steps:.3f}" if steps else "-") for s in (a, b)}
        equal = "yes" if r["bitwise_equal"] else f"**no** (max abs diff {r['max_abs_diff']:.1e})"
        rows.append([
            LABELS[r["algorithm"]], steps,
            f"{r[f'compile_s_{a}']:.1f} / {r[f'compile_s_{b}']:.1f}",
            f"{med[a]:.2f} / {med[b]:.2f}", f"{per_step[a]} / {per_step[b]}",
            f"{med[b] / med[a]:.2f}x",
            f"{r[f'temp_mib_{a}']:.0f} / {r[f'temp_mib_{b}']:.0f}",
            f"{r[f'temp_mib_{b}'] / max(r[f'temp_mib_{a}'], 1e-9):.2f}x",
            equal])
    table = markdown_table(
        ["round", "local steps / iterations", f"compile s ({a} / {b})", f"s/round median ({a} / {b})",
         "s per step", f"speed of {a} vs {b}", f"XLA temp MiB ({a} / {b})", "temp saved",
         "bitwise-equal results"], rows)
    loads = "; ".join(f"{r['algorithm']} {r['load_start']} / {r['load_end']}" for r in results)
    return "\n\n".join([
        f"One round per algorithm, {args.clients} synthetic 32x32x3 IID clients ({2 * args.train_per_client} examples "
        f"each before the config's train / val / test split), all sampled, built through the registry twice (`{a}` = "
        f"`{env_var}={a}`, `{b}` = `{env_var}={b}`), compiled, warmed up, then {args.repeats} rounds "
        f"each, alternated, from the same state and key. Speed above 1: `{a}` is faster.",
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
        a, b = COMPARISONS[args.compare][1]
        print(f"  compile {r[f'compile_s_{a}']:.1f} / {r[f'compile_s_{b}']:.1f} s, rounds {a} "
              f"{[round(t, 2) for t in r['times'][a]]} {b} {[round(t, 2) for t in r['times'][b]]}, "
              f"temp {r[f'temp_mib_{a}']:.0f} / {r[f'temp_mib_{b}']:.0f} MiB, bitwise equal {r['bitwise_equal']}",
              flush=True)
        results.append(r)
    body = report(args, results)
    print(body)
    if not args.no_write:
        where = write_results(COMPARISONS[args.compare][2], command_line("studies/scheduler_ab.py"), results[0]["machine"], body)
        print(f"{where} {RESULTS}")


if __name__ == "__main__":
    main()
