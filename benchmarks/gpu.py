"""One accelerator: where a FedNAS search step's time goes, against PyTorch on the same card.

The prepared device script of the GPU work (one command, a time budget, its table printed
last and written to ``--out``). Every figure is a steady state: each program is compiled
ahead of time, run once to warm up (on a GPU: load, autotune), the device synchronised
before a clock is read, the median of repeats reported; every variant is checked against
the reference before it is timed. Parts, in the order they run (``--parts``):

* ``floors``  -- the card's dense matmul rate in each precision (fp32 at highest precision,
  the default -- TF32 on GPUs --, bf16) and its copy bandwidth, measured here; one MiLeNAS
  step's arithmetic (multiply-adds of both passes of Eq. 4 with depthwise convolutions as
  grouped convolutions, x2 for FLOPs) and its minimum traffic (every activation saved for a
  backward pass written once and read once, the weights read and written by both passes and
  the optimizer); the floor of a step is the larger of FLOPs / rate and bytes / bandwidth.
* ``torch``   -- the same step in ``benchmarks/torch_darts.py`` (the authors' MiLeNAS order:
  three forward and backward passes), ``cudnn.benchmark`` on, in its own process on the
  same device. Skipped with a note where torch is not installed.
* ``ops``     -- each convolution of a search edge (sep_conv 3x3 and 5x5, dil_conv 3x3 and
  5x5, with their train-mode BN) alone, forward and backward, at the first and the last
  stage's shapes (32x32 with C, 8x8 with 4C), in every depthwise formulation (checked
  against the grouped one) and, in the ``torch`` part, in the authors' modules: which op and
  which formulation a step's time comes from, for seconds of compilation.
* ``step``    -- one client's FedNAS local search (``make_local_search``: a ``lax.scan`` of
  ``--steps`` MiLeNAS steps) at the paper's shapes (C=16, 8 cells, B=64, CIFAR-sized input)
  for each formulation of the separable and dilated convolutions (``algo.dw_impl``: grouped,
  fused, hybrid, slices; the grouped-by-source cells; unrolled edges) in the default
  precision, then the fastest in fp32-highest, bf16 and the authors' 3-pass order. The
  reference is the grouped formulation in fp32 at highest precision: each variant's one-step
  update of the weights and its loss must match it (relative L2; the tolerance grows with the
  precision) or it is not timed. At these shapes a variant costs about a minute of
  compilation on an H200 (and half a minute of first call): the variants are first compiled
  side by side, ``--compile-jobs`` processes at a time, into the compilation cache, which the
  timing process then reads (``--cache-dir``, else a temporary one); so are the rounds of
  the ``round`` part and the presets of the ``presets`` part. The first formulation
  timed, and the fastest, run once more under ``jax.profiler``: their top kernels and their
  share of device time.
* ``round``   -- a FedNAS round of ``--round-clients`` clients (``--steps`` local steps each,
  the fastest formulation) with clients one at a time (``lax.map``) and in vmapped chunks
  (``--chunks``; a chunk of every client is plain ``vmap``); ``jaxfednas plan``'s
  extrapolation of the one-at-a-time round from a few local steps against its measured time;
  the paper's 50-round search extrapolated from the fastest round's time per client-step.
* ``presets`` -- ``jaxfednas plan`` (steady state, a few local steps extrapolated, clients one
  at a time) of the other papers' presets on the same card: DFNAS cross-silo, SPIDER,
  PerFedRLNAS (DARTS space), DP-FNAS.

Each part runs in its own process and appends its rows to a JSON-lines log as they come, so
a part cut off by ``--budget-s`` (or a killed run) keeps what it measured; a part that
would start with less than a minute left is skipped, and the table says so. One lease of a
GPU (15 minutes) holds two calls: the first (9 minutes of budget) measures the floors, the
PyTorch step and the formulations (the GPU default, the kernel-reduced grouped cells, first
after the reference); the second, on the still-warm machine with the same cache, the
paper's round of 16 clients vmapped (as ``placement=auto`` runs it) with the formulation the
first found fastest. Every compiled program's kernels per step (``jaxfednas.kernels``) are
printed beside its time.

    PYTHONPATH=. python benchmarks/gpu.py --out $OUT/gpu.md --cache-dir .cache/gpu-xla  # GPU, ~9 min
    PYTHONPATH=. python benchmarks/gpu.py --parts round --round-formulation FASTEST --round-clients 16 \
        --chunks 16 --budget-s 270 --out $OUT/gpu2.md --cache-dir .cache/gpu-xla        # then, warm
    PYTHONPATH=. python benchmarks/gpu.py --quick                                        # CPU: every code path
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import _bench_util as bu
import fednas_search as fs  # its synthetic client and worker environment

PARTS = ("floors", "torch", "ops", "step", "round", "presets")
CONFIGS = {"paper": (16, 8, 64), "q": (4, 1, 8)}  # C, cells, batch
NODES = {"q": 1}
# FedNAS config fields of each formulation (the default precision); order = priority
FORMULATIONS = {
    # the GPU default (algo.dw_impl=auto, group_edges=auto): the fewest kernels (benchmarks/kernels.py)
    "fused/grouped-cells": {"dw_impl": "fused", "group_edges": "on"},
    "grouped": {"dw_impl": "grouped", "group_edges": "off"},
    "fused": {"dw_impl": "fused", "group_edges": "off"},
    "hybrid": {"dw_impl": "hybrid", "group_edges": "off"},
    "slices": {"dw_impl": "slices", "group_edges": "off"},
    "grouped/unrolled": {"dw_impl": "grouped", "group_edges": "off", "scan_edges": False},
}
PRECISIONS = ("default", "highest", "bf16")  # default: TF32 on GPUs, exact float32 on CPU
# relative L2 of the one-step weight update (and of the loss) against the reference
TOLERANCE = {"highest": 1e-3, "default": 3e-2, "bf16": 1.5e-1}
# clients one at a time (a vmapped paper-sized round may not fit; plan's few-step timing needs it)
PRESETS = (("dfnas", "cross-silo", {"run.placement": "map"}), ("spider", "paper", {"run.placement": "map"}),
           ("perfedrlnas", "paper", {"algo.space": "darts", "run.placement": "map"}),
           ("dp_fnas", "paper", {"run.placement": "map"}))
# --quick: the quickest to compile; two, so that their compile processes run too
QUICK_PRESETS = (("perfedrlnas", "smoke", {}), ("fedavg", "smoke", {}))
# share of --budget-s each part may take (the last part run takes what is left)
BUDGET_SHARE = {"floors": 0.08, "torch": 0.12, "ops": 0.12, "step": 0.6, "round": 0.3, "presets": 1.0}
# the `ops` part: the search edge's convolutions alone, forward + backward, at a cell's shapes
CONV_OPS = ("sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5")
DW_IMPLS = ("grouped", "fused", "hybrid", "slices")  # the first is the reference of the others
OP_CALLS = 20  # calls per timed repeat, back to back (device time, not dispatch, dominates)
PAPER_ROUNDS, PAPER_EPOCHS = 50, 5
QUICK = {"config": "q", "steps": 1, "repeats": 1, "compile_jobs": 2, "round_clients": 2, "chunks": "1,2", "round_repeats": 1,
         "local_steps": 1, "budget_s": 0.0, "matmul_n": 512, "copy_mib": 16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list from {PARTS}")
    p.add_argument("--config", default="paper", help=f"step/round shapes: {sorted(CONFIGS)} (C, cells, batch)")
    p.add_argument("--formulations", default=",".join(FORMULATIONS), help=f"comma list from {tuple(FORMULATIONS)}")
    p.add_argument("--steps", type=int, default=2, help="MiLeNAS steps per timed call (and per client in a round)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up (median reported)")
    p.add_argument("--compile-jobs", type=int, default=8, help="the step part compiles its variants in this many "
                   "processes at once into the compilation cache before timing them one after another (1: "
                   "one after another in the timing process)")
    p.add_argument("--round-clients", type=int, default=4, help="clients of the `round` part")
    p.add_argument("--chunks", default="1,2,4,8", help="clients in flight of the `round` part (1: lax.map, one at "
                   "a time; every client: vmap); sizes above --round-clients are left out")
    p.add_argument("--round-repeats", type=int, default=3, help="timed rounds per placement")
    p.add_argument("--local-steps", type=int, default=2, help="local-step slots plan measures before extrapolating")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting parts after this many seconds "
                   "(0: no limit); a running part is cut off at the budget and keeps the rows it wrote")
    p.add_argument("--matmul-n", type=int, default=8192, help="size of the square matmuls of the `floors` part")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB copied to measure the bandwidth")
    p.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache for every part (a "
                   "second run on the same machine then reads its programs: its compile times are cache reads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; do not write the results file")
    bu.add_torch_python_arg(p)
    bu.add_output_args(p, "config q (C=4, 1 cell of 1 node, B=8), 1 step x 1 call, 2 clients, every preset's "
                       "smoke configuration, no time budget")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--round-formulation", dest="best", default="", help="the formulation of the `round` part "
                   "(default: the step part's fastest in this run, else grouped); for a second call that runs "
                   "`--parts round,presets` after the step part's")
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)  # the precompile worker's variant
    args = bu.parse_with_quick(p, argv, QUICK)
    parts = bu.check_choices(p, args.parts, PARTS, "part")
    args.torch_exe = bu.torch_python(p, args) if "torch" in parts and not args.worker else None
    bu.check_choices(p, args.formulations, tuple(FORMULATIONS), "formulation")
    if args.config not in CONFIGS:
        p.error(f"unknown config {args.config!r}; choose from {sorted(CONFIGS)}")
    for name in ("steps", "repeats", "compile_jobs", "round_clients", "round_repeats", "local_steps", "matmul_n", "copy_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.chunk_list = sorted({int(c) for c in args.chunks.split(",")})
    except ValueError:
        p.error(f"--chunks must be a comma list of integers, got {args.chunks!r}")
    if args.chunk_list[0] < 1:
        p.error(f"--chunks must be >= 1, got {args.chunks!r}")
    if args.best and args.best.partition("@")[0].removesuffix("+3pass") not in FORMULATIONS:
        p.error(f"--round-formulation must be one of {tuple(FORMULATIONS)}, got {args.best!r}")
    if not (args.budget_s >= 0 and math.isfinite(args.budget_s)):
        p.error(f"--budget-s must be a finite number >= 0, got {args.budget_s}")
    return args


def emit(args, row: dict) -> None:
    """Append one result row to the worker's log (flushed: a cut-off part keeps it)."""
    with open(args.log, "a") as f:
        f.write(json.dumps(row) + "\n")


# --- shared JAX pieces --------------------------------------------------------------------


def fednas_fields(args, extra: dict | None = None) -> dict:
    C, layers, batch = CONFIGS[args.config]
    return {"C": C, "layers": layers, "nodes": NODES.get(args.config, 4), "batch_size": batch, "local_epochs": 1,
            **(extra or {})}


def variant_fields(name: str) -> tuple[dict, str]:
    """``(FedNAS config fields, precision)`` of a variant named ``FORMULATION[@PRECISION][+3pass]``."""
    base, _, rest = name.partition("@")
    precision, three = (rest or "default"), False
    if base.endswith("+3pass"):
        base, three = base[:-len("+3pass")], True
    if precision.endswith("+3pass"):
        precision, three = precision[:-len("+3pass")], True
    fields = dict(FORMULATIONS[base])
    if three:
        fields["order"] = "alpha_first"
    return fields, precision


def xla_gib(compiled) -> float | None:
    """XLA's memory analysis of a compiled program, as ``jaxfednas plan`` totals it (GiB)."""
    from jaxfednas.plan import _memory

    mem = _memory(compiled)
    return None if mem is None else mem["total"] / 2 ** 30


def kernels_of(compiled) -> int:
    """The launches of a compiled program (:func:`jaxfednas.kernels.count_kernels`: every
    branch of a conditional counted), for the kernels-per-step column beside its time."""
    from jaxfednas.kernels import count_kernels

    return count_kernels(compiled.as_text()).kernels


def matmul_precision(precision: str):
    import contextlib

    import jax

    return jax.default_matmul_precision("highest") if precision == "highest" else contextlib.nullcontext()


# --- worker: floors -----------------------------------------------------------------------


def worker_floors(args) -> None:
    import jax
    import jax.numpy as jnp

    from jaxfednas.algorithms.fednas import FedNASConfig, make_supernet
    from jaxfednas.cost import count_macs

    n = args.matmul_n
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    for precision in PRECISIONS:
        x = a.astype(jnp.bfloat16) if precision == "bf16" else a
        with matmul_precision(precision):
            f = jax.jit(lambda x: x @ x).lower(x).compile()
        jax.block_until_ready(f(x))
        best = min(bu.timed(lambda: f(x))[0] for _ in range(5))
        emit(args, {"part": "floors", "what": f"matmul_{precision}", "flops_per_s": 2.0 * n ** 3 / best})
    m = args.copy_mib * 2 ** 20 // 4
    buf = jnp.ones((m,), jnp.float32)
    copy = jax.jit(lambda b: b * 1.0000001).lower(buf).compile()  # reads and writes every byte once
    jax.block_until_ready(copy(buf))
    best = min(bu.timed(lambda: copy(buf))[0] for _ in range(5))
    emit(args, {"part": "floors", "what": "copy", "bytes_per_s": 2.0 * 4 * m / best})

    # one MiLeNAS step's arithmetic and minimum traffic, depthwise convolutions as grouped ones
    cfg = FedNASConfig(**fednas_fields(args, FORMULATIONS["grouped"]))
    info, _, _ = fs._single_client_data(cfg.batch_size, cfg.batch_size, args.seed)
    model = make_supernet(cfg, info)
    x0 = jnp.zeros((1,) + info.image_shape)
    shapes = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, x0, train=False))
    batch = jax.ShapeDtypeStruct((cfg.batch_size,) + info.image_shape, jnp.float32)
    labels = jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32)

    stats = shapes["batch_stats"]

    def loss(params, arch, stats, x, y):
        logits, _ = model.apply({"params": params, "arch": arch, "batch_stats": stats}, x,
                                train=True, mutable=["batch_stats"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    both = lambda p, a, s, x, y: jax.vjp(lambda p_, a_: loss(p_, a_, s, x, y), p, a)  # noqa: E731
    arch_only = lambda p, a, s, x, y: jax.vjp(lambda a_: loss(p, a_, s, x, y), a)  # noqa: E731
    operands = (shapes["params"], shapes["arch"], stats, batch, labels)

    def macs(vjp) -> int:  # forward and backward of one pass
        def grads(*ops):
            value, pullback = vjp(*ops)
            return pullback(jnp.ones_like(value))
        return count_macs(grads, *operands)

    def saved_bytes(vjp) -> int:
        """Bytes a pass keeps for its backward: the leaves of its pullback."""
        out = jax.eval_shape(lambda *ops: jax.tree.leaves(vjp(*ops)[1]), *operands)
        return sum(math.prod(o.shape) * o.dtype.itemsize for o in out)

    w_and_a, a_only = macs(both), macs(arch_only)
    param_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes["params"]))
    input_bytes = 2 * (math.prod(batch.shape) * 4 + cfg.batch_size * 4)
    # saved activations written and read once per pass; weights read by both passes, their
    # gradient written and read, SGD's momentum read and written, the weights written back
    min_bytes = 2 * saved_bytes(both) + 2 * saved_bytes(arch_only) + input_bytes + 6 * param_bytes
    emit(args, {"part": "floors", "what": "step", "flops": 2.0 * (w_and_a + a_only), "bytes": float(min_bytes),
                "params": int(param_bytes // 4)})


# --- worker: the edge's convolutions alone -----------------------------------------------------


def op_shapes(args) -> list[tuple[int, int]]:
    """``(H=W, C)`` of the first stage's cells and of the last (C doubles, H halves per reduction)."""
    C, layers, _ = CONFIGS[args.config]
    # DARTS reduces at layers // 3 and 2 * layers // 3: two reductions from 3 cells on
    return [(32, C)] if layers < 3 else [(32, C), (32 // 4, 4 * C)]


def worker_ops(args) -> None:
    """Each convolution of a search edge (affine-free BN in training mode, as in the
    supernet) forward and backward, in every depthwise formulation, checked against the
    grouped one (input and parameter gradients, relative L2) before it is timed: where a
    step's time goes, op by op, in seconds of compilation."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfednas.search_spaces.darts.operations import make_op

    batch = CONFIGS[args.config][2]
    key = jax.random.PRNGKey(args.seed)
    for hw, C in op_shapes(args):
        kx, kc = jax.random.split(jax.random.fold_in(key, hw))
        x = jax.random.normal(kx, (batch, hw, hw, C))
        ct = jax.random.normal(kc, (batch, hw, hw, C))
        for op in CONV_OPS:
            ref = None
            for impl in DW_IMPLS:
                row = {"part": "ops", "variant": impl, "op": op, "hw": hw, "C": C, "batch": batch}
                module = make_op(op, C, 1, False, dw_impl=impl)
                variables = module.init(key, x, train=True)
                stats = variables.get("batch_stats", {})

                def loss(params, x, module=module, stats=stats):
                    out, _ = module.apply({"params": params, "batch_stats": stats}, x, train=True,
                                          mutable=["batch_stats"])
                    return jnp.vdot(out, ct)

                t0 = time.perf_counter()
                compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables["params"], x).compile()
                row["compile_s"] = time.perf_counter() - t0
                _, grads = compiled(variables["params"], x)
                got = np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])
                if ref is None:
                    ref = got
                    row["check"] = "reference"
                else:
                    row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    row["check"] = "ok" if row["rel_err"] <= TOLERANCE["default"] else "FAILED"
                if row["check"] != "FAILED":
                    def calls(params=variables["params"], compiled=compiled):
                        return [compiled(params, x) for _ in range(OP_CALLS)]
                    bu.timed(calls)
                    times = [bu.timed(calls)[0] / OP_CALLS for _ in range(args.repeats)]
                    row.update(times=times, s_per_call=bu.median(times))
                emit(args, row)


# --- worker: the step in every formulation ------------------------------------------------


def build_step(args, name: str, info):
    """The jitted local search of variant ``name`` and its one-time compiled program."""
    from jaxfednas.algorithms.fednas import FedNASConfig, cpu_scheduler, make_local_search, make_supernet
    from jaxfednas.runtime import jit

    fields, precision = variant_fields(name)
    cfg = FedNASConfig(**fednas_fields(args, fields))
    model = make_supernet(cfg, info)
    local = jit(make_local_search(cfg, info, model, epochs=1, precision="bf16" if precision == "bf16" else "fp32"),
                scheduler=cpu_scheduler(cfg), keep_calls=model.runs_grouped(info.image_shape))
    return cfg, model, local, precision


def step_inputs(args, key):
    """The data, starting variables and key every variant of the step part is lowered with
    (the timing process and the compile processes build the same arguments, hence the same
    program and cache key)."""
    import jax
    import jax.numpy as jnp

    C, layers, batch = CONFIGS[args.config]
    info, train, val = fs._single_client_data(args.steps * batch, batch, args.seed)
    one_step = train.replace(count=jnp.asarray(batch, train.count.dtype))  # the same program, one real step
    _, model, _, _ = build_step(args, "grouped", info)
    x0 = jnp.zeros((1,) + info.image_shape)
    variables = dict(jax.jit(lambda k: model.init({"params": k}, x0, train=False))(key))
    return info, train, one_step, val, variables


def variant_start(cfg, variables) -> dict:
    """``variables`` in variant ``cfg``'s layout (the same values; unrolled edges split the scan's)."""
    from jaxfednas.search_spaces.darts import unroll_variables

    if cfg.scan_edges:
        return variables
    return {"params": unroll_variables(variables["params"]), "arch": variables["arch"],
            "batch_stats": unroll_variables(variables["batch_stats"])}


def worker_precompile(args) -> None:
    """Lower and compile one program (``--variant``: a step variant, ``round:CHUNK`` or
    ``preset:INDEX``) into the persistent compilation cache, for the timing process to read
    back: compiling is the costly part at the paper's shapes (about a minute a program on an
    H200), and separate processes compile side by side."""
    import jax

    t0 = time.perf_counter()
    kind, _, which = args.variant.partition(":")
    if kind == "round":
        from jaxfednas.plan import plan_data

        cfg, n_train, _ = round_setup(args, int(which))
        round_program(args, cfg, plan_data(cfg, num_train=n_train, num_test=args.round_clients))[0].compile()
    elif kind == "preset":
        from jaxfednas.plan import plan_run

        plan_run(preset_config(args, int(which)), measure=False, probe_chunk=False, precisions=(), macs=False)
    else:
        key = jax.random.PRNGKey(args.seed)
        info, _, one_step, val, variables = step_inputs(args, key)
        cfg, _, local, precision = build_step(args, args.variant, info)
        with matmul_precision(precision):
            lowered = local.lower(variant_start(cfg, variables), one_step, val, key)
        lowered.compile()
    emit(args, {"part": "precompile", "variant": args.variant, "compile_s": time.perf_counter() - t0})


def ensure_cache(args) -> None:
    """A compilation cache for this part (``--cache-dir``, else a temporary one): the compile
    processes hand their programs over through it."""
    import tempfile

    import jax

    if not args.cache_dir:
        args.cache_dir = tempfile.mkdtemp(prefix="jaxfednas-gpu-cache-")
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def precompile(args, names: list[str]) -> None:
    """Compile ``names`` into the compilation cache, ``--compile-jobs`` processes at a time
    (before this process touches the device: the compile processes' autotuning needs its
    memory; they allocate only what they use). A variant that fails to compile here is
    compiled, and its error reported, by the timing process."""
    if args.compile_jobs < 2 or len(names) < 2:
        return
    env = dict(fs.worker_env(), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    base = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", "precompile", "--log", args.log,
            "--cache-dir", args.cache_dir]
    waiting, running = list(names), []
    while waiting or running:
        while waiting and len(running) < args.compile_jobs:
            running.append(subprocess.Popen(base + ["--variant", waiting.pop(0)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        running[0].wait()
        running = [r for r in running if r.poll() is None]


def worker_step(args) -> None:
    import jax
    import numpy as np

    ensure_cache(args)
    formulations = args.formulations.split(",")
    precompile(args, ["grouped@highest"] + [f for f in formulations if f != "grouped@highest"])

    from jaxfednas.runtime import release_memory_after_compiles
    from jaxfednas.search_spaces.darts import unroll_variables

    release_memory_after_compiles()
    key = jax.random.PRNGKey(args.seed)
    info, train, one_step, val, variables = step_inputs(args, key)
    reference = None
    runners = {}  # variant -> one timed call of its compiled program (for the profile)

    def update(out, start):
        return (jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                             out[0]["params"], start["params"]), float(out[1]["loss_sum"]))

    def flat(tree):
        return np.concatenate([x.ravel() for x in jax.tree.leaves(tree)])

    def run_variant(name: str, time_it: bool = True) -> dict:
        nonlocal reference
        cfg, _, local, precision = build_step(args, name, info)
        start = variant_start(cfg, variables)
        row = {"part": "step", "variant": name, "precision": precision}
        t0 = time.perf_counter()
        with matmul_precision(precision):
            lowered = local.lower(start, one_step, val, key)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        row.update(lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
        row["xla_gib"] = xla_gib(compiled)
        row["kernels_per_step"] = kernels_of(compiled) / args.steps
        first_s, out = bu.timed(lambda: compiled(start, one_step, val, key))
        d, loss = update(out, start)
        row["first_call_s"] = first_s
        if reference is None:
            reference = (d, loss)
            row.update(check="reference", rel_err=0.0)
        else:
            want = flat(reference[0] if cfg.scan_edges else unroll_variables(reference[0]))
            err = float(np.linalg.norm(flat(d) - want) / np.linalg.norm(want))
            loss_err = abs(loss - reference[1]) / abs(reference[1])
            tol = TOLERANCE[precision]
            row.update(rel_err=err, loss_rel_err=loss_err, tolerance=tol,
                       check="ok" if max(err, loss_err) <= tol else "FAILED")
        if time_it and row["check"] != "FAILED":
            bu.timed(lambda: compiled(start, train, val, key))  # warm-up at the timed shape
            times = [bu.timed(lambda: compiled(start, train, val, key))[0] for _ in range(args.repeats)]
            row.update(times=times, s_per_step=bu.median(times) / args.steps)
            runners[name] = lambda: compiled(start, train, val, key)
        emit(args, row)
        return row

    run_variant("grouped@highest")  # the reference (also a timed row)
    rows = []
    profiled = ""
    for name in formulations:
        try:
            rows.append(run_variant(name))
        except Exception as e:  # noqa: BLE001 -- a formulation that does not build is a row, not the end
            if args.quick:  # tiny shapes: an error is a broken code path, not a limit
                raise
            emit(args, {"part": "step", "variant": name, "precision": "default",
                        "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
        if not profiled and name in runners:  # where the first one's time goes, before a cut-off can come
            profiled = name
            try:
                profile_compiled(args, name, runners[name])
            except Exception as e:  # noqa: BLE001 -- a profiler that fails costs its table only
                emit(args, {"part": "profile_error", "error": f"{type(e).__name__}: {e}"[:300]})
    timed_rows = [r for r in rows if "s_per_step" in r]
    if not timed_rows:
        return
    best = min(timed_rows, key=lambda r: r["s_per_step"])["variant"]
    try:
        if best != profiled:
            profile_compiled(args, best, runners[best])
    except Exception as e:  # noqa: BLE001 -- a profiler that fails costs its table only
        emit(args, {"part": "profile_error", "error": f"{type(e).__name__}: {e}"[:300]})
    for name in list(runners):
        if name != best:
            del runners[name]  # the other programs' memory back before the next compiles
    suffixed = [best + suffix for suffix in ("@highest", "@bf16", "+3pass") if best + suffix != "grouped@highest"]
    precompile(args, suffixed)  # with less device memory free than the first time: one that fails compiles here
    for name in suffixed:
        try:
            run_variant(name)
        except Exception as e:  # noqa: BLE001
            if args.quick:  # tiny shapes: an error is a broken code path, not a limit
                raise
            emit(args, {"part": "step", "variant": name, "error": f"{type(e).__name__}: {e}"[:300]})


def profile_compiled(args, name: str, run) -> None:
    """One call of ``run()`` (variant ``name``'s compiled local search) under jax.profiler:
    its top kernels."""
    import tempfile

    import jax

    trace_dir = tempfile.mkdtemp(prefix="jaxfednas-profile-")
    jax.profiler.start_trace(trace_dir)
    try:
        bu.timed(run)
    finally:
        jax.profiler.stop_trace()
    kernels, where = top_kernels(trace_dir)
    total = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    emit(args, {"part": "profile", "variant": name, "where": where, "total_ms": total / 1e6,
                "kernels": [[k, t / 1e6, t / total if total else 0.0] for k, t in top]})


def top_kernels(trace_dir: str) -> tuple[dict[str, float], str]:
    """Device time per kernel (ns, summed over launches) from the trace's xplane: the GPU's
    ``XLA Ops`` line (else its stream lines), or on CPU the XLA threads of the host plane."""
    from jax.profiler import ProfileData

    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        return {}, "no trace written"
    data = ProfileData.from_file(str(paths[-1]))
    planes = list(data.planes)
    device = [pl for pl in planes if pl.name.startswith("/device:")]
    lines, where = [], ""
    for pl in device:
        ops = [ln for ln in pl.lines if ln.name == "XLA Ops"]
        lines += ops or [ln for ln in pl.lines if ln.name.startswith("Stream")]
        where = where or f"{pl.name} ({'XLA Ops' if ops else 'streams'})"
    if not lines:
        for pl in planes:
            if pl.name == "/host:CPU":
                lines = [ln for ln in pl.lines if ln.name.startswith("tf_XLA")]
                where = "/host:CPU (XLA threads)"
    out: dict[str, float] = {}
    for ln in lines:
        for ev in ln.events:
            if ev.name.startswith("ThunkExecutor"):  # XLA:CPU's wrapper around the kernels it runs
                continue
            out[ev.name] = out.get(ev.name, 0.0) + float(ev.duration_ns)
    return out, where


# --- worker: torch ------------------------------------------------------------------------


def worker_torch(args) -> None:
    import torch

    import torch_darts as td

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    C, layers, batch = CONFIGS[args.config]
    n = NODES.get(args.config, 4)
    net = td.DartsSearchNetwork(C, 10, layers, steps=n, multiplier=n).to(dev)
    with torch.no_grad():  # α as leaf tensors on the device (they are not module parameters)
        net.alphas_normal = net.alphas_normal.detach().to(dev).requires_grad_(True)
        net.alphas_reduce = net.alphas_reduce.detach().to(dev).requires_grad_(True)
    net.train()
    w_opt, a_opt = td.make_optimizers(net)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(2 * args.steps, batch, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (2 * args.steps, batch), generator=g).to(dev)

    def run(k: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(k):
            td.milenas_step(net, w_opt, a_opt, x[i % args.steps], y[i % args.steps],
                            x[args.steps + i % args.steps], y[args.steps + i % args.steps])
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(3)  # warm-up (cudnn.benchmark picks its kernels on the first calls)
    times = [run(args.steps) for _ in range(args.repeats)]
    row = {"part": "torch", "variant": "torch (authors' 3-pass order)", "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cudnn_benchmark": cuda,
           "times": times, "s_per_step": bu.median(times) / args.steps}
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["cuda"] = torch.version.cuda
    emit(args, row)

    # the `ops` part's convolutions in the authors' modules (NCHW, cuDNN), forward + backward
    for hw, C in op_shapes(args):
        xo = torch.randn(batch, C, hw, hw, generator=g).to(dev).requires_grad_(True)
        cto = torch.randn(batch, C, hw, hw, generator=g).to(dev)
        for op in CONV_OPS:
            module = td.make_op(op, C, 1).to(dev).train()

            def calls(k: int, module=module, x=xo, ct=cto) -> float:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(k):
                    module(x).backward(ct)
                if cuda:
                    torch.cuda.synchronize()
                return time.perf_counter() - t0

            calls(3)
            times = [calls(OP_CALLS) / OP_CALLS for _ in range(args.repeats)]
            emit(args, {"part": "ops", "variant": "torch", "op": op, "hw": hw, "C": C, "batch": batch,
                        "times": times, "s_per_call": bu.median(times)})


# --- worker: rounds and the plan's extrapolation -------------------------------------------


def round_config(args, chunk: int | None, placement: str):
    from jaxfednas.registry import make_config

    fields, _ = variant_fields(args.best or "grouped")
    K, batch = args.round_clients, CONFIGS[args.config][2]
    algo = {f"algo.{k}": v for k, v in fednas_fields(args, fields).items()}
    return make_config("fednas", overrides={
        "data.dataset": "cifar10", "data.num_clients": K, "data.partition": "iid", "data.split": (0.5, 0.5, 0.0),
        "run.seed": args.seed, "run.placement": placement, "run.client_chunk_size": chunk, **algo,
    }), K * 2 * args.steps * batch


def round_setup(args, chunk: int):
    """``(config, training examples, placement)`` of the round part with ``chunk`` clients in
    flight: one at a time (``lax.map``), chunks of the map, or every client vmapped."""
    K = args.round_clients
    placement = "vmap" if chunk == K and chunk > 1 else "map"
    cfg, n_train = round_config(args, None if placement == "vmap" or chunk == 1 else chunk, placement)
    return cfg, n_train, placement


def round_program(args, cfg, data):
    """``(lowered round, state, key)``: the round of ``cfg`` lowered on ``data``."""
    from jaxfednas.registry import build_algorithm
    from jaxfednas.rng import init_key, round_key

    algo = build_algorithm(cfg, data.info)
    state, key = algo.init(init_key(args.seed)), round_key(args.seed, 0)
    return algo.round.lower(state, data, key), state, key


def measure_one_round(args, cfg, data, chunk: int) -> dict:
    from jaxfednas.plan import measure_round

    row = {"client_steps": int(sum(-(-int(n) // cfg.algo.batch_size) for n in data.train.counts))}
    t0 = time.perf_counter()
    lowered, state, key = round_program(args, cfg, data)
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - t0
    row["xla_gib"] = xla_gib(compiled)
    row["kernels_per_client_step"] = kernels_of(compiled) / row["client_steps"]
    row["first_call_s"], _ = bu.timed(lambda: compiled(state, data, key))
    times = [bu.timed(lambda: compiled(state, data, key))[0] for _ in range(args.round_repeats)]
    row.update(times=times, round_s=bu.median(times), s_per_client_step=bu.median(times) / row["client_steps"])
    if chunk == 1:  # the plan's estimate of this very round, from a few local steps
        est = measure_round(cfg, data, {"compiled": compiled, "state": state, "key": key}, args.local_steps)
        row.update(plan_round_s=est["round_s"], plan_method=est["method"])
    return row


def worker_round(args) -> None:
    from jaxfednas.data import partition as part
    from jaxfednas.experiment import make_partition
    from jaxfednas.plan import plan_data, synthetic_like
    from jaxfednas.registry import make_config
    from jaxfednas.runtime import release_memory_after_compiles

    ensure_cache(args)
    K = args.round_clients
    chunks = [c for c in args.chunk_list if c <= K]
    precompile(args, [f"round:{c}" for c in chunks])
    release_memory_after_compiles()
    # the paper's search: every client's local-step slots over 5 epochs and 50 rounds
    paper = make_config("fednas", preset="paper")
    splits = part.manifest_splits(make_partition(paper, synthetic_like(paper.data.dataset, seed=paper.run.seed)))
    slots = sum(-(-len(ids) // paper.algo.batch_size) for ids in splits["train"])
    emit(args, {"part": "paper", "client_steps_per_round": int(slots * PAPER_EPOCHS),
                "rounds": PAPER_ROUNDS})
    data = None
    for c in chunks:
        cfg, n_train, placement = round_setup(args, c)
        row = {"part": "round", "placement": placement, "chunk": c, "clients": K}
        try:
            if data is None:
                data = plan_data(cfg, num_train=n_train, num_test=K)
            row.update(measure_one_round(args, cfg, data, c))
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory: the row says so, the next chunk runs
            if args.quick:  # tiny shapes cannot run out of memory: an error there is a broken code path
                raise
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        emit(args, row)


def preset_config(args, i: int):
    from jaxfednas.registry import make_config

    algo, preset, extra = (QUICK_PRESETS if args.quick else PRESETS)[i]
    return make_config(algo, preset=preset, overrides=extra)


def worker_presets(args) -> None:
    from jaxfednas.plan import plan_run

    presets = QUICK_PRESETS if args.quick else PRESETS
    ensure_cache(args)
    precompile(args, [f"preset:{i}" for i in range(len(presets))])
    for i, (algo, preset, _) in enumerate(presets):
        row = {"part": "presets", "algorithm": algo, "preset": preset}
        try:
            cfg = preset_config(args, i)
            plan = plan_run(cfg, local_steps=args.local_steps, probe_chunk=False, precisions=(), macs=False)
        except Exception as e:  # noqa: BLE001 -- one preset's failure is its row
            if args.quick:  # tiny shapes: an error is a broken code path, not a limit
                raise
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            emit(args, row)
            continue
        r, t = plan.get("round") or {}, plan.get("timing") or {}
        mem = (r.get("memory_bytes_per_device") or {}).get("total")
        row.update(placement=plan["placement"]["resolved"], compile_s=r.get("compile_s"),
                   xla_gib=mem / 2 ** 30 if mem else None, round_s=t.get("round_s"), rounds=t.get("rounds"),
                   run_s=t.get("run_s_estimate"), method=t.get("method") or t.get("skipped") or r.get("error"))
        emit(args, row)


WORKERS = {"floors": worker_floors, "ops": worker_ops, "step": worker_step, "precompile": worker_precompile,
           "torch": worker_torch, "round": worker_round, "presets": worker_presets}


# --- driver -------------------------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut off by a kill
            pass
    return rows


def spawn(args, part: str, log: Path, timeout: float | None, best: str = "") -> str:
    """Run one part in a fresh process; ``""`` on success, else why it stopped."""
    env = fs.worker_env()
    exe = args.torch_exe if part == "torch" else sys.executable
    cmd = [exe, os.path.abspath(__file__), *sys.argv[1:], "--worker", part, "--log", str(log)]
    if best:
        cmd += ["--round-formulation", best]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"cut off at the time budget ({timeout:.0f} s)"
    if proc.returncode != 0:
        sys.stderr.write(f"--- {part} failed; the end of its output:\n" + proc.stdout[-2000:] + proc.stderr[-4000:])
        return f"worker exited {proc.returncode}"
    return ""


def machine_facts() -> dict:
    """Device, driver, CUDA and package versions, without importing jax here (the parts own the device)."""
    from importlib import metadata

    facts = {}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt",
                "flax", "torch"):
        try:
            facts[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            facts["gpu"] = out.stdout.strip().splitlines()[0]
        top = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        for line in top.splitlines():
            if "CUDA Version" in line:
                facts["driver_cuda"] = line.split("CUDA Version:")[1].split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    facts["cpu_count"] = os.cpu_count()
    return facts


def _ms(s) -> str:
    return "n/a" if s is None else f"{1e3 * s:.1f}"


def _kernels(n) -> str:
    return "" if n is None else f"{n:,.0f}"


def _gib(r: dict, key: str) -> str:
    return "n/a" if r.get(key) is None else f"{r[key]:.2f}"


def _x(a, b) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def report(args, rows: list[dict], skipped: dict[str, str], facts: dict) -> str:
    by = lambda part: [r for r in rows if r.get("part") == part]  # noqa: E731
    floors = {r["what"]: r for r in by("floors")}
    torch_row = next(iter(by("torch")), None)
    C, layers, batch = CONFIGS[args.config]
    out = [f"Config: C={C}, {layers} cells, {NODES.get(args.config, 4)} nodes, batch {batch}, 32x32x3, "
           f"{args.steps} steps per timed call, median of {args.repeats}"
           + (f"; persistent compilation cache {args.cache_dir} (compile times may be cache reads)." if args.cache_dir
              else "; a temporary compilation cache per part (its compile processes fill it)."),
           "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + "."]
    floor_s = {}
    if "step" in floors:
        st = floors["step"]
        out += ["", "**Floors** (measured in the same run)", "",
                bu.markdown_table(["what", "value"], [
                    ["one step: FLOPs (both passes of Eq. 4, grouped depthwise)", f"{st['flops'] / 1e9:.2f} GFLOP"],
                    ["one step: minimum traffic", f"{st['bytes'] / 2 ** 30:.3f} GiB"],
                    *[[f"matmul rate, {p}", f"{floors[f'matmul_{p}']['flops_per_s'] / 1e12:.2f} TFLOP/s"]
                      for p in PRECISIONS if f"matmul_{p}" in floors],
                    *([["copy bandwidth", f"{floors['copy']['bytes_per_s'] / 1e9:.1f} GB/s"]] if "copy" in floors
                      else []),
                ])]
        for p in PRECISIONS:
            if f"matmul_{p}" in floors and "copy" in floors:
                floor_s[p] = max(st["flops"] / floors[f"matmul_{p}"]["flops_per_s"],
                                 st["bytes"] / floors["copy"]["bytes_per_s"])
        out += ["", "Floor of a step (the larger of FLOPs / rate and traffic / bandwidth): " +
                ", ".join(f"{p} {_ms(s)} ms" for p, s in floor_s.items()) + "."]
    ops = by("ops")
    if ops:
        cells = {}
        for r in ops:
            cell = cells.setdefault((r["hw"], r["C"], r["op"]), {})
            if "s_per_call" in r:
                cell[r["variant"]] = f"{1e3 * r['s_per_call']:.3f}"
            elif r.get("check") == "FAILED":
                cell[r["variant"]] = f"FAILED ({r['rel_err']:.1e})"
        cols = [v for v in (*DW_IMPLS, "torch") if any(v in c for c in cells.values())]
        batch_ = ops[0]["batch"]
        table = [[f"{op}, {hw}x{hw}x{C}", *[c.get(v, "") for v in cols]] for (hw, C, op), c in cells.items()]
        worst = max((r.get("rel_err", 0.0) for r in ops), default=0.0)
        out += ["", f"**The edge's convolutions alone** (batch {batch_}, forward + backward with train-mode BN, "
                f"ms per call, median of {args.repeats} x {OP_CALLS} calls; every formulation's gradients within "
                f"{worst:.1e} of grouped's, relative L2)", "",
                bu.markdown_table(["op, input", *cols], table)]
    steps = by("step")
    compiled_apart = {r["variant"]: r["compile_s"] for r in by("precompile")}
    if steps or torch_row:
        torch_s = torch_row["s_per_step"] if torch_row else None
        table = []
        for r in steps:
            if "error" in r:
                table.append([r["variant"], r.get("precision", ""), "error: " + r["error"], "", "", "", "", "", ""])
                continue
            check = r["check"] if r["check"] == "reference" else \
                f"{r['check']} ({max(r['rel_err'], r['loss_rel_err']):.1e} <= {r['tolerance']:g})"
            s = r.get("s_per_step")
            compile_s = f"{r['compile_s']:.1f}"
            if r["variant"] in compiled_apart:
                compile_s = f"{compiled_apart[r['variant']]:.1f} ({r['compile_s']:.1f})"
            table.append([r["variant"], r["precision"], check, compile_s, f"{r['first_call_s']:.1f}",
                          _gib(r, "xla_gib"), _kernels(r.get("kernels_per_step")), _ms(s), _x(torch_s, s),
                          _x(s, floor_s.get(r["precision"]))])
        if torch_row:
            table.append([torch_row["variant"], "torch default", "-", "-", "-",
                          _gib(torch_row, "peak_gib"), "", _ms(torch_s), "1.00x", "n/a"])
        out += ["", "**One MiLeNAS step** (one client; check: relative L2 of the one-step weight update and of "
                "the loss against the reference; compile s: in a compile process of their own, side by side "
                f"(--compile-jobs {args.compile_jobs}), and in brackets the timing process' read of it from the "
                "cache; first call s: the first run of the compiled program, one step)", "",
                bu.markdown_table(["variant", "precision", "check", "compile s", "first call s", "memory GiB",
                                   "kernels/step", "ms/step", "speed vs torch", "vs floor"], table)]
    for r in by("profile"):
        out += ["", f"**Where the time goes**: {r['variant']}, {r['where']}, one call of {args.steps} steps, "
                f"{r['total_ms']:.1f} ms of kernels", "",
                bu.markdown_table(["kernel", "ms", "share"],
                                  [[k[:90].replace("|", "/"), f"{t:.2f}", f"{100 * sh:.1f}%"] for k, t, sh in
                                   r["kernels"]])]
    rounds = by("round")
    if rounds:
        table = []
        for r in rounds:
            if "error" in r:
                table.append([r["placement"] if r["placement"] == "vmap" else f"map, chunk {r['chunk']}",
                              "error: " + r["error"], "", "", "", "", ""])
                continue
            plan = ("" if "plan_round_s" not in r else
                    f"{r['plan_round_s']:.3g} s ({100 * (r['plan_round_s'] / r['round_s'] - 1):+.0f}%)")
            compile_s = f"{r['compile_s']:.1f}"
            if f"round:{r['chunk']}" in compiled_apart:
                compile_s = f"{compiled_apart['round:' + str(r['chunk'])]:.1f} ({r['compile_s']:.1f})"
            table.append([r["placement"] if r["placement"] == "vmap" else f"map, chunk {r['chunk']}",
                          compile_s, _gib(r, "xla_gib"), _kernels(r.get("kernels_per_client_step")),
                          f"{r['round_s']:.3g}", _ms(r["s_per_client_step"]), plan])
        out += ["", f"**A FedNAS round** of {rounds[0]['clients']} clients, {args.steps} local steps each "
                f"(formulation {args.best or 'grouped'})", "",
                *(["compile s: in a compile process of its own, side by side, and in brackets the timing "
                   "process' read of it from the cache", ""] if any(k.startswith("round:") for k in compiled_apart)
                  else []),
                bu.markdown_table(["clients in flight", "compile s", "memory GiB", "kernels per client-step",
                                   "round s", "ms per client-step", "plan's estimate (vs measured)"], table)]
        paper = next(iter(by("paper")), None)
        measured = [r for r in rounds if "s_per_client_step" in r]
        if paper and measured and args.config != "paper":
            out += ["", f"The paper's search is not extrapolated from config {args.config} (not the paper's shapes)."]
        elif paper and measured:
            best = min(measured, key=lambda r: r["s_per_client_step"])
            total = best["s_per_client_step"] * paper["client_steps_per_round"] * paper["rounds"]
            out += ["", f"**The paper's search** (16 clients, 5 local epochs, {paper['client_steps_per_round']} "
                    f"client-steps a round, {paper['rounds']} rounds) at the fastest round's "
                    f"{_ms(best['s_per_client_step'])} ms per client-step: {total / 3600:.2f} h "
                    "(compilation, evaluation and checkpoints excluded; target < 2 h)."]
    presets = by("presets")
    if presets:
        table = [[r["algorithm"], r["preset"], r.get("placement", ""),
                  "error: " + r["error"] if "error" in r else f"{r.get('compile_s') or 0:.1f}" + (
                      f" (apart {compiled_apart[f'preset:{i}']:.1f})" if f"preset:{i}" in compiled_apart else ""),
                  "" if r.get("xla_gib") is None else f"{r['xla_gib']:.2f}",
                  "" if r.get("round_s") is None else f"{r['round_s']:.3g}",
                  "" if r.get("run_s") is None else f"{r['run_s'] / 3600:.2f} h ({r.get('rounds')} rounds)",
                  r.get("method") or ""] for i, r in enumerate(presets)]
        out += ["", "**The other papers' presets** (`jaxfednas plan`, steady state)", "",
                bu.markdown_table(["algorithm", "preset", "placement", "compile s", "memory GiB", "round s",
                                   "run estimate", "how"], table)]
    if skipped:
        out += ["", "Not measured: " + "; ".join(f"{p}: {why}" for p, why in skipped.items()) + "."]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        if args.worker != "torch":
            bu.ensure_package_importable()
        if args.cache_dir and args.worker != "torch":
            import jax

            jax.config.update("jax_compilation_cache_dir", os.path.abspath(args.cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        WORKERS[args.worker](args)
        return 0
    out = bu.results_path(args)
    log = out.with_suffix(".jsonl")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    start = time.monotonic()
    parts = args.parts.split(",")
    skipped: dict[str, str] = {}
    facts = machine_facts()
    best = ""
    for part in PARTS:
        if part not in parts:
            continue
        left = None if not args.budget_s else args.budget_s - (time.monotonic() - start)
        if left is not None and left < 60:
            skipped[part] = f"skipped: {max(left, 0):.0f} s of the time budget left"
            continue
        last = part == [q for q in PARTS if q in parts][-1]
        cap = left if left is None or last else min(left, max(60.0, BUDGET_SHARE[part] * args.budget_s))
        if part == "torch" and not args.torch_exe:
            skipped[part] = "skipped: torch is not installed"
            continue
        t0 = time.monotonic()
        print(f"[{time.monotonic() - start:6.0f} s] {part} ...", flush=True)
        why = spawn(args, part, log, cap, best)
        if why:
            skipped[part] = why
        print(f"[{time.monotonic() - start:6.0f} s] {part} done in {time.monotonic() - t0:.0f} s"
              + (f" ({why})" if why else ""), flush=True)
        if part == "step":
            timed = [r for r in read_log(log) if r.get("part") == "step" and r.get("precision") == "default"
                     and "s_per_step" in r and "+3pass" not in r["variant"]]
            best = min(timed, key=lambda r: r["s_per_step"])["variant"] if timed else ""
    args.best = best
    body = report(args, read_log(log), skipped, facts)
    body += f"\n\nRows as measured: `{log.name}` beside this file. Total {time.monotonic() - start:.0f} s."
    bu.publish("One accelerator: FedNAS step by formulation and precision, PyTorch, rounds, floors", "gpu.py", body,
               write=not args.no_write, path=out)
    failed = [p for p, why in skipped.items() if why.startswith("worker exited")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
