"""Peak memory vs clients in flight for a FedNAS round on the DARTS supernet.

``run.client_chunk_size`` = c clients in flight per device (``lax.map`` over chunks of c
vmapped clients); ``run.memory_budget_gib`` picks c from XLA's memory analysis of the
compiled round (``jaxfednas.memory_fit.round_memory_gib``). For each c, one subprocess
(peak RSS is per process) builds the FedNAS round on one device (``run.placement=map``),
compiles it ahead of time (compile seconds, XLA's estimate: arguments + outputs - donated +
temporaries) and runs the compiled round twice: peak RSS growth during the first run (the
high-water mark reset through ``/proc/self/clear_refs`` after compiling, so the compiler's
memory is not counted) and the seconds of the second.

Supernet: C=8, 5 cells, 4 nodes, the 8 DARTS ops (the main job's) on synthetic 32x32x3
images, 8 clients of ~32 training examples (one local step of B=32 per round).

    PYTHONPATH=. python benchmarks/clients_in_flight.py [--chunks 1,2,4,8] [--image 32]
    PYTHONPATH=. python benchmarks/clients_in_flight.py --quick   # CI: C=4, 1 cell of 1 node, 2 clients, 8x8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _bench_util as bu


QUICK = {"chunks": "1,2", "image": 8, "clients": 2, "C": 4, "layers": 1, "nodes": 1}


def worker(chunk: int, image: int, clients: int, out: str, supernet: dict) -> None:
    bu.ensure_repo_on_path()
    import jax

    from jaxfednas.data import make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.memory_fit import round_memory_gib
    from jaxfednas.registry import build_algorithm, make_config
    from jaxfednas.rng import init_key, round_key

    cfg = make_config("fednas", overrides={
        "data.dataset": "synthetic", "data.num_clients": clients, "data.partition": "iid",
        "data.split": (0.5, 0.25, 0.25), "run.placement": "map", "run.client_chunk_size": chunk,
        "algo.local_epochs": 1, "algo.batch_size": 32, **{f"algo.{k}": v for k, v in supernet.items()}})
    ds = load_dataset("synthetic", num_train=64 * clients, num_test=64, image_shape=(image, image, 3))
    data = make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))
    algo = build_algorithm(cfg, data.info)
    state = algo.init(init_key(0))
    t0 = time.perf_counter()
    compiled = algo.round.lower(state, data, round_key(0, 0)).compile()
    compile_s = time.perf_counter() - t0
    gib = round_memory_gib(algo, state, data, round_key(0, 0))  # (the same analysis, from a cached compile)
    bu.reset_hwm()  # compilation's own memory is not counted
    before = bu.rss_mib()
    jax.block_until_ready(compiled(state, data, round_key(0, 0)))
    peak = bu.hwm_mib() - before
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(state, data, round_key(0, 1)))
    round_s = time.perf_counter() - t0
    json.dump({"xla_gib": gib, "compile_s": compile_s, "round_s": round_s, "peak_mib": peak}, open(out, "w"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--C", type=int, default=None, help="supernet channels (default: the fednas config's, 8)")
    ap.add_argument("--layers", type=int, default=None, help="supernet cells (default: the fednas config's, 5)")
    ap.add_argument("--nodes", type=int, default=None, help="nodes per cell (default: the fednas config's, 4)")
    ap.add_argument("--no-write", action="store_true")
    bu.add_output_args(ap, "C=4, 1 cell of 1 node, 2 clients of 8x8x3 images, chunk sizes 1 and 2")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = bu.parse_with_quick(ap, argv, QUICK)
    supernet = {k: getattr(a, k) for k in ("C", "layers", "nodes") if getattr(a, k) is not None}
    if a.worker is not None:
        return worker(a.worker, a.image, a.clients, a.json_out, supernet)
    rows = []
    env = dict(os.environ, JAXFEDNAS_CACHE="off")
    env.pop("XLA_FLAGS", None)  # one device
    for c in (int(v) for v in a.chunks.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--chunks", a.chunks, "--image", str(a.image),
                   "--clients", str(a.clients), "--worker", str(c), "--json-out", f.name]
            cmd += [arg for k, v in supernet.items() for arg in (f"--{k}", str(v))]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"chunk {c} failed:\n{proc.stderr[-3000:]}")
            r = json.load(open(f.name))
        rows.append([c, f"{r['xla_gib']:.2f}", f"{r['peak_mib'] / 1024:.2f}", f"{r['round_s']:.1f}",
                     f"{r['compile_s']:.1f}"])
        print(rows[-1], flush=True)
    table = bu.markdown_table(["clients in flight", "XLA estimate GiB", "peak RSS growth GiB", "s/round",
                               "compile s"], rows)
    print(table)
    if not a.no_write:
        net = ", ".join(f"{k}={v}" for k, v in {"C": 8, "layers": 5, "nodes": 4, **supernet}.items())
        path = bu.results_path(a)
        where = bu.write_results("FedNAS round memory vs clients in flight (run.client_chunk_size)",
                                 bu.command_line("clients_in_flight.py"), bu.machine_info(),
                                 table + f"\n\n{a.clients} clients on one CPU device, {a.image}x{a.image}x3 "
                                 f"synthetic images, supernet {net}, one local step of B=32 per client.", path)
        print(f"{where} {path}")


if __name__ == "__main__":
    main()
