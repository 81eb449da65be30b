"""How fast XLA runs the convolutions of a grouped DARTS cell, as a fraction of a dense matmul.

``benchmarks/fednas_search.py`` reports that a MiLeNAS step reaches ~1/4 of the device's
dense float32 matmul rate. This script splits that by convolution and by pass: for the
wide convolutions a grouped cell of config (b) (C=16, 8 cells, batch 64) runs -- the
first separable / dilated block of the n edges leaving a state as one convolution
C -> n*C (n = ``--edges``, 4 for a cell input), k = 3 or 5, dilation 1 or 2, at each
stage's width and resolution -- it times, each alone under ``jit``:

* ``forward``: :func:`jaxfednas.nn.dense_conv` (what ``wide.py`` runs);
* ``input grad``: the input gradient :func:`jaxfednas.nn.conv_canonical_grad` computes on
  CPU (a full correlation with the flipped kernel);
* ``kernel grad``: its kernel gradient (batch and channels swapped: a convolution whose
  "kernel" is the cotangent);

and a dense float32 matmul on the same device (``2048 x 2048`` on CPU, ``8192 x 8192`` on
accelerators). GFLOP/s = 2 * multiply-adds
of the convolution / best-of-``--repeats`` seconds.

    PYTHONPATH=. python benchmarks/studies/conv_rates.py

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
from _bench_util import ensure_repo_on_path, load_line, markdown_table, matmul_gflops, publish, timed

SHAPES = ((16, 32), (32, 16), (64, 8))  # config (b)'s cells: C=16 at 32x32, 32 at 16x16, 64 at 8x8
KERNELS = ((3, 1), (5, 1), (3, 2), (5, 2))  # sep/dil conv 3x3, 5x5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--edges", type=int, default=4, help="edges side by side in the wide convolution (4: a cell input)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best reported)")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    return p.parse_args(argv)


def passes(k: int, dil: int):
    """The three programs (forward, input gradient, kernel gradient) of one wide convolution."""
    import jax

    from jaxfednas.nn import conv_canonical_grad, dense_conv

    pad = dil * (k - 1) // 2
    conv = lambda x, w: conv_canonical_grad(x, w, (1, 1), ((pad, pad), (pad, pad)), (dil, dil))  # noqa: E731

    def grads(x, w, g):
        return jax.vjp(conv, x, w)[1](g)

    return {
        "forward": jax.jit(lambda x, w, g: dense_conv(x, w, 1, pad, dil)),
        "input grad": jax.jit(lambda x, w, g: grads(x, w, g)[0]),
        "kernel grad": jax.jit(lambda x, w, g: grads(x, w, g)[1]),
    }


def main(argv=None):
    args = parse_args(argv)
    ensure_repo_on_path()
    import jax

    load0 = load_line()
    peak = matmul_gflops(repeats=args.repeats)
    print(f"dense f32 matmul: {peak:.0f} GFLOP/s", flush=True)
    rows = []
    key = jax.random.PRNGKey(0)
    for C, H in SHAPES:
        D = args.edges * C
        x = jax.random.normal(key, (args.batch, H, H, C))
        g = jax.random.normal(key, (args.batch, H, H, D))
        for k, dil in KERNELS:
            w = jax.random.normal(key, (k, k, C, D))
            flop = 2.0 * args.batch * H * H * k * k * C * D
            cells = []
            for _name, fn in passes(k, dil).items():
                jax.block_until_ready(fn(x, w, g))  # compile + warm up
                best = min(timed(lambda: fn(x, w, g))[0] for _ in range(args.repeats))
                cells += [f"{best * 1e3:.1f}", f"{flop / best / 1e9:.0f} ({flop / best / 1e9 / peak:.0%})"]
            rows.append([f"C={C}, {H}x{H}", f"{k}x{k}" + (f", dilation {dil}" if dil > 1 else ""),
                         f"{C} -> {D}", f"{flop / 1e9:.2f}", *cells])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    header = ["cell width / input", "kernel", "channels", "GFLOP per pass", "forward ms", "forward GFLOP/s (of matmul)",
              "input grad ms", "input grad GFLOP/s", "kernel grad ms", "kernel grad GFLOP/s"]
    body = "\n\n".join([
        f"One wide convolution of a grouped DARTS cell (config (b) widths, {args.edges} edges side by side), batch "
        f"{args.batch}, each pass alone under `jit`, best of {args.repeats}; dense float32 matmul "
        f"(`_bench_util.matmul_gflops`: 2048^2 on CPU, "
        f"8192^2 on accelerators) on the same device: **{peak:.0f} GFLOP/s** (the percentages).",
        markdown_table(header, rows),
        f"Load average (1/5/15 min) at start / end: {load0} / {load_line()}."])
    publish("Convolution rates of a grouped DARTS cell against a dense matmul", "studies/conv_rates.py", body,
            write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
