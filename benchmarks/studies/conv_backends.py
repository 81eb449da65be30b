"""DARTS ops on XLA:CPU's three convolution libraries, every depthwise formulation.

XLA:CPU (jaxlib 0.12) hands convolutions to YNNPACK by default; with YNNPACK's fusions off
it runs its own Eigen convolutions, and with ``xla_cpu_experimental_onednn_custom_call`` as
well it calls oneDNN, the library behind PyTorch's CPU convolutions
(:data:`jaxfednas.runtime.CPU_CONV_BACKENDS`). For each library and each depthwise + 1x1
formulation (``jaxfednas.nn.SeparableConv``: ``grouped``, ``slices``, ``fused``,
``hybrid``) this times, in one process, forward + backward (train-mode BN, a random
cotangent) of

* ``edge``: a whole 8-op search ``MixedOp`` (stride 1, uniform op weights), and
* ``sep3``: ``sep_conv_3x3`` alone,

as ``--steps`` SGD steps in one jitted ``lax.scan`` (how a client's local epoch runs), at
batch ``--batch`` of ``--hw`` x ``--hw`` inputs with C in ``--channels``; config (a) of
``benchmarks/fednas_search.py`` is C=8, batch 32; (b), the paper's cell, C=16, batch 64. Every
program compiles with the library's CPU options (:func:`jaxfednas.runtime.compiler_options`)
plus the library's; timed runs alternate their order; the gradients of every variant are
compared with ``grouped`` on XLA's own convolutions.

    PYTHONPATH=. python benchmarks/studies/conv_backends.py --channels 16 --batch 64
    PYTHONPATH=. python benchmarks/studies/conv_backends.py --channels 8 --batch 32

Frozen study: its finding is in ``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxfednas.runtime import CPU_CONV_BACKENDS, compiler_options  # noqa: E402
from jaxfednas.search_spaces.darts import MixedOp, PRIMITIVES, SepConv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def make_module(workload: str, C: int, impl: str):
    if workload == "edge":
        return MixedOp(C, 1, PRIMITIVES, impl)
    return SepConv(C, 3, 1, 1, affine=False, dw_impl=impl)


def compiled_epoch(workload: str, C: int, impl: str, backend: str, variables, xs, gs):
    """The scanned SGD steps of one (formulation, library), compiled; and its first step's gradients."""
    mod = make_module(workload, C, impl)
    w = jnp.full((len(PRIMITIVES),), 1.0 / len(PRIMITIVES))

    def loss(p, bs, x, g):
        args = (x, w, True) if workload == "edge" else (x, True)
        y, upd = mod.apply({"params": p, "batch_stats": bs}, *args, mutable=["batch_stats"])
        return jnp.sum(y * g), upd["batch_stats"]

    def epoch(p, bs, xs, gs):
        def step(carry, xg):
            p, bs = carry
            (l, bs), gp = jax.value_and_grad(loss, has_aux=True)(p, bs, *xg)
            return (jax.tree.map(lambda a, b: a - 1e-3 * b, p, gp), bs), l
        return jax.lax.scan(step, (p, bs), (xs, gs))

    options = {**(compiler_options() or {}), **CPU_CONV_BACKENDS[backend]}
    p, bs = variables["params"], variables["batch_stats"]
    t0 = time.perf_counter()
    run = jax.jit(epoch).lower(p, bs, xs, gs).compile(compiler_options=options)
    compile_s = time.perf_counter() - t0
    grad = jax.jit(jax.grad(lambda p: loss(p, bs, xs[0], gs[0])[0])).lower(p).compile(compiler_options=options)
    hlo = run.as_text()
    counts = {"ynn": hlo.count('"kind":"__ynn_fusion"'), "onednn": hlo.count('custom_call_target="__onednn$convolution"'),
              "xla": len(re.findall(r"= \S+ convolution\(", hlo))}
    calls = ", ".join(f"{k} {n}" for k, n in counts.items() if n)
    return {"run": lambda: run(p, bs, xs, gs), "compile_s": compile_s, "calls": calls,
            "grads": jax.tree.map(np.asarray, grad(p))}


def max_rel_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--channels", default="16")
    p.add_argument("--workloads", default="edge,sep3")
    p.add_argument("--impls", default="grouped,slices,fused,hybrid")
    p.add_argument("--backends", default=",".join(CPU_CONV_BACKENDS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hw", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="SGD steps in the scan")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS.md")
    args = p.parse_args()
    impls, backends = args.impls.split(","), args.backends.split(",")
    rows = []
    for workload in args.workloads.split(","):
        for C in (int(c) for c in args.channels.split(",")):
            k = jax.random.split(jax.random.key(0), 3)
            shape = (args.steps, args.batch, args.hw, args.hw, C)
            xs, gs = jax.random.normal(k[0], shape), jax.random.normal(k[1], shape)
            init = (xs[0], jnp.full((len(PRIMITIVES),), 0.125), False) if workload == "edge" else (xs[0], False)
            variables = make_module(workload, C, impls[0]).init(k[2], *init)
            variants = [(i, b) for i in impls for b in backends]
            res = {}
            for v in variants:
                res[v] = compiled_epoch(workload, C, *v, variables, xs, gs)
                t0 = time.perf_counter()
                jax.block_until_ready(res[v]["run"]())
                print(f"[conv_backends] {workload} C={C} {v[0]}/{v[1]}: compiled in {res[v]['compile_s']:.1f} s, "
                      f"first run {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            ref = compiled_epoch(workload, C, "grouped", "xla", variables, xs, gs)["grads"]
            times = {v: [] for v in variants}
            for r in range(args.repeats):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    t0 = time.perf_counter()
                    jax.block_until_ready(res[v]["run"]())
                    times[v].append(time.perf_counter() - t0)
            med = {v: statistics.median(t) / args.steps for v, t in times.items()}
            base = med[(impls[0], backends[0])]
            for v in variants:
                rows.append([workload, C, v[0], v[1], res[v]["calls"], f"{res[v]['compile_s']:.1f}",
                             f"{1000 * med[v]:.1f}", f"{base / med[v]:.2f}x",
                             f"{max_rel_diff(res[v]['grads'], ref):.1e}"])
                print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["workload", "C", "formulation", "library", "HLO: fusions / calls / convolutions", "compile s", "ms/step (fwd+bwd)",
              f"speed vs {impls[0]}/{backends[0]}", "max rel |Δ grad| vs grouped/xla"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
    print(table)
    if not args.no_write:
        cmd = "PYTHONPATH=. python benchmarks/studies/conv_backends.py " + shlex.join(sys.argv[1:])
        with RESULTS.open("a") as f:
            f.write(f"\n## `{cmd.strip()}`\n\n{datetime.date.today()}, {platform.processor() or platform.machine()}, "
                    f"jax {jax.__version__}, batch {args.batch}, {args.hw}x{args.hw}, {args.steps} steps, median of "
                    f"{args.repeats}\n\n{table}\n")


if __name__ == "__main__":
    main()
