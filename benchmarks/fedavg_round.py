"""One FedAvg round under each client placement, against a Python-loop baseline.

Placements (every one runs the same per-client function, ``make_local_train``):

* ``loop``          — Python loop over the sampled clients, each a call of the jitted
                      single-client ``local_train``, then a jitted ``weighted_mean``
                      (the "one client at a time" style of most FL code bases);
* ``vmap``          — the jitted FedAvg round of ``registry.build_algorithm``
                      with ``Placement('vmap')``;
* ``map1``/``map4`` — ``Placement('map')`` with ``client_chunk_size`` 1 (sequential
                      ``lax.map``) and 4;
* ``shard_map``     — ``Placement('shard_map', within='vmap')`` over ``--devices`` fake CPU
                      devices (``XLA_FLAGS=--xla_force_host_platform_device_count``);
* ``shard_map_map`` — the same with ``within='map'``;
* ``vmap_8dev``     — ``vmap`` in a process that has the fake devices (a control: what
                      the fake devices cost a single-device placement).

Each placement runs in its own subprocess (peak RSS is a per-process high-water
mark; the fake-device flag must be set before jax is imported). Inside that
subprocess the placement's round and the ``loop`` round are timed alternately,
so the speed ratio vs ``loop`` and the numeric agreement (max |Δ| of the
aggregated variables after one round from the same state and key) are measured
in the same process. Peak RSS is read after the placement's first (warm-up) round and
before the ``loop`` baseline is built.

    PYTHONPATH=. python benchmarks/fedavg_round.py                      # digits, CNN
    PYTHONPATH=. python benchmarks/fedavg_round.py --dataset synthetic --model resnet_tiny
    PYTHONPATH=. python benchmarks/fedavg_round.py --quick   # CI: 2 tiny synthetic clients, 4 placements
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import _bench_util as bu

SPECS = {
    # name: (mode, client_chunk_size, within, needs fake devices)
    "loop": (None, None, None, False),
    "vmap": ("vmap", None, "vmap", False),
    "map1": ("map", 1, "vmap", False),
    "map4": ("map", 4, "vmap", False),
    "shard_map": ("shard_map", None, "vmap", True),
    "shard_map_map": ("shard_map", None, "map", True),
    "vmap_8dev": ("vmap", None, "vmap", True),
}
DEFAULT_PLACEMENTS = "loop,vmap,map1,map4,shard_map,shard_map_map,vmap_8dev"
DEVICE_FLAG = "--xla_force_host_platform_device_count"
QUICK = {"dataset": "synthetic", "synthetic_shape": "8,8,1", "synthetic_train": 64, "clients": 2, "repeats": 1,
         "devices": 2, "placements": "loop,vmap,map1,shard_map_map"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits", choices=("digits", "synthetic"))
    p.add_argument("--model", default="auto", help="auto (cnn) | cnn | resnet_tiny | resnet18")
    p.add_argument("--clients", type=int, default=8, help="number of clients K (Dirichlet partition)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--clients-per-round", default="1.0", help="int count or float fraction (default: all)")
    p.add_argument("--epochs", type=int, default=1, help="local epochs E")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--synthetic-shape", default="32,32,3", help="H,W,C of --dataset synthetic")
    p.add_argument("--synthetic-train", type=int, default=512, help="examples of --dataset synthetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per placement (median reported)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices for the shard_map rows")
    p.add_argument("--placements", default=DEFAULT_PLACEMENTS, help=f"comma list from {sorted(SPECS)}")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    bu.add_output_args(p, "2 clients of synthetic 8x8x1 images, 1 timed round, placements loop, vmap, map1, "
                       "shard_map_map over 2 devices")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = bu.parse_with_quick(p, argv, QUICK)
    for name in args.placements.split(","):
        if name not in SPECS:
            p.error(f"unknown placement {name!r}; choose from {sorted(SPECS)}")
    return args


def clients_per_round(text: str):
    return float(text) if any(c in text for c in ".eE") else int(text)


# --- worker (one placement, one process) ------------------------------------------


def setup(args):
    bu.ensure_repo_on_path()
    from jaxfednas.data import load_dataset, make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import make_config

    cfg = make_config("fedavg", overrides={
        "data.dataset": args.dataset, "data.num_clients": args.clients, "data.partition": "dirichlet",
        "data.alpha": args.alpha, "run.clients_per_round": clients_per_round(args.clients_per_round),
        "run.seed": args.seed, "algo.local_epochs": args.epochs, "algo.batch_size": args.batch_size,
        "algo.model": args.model,
    })
    if args.dataset == "synthetic":
        shape = tuple(int(s) for s in args.synthetic_shape.split(","))
        ds = load_dataset("synthetic", seed=args.seed, image_shape=shape, num_train=args.synthetic_train)
    else:
        ds = load_dataset(args.dataset)
    manifest = make_partition(cfg, ds)
    data = make_federated_data(ds, part.manifest_splits(manifest))
    return cfg, data


def build_placement(cfg, info, name):
    """The jitted FedAvg round for placement ``name`` (not ``loop``)."""
    import dataclasses

    from jaxfednas.registry import algorithm_module, build_algorithm
    from jaxfednas.run_options import RunOptions
    from jaxfednas.runtime import Placement

    mode, chunk, within, _ = SPECS[name]
    fedavg = algorithm_module("fedavg")
    if within == "vmap":  # what `build` exposes through the config
        run = dataclasses.replace(cfg.run, placement=mode, client_chunk_size=chunk)
        return build_algorithm(dataclasses.replace(cfg, run=run), info)
    placement = Placement(mode, chunk, within=within)
    return fedavg.fedavg(cfg.algo, info, run=RunOptions(clients_per_round=cfg.run.clients_per_round, placement=placement))


class LoopRound:
    """``round(state, data, key)`` as a host loop over clients of a jitted ``local_train``."""

    def __init__(self, cfg, info, data):
        import jax
        import numpy as np

        from jaxfednas.algorithms.common import make_local_train, train_metrics
        from jaxfednas.search_spaces.models import make_model
        from jaxfednas.data.federated import ClientData
        from jaxfednas.runtime import resolve_clients_per_round, round_clients, weighted_mean

        self._np = np
        model = make_model(cfg.algo.model, info.num_classes, info.name)
        m = resolve_clients_per_round(cfg.run.clients_per_round, info.num_clients)

        def prepare(key):
            idx, keys = round_clients(key, info.num_clients, m)
            return idx, [keys[i] for i in range(m)]

        def aggregate(state, new_vars, metrics, counts, idx):
            stack = lambda xs: jax.tree.map(lambda *a: jax.numpy.stack(a), *xs)  # noqa: E731
            avg = weighted_mean(stack(new_vars), counts[idx])
            old = state.variables["params"]
            params = jax.tree.map(lambda w, a: w + (a - w), old, avg["params"])  # as FedAvg's round
            variables = {"params": params, "batch_stats": avg["batch_stats"]}
            return state.replace(variables=variables, round=state.round + 1), train_metrics(stack(metrics))

        self.prepare = jax.jit(prepare)
        self.local_train = jax.jit(make_local_train(model, info, cfg.algo))
        self.aggregate = jax.jit(aggregate)
        # Per-client arrays split once, outside the timed round (as per-client loaders would be).
        tr = data.train
        self.clients = [ClientData(x=tr.x[k], y=tr.y[k], count=tr.counts[k]) for k in range(info.num_clients)]
        self.counts = tr.counts

    def compile(self, state, key):
        """AOT-compile the three jitted pieces; returns (lower_s, compile_s)."""
        import jax

        t0 = time.perf_counter()
        lp = self.prepare.lower(key)
        idx, keys = jax.eval_shape(self.prepare, key)
        ll = self.local_train.lower(state.variables, self.clients[0], keys[0])
        out_vars, out_met = jax.eval_shape(self.local_train, state.variables, self.clients[0], keys[0])
        la = self.aggregate.lower(state, [out_vars] * len(keys), [out_met] * len(keys), self.counts, idx)
        t1 = time.perf_counter()
        self.prepare, self.local_train, self.aggregate = lp.compile(), ll.compile(), la.compile()
        return t1 - t0, time.perf_counter() - t1

    def __call__(self, state, data, key):
        idx, keys = self.prepare(key)
        idx_host = self._np.asarray(idx)  # the host decides which client runs next
        outs = [self.local_train(state.variables, self.clients[int(k)], keys[i]) for i, k in enumerate(idx_host)]
        return self.aggregate(state, [o[0] for o in outs], [o[1] for o in outs], self.counts, idx)


def max_abs_diff(a, b) -> float:
    import jax
    import numpy as np

    diffs = jax.tree.leaves(jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b))
    return max(diffs) if diffs else 0.0


def run_worker(args) -> dict:
    import jax
    import numpy as np

    name = args.worker
    fake = SPECS[name][3]
    if fake and jax.device_count() != args.devices:
        raise RuntimeError(f"expected {args.devices} fake devices, jax sees {jax.device_count()}")
    from jaxfednas.algorithms.fedavg import fedavg
    from jaxfednas.run_options import RunOptions
    from jaxfednas.rng import init_key, round_key
    from jaxfednas.runtime import Placement

    cfg, data = setup(args)
    info = data.info
    # One initial state for every placement (the jitted init of the FedAvg builder).
    state0 = fedavg(cfg.algo, info, run=RunOptions(placement=Placement("vmap"))).init(init_key(args.seed))
    key0 = round_key(args.seed, 0)
    keys = [round_key(args.seed, r) for r in range(args.repeats)]
    res = {"name": name, "machine": bu.machine_info(), "load_start": bu.load_line()}
    m_max = int(data.train.max_examples)
    res["shape"] = {
        "client_train_sizes": [int(c) for c in np.asarray(data.train.counts)],
        "slots_per_client": args.epochs * math.ceil(m_max / args.batch_size),
    }

    def compile_and_first(fn_obj, aot):
        lower_s, compile_s = aot()
        first_s, out = bu.timed(lambda: fn_obj(state0, data, key0))
        return lower_s, compile_s, first_s, out

    loop = None
    if name == "loop":
        loop = LoopRound(cfg, info, data)
        lower_s, compile_s, first_s, out = compile_and_first(loop, lambda: loop.compile(state0, key0))
        run = loop
    else:
        algo = build_placement(cfg, info, name)
        holder = {}

        def aot():
            t0 = time.perf_counter()
            lowered = algo.round.lower(state0, data, key0)
            t1 = time.perf_counter()
            holder["fn"] = lowered.compile()
            return t1 - t0, time.perf_counter() - t1

        lower_s, compile_s = aot()
        run = holder["fn"]
        first_s, out = bu.timed(lambda: run(state0, data, key0))
    res.update(lower_s=lower_s, compile_s=compile_s, first_run_s=first_s)
    res["peak_rss_mib"] = bu.peak_rss_mib()  # before the loop baseline exists in this process
    state1, met = out
    res["local_steps"] = int(met["local_steps"])
    res["train_loss"] = float(met["train_loss"])

    times, loop_times, ratios, steps = [], [], [], []
    if name == "loop":
        for k in keys:
            t, (_, m) = bu.timed(lambda: run(state0, data, k))
            times.append(t)
            steps.append(int(m["local_steps"]))
        res["max_abs_diff_vs_loop"] = 0.0
        res["loop_local_steps"] = res["local_steps"]
    else:
        loop = LoopRound(cfg, info, data)
        loop.compile(state0, key0)
        l_state1, l_met = loop(state0, data, key0)  # doubles as its warm-up round
        res["max_abs_diff_vs_loop"] = max_abs_diff(state1.variables, l_state1.variables)
        res["loop_local_steps"] = int(l_met["local_steps"])
        for i, k in enumerate(keys):  # alternate the order so neither side always runs first
            pair = [("p", run), ("l", loop)] if i % 2 == 0 else [("l", loop), ("p", run)]
            got = {}
            for tag, fn in pair:
                got[tag] = bu.timed(lambda: fn(state0, data, k))
            times.append(got["p"][0])
            loop_times.append(got["l"][0])
            ratios.append(got["l"][0] / got["p"][0])
            steps.append(int(got["p"][1][1]["local_steps"]))
    res.update(times=times, loop_times=loop_times, ratios=ratios, steps=steps, load_end=bu.load_line())
    return res


# --- driver -----------------------------------------------------------------------


def worker_env(fake: bool, devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
    if fake:
        flags.append(f"{DEVICE_FLAG}={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    root = str(bu.REPO_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def spawn(args, name: str) -> dict:
    return bu.run_worker([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", name],
                         worker_env(SPECS[name][3], args.devices), {"name": name})


def label(name: str, devices: int) -> str:
    mode, chunk, within, fake = SPECS[name]
    if name == "loop":
        return "loop (python, jitted client)"
    if mode == "map":
        return f"map (chunk {chunk})"
    if mode == "shard_map":
        return f"shard_map {devices} dev, within={within}"
    return f"vmap ({devices} fake dev in process)" if fake else "vmap"


def report(args, results: list[dict]) -> str:
    header = [
        "placement", "devices", "compile s (lower+compile)", "s/round (median)", "client-steps/s",
        "loop s/round (same proc)", "speed vs loop", "peak RSS MiB", "max abs Δ vs loop",
    ]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([label(r["name"], args.devices), "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        t = bu.median(r["times"])
        sps = bu.median([s / x for s, x in zip(r["steps"], r["times"])])
        if r["name"] == "loop":
            loop_t, ratio = "—", "1.00x"
        else:
            loop_t = f"{bu.median(r['loop_times']):.3f}"
            ratio = f"{bu.median(r['ratios']):.2f}x"
        rows.append([
            label(r["name"], args.devices), r["machine"]["device_count"],
            f"{r['lower_s']:.2f} + {r['compile_s']:.2f}", f"{t:.3f}", f"{sps:.0f}", loop_t, ratio,
            f"{r['peak_rss_mib']:.0f}", f"{r['max_abs_diff_vs_loop']:.2e}",
        ])
    ok = [r for r in results if "error" not in r]
    lines = []
    if ok:
        r0 = ok[0]
        sizes = r0["shape"]["client_train_sizes"]
        lines.append(
            f"FedAvg, {args.dataset}"
            + (f" {args.synthetic_shape.replace(',', 'x')} ({args.synthetic_train} examples)"
               if args.dataset == "synthetic" else "")
            + f", model {args.model}, {args.clients} Dirichlet({args.alpha}) clients, clients/round "
            f"{args.clients_per_round}, E={args.epochs}, B={args.batch_size}; client train sizes {sizes}; "
            f"{r0['local_steps']} real local steps per round, {r0['shape']['slots_per_client']} lock-step slots "
            f"per client; {args.repeats} timed rounds per placement. Load average at start/end of each "
            f"worker: {', '.join(r['load_start'] + ' / ' + r['load_end'] for r in ok)}."
        )
        lines.append("")
    lines.append(bu.markdown_table(header, rows))
    lines.append("")
    lines.append(
        "speed vs loop = median over rounds of (loop time / placement time), the two timed alternately in the "
        "placement's own process; client-steps/s counts real local SGD steps only (padding slots excluded); "
        "peak RSS is the placement's process high-water mark before the loop baseline is built there "
        "(the loop row: its own process)."
    )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if bu.serve_worker(args, run_worker):
        return
    names = args.placements.split(",")
    results = []
    for name in names:
        print(f"[fedavg_round] {name} ...", flush=True)
        res = spawn(args, name)
        results.append(res)
        if "error" not in res:
            print(
                f"  compile {res['lower_s']:.2f}+{res['compile_s']:.2f}s, median {bu.median(res['times']):.3f}s/round"
                + (f", loop {bu.median(res['loop_times']):.3f}s, ratio {bu.median(res['ratios']):.2f}x"
                   if res["loop_times"] else "")
                + f", rss {res['peak_rss_mib']:.0f} MiB, max|Δ| {res['max_abs_diff_vs_loop']:.2e}"
                f" (steps {res['local_steps']} vs loop {res['loop_local_steps']}), worker wall {res['wall_s']:.0f}s",
                flush=True,
            )
        else:
            print(f"  FAILED: {res['error']}", flush=True)
    body = report(args, results)
    print()
    print(body)
    ok = [r for r in results if "error" not in r]
    if not args.no_write and ok:
        info = next((r["machine"] for r in ok if r["machine"]["device_count"] == 1), ok[0]["machine"])
        title = f"FedAvg round by placement: {args.dataset}, model {args.model}, {args.clients} clients, E={args.epochs}"
        path = bu.results_path(args)
        how = bu.write_results(title, bu.command_line("fedavg_round.py"), info, body, path)
        print(f"\n{how} {path}")
    return 1 if len(ok) < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
