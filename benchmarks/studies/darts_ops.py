"""DARTS ops on XLA: depthwise formulations, and compile time of the search supernet.

Part 1 -- forward + backward (train-mode BN, random cotangent) of

* ``edge``: a whole 8-op search ``MixedOp`` (stride 1, uniform op weights), and
* ``sep3``: ``sep_conv_3x3`` alone,

for batch ``--batch`` (32) of ``--hw`` x ``--hw`` (32x32) inputs with C in ``--channels``
(8, 16), once standalone (one jitted value-and-grad) and once as ``--steps`` SGD steps
inside one jitted ``lax.scan`` (how a client's local epoch runs). Formulations of the
depthwise + 1x1 pairs (``jaxfednas.nn.SeparableConv``):

* ``grouped`` -- ``conv_general_dilated`` with ``feature_group_count=C``;
* ``slices``  -- k*k strided slices times per-channel weights, summed;
* ``fused``   -- depthwise and 1x1 folded into one exact dense k x k convolution.

The same parameters are used for every formulation and the gradients are compared.

Part 2 -- trace+lower and XLA compile time of ``jit(value_and_grad)`` of the C=16 search
supernet (8 cells unless ``--layers``), batch ``--compile-batch`` (64) of 32x32x3, for the
scanned layout (edges scanned per cell, repeated cells scanned) and, with
``--unrolled-baseline``, every edge unrolled; ``--run-step`` also times one step.

    PYTHONPATH=. python benchmarks/studies/darts_ops.py
    PYTHONPATH=. python benchmarks/studies/darts_ops.py --channels 36 --skip-compile

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
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

from jaxfednas.search_spaces.darts import DartsSearchNetwork, MixedOp, PRIMITIVES, SepConv  # noqa: E402
from jaxfednas.nn import default_depthwise_impl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _now(out):
    jax.block_until_ready(out)
    return time.perf_counter()


def make_module(workload: str, C: int, impl: str):
    if workload == "edge":
        return MixedOp(C, 1, PRIMITIVES, impl)
    return SepConv(C, 3, 1, 1, affine=False, dw_impl=impl)


def apply_fn(mod, workload: str, C: int):
    w = jnp.full((len(PRIMITIVES),), 1.0 / len(PRIMITIVES))

    def f(params, bs, x):
        variables = {"params": params, "batch_stats": bs}
        if workload == "edge":
            return mod.apply(variables, x, w, True, mutable=["batch_stats"])
        return mod.apply(variables, x, True, mutable=["batch_stats"])

    return f


def bench_op(args, workload: str, C: int, impl: str, data, variables):
    mod = make_module(workload, C, impl)
    f = apply_fn(mod, workload, C)
    params, bs = variables["params"], variables["batch_stats"]
    xs, gs = data

    def loss(p, bs, x, g):
        y, upd = f(p, bs, x)
        return jnp.sum(y * g), upd["batch_stats"]

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))

    def train(p, bs, xs, gs):
        def step(carry, xg):
            p, bs = carry
            (l, bs), (gp, _) = jax.value_and_grad(loss, has_aux=True, argnums=(0, 2))(p, bs, *xg)
            return (jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, gp), bs), l

        return jax.lax.scan(step, (p, bs), (xs, gs))

    train = jax.jit(train)
    t0 = time.perf_counter()
    c_grad = grad.lower(params, bs, xs[0], gs[0]).compile()
    t1 = time.perf_counter()
    c_train = train.lower(params, bs, xs, gs).compile()
    t2 = time.perf_counter()
    out = c_grad(params, bs, xs[0], gs[0])
    c_train(params, bs, xs, gs)
    jax.block_until_ready(out)
    return {
        "compile_grad": t1 - t0, "compile_scan": t2 - t1,
        "grad": lambda: c_grad(params, bs, xs[0], gs[0]),
        "scan": lambda: c_train(params, bs, xs, gs),
        "grads": jax.tree_util.tree_map(np.asarray, out[1]),
    }


def max_rel_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(la, lb))


def part1(args) -> tuple[str, dict]:
    impls = args.impls.split(",")
    rows, notes, best = [], [], {}
    for workload in args.workloads.split(","):
        for C in (int(c) for c in args.channels.split(",")):
            key = jax.random.split(jax.random.PRNGKey(0), 3)
            shape = (args.steps, args.batch, args.hw, args.hw, C)
            xs = jax.random.normal(key[0], shape)
            gs = jax.random.normal(key[1], shape)
            mod = make_module(workload, C, impls[0])
            init_args = (xs[0], jnp.full((len(PRIMITIVES),), 0.125), False) if workload == "edge" else (xs[0], False)
            variables = mod.init(key[2], *init_args)
            res = {impl: bench_op(args, workload, C, impl, (xs, gs), variables) for impl in impls}
            times = {(i, m): [] for i in impls for m in ("grad", "scan")}
            for r in range(args.repeats):
                order = impls if r % 2 == 0 else impls[::-1]
                for impl in order:
                    for m in ("grad", "scan"):
                        t0 = time.perf_counter()
                        t1 = _now(res[impl][m]())
                        times[(impl, m)].append(t1 - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            ref = impls[0]
            for impl in impls:
                g_ms = 1000 * med[(impl, "grad")]
                s_ms = 1000 * med[(impl, "scan")] / args.steps
                rows.append([
                    workload, C, impl, f"{res[impl]['compile_grad']:.1f}", f"{g_ms:.1f}",
                    f"{res[impl]['compile_scan']:.1f}", f"{s_ms:.1f}",
                    f"{med[(ref, 'grad')] / med[(impl, 'grad')]:.2f}x",
                    f"{med[(ref, 'scan')] / med[(impl, 'scan')]:.2f}x",
                ])
                if impl != ref:
                    notes.append(f"{workload} C={C} {impl} vs {ref}: max relative |Δ grad| "
                                 f"{max_rel_diff(res[impl]['grads'], res[ref]['grads']):.1e}")
            best[(workload, C)] = min(impls, key=lambda i: med[(i, "scan")])
            print(f"[darts_ops] {workload} C={C}: " + ", ".join(
                f"{i} {1000 * med[(i, 'grad')]:.0f} ms / {1000 * med[(i, 'scan')] / args.steps:.0f} ms/step"
                for i in impls), flush=True)
    header = ["workload", "C", "formulation", "compile s (standalone)", "ms fwd+bwd (standalone)",
              f"compile s (scan of {args.steps})", "ms/step (in scan)", f"speed vs {impls[0]} (standalone)",
              f"speed vs {impls[0]} (scan)"]
    lines = [
        f"Forward + backward (train-mode BN, random cotangent), batch {args.batch}, {args.hw}x{args.hw}, "
        f"stride 1; `edge` = 8-op search MixedOp (uniform weights), `sep3` = sep_conv_3x3 alone. "
        f"Median of {args.repeats} runs, formulations timed round-robin in one process; load average "
        f"{load()}.",
        "",
        table(header, rows),
        "",
        "Numerics: " + "; ".join(notes) + ".",
        "",
        "Fastest in scan: " + ", ".join(f"{w} C={c}: {i}" for (w, c), i in best.items())
        + f". Default on this backend: `{default_depthwise_impl()}`.",
    ]
    return "\n".join(lines), best


def part2(args) -> str:
    rows = []
    configs = [(L, True) for L in (int(s) for s in args.layers.split(","))]
    if args.unrolled_baseline:
        configs.append((int(args.layers.split(",")[0]), False))
    for layers, scan in configs:
        net = DartsSearchNetwork(16, 10, layers, dw_impl=args.compile_impl or None, scan_cells=scan, scan_edges=scan)
        x = jnp.zeros((args.compile_batch, 32, 32, 3))
        y = jnp.zeros((args.compile_batch,), jnp.int32)
        v = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), x[:2], train=False))
        v = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), v)

        def loss(params, arch, bs, x, y, net=net):
            logits, upd = net.apply({"params": params, "arch": arch, "batch_stats": bs}, x, train=True,
                                    mutable=["batch_stats"])
            ll = jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)
            return -jnp.mean(ll), upd

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        a = (v["params"], v["arch"], v["batch_stats"], x, y)
        t0 = time.perf_counter()
        lowered = step.lower(*a)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        run = "-"
        if args.run_step and scan and layers == configs[0][0]:
            _now(compiled(*a))
            t3 = time.perf_counter()
            run = f"{_now(compiled(*a)) - t3:.1f}"
        layout = "edges + repeated cells scanned" if scan else "unrolled"
        rows.append([layers, layout, f"{t1 - t0:.1f}", f"{t2 - t1:.1f}", f"{t2 - t0:.1f}", run])
        print(f"[darts_ops] supernet L{layers} {layout}: lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s, "
              f"step {run}", flush=True)
    impl = args.compile_impl or default_depthwise_impl()
    header = ["layers", "layout", "trace+lower s", "XLA compile s", "total s", "s per step"]
    return "\n".join([
        f"`jit(value_and_grad)` of the C=16 search supernet (10 classes, 8 primitives, `{impl}` formulation), "
        f"train-mode BN, batch {args.compile_batch} of 32x32x3, loss w.r.t. params and arch; no persistent "
        f"compilation cache.",
        "",
        table(header, rows),
    ])


def table(header, rows) -> str:
    out = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def machine() -> str:
    d = jax.devices()[0]
    return (f"{os.cpu_count()} CPU cores ({platform.machine()}), jax {jax.__version__} on {jax.default_backend()} "
            f"({d.device_kind}), python {platform.python_version()}")


def append_section(command: str, body: str) -> None:
    """Append (never rewrite) one section headed by the exact command to RESULTS.md."""
    section = "\n".join([
        f"## `{command}`", "", "**DARTS ops: depthwise formulations and supernet compile time**", "",
        f"Machine: {machine()}; measured {datetime.date.today().isoformat()}.", "", body.rstrip(), "", "",
    ])
    prefix = ""
    if RESULTS.exists() and RESULTS.stat().st_size:
        text = RESULTS.read_text()
        prefix = "" if text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
    with RESULTS.open("a") as f:
        f.write(prefix + section)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", default="8,16")
    p.add_argument("--workloads", default="edge,sep3")
    p.add_argument("--impls", default="grouped,slices,fused")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hw", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="SGD steps in the scanned variant")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", default="8", help="comma list of supernet depths for part 2")
    p.add_argument("--compile-batch", type=int, default=64)
    p.add_argument("--compile-impl", default="", help="formulation for part 2 (default: the backend default)")
    p.add_argument("--unrolled-baseline", action="store_true", help="also compile the fully unrolled supernet")
    p.add_argument("--run-step", action="store_true", help="also time one supernet step")
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS.md")
    args = p.parse_args(argv)

    parts = []
    if not args.skip_ops:
        body, _ = part1(args)
        parts.append(body)
    if not args.skip_compile:
        parts.append(part2(args))
    body = "\n\n".join(parts)
    print()
    print(body)
    if not args.no_write:
        command = "PYTHONPATH=. python " + shlex.join(["benchmarks/studies/darts_ops.py", *sys.argv[1:]])
        append_section(command, body)
        print(f"\nappended to {RESULTS}")


if __name__ == "__main__":
    main()
