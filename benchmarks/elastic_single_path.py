"""Single-path cost of the elastic MobileNetV3 space on CPU: a subnet chosen by a traced
``choice`` (one compiled program for every client) vs the fixed supernet and the fixed
smallest subnet (time per training step, compile time, memory).

Configurations, per preset (``--presets``, default ``small`` on 8x8x1 and ``cifar`` on
32x32x3 synthetic inputs, 10 classes, batch ``--batch``):

* ``traced`` -- PerFedRLNAS' client step as ``algorithms/perfedrlnas.py`` runs it: the
  subnet is an int32 ``[D]`` argument of the jitted program (``lax.switch`` per
  convolution, ``lax.cond`` per optional block), ``--clients`` clients one after
  another under ``lax.map``, each one SGD step on its own batch (value_and_grad, update
  and BatchNorm statistics restricted to the subnet's variable mask). One compiled
  program, timed with every client on the smallest subnet, on random subnets (seeded)
  and on the largest;
* ``static:max`` -- the same step with the largest choice as a concrete numpy array:
  Python picks every branch, so the program is the supernet itself (no switch, no
  padding);
* ``static:min`` -- the same with the smallest choice: the smallest child alone.

Ratios: each traced row against the static program of the same subnet (``min`` / ``max``;
random subnets against ``static:max``) -- the price of one program for all subnets --
and ``static:max / static:min``, what a perfect single path could save.

Timing: AOT lower + compile (timed), one warm-up call per choice set (XLA:CPU pays a
one-off cost the first time a switch branch runs), then ``--repeats`` timed calls;
s/client-step = median call time / clients. Memory: XLA's ``memory_analysis()`` temp
bytes of the compiled program (one per program: static shapes, so the same for every
traced choice) and the step memory = peak RSS over all calls of the program, warm-ups
included (peak mark reset via ``/proc/self/clear_refs`` after compiling), minus RSS
before the first call. Every program runs in its own subprocess.

    PYTHONPATH=. python benchmarks/elastic_single_path.py --no-write          # ~3.5 min on 2 cores
    PYTHONPATH=. python benchmarks/elastic_single_path.py --presets small --repeats 3 --no-write
    PYTHONPATH=. python benchmarks/elastic_single_path.py --quick   # CI: the tiny preset, batch 4, 1 timed call
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

NUM_CLASSES = 10
IMAGES = {"tiny": (8, 8, 1), "small": (8, 8, 1), "cifar": (32, 32, 3)}
PROGRAMS = ("traced", "static:max", "static:min")
TRACED_SETS = ("min", "random", "max")
QUICK = {"presets": "tiny", "batch": 4, "repeats": 1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="small,cifar", help=f"comma list from {sorted(IMAGES)}")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--clients", type=int, default=2, help="clients per call (lax.map, one SGD step each)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per choice set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    bu.add_output_args(p, "the tiny preset (8x8x1), batch 4, 1 timed call per subnet set")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = bu.parse_with_quick(p, argv, QUICK)
    for name in args.presets.split(","):
        if name not in IMAGES:
            p.error(f"unknown preset {name!r}; choose from {sorted(IMAGES)}")
    return args


# --- worker -------------------------------------------------------------------------------


def make_round(space, static_choice=None, lr: float = 0.05):
    """``round(variables, choices [N, D], x [N, B, ...], y [N, B]) -> (new variables [N, ...],
    losses [N])``: every client one masked SGD step on its subnet, one after another.
    With ``static_choice`` (numpy) the ``choices`` argument is ignored and the subnet is
    fixed at trace time."""
    import jax
    import jax.numpy as jnp
    import optax

    def client(variables, choice, x, y):
        choice = choice if static_choice is None else static_choice
        keep = space.variable_mask(choice, variables)
        mask = jnp.ones((x.shape[0],), bool)

        def loss(params):
            logits, new = space.subnet(choice).apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                                                     train=True, mask=mask, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        params = jax.tree.map(lambda p, g, k: p - lr * k * g, variables["params"], grads, keep["params"])
        stats = jax.tree.map(lambda n, o, k: jnp.where(k > 0, n, o), stats, variables["batch_stats"],
                             keep["batch_stats"])
        return {"params": params, "batch_stats": stats}, value

    def round_fn(variables, choices, x, y):
        return jax.lax.map(lambda a: client(variables, *a), (choices, x, y))

    return round_fn


def worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fednas_search as fs
    from jaxfednas.search_spaces.elastic import ElasticMobileNet

    preset, program = args.worker.split("/")
    res = {"kind": args.worker, "load_start": bu.load_line()}
    shape = IMAGES[preset]
    space = ElasticMobileNet.from_preset(preset, num_classes=NUM_CLASSES, image_shape=shape)
    n, b = args.clients, args.batch
    key = jax.random.key(args.seed)
    x = jax.random.normal(jax.random.fold_in(key, 1), (n, b) + shape)
    y = jax.random.randint(jax.random.fold_in(key, 2), (n, b), 0, NUM_CLASSES)
    variables = jax.jit(space.init)(jax.random.fold_in(key, 0), x[0, :1])
    k = np.array([len(d.choices) for d in space.dims])
    rng = np.random.default_rng(args.seed)
    sets = {"min": np.tile(space.smallest_choice(), (n, 1)), "max": np.tile(space.largest_choice(), (n, 1)),
            "random": rng.integers(0, k, size=(n, len(k))).astype(np.int32)}
    static = None if program == "traced" else (space.largest_choice() if program == "static:max"
                                                else space.smallest_choice())
    fn = jax.jit(make_round(space, static))
    names = TRACED_SETS if program == "traced" else (program.split(":")[1],)
    t0 = time.perf_counter()
    lowered = fn.lower(variables, jnp.asarray(sets["min"]), x, y)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    res.update(lower_s=t1 - t0, compile_s=t2 - t1, temp_mib=mem.temp_size_in_bytes / 2**20,
               costs={s: [space.cost(c).to_dict() for c in sets[s]] for s in names})
    runs = {}
    res["peak_compile_mib"] = fs.hwm_mib()
    before = fs.rss_mib()
    fs.reset_hwm()
    for s in names:
        c = jnp.asarray(sets[s])
        warm, _ = bu.timed(lambda: compiled(variables, c, x, y))
        times = [bu.timed(lambda: compiled(variables, c, x, y))[0] for _ in range(args.repeats)]
        runs[s] = {"warmup_s": warm, "times": times}
    res.update(runs=runs, step_mib=fs.hwm_mib() - before, load_end=bu.load_line(), dims=len(space.dims))
    return res


# --- driver -------------------------------------------------------------------------------


def spawn(kind: str) -> dict:
    import fednas_search as fs

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", kind, "--json-out", out]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=fs.worker_env(), capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            return {"kind": kind, "error": f"worker exited {proc.returncode}"}
        with open(out) as f:
            res = json.load(f)
        res["wall_s"] = time.perf_counter() - t0
        return res


def ms(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def report(args, res: dict) -> str:
    header = ["preset", "program", "subnets", "compile s (lower + compile)", "s/client-step (median)",
              "time vs static:min", "time vs static:max", "XLA temp MiB", "temp vs static:max", "step memory MiB",
              "MACs/example (mean)", "params (mean)"]
    rows, notes = [], []

    def ok(r):
        return r is not None and "error" not in r
    for preset in args.presets.split(","):
        static = {s: res.get(f"{preset}/static:{s}") for s in ("min", "max")}

        def step(r, s):
            return bu.median(r["runs"][s]["times"]) / args.clients

        for program in PROGRAMS:
            r = res.get(f"{preset}/{program}")
            if r is None:
                continue
            if "error" in r:
                rows.append([preset, program, "", r["error"]] + [""] * (len(header) - 4))
                continue
            for s in r["runs"]:
                costs = r["costs"][s]
                rows.append([
                    preset, program, s, f"{r['lower_s']:.1f} + {r['compile_s']:.1f}", ms(step(r, s)),
                    *(f"{step(r, s) / step(ref, t):.2f}x" if ok(ref) else "-" for t, ref in static.items()),
                    f"{r['temp_mib']:.0f}", f"{r['temp_mib'] / static['max']['temp_mib']:.2f}x" if ok(static["max"]) else "-",
                    f"{r['step_mib']:.0f}", f"{sum(c['macs'] for c in costs) / len(costs) / 1e6:.2f}M",
                    f"{sum(c['params'] for c in costs) / len(costs) / 1e3:.1f}k",
                ])
        if all(ok(v) for v in static.values()):
            notes.append(f"{preset}: static max / static min = {step(static['max'], 'max') / step(static['min'], 'min'):.2f}x "
                         f"time, {static['max']['temp_mib'] / static['min']['temp_mib']:.2f}x XLA temp")
    lines = [
        f"**Elastic MobileNetV3 (search_spaces/elastic), single path on CPU.** Batch {args.batch}, synthetic "
        f"inputs, {NUM_CLASSES} classes, {args.clients} clients per call under `lax.map`, one masked SGD step each "
        f"(value_and_grad, update and BN statistics inside the subnet's variable mask). `traced`: the choice is a "
        f"jitted argument (one program, timed on the smallest, random and largest subnets); `static`: the choice "
        f"fixed at trace time (the child network alone). One subprocess per program; {args.repeats} timed calls "
        f"after one warm-up call per subnet set; XLA temp = `memory_analysis().temp_size_in_bytes` (buffers of "
        f"`lax.switch` branches may not all be in it); step memory = peak RSS over all calls of the program "
        f"(warm-ups included, peak mark reset after compiling) minus RSS before the first call.",
        "",
        bu.markdown_table(header, rows),
        "",
    ]
    if notes:
        lines.append("Static max vs min: " + "; ".join(notes) + ".")
    loads = [f"{k} {r['load_start']} / {r['load_end']}" for k, r in res.items() if "error" not in r]
    if loads:
        lines += ["", "Load average (1/5/15 min) at start / end of each worker: " + "; ".join(loads) + "."]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        bu.ensure_repo_on_path()
    if bu.serve_worker(args, worker):
        return
    info = bu.machine_info()
    res = {}
    for preset in args.presets.split(","):
        for program in PROGRAMS:
            kind = f"{preset}/{program}"
            print(f"running {kind} ...", file=sys.stderr, flush=True)
            res[kind] = spawn(kind)
    body = report(args, res)
    print(bu.machine_line(info))
    print(body)
    if not args.no_write:
        path = bu.results_path(args)
        where = bu.write_results("Elastic MobileNetV3: traced single path vs fixed supernet / smallest subnet",
                                 bu.command_line("elastic_single_path.py"), info, body, path)
        print(f"\n(section {where} {path})")
    return 1 if any("error" in r for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
