"""DFNAS search cost on CPU: the single-path DSNAS step vs every-candidate supernets, fixed
children, client placements and the FedNAS DARTS step (time, compile, memory).

Configurations (cross_silo space: 20 choice blocks x 4 candidates; 32x32x3 synthetic
inputs, 10 classes; batch ``--batch``, 64 = the paper's):

* ``dfnas:single`` -- DFNAS' local search exactly as the algorithm runs it
  (``jaxfednas.algorithms.dfnas.make_local_search`` on one client, one local epoch of ``--steps``
  minibatches = one jitted ``lax.scan``): sample a path from α, value_and_grad of the
  loss w.r.t. (weights, block gates), masked SGD with momentum, DSNAS' α gradient, Adam
  on α. Each block is a ``lax.switch``: only the sampled candidate runs. Blocks unrolled
  (``algo.scan_blocks`` off, the default).
* ``dfnas:scan`` -- the same local search with ``scan_blocks=True``: the identical blocks
  of a stage run as one ``lax.scan`` (traced and compiled once per stage): compile time
  vs step time of the block scan.
* ``dfnas:all`` -- the same step on the supernet with ``all_paths=True`` (every candidate
  computed, the selected one kept: what a vmapped switch pays).
* ``child:k3`` / ``child:k7`` -- the "one network" floor: the fixed child (``build`` of
  ``uniform_arch``, all-k3 = the smallest, all-k7 = the largest ShuffleNetV2 unit),
  the same step (loss, value_and_grad w.r.t. weights and gates, SGD) without the search.
* ``clients:map`` / ``clients:vmap`` -- one DFNAS round (``dfnas(...).round``) of 2
  clients with ``--steps`` local steps each, through ``jaxfednas.runtime.map_clients``
  with ``Placement("map")`` (sequential: the switch stays a branch) and
  ``Placement("vmap")`` (the switch index is batched, so it becomes a select over all
  candidates). Time per round.
* ``fednas`` -- FedNAS' MiLeNAS step on the DARTS supernet at the FedNAS paper's
  config (C=16, 8 cells, batch 64; ``jaxfednas.algorithms.fednas.make_local_search``, as in
  ``benchmarks/fednas_search.py``): ~1 min/step on 2 cores, so one warm-up step and one
  timed step (skipped with ``--quick``).

``--quick`` (what CI runs) is the smallest run of each kind of worker: the ``tiny`` space at
batch 4, 1 step x 1 run, 1 timed round, ``slices`` only: ``dfnas:single``, ``child:k3`` and
``clients:map`` (``--skip`` given on the command line replaces the quick one).

The depthwise convolutions use ``--impls`` (default ``slices``, the CPU default at 32x32);
``grouped`` (the GPU form) runs the backward of grouped convolutions inside
``lax.switch`` -- and inside the local search's ``lax.scan``, switch or not -- on XLA:CPU's
slow generic emitter, so its step takes seconds even at batch 8: it is measured at
``--grouped-batch`` (default 8; 0 skips it).

A configuration whose compiled executable needs more XLA temp memory than 75% of the
machine's available memory is compiled but not run (the table says so): on a 24 GiB box
the ``vmap`` round at batch 64 needs ~22 GiB. Compare the placements at a smaller
``--batch`` (e.g. ``--batch 16 --impls slices --skip fednas,child,dfnas:all``).

Timing: AOT lower + compile (timed), then warm-up runs, then ``--repeats`` timed runs with
freshly sampled paths (different keys); s/step = median over runs of run time / steps.
**Warm-up covers every branch**: XLA:CPU pays a one-off cost (~1-2 s per new set of
branches at batch 8) the first time each ``lax.switch`` branch executes, so the
single-path configurations are warmed up with the 4 uniform paths (every block fixed to
candidate c via DFNAS' early-fixing inputs, c = 0..3) before timing random paths.
Memory: XLA's ``memory_analysis()`` temp bytes of the compiled executable, the process
peak RSS (incl. compilation), and the step memory = peak RSS over the runs (peak mark
reset via ``/proc/self/clear_refs`` after compilation) minus the RSS right before the
first run. Every configuration runs in its own subprocess.

    PYTHONPATH=. python benchmarks/dfnas_cost.py --quick                # CI: tiny space, seconds per configuration
    PYTHONPATH=. python benchmarks/dfnas_cost.py                      # full: ~42 min on 2 cores at load ~3
    PYTHONPATH=. python benchmarks/dfnas_cost.py --batch 16 --impls slices --skip fednas,child,dfnas:all
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _bench_util as bu

NUM_CLASSES = 10
ROUND_CLIENTS = 2
FEDNAS = (16, 8, 64)  # C, cells, batch: the FedNAS paper's config (b)
PAPER_MB = {"dfnas": 1437, "fednas": 10793}  # DFNAS paper, GPU memory per client, batch 64
IMPLS = ("slices", "grouped")
QUICK = {"space": "tiny", "batch": 4, "steps": 1, "repeats": 1, "round_repeats": 1, "impls": "slices",
         "skip": "dfnas:scan,dfnas:all,clients:vmap,fednas"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--space", default="cross_silo", help="ShuffleNet space (tiny: a smoke test of this script)")
    p.add_argument("--batch", type=int, default=64, help="minibatch size of the DFNAS / child / client configs")
    p.add_argument("--steps", type=int, default=2, help="local steps per timed run (one lax.scan)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (fresh sampled paths) after the warm-up")
    p.add_argument("--round-repeats", type=int, default=2, help="timed rounds per placement")
    p.add_argument("--impls", default="slices,grouped", help=f"comma list from {IMPLS}")
    p.add_argument("--grouped-batch", type=int, default=8, help="batch of the grouped rows (0: skip grouped)")
    p.add_argument("--fednas-steps", type=int, default=1, help="FedNAS steps per run (1 warm-up run + 1 timed run)")
    p.add_argument("--skip", default="", help="comma list of configurations to skip: dfnas, dfnas:single, "
                   "dfnas:scan, dfnas:all, child, clients, clients:map, clients:vmap, fednas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    bu.add_output_args(p, "tiny space, batch 4, 1 step x 1 run, 1 timed round, slices only: dfnas:single, "
                       "child:k3 and clients:map")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = bu.parse_with_quick(p, argv, QUICK)
    for impl in args.impls.split(","):
        if impl not in IMPLS:
            p.error(f"unknown dw impl {impl!r}; choose from {IMPLS}")
    return args


# --- memory probes (shared with fednas_search.py) ------------------------------------

def _probes():
    import fednas_search as fs

    return fs.rss_mib, fs.hwm_mib, fs.reset_hwm


MEM_FRACTION = 0.75  # run a configuration only if its XLA temp fits in this share of MemAvailable


def _mem_available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _client_data(num_clients: int, n_train: int, seed: int):
    """``num_clients`` synthetic 32x32x3 clients with ``n_train`` training rows each."""
    import numpy as np

    from jaxfednas.data import make_federated_data
    from jaxfednas.data.datasets import load_dataset

    ds = load_dataset("synthetic", seed=seed, num_train=num_clients * n_train + 1, image_shape=(32, 32, 3))
    splits = {"train": [np.arange(k * n_train, (k + 1) * n_train) for k in range(num_clients)],
              "val": [np.arange(num_clients * n_train, num_clients * n_train + 1)] * num_clients,
              "test": [np.arange(num_clients * n_train, num_clients * n_train + 1)] * num_clients}
    return make_federated_data(ds, splits)


def _first_client(data):
    import jax

    return jax.tree.map(lambda a: a[0], data.all_clients("train"))


def _memory(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
        return {"temp_mib": m.temp_size_in_bytes / 2**20,
                "arg_mib": m.argument_size_in_bytes / 2**20, "out_mib": m.output_size_in_bytes / 2**20}
    except Exception as e:  # noqa: BLE001 (not every backend implements it)
        return {"temp_mib": None, "memory_analysis_error": repr(e)}


def _measure(res: dict, lower, warmups, timed_calls, steps_of) -> dict:
    """Common protocol: lower + compile, memory analysis, warm-up calls, timed calls."""
    rss_mib, hwm_mib, reset_hwm = _probes()
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    res.update(lower_s=t1 - t0, compile_s=t2 - t1, **_memory(compiled))
    avail = _mem_available_mib()
    if res.get("temp_mib") and avail and res["temp_mib"] > MEM_FRACTION * avail:
        # e.g. the vmapped round at batch 64 (every candidate for every client): do not swap or OOM a shared box
        res["error"] = (f"not run: XLA temp {res['temp_mib'] / 1024:.1f} GiB > {MEM_FRACTION:.0%} of available "
                        f"memory {avail / 1024:.1f} GiB (compile {res['lower_s']:.0f} + {res['compile_s']:.0f} s)")
        res["load_end"] = bu.load_line()
        return res
    res["hwm_compile_mib"] = hwm_mib()
    res["rss_before_mib"] = rss_mib()
    res["hwm_reset"] = reset_hwm()
    warm = []
    for call in warmups:
        t, out = bu.timed(lambda: call(compiled))
        warm.append(t)
    res["warmup_s"] = warm
    times, steps = [], []
    for call in timed_calls:
        t, out = bu.timed(lambda: call(compiled))
        times.append(t)
        steps.append(steps_of(out))
    res["hwm_runs_mib"] = hwm_mib()
    res["peak_rss_mib"] = max(res["hwm_compile_mib"], res["hwm_runs_mib"])
    res.update(times=times, step_counts=steps, load_end=bu.load_line())
    return res


# --- workers --------------------------------------------------------------------------


def worker_dfnas(args, mode: str, impl: str, batch: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxfednas.algorithms.dfnas import DFNASConfig, make_local_search, make_supernet
    from jaxfednas.runtime import jit

    cfg = DFNASConfig(space=args.space, batch_size=batch, local_epochs=1, dw_impl=impl,
                      **({"scan_blocks": True} if mode == "scan" else {}))
    data = _client_data(1, args.steps * batch, args.seed)
    info, client = data.info, _first_client(data)
    model = make_supernet(cfg, info, all_paths=mode == "all")
    local = jit(make_local_search(cfg, info, model, epochs=1))
    variables = dict(model.init({"params": jax.random.PRNGKey(args.seed)}, jnp.zeros((1,) + info.image_shape),
                                train=False))
    nb, nc = model.space.num_blocks, model.space.num_candidates
    free, lr = jnp.zeros((nb,), bool), jnp.float32(0.1)
    res = {"kind": f"dfnas:{mode}:{impl}:{batch}", "machine": bu.machine_info(), "load_start": bu.load_line(),
           "steps": args.steps}

    def forced(c):  # every block fixed to candidate c (DFNAS' early-fixing inputs): a uniform path
        return lambda comp: comp(variables, jnp.ones((nb,), bool), jnp.full((nb,), c, jnp.int32), lr, client,
                                 jax.random.PRNGKey(7))

    def sampled(r):
        return lambda comp: comp(variables, free, jnp.zeros((nb,), jnp.int32), lr, client, jax.random.PRNGKey(100 + r))

    warm = [forced(c) for c in (range(nc) if mode in ("single", "scan") else range(1))]
    return _measure(res, lambda: local.lower(variables, free, jnp.zeros((nb,), jnp.int32), lr, client,
                                             jax.random.PRNGKey(0)),
                    warm, [sampled(r) for r in range(args.repeats)], lambda out: int(out[1]["steps"]))


def worker_child(args, cand: str, impl: str, batch: int) -> dict:
    """The DFNAS step on a fixed child: same loss, value_and_grad w.r.t. (weights, gates),
    SGD with momentum and weight decay on kernels (every unit active), no α."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxfednas.algorithms.common import make_augment
    from jaxfednas.algorithms.dfnas import DFNASConfig
    from jaxfednas.data.augment import augment_batch
    from jaxfednas.data.federated import run_local_epochs
    from jaxfednas.runtime import jit
    from jaxfednas.search_spaces.shufflenet import build, uniform_arch

    cfg = DFNASConfig(space=args.space, batch_size=batch, dw_impl=impl)
    data = _client_data(1, args.steps * batch, args.seed)
    info, client = data.info, _first_client(data)
    model = build(uniform_arch(args.space, cand), info.num_classes, dw_impl=impl)
    aug = make_augment(cfg.augment, info.name)
    nb = model.space.num_blocks

    def loss_fn(params, gates, stats, batch_):
        logits, new = model.apply({"params": params, "batch_stats": stats}, batch_["x"], None, gates, train=True,
                                  mask=batch_["mask"], mutable=["batch_stats"])
        labels = optax.smooth_labels(jax.nn.one_hot(batch_["y"], info.num_classes), cfg.label_smoothing)
        ce = optax.softmax_cross_entropy(logits, labels) * batch_["mask"]
        return ce.sum() / jnp.maximum(batch_["mask"].sum(), 1), (new["batch_stats"], ce.sum())

    def local(variables, lr, client_, key):
        params = variables["params"]

        def step(carry, batch_, k):
            params, momentum, stats = carry
            batch_ = {**batch_, "x": augment_batch(k, info.normalize(batch_["x"]), aug)}
            (_, (stats, loss_sum)), (g_w, credit) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                params, jnp.ones((nb,), jnp.float32), stats, batch_)
            g_w = jax.tree.map(lambda g, p: g + cfg.weight_decay * p if p.ndim > 1 else g, g_w, params)
            momentum = jax.tree.map(lambda m, g: cfg.momentum * m + g, momentum, g_w)
            params = jax.tree.map(lambda p, m: p - lr * m, params, momentum)
            return (params, momentum, stats), {"loss_sum": loss_sum, "credit_sum": credit}

        carry = (params, jax.tree.map(jnp.zeros_like, params), variables["batch_stats"])
        (params, _, stats), met = run_local_epochs(step, carry, client_, key, epochs=1, batch_size=batch)
        return {"params": params, "batch_stats": stats}, met

    local = jit(local)
    variables = dict(model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1,) + info.image_shape), train=False))
    lr = jnp.float32(0.1)
    res = {"kind": f"child:{cand}:{impl}:{batch}", "machine": bu.machine_info(), "load_start": bu.load_line(),
           "steps": args.steps}
    call = lambda r: (lambda comp: comp(variables, lr, client, jax.random.PRNGKey(100 + r)))  # noqa: E731
    return _measure(res, lambda: local.lower(variables, lr, client, jax.random.PRNGKey(0)), [call(-1)],
                    [call(r) for r in range(args.repeats)], lambda out: int(out[1]["steps"]))


def worker_clients(args, placement: str, impl: str, batch: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxfednas.algorithms.dfnas import DFNASConfig, dfnas
    from jaxfednas.run_options import RunOptions
    from jaxfednas.runtime import Placement

    cfg = DFNASConfig(space=args.space, batch_size=batch, local_epochs=1, dw_impl=impl)
    data = _client_data(ROUND_CLIENTS, args.steps * batch, args.seed)
    algo = dfnas(cfg, data.info, run=RunOptions(rounds=10, clients_per_round=ROUND_CLIENTS, placement=Placement(placement)))
    state0 = algo.init(jax.random.PRNGKey(args.seed))
    nb = state0.fixed.shape[0]
    res = {"kind": f"clients:{placement}:{impl}:{batch}", "machine": bu.machine_info(),
           "load_start": bu.load_line(), "steps": args.steps}

    def forced(c):
        s = state0.replace(fixed=jnp.ones((nb,), bool), fixed_choice=jnp.full((nb,), c, jnp.int32))
        return lambda comp: comp(s, data, jax.random.PRNGKey(7))

    def sampled(r):
        return lambda comp: comp(state0, data, jax.random.PRNGKey(100 + r))

    warm = [forced(c) for c in (range(4) if placement == "map" else range(1))]
    return _measure(res, lambda: algo.round.lower(state0, data, jax.random.PRNGKey(0)), warm,
                    [sampled(r) for r in range(args.round_repeats)], lambda out: int(out[1]["local_steps"]))


def worker_fednas(args) -> dict:
    import jax

    import fednas_search as fs
    from jaxfednas.algorithms.fednas import FedNASConfig, make_local_search, make_supernet
    from jaxfednas.nn import default_depthwise_impl
    from jaxfednas.runtime import jit

    C, layers, batch = FEDNAS
    steps = args.fednas_steps
    cfg = FedNASConfig(C=C, layers=layers, batch_size=batch, local_epochs=1)
    info, train, val = fs._single_client_data(steps * batch, batch, args.seed)
    model = make_supernet(cfg, info)
    local = jit(make_local_search(cfg, info, model, epochs=1))
    variables = dict(model.init({"params": jax.random.PRNGKey(args.seed)}, jax.numpy.zeros((1,) + info.image_shape),
                                train=False))
    res = {"kind": "fednas", "machine": bu.machine_info(), "load_start": bu.load_line(), "steps": steps,
           "dw_impl": default_depthwise_impl()}
    call = lambda r: (lambda comp: comp(variables, train, val, jax.random.PRNGKey(1000 + r)))  # noqa: E731
    return _measure(res, lambda: local.lower(variables, train, val, jax.random.PRNGKey(0)), [call(0)], [call(1)],
                    lambda out: int(out[1]["steps"]))


def run_worker(args) -> dict:
    kind, *rest = args.worker.split(":")
    if kind == "fednas":
        return worker_fednas(args)
    what, impl, batch = rest[0], rest[1], int(rest[2])
    fn = {"dfnas": worker_dfnas, "child": worker_child, "clients": worker_clients}[kind]
    return fn(args, what, impl, batch)


# --- driver ---------------------------------------------------------------------------


def spawn(kind: str) -> dict:
    import fednas_search as fs

    return bu.run_worker([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", kind],
                         fs.worker_env(), {"kind": kind})


def plan(args) -> list[str]:
    impls = ["slices"] if args.quick else args.impls.split(",")
    skip = set(filter(None, args.skip.split(",")))
    kinds = []
    for impl in impls:
        if impl == "grouped" and not args.grouped_batch:
            continue
        b = args.batch if impl == "slices" else args.grouped_batch
        kinds += [f"dfnas:single:{impl}:{b}", f"dfnas:scan:{impl}:{b}", f"dfnas:all:{impl}:{b}"]
        kinds += [f"child:{c}:{impl}:{b}" for c in (("k3",) if args.quick or impl == "grouped" else ("k3", "k7"))]
        if impl == "slices":
            kinds += [f"clients:{pl}:{impl}:{b}" for pl in ("map", "vmap")]
    if not args.quick:
        kinds.append("fednas")
    return [k for k in kinds if k.split(":")[0] not in skip and ":".join(k.split(":")[:2]) not in skip]


def ms(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def gib(mib) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


LABELS = {
    "dfnas:single": "DFNAS single path (`lax.switch`, `make_local_search`)",
    "dfnas:scan": "same, a stage's identical blocks as one `lax.scan` (`scan_blocks=True`)",
    "dfnas:all": "same supernet, `all_paths=True` (every candidate)",
    "child:k3": "fixed child, all k3 (`build`)",
    "child:k7": "fixed child, all k7 (`build`)",
    "clients:map": f"DFNAS round, {ROUND_CLIENTS} clients, `Placement(\"map\")`",
    "clients:vmap": f"DFNAS round, {ROUND_CLIENTS} clients, `Placement(\"vmap\")`",
    "fednas": "FedNAS MiLeNAS step, DARTS supernet C=16, 8 cells",
}


def per_step(r: dict) -> float:
    """Seconds per local step (client-step for rounds): median over runs of time / steps."""
    return bu.median([t / max(s, 1) for t, s in zip(r["times"], r["step_counts"])])


def step_mem(r: dict) -> float:
    return r["hwm_runs_mib"] - r["rss_before_mib"]


def report(args, res: dict) -> str:
    header = ["configuration", "dw impl", "batch", "compile s (lower + compile)", "s/step (median)",
              "time vs DFNAS single", "per round (median)", "XLA temp MiB", "peak RSS GiB (incl. compile)",
              "step memory GiB (peak - before)", "step memory vs DFNAS single"]
    rows = []

    def base_for(kind: str):
        if kind == "fednas":
            return res.get(f"dfnas:single:slices:{args.batch}")
        _, _, impl, b = kind.split(":")
        return res.get(f"dfnas:single:{impl}:{b}")

    for kind, r in res.items():
        key = ":".join(kind.split(":")[:2]) if kind != "fednas" else "fednas"
        impl, b = (r.get("dw_impl", "fused"), FEDNAS[2]) if kind == "fednas" else kind.split(":")[2:]
        if "error" in r:
            rows.append([LABELS[key], impl, b, r["error"]] + [""] * (len(header) - 4))
            continue
        base = base_for(kind)
        ok = base is not None and "error" not in base
        s = per_step(r)
        rnd = ms(bu.median(r["times"])) if kind.startswith("clients") else "-"
        rows.append([
            LABELS[key] + (f" ({r['step_counts'][0]} client-steps/round)" if kind.startswith("clients") else ""),
            impl, b, f"{r['lower_s']:.1f} + {r['compile_s']:.1f}", ms(s),
            f"{s / per_step(base):.2f}x" if ok else "-", rnd,
            "-" if r.get("temp_mib") is None else f"{r['temp_mib']:.0f}", gib(r["peak_rss_mib"]),
            gib(step_mem(r)), f"{step_mem(r) / step_mem(base):.2f}x" if ok else "-",
        ])
    lines = [
        f"**DFNAS search cost, {args.space} space, 32x32x3 synthetic inputs, 10 classes.** "
        f"One subprocess per row. DFNAS rows: `make_local_search` of `algorithms/dfnas.py` on one client, one "
        f"jitted `lax.scan` of {args.steps} local step(s) (sample path, value_and_grad w.r.t. weights and gates, "
        f"masked SGD, Adam on α); warm-up: the single-path supernet runs the 4 uniform paths first (XLA:CPU pays "
        f"a one-off cost the first time each `lax.switch` branch executes), then {args.repeats} timed runs with "
        f"freshly sampled paths; s/step = median of run time / steps. Child rows: the same loss and update on the "
        f"fixed child (no α). Client rows: `dfnas(...).round` with {ROUND_CLIENTS} clients x {args.steps} local "
        f"step(s), {args.round_repeats} timed round(s) after the warm-up (map: 4 forced uniform-path rounds); "
        f"s/step there is per client-step. FedNAS: `algorithms/fednas.py` MiLeNAS step (Eq. 4, 2 fwd + 2 bwd), "
        f"{args.fednas_steps} step(s) per run, one warm-up run and one timed run. Time/memory ratios are against "
        f"the DFNAS single-path row of the same dw impl and batch (FedNAS: against slices at batch {args.batch}). "
        f"XLA temp = `compiled.memory_analysis().temp_size_in_bytes` of the whole jitted call (all steps of the "
        f"scan / the whole round). Step memory = peak RSS over the runs (peak mark reset after compilation) minus "
        f"RSS right before the first run.",
        "",
        bu.markdown_table(header, rows),
        "",
    ]
    single = res.get(f"dfnas:single:slices:{args.batch}")
    fed = res.get("fednas")
    notes = [
        f"Paper claim (DFNAS paper, GPU, batch 64): {PAPER_MB['dfnas']:,} MB per client for DFNAS vs "
        f"{PAPER_MB['fednas']:,} MB for FedNAS ({PAPER_MB['fednas'] / PAPER_MB['dfnas']:.1f}x)."
    ]
    if single and fed and "error" not in single and "error" not in fed:
        notes.append(
            f"Here (CPU, step memory): FedNAS {gib(step_mem(fed))} GiB vs DFNAS single path "
            f"{gib(step_mem(single))} GiB ({step_mem(fed) / step_mem(single):.1f}x); XLA temp "
            f"{fed['temp_mib']:.0f} vs {single['temp_mib']:.0f} MiB ({fed['temp_mib'] / single['temp_mib']:.1f}x; "
            f"FedNAS runs {fed['steps']} step(s) per scan, DFNAS {single['steps']}); time per step "
            f"{per_step(fed) / per_step(single):.1f}x.")
    warm = [f"{k} {', '.join(f'{t:.1f}' for t in r['warmup_s'])} s" for k, r in res.items()
            if "error" not in r and k.startswith(("dfnas:single", "dfnas:scan", "clients:map"))]
    if warm:
        notes.append("Warm-up runs (uniform paths k3, k5, k7, xception; the first includes the first-run cost "
                     "of every kernel outside the switch): " + "; ".join(warm) + ".")
    lines.append("Notes: " + " ".join(notes))
    loads = [f"{r['kind']} {r['load_start']} / {r['load_end']}" for r in res.values() if "error" not in r]
    if loads:
        lines += ["", "Load average (1/5/15 min) at start / end of each worker: " + "; ".join(loads) + "."]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if bu.serve_worker(args, run_worker):
        return
    t_start = time.perf_counter()
    res = {}
    for kind in plan(args):
        print(f"[dfnas_cost] {kind} ...", flush=True)
        r = spawn(kind)
        res[kind] = r
        if "error" in r:
            print(f"  FAILED: {r['error']}", flush=True)
            continue
        print(f"  compile {r['lower_s']:.1f}+{r['compile_s']:.1f}s, warm-up {[round(t, 1) for t in r['warmup_s']]} s, "
              f"runs {[round(t, 2) for t in r['times']]} s ({r['step_counts']} steps), {per_step(r):.2f} s/step, "
              f"temp {r.get('temp_mib') or 0:.0f} MiB, peak rss {r['peak_rss_mib']:.0f} MiB, step mem "
              f"{step_mem(r):.0f} MiB, load {r['load_end']}, worker wall {r['wall_s']:.0f}s", flush=True)
    wall = time.perf_counter() - t_start
    body = report(args, res) + f"\n\nTotal wall time of this run: {wall / 60:.1f} min."
    print()
    print(body)
    ok = [r for r in res.values() if "error" not in r and "machine" in r]
    if not args.no_write and res:
        info = ok[0]["machine"] if ok else bu.machine_info()
        title = ("DFNAS search cost on CPU: single-path step vs all-candidate supernet, fixed children, client "
                 "placements and the FedNAS step")
        path = bu.results_path(args)
        how = bu.write_results(title, bu.command_line("dfnas_cost.py"), info, body, path)
        print(f"\n{how} {path}")
    return 1 if any("error" in r for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
