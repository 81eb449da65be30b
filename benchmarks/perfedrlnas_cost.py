"""PerFedRLNAS client cost on CPU, DARTS space: a sampled subnet computed single-path vs
the same subnet as a mask over the whole supernet (time, compile, memory).

Rows (one subprocess each; 32x32x3 synthetic inputs, 10 classes, the 8-op DARTS space
with ``none``, C = ``--C``, ``--layers`` cells, 4 nodes; batch ``--batch``):

* ``single`` -- ``jaxfednas.algorithms.perfedrlnas.make_client_train`` on one client, one local epoch
  of ``--steps`` minibatches (one jitted ``lax.scan``): the subnet's loss and gradient,
  masked SGD with momentum, BatchNorm statistics of its ops only. The supernet has
  ``single_path=True``: every op of every edge sits under a ``cond`` on its one-hot
  weight, so only the sampled op per edge runs.
* ``masked`` -- the same step with ``single_path=False``: every op of every edge is
  computed and multiplied by its 0/1 weight (one compiled program, the supernet's cost;
  what a ``vmap`` over clients pays as well).

Timing: AOT lower + compile (timed), warm-up runs with ``--warmup`` freshly sampled
subnets (XLA:CPU pays a one-off cost the first time a branch runs), then ``--repeats``
timed runs with new subnets; s/step = median of run time / steps. Memory: XLA's
``memory_analysis()`` temp bytes of the compiled step, the process peak RSS (incl.
compilation) and the step memory = peak RSS over the runs (peak mark reset after
compilation) minus the RSS right before the first run.

    PYTHONPATH=. python benchmarks/perfedrlnas_cost.py                 # C=8, 5 cells, batch 32
    PYTHONPATH=. python benchmarks/perfedrlnas_cost.py --C 16 --layers 8 --batch 64
    PYTHONPATH=. python benchmarks/perfedrlnas_cost.py --quick   # CI: C=4, 1 cell of 1 node, batch 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _bench_util import (add_output_args, command_line, ensure_repo_on_path, load_line, machine_info, markdown_table,
                         median, hwm_mib, parse_with_quick, peak_rss_mib, reset_hwm, results_path, rss_mib,
                         write_results)

ROWS = {"single": "single path (a `cond` per op: only the sampled op of each edge runs)",
        "masked": "masked supernet (every op computed, ×0/1)"}
QUICK = {"C": 4, "layers": 1, "nodes": 1, "batch": 8, "steps": 1, "warmup": 1, "repeats": 1}


def worker(args) -> dict:
    ensure_repo_on_path()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfednas.algorithms import perfedrlnas as pf
    from jaxfednas.data.federated import ClientData, DataInfo
    from jaxfednas.registry import make_config

    info = DataInfo("synthetic", 1, 10, (32, 32, 3), 1.0, (0.0,) * 3, (1.0,) * 3)
    cfg = make_config("perfedrlnas", overrides={
        "algo.C": args.C, "algo.layers": args.layers, "algo.nodes": args.nodes, "algo.primitives": "darts",
        "algo.batch_size": args.batch, "algo.local_epochs": 1, "algo.single_path": args.worker == "single"}).algo
    space = pf.make_space(cfg, info)
    train = pf.make_client_train(cfg, info, space)
    n = args.batch * args.steps
    rs = np.random.RandomState(0)
    client = ClientData(x=jnp.asarray(rs.rand(n, 32, 32, 3), jnp.float32), y=jnp.asarray(rs.randint(0, 10, n)),
                        count=jnp.asarray(n, jnp.int32))
    v = space.init(jax.random.key(0), client.x[:1])
    step = jax.jit(train)
    choice0 = jnp.zeros(len(space.dims), jnp.int32)
    t0 = time.perf_counter()
    lowered = step.lower(v, choice0, client, jax.random.key(1), jnp.float32(0.025))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    k = len(space.dims[0].choices)

    def run(seed):
        c = jnp.asarray(np.random.RandomState(seed).randint(0, k, len(space.dims)), jnp.int32)
        out = compiled(v, c, client, jax.random.key(seed), jnp.float32(0.025))
        jax.block_until_ready(out)

    for s in range(args.warmup):
        run(100 + s)
    reset_hwm()
    before = rss_mib()
    times = []
    for s in range(args.repeats):
        t = time.perf_counter()
        run(1000 + s)
        times.append((time.perf_counter() - t) / args.steps)
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "s_per_step": median(times), "temp_mib": temp,
            "peak_rss_gib": peak_rss_mib() / 1024, "step_mem_gib": (hwm_mib() - before) / 1024}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--C", type=int, default=8)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--nodes", type=int, default=4, help="intermediate nodes per cell")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2, help="minibatches per timed run (one local epoch)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    add_output_args(p, "C=4, 1 cell of 1 node, batch 8, 1 step, 1 warm-up and 1 timed run")
    p.add_argument("--worker", choices=sorted(ROWS), help=argparse.SUPPRESS)
    args = parse_with_quick(p, argv, QUICK)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    results = {}
    for row in ROWS:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", row]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."})
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[row] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(row, results[row], flush=True)
    base = results["single"]
    rows = [[ROWS[r], args.batch, f"{x['lower_s']:.1f} + {x['compile_s']:.1f}", f"{x['s_per_step'] * 1e3:.0f} ms",
             f"{x['s_per_step'] / base['s_per_step']:.2f}x", f"{x['temp_mib']:.0f}", f"{x['peak_rss_gib']:.2f}",
             f"{x['step_mem_gib']:.2f}"] for r, x in results.items()]
    table = markdown_table(["configuration", "batch", "compile s (lower + compile)", "s/step (median)",
                            "time vs single path", "XLA temp MiB", "peak RSS GiB", "step memory GiB"], rows)
    body = (f"**PerFedRLNAS client step, DARTS 8-op space, C={args.C}, {args.layers} cells, {args.nodes} nodes, 32x32x3 "
            f"synthetic, batch {args.batch}.** One subprocess per row; `make_client_train` of "
            f"`algorithms/perfedrlnas.py`, one jitted local epoch of {args.steps} minibatches; {args.warmup} warm-up "
            f"runs and {args.repeats} timed runs, each with a freshly sampled subnet. Load average at the end: "
            f"{load_line()}.\n\n" + table)
    print(body)
    if not args.no_write:
        path = results_path(args)
        where = write_results("PerFedRLNAS client cost: single-path subnet vs masked supernet", command_line(
            "perfedrlnas_cost.py"), machine_info(), body, path)
        print(f"({where} {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
