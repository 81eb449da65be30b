"""The first separable block of a grouped DARTS cell (``search_spaces/darts/wide.py``): the
``n`` edges leaving one state apply their own depthwise k x k + pointwise 1x1 pair to the
same input. Which formulation XLA:CPU runs fastest at config (b)'s widths?

Forms (same math; ``x`` [B, H, W, C] -> [B, H, W, n*C]):

* ``fused``     -- what wide.py does: each edge's pair folded into one dense k x k kernel,
  the n kernels side by side: one convolution C -> n*C (k*k*C*n*C multiply-adds per pixel);
* ``einsum``    -- depthwise as k*k shifted slices of x times each edge's tap weights
  ([B, H, W, n, C]), then the pointwise maps as one batched matmul over edges
  (k*k*n*C + n*C*C per pixel);
* ``blockdiag`` -- the same depthwise, then one 1x1 convolution n*C -> n*C whose kernel is
  block-diagonal (n times the pointwise work, one dense convolution);
* ``peredge``   -- the same depthwise, then n separate 1x1 convolutions;
* ``grouped``   -- depthwise as one grouped convolution (``feature_group_count=C``, each
  input channel to n outputs), then the batched pointwise matmul.

Each form: ``jit`` of a ``lax.scan`` of ``--steps`` SGD steps (forward + backward w.r.t.
both kernels, ReLU in front as in DARTS), batch 64, compile timed, best of 3 runs;
gradient difference vs ``fused`` after the scan.

    PYTHONPATH=. python benchmarks/studies/wide_conv_forms.py

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
from _bench_util import check_choices, ensure_repo_on_path, load_line, markdown_table, publish

FORMS = ("fused", "einsum", "blockdiag", "peredge", "grouped")
SHAPES = ((16, 32), (32, 16), (64, 8))  # config (b)'s normal cells: C=16 at 32x32, 32 at 16x16, 64 at 8x8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma list from {FORMS}")
    p.add_argument("--kernels", default="3,5", help="kernel sizes (dilation 1)")
    p.add_argument("--edges", type=int, default=4, help="edges leaving the state (4 for a cell input)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="SGD steps per scan")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    args = p.parse_args(argv)
    check_choices(p, args.forms, FORMS, "form(s)")
    return args


def make_forms():
    import jax.numpy as jnp
    from jax import lax

    from jaxfednas.nn import dense_conv

    def taps(x, k, pad):
        b, h, w, c = x.shape
        xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        for u in range(k):
            for v in range(k):
                yield u, v, lax.slice(xp, (0, u, v, 0), (b, u + h, v + w, c))

    def depthwise(x, dw, k, pad):  # [B, H, W, n, C]
        out = None
        for u, v, t in taps(x, k, pad):
            y = t[..., None, :] * dw[:, u, v, 0, :]
            out = y if out is None else out + y
        return out

    def fused(x, dw, pw, k, pad):  # dw [n, k, k, 1, C], pw [n, 1, 1, C, D]
        n = dw.shape[0]
        kern = (dw[:, :, :, 0, :, None] * pw[:, 0, 0][:, None, None]).transpose(1, 2, 3, 0, 4)
        return dense_conv(x, kern.reshape(k, k, x.shape[-1], n * pw.shape[-1]), 1, pad, 1)

    def einsum(x, dw, pw, k, pad):
        z = jnp.einsum("bhwnc,ncd->bhwnd", depthwise(x, dw, k, pad), pw[:, 0, 0])
        return z.reshape(z.shape[:3] + (-1,))

    def blockdiag(x, dw, pw, k, pad):
        n, c, d = dw.shape[0], dw.shape[-1], pw.shape[-1]
        y = depthwise(x, dw, k, pad)
        eye = jnp.eye(n, dtype=x.dtype)
        kern = (eye[:, None, :, None] * pw[:, 0, 0][:, :, None, :]).reshape(n * c, n * d)[None, None]
        return dense_conv(y.reshape(y.shape[:3] + (n * c,)), kern, 1, 0, 1)

    def peredge(x, dw, pw, k, pad):
        y = depthwise(x, dw, k, pad)
        return jnp.concatenate([dense_conv(y[..., r, :], pw[r], 1, 0, 1) for r in range(dw.shape[0])], -1)

    def grouped(x, dw, pw, k, pad):
        n, c = dw.shape[0], dw.shape[-1]
        kern = dw[:, :, :, 0, :].transpose(1, 2, 3, 0).reshape(k, k, 1, c * n)  # group c: channel c -> its n outputs
        y = lax.conv_general_dilated(x, kern, (1, 1), ((pad, pad), (pad, pad)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=c)
        z = jnp.einsum("bhwcn,ncd->bhwnd", y.reshape(y.shape[:3] + (c, n)), pw[:, 0, 0])
        return z.reshape(z.shape[:3] + (-1,))

    return {"fused": fused, "einsum": einsum, "blockdiag": blockdiag, "peredge": peredge, "grouped": grouped}


def measure(form, C, H, k, args):
    import jax
    import jax.numpy as jnp
    from jax import lax

    pad = (k - 1) // 2
    kx, kd, kp = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (args.batch, H, H, C))
    params = (jax.random.normal(kd, (args.edges, k, k, 1, C)) * 0.1,
              jax.random.normal(kp, (args.edges, 1, 1, C, C)) * 0.1)

    def loss(p):
        y = form(jax.nn.relu(x), p[0], p[1], k, pad)
        return jnp.sum(y * y)

    def body(p, _):
        g = jax.grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 1e-6 * b, p, g), None

    run = jax.jit(lambda p: lax.scan(body, p, None, length=args.steps)[0])
    t0 = time.perf_counter()
    compiled = run.lower(params).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(params))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(params))
        best = min(best, time.perf_counter() - t0)
    return compile_s, 1e3 * best / args.steps, out


def main(argv=None):
    args = parse_args(argv)
    ensure_repo_on_path()
    import jax.numpy as jnp

    forms = make_forms()
    names = args.forms.split(",")
    load0 = load_line()
    rows = []
    for C, H in SHAPES:
        for k in (int(s) for s in args.kernels.split(",")):
            res = {}
            for name in names:
                c_s, ms, out = measure(forms[name], C, H, k, args)
                res[name] = (c_s, ms, out)
                print(f"C={C} {H}x{H} k={k} {name:10s} compile {c_s:5.1f} s  {ms:8.1f} ms/step", flush=True)
            base = res.get("fused", next(iter(res.values())))
            for name in names:
                c_s, ms, out = res[name]
                diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(out, base[2]))
                rows.append([f"C={C}, {H}x{H}", k, f"`{name}`", f"{c_s:.1f}", f"{ms:.1f}", f"{base[1] / ms:.2f}x",
                             f"{diff:.1e}"])
    body = "\n\n".join([
        f"One group of {args.edges} edges leaving a state, first separable block (depthwise k x k + pointwise 1x1, "
        f"C -> C per edge), batch {args.batch}, forward + backward w.r.t. both kernels, `jit` of a `lax.scan` of "
        f"{args.steps} SGD steps, best of 3 runs. Speed vs fused above 1: faster than what wide.py does.",
        markdown_table(["cell width / input", "k", "form", "compile s", "ms/step", "speed vs fused",
                        "max |Δ kernels| vs fused after the scan"], rows),
        f"Load average (1/5/15 min) at start / end: {load0} / {load_line()}."])
    publish("Grouped DARTS cell: formulations of the first separable block of a source's edges", "wide_conv_forms.py",
            body, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
