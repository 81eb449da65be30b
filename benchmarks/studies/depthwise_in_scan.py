"""A separable convolution's three formulations inside a ``lax.scan`` of SGD steps, on XLA:CPU.

The FedNAS local search runs its steps in a ``lax.scan``. There, JAX's kernel gradient of a
grouped (depthwise) convolution -- a convolution with ``batch_group_count`` that XLA expands
into a dense ``C x C`` one over an image-sized window -- is taken by neither fast library
and runs seconds per step, which is why the CPU default folds the depthwise and pointwise
kernels into one dense ``k x k`` convolution (``fused``, k²·C·D multiply-adds per pixel
where the separable pair needs k²·C + C·D). This study times, per SGD step of ``depthwise
k x k -> pointwise 1x1`` (C=16 -> 16, batch 64, 32x32, the paper's cell; gradients w.r.t. the
input and both kernels, the loss the output's mean square), inside a scan of ``--steps``
steps:

* ``fused``: one dense ``k x k`` convolution with kernel ``depthwise ⊗ pointwise``
  (:func:`jaxfednas.nn.dense_conv`: the library's canonical gradient convolutions on CPU);
* ``grouped``: the grouped convolution (``feature_group_count=C``) with JAX's gradients, then
  the 1x1 convolution (``dense_conv``);
* ``grouped, dense dW``: the grouped convolution, its input gradient JAX's, its kernel
  gradient written as the dense ``C x C`` correlation of the padded input with the cotangent
  (batch as the contraction) and its diagonal taken -- the expansion XLA makes, in a layout
  chosen here (a ``jax.custom_vjp``).

The gradients of the last two are compared with ``fused``'s (the same linear map). The
convolution library is the process's (``JAXFEDNAS_CPU_CONV``, default ``ynn+onednn``).

    PYTHONPATH=. python benchmarks/studies/depthwise_in_scan.py
    JAXFEDNAS_CPU_CONV=ynn PYTHONPATH=. python benchmarks/studies/depthwise_in_scan.py
    PYTHONPATH=. python benchmarks/studies/depthwise_in_scan.py --ops 3x1 --fused-jax-grads

Frozen study: its finding is in ``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jaxfednas import runtime  # noqa: E402
from jaxfednas.nn import dense_conv  # noqa: E402

_DN = ("NHWC", "HWIO", "NHWC")


def grouped(x, w, d: int, p: int):
    return lax.conv_general_dilated(x, w, (1, 1), ((p, p), (p, p)), rhs_dilation=(d, d), dimension_numbers=_DN,
                                    feature_group_count=x.shape[-1])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def grouped_dense_dw(x, w, d: int, p: int):
    return grouped(x, w, d, p)


def _fwd(x, w, d, p):
    return grouped(x, w, d, p), (x, w)


def _bwd(d, p, res, g):
    x, w = res
    _, vjp_x = jax.vjp(lambda x_: grouped(x_, w, d, p), x)
    (dx,) = vjp_x(g)
    xp = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    # full[i, u, v, o] = sum_{b, y, z} xp[b, y + d u, z + d v, i] g[b, y, z, o]; dW is its diagonal i = o
    full = lax.conv_general_dilated(jnp.transpose(xp, (3, 1, 2, 0)), jnp.transpose(g, (1, 2, 0, 3)), (d, d), "VALID",
                                    dimension_numbers=_DN)
    return dx, jnp.diagonal(full, axis1=0, axis2=3)[:, :, None, :].astype(w.dtype)


grouped_dense_dw.defvjp(_fwd, _bwd)


def separable(form: str, k: int, d: int, jax_grads: bool = False):
    p = d * (k - 1) // 2

    def apply(x, dw, pw):
        kernel = dw[:, :, 0, :, None] * pw[0, 0][None, None]
        if form == "fused" and jax_grads:  # JAX's own convolution gradients
            return lax.conv_general_dilated(x, kernel, (1, 1), ((p, p), (p, p)), rhs_dilation=(d, d),
                                            dimension_numbers=_DN)
        if form == "fused":  # the library's CPU default: its dense convolution, canonical gradients
            return dense_conv(x, kernel, 1, p, d)
        y = grouped(x, dw, d, p) if form == "grouped" else grouped_dense_dw(x, dw, d, p)
        return dense_conv(y, pw, 1, 0, 1)
    return apply


def epoch(apply, steps: int):
    """``steps`` SGD steps of the input and both kernels in one ``lax.scan``; also one step's gradients."""
    grad = jax.grad(lambda x, dw, pw: (apply(x, dw, pw) ** 2).mean(), argnums=(0, 1, 2))

    def run(x, dw, pw):
        def body(c, _):
            gs = grad(*c)
            return tuple(a - 0.1 * b for a, b in zip(c, gs)), None
        return lax.scan(body, (x, dw, pw), None, length=steps)[0]
    return runtime.jit(run), runtime.jit(grad)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="3x1,5x1,3x2,5x2", help="comma list of KxD: kernel size x dilation")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="SGD steps in the scan")
    p.add_argument("--repeats", type=int, default=3, help="timed scans (the best is reported)")
    p.add_argument("--fused-jax-grads", action="store_true",
                   help="the fused form with JAX's own convolution gradients instead of the library's canonical ones")
    args = p.parse_args(argv)
    C, B = args.channels, args.batch
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (B, 32, 32, C))
    print(f"library {runtime.cpu_conv_backend()}, C={C}, batch {B}, 32x32, {args.steps} steps per scan, "
          f"best of {args.repeats}; jax {jax.__version__}\n")
    print("| op | formulation | ms/step (fwd+bwd) | speed vs fused | max rel |Δ grad| vs fused |")
    print("|---|---|---|---|---|")
    for op in args.ops.split(","):
        k, d = (int(v) for v in op.split("x"))
        dw = jax.random.normal(keys[1], (k, k, 1, C)) * 0.3
        pw = jax.random.normal(keys[2], (1, 1, C, C)) * 0.3
        base, ref = None, None
        for form in ("fused", "grouped", "grouped, dense dW"):
            run, grad = epoch(separable(form, k, d, args.fused_jax_grads), args.steps)
            gs = grad(x, dw, pw)
            jax.block_until_ready(run(x, dw, pw))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(run(x, dw, pw))
                times.append((time.perf_counter() - t0) / args.steps)
            best = 1e3 * min(times)
            if ref is None:
                base, ref, diff = best, gs, "-"
            else:
                diff = f"{max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(gs, ref)):.1e}"
            speed = f"{base / best:.2f}x" if base / best >= 0.01 else f"1/{best / base:.0f}"
            print(f"| {k}x{k}{' dilated' if d > 1 else ''} | {form} | {best:.1f} | {speed} | {diff} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
