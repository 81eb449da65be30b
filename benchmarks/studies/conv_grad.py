"""Conv gradients inside ``lax.scan`` (the evidence for ``jaxfednas/nn.py``).

Times ``--steps`` SGD steps of one conv (``--kernel`` 3, ``--stride`` 1, ``--cin`` 32 ->
``--cout`` 64 channels, batch ``--batch`` 32, SAME padding, MSE loss against a fixed target, a fresh input batch per
step) as one jitted ``lax.scan`` with:

* ``native``    — ``lax.conv_general_dilated`` differentiated by JAX (inside the scan's
                  ``while`` loop XLA:CPU keeps its gradient convolutions in a
                  non-canonical dimension order and runs them on its slow generic emitter);
* ``patch``     — ``jaxfednas.nn.conv_patch_grad`` (kernel gradient = im2col
                  patches x output gradient; input gradient = JAX's native transpose);
* ``canonical`` — ``jaxfednas.nn.conv_canonical_grad`` (what ``jaxfednas.nn.Conv`` uses on
                  CPU): input and kernel gradients written as canonical convolutions;

each also with the scan fully unrolled (``unroll=True``, no ``while`` loop: XLA
canonicalises the native convolutions itself), six variants in all.

All run in one process, timed round-robin (median of ``--repeats``), so the
ratios compare like with like. By default the input is differentiated too (as
for an inner layer) and its gradient is used in the update, so the
input-gradient convolution runs inside the loop (``--no-input-grad``: kernel
gradient only). One kernel and input gradient of ``patch`` and ``canonical`` is
checked against ``native`` with ``allclose`` (and ``canonical`` for bitwise
equality), as are the weights after every variant's scan.

    PYTHONPATH=. python benchmarks/studies/conv_grad.py
    PYTHONPATH=. python benchmarks/studies/conv_grad.py --cin 16 --cout 16 --sizes 16,32

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
import _bench_util as bu  # noqa: E402

bu.ensure_repo_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxfednas.nn import conv_canonical_grad, conv_patch_grad  # noqa: E402

DN = ("NHWC", "HWIO", "NHWC")
KINDS = ("native", "patch", "canonical")
VARIANTS = tuple((k, u) for u in (False, True) for k in KINDS)


def conv(kind: str, x, w, stride: int = 1):
    if kind == "native":
        return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DN)
    if kind == "patch":
        return conv_patch_grad(x, w, (stride, stride), "SAME", (1, 1))
    if kind == "canonical":
        return conv_canonical_grad(x, w, (stride, stride), "SAME", (1, 1))
    raise ValueError(kind)


def make_train(kind: str, unroll: bool, input_grad: bool, stride: int, lr: float = 0.01):
    """``train(w, xs, ts) -> (w, losses)``: one SGD step per leading row of ``xs``."""

    def loss(w, x, t):
        return 0.5 * jnp.mean((conv(kind, x, w, stride) - t) ** 2)

    def step(w, xt):
        x, t = xt
        if input_grad:
            val, (gw, gx) = jax.value_and_grad(loss, argnums=(0, 1))(w, x, t)
            # Fold the input gradient into the update so it cannot be dead-code eliminated.
            gw = gw + 1e-6 * jnp.mean(gx)
        else:
            val, gw = jax.value_and_grad(loss)(w, x, t)
        return w - lr * gw, val

    def train(w, xs, ts):
        return jax.lax.scan(step, w, (xs, ts), unroll=unroll)

    return jax.jit(train)


def name_of(kind: str, unroll: bool) -> str:
    return kind + (" unrolled" if unroll else "")


def bench_size(args, hw: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    kk, s = args.kernel, args.stride
    w = jax.random.normal(k[0], (kk, kk, args.cin, args.cout), jnp.float32) * (2.0 / (kk * kk * args.cin)) ** 0.5
    xs = jax.random.normal(k[1], (args.steps, args.batch, hw, hw, args.cin), jnp.float32)
    ho = -(-hw // s)  # SAME padding
    ts = jax.random.normal(k[2], (args.steps, args.batch, ho, ho, args.cout), jnp.float32)

    # Numerical agreement of one gradient (kernel and input) and of the whole scan.
    def g(kind):
        f = lambda w_, x_: 0.5 * jnp.mean((conv(kind, x_, w_, s) - ts[0]) ** 2)  # noqa: E731
        return jax.jit(jax.grad(f, argnums=(0, 1)))(w, xs[0])

    grads = {kind: tuple(np.asarray(a) for a in g(kind)) for kind in KINDS}
    gw_n, gx_n = grads["native"]
    check = {"grad_w_max_abs": float(np.max(np.abs(gw_n))), "grad_x_max_abs": float(np.max(np.abs(gx_n)))}
    for kind in KINDS[1:]:
        gw, gx = grads[kind]
        check[kind] = {
            "grad_w_max_abs_diff": float(np.max(np.abs(gw_n - gw))),
            "grad_x_max_abs_diff": float(np.max(np.abs(gx_n - gx))),
            "grad_w_allclose": bool(np.allclose(gw_n, gw, rtol=1e-4, atol=1e-6)),
            "grad_x_allclose": bool(np.allclose(gx_n, gx, rtol=1e-4, atol=1e-7)),
            "bitwise": bool(np.array_equal(gw_n, gw) and np.array_equal(gx_n, gx)),
        }

    fns, compile_s, finals = {}, {}, {}
    for kind, unroll in VARIANTS:
        name = name_of(kind, unroll)
        fn = make_train(kind, unroll, args.input_grad, s)
        t0 = time.perf_counter()
        fns[name] = fn.lower(w, xs, ts).compile()
        compile_s[name] = time.perf_counter() - t0
        _, (w_final, _) = bu.timed(lambda: fns[name](w, xs, ts))  # warm-up run
        finals[name] = np.asarray(w_final)
    ref = finals["native"]
    check["final_w_max_abs_diff"] = max(float(np.max(np.abs(v - ref))) for v in finals.values())
    check["final_w_allclose"] = all(np.allclose(v, ref, rtol=1e-4, atol=1e-6) for v in finals.values())
    grads_ok = all(check[k]["grad_w_allclose"] and check[k]["grad_x_allclose"] for k in KINDS[1:])
    if not (grads_ok and check["final_w_allclose"]):
        raise AssertionError(f"gradients disagree with native at {hw}x{hw}: {check}")

    times = {n: [] for n in fns}
    for r in range(args.repeats):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for n in order:
            t, _ = bu.timed(lambda: fns[n](w, xs, ts))
            times[n].append(t)
    return {"hw": hw, "times": times, "compile_s": compile_s, "check": check}


def report(args, results: list[dict]) -> str:
    header = ["input", "variant", "compile s", f"s per {args.steps} steps (median)", "ms/step",
              "vs native (scanned)", "vs native unrolled", "vs canonical (scanned)"]
    rows, checks = [], []
    for res in results:
        med = {n: bu.median(t) for n, t in res["times"].items()}
        for n, t in med.items():
            rows.append([
                f"{args.batch}x{res['hw']}x{res['hw']}x{args.cin}", n, f"{res['compile_s'][n]:.2f}", f"{t:.4f}",
                f"{1000 * t / args.steps:.2f}", f"{med['native'] / t:.2f}x", f"{med['native unrolled'] / t:.2f}x",
                f"{med['canonical'] / t:.2f}x",
            ])
        c = res["check"]
        parts = []
        for kind in KINDS[1:]:
            k = c[kind]
            parts.append(
                f"{kind}: max |Δ| kernel grad {k['grad_w_max_abs_diff']:.2e}, input grad "
                f"{k['grad_x_max_abs_diff']:.2e} (allclose rtol 1e-4: {k['grad_w_allclose'] and k['grad_x_allclose']}"
                f", bitwise equal: {k['bitwise']})"
            )
        checks.append(
            f"{res['hw']}x{res['hw']} (max |grad| kernel {c['grad_w_max_abs']:.2e}, input {c['grad_x_max_abs']:.2e}) — "
            + "; ".join(parts)
            + f"; weights after the scan, max |Δ| across all variants {c['final_w_max_abs_diff']:.2e} "
            f"(allclose: {c['final_w_allclose']})"
        )
    grad = "kernel and input gradient" if args.input_grad else "kernel gradient only"
    lines = [
        f"{args.kernel}x{args.kernel} conv (stride {args.stride}) {args.cin}->{args.cout}, batch {args.batch}, "
        f"{args.steps} SGD steps in one jitted "
        f"`lax.scan`, {grad}; {args.repeats} timed runs per variant, round-robin in one process "
        f"(load average at start/end: {results[0]['load'][0]} / {results[-1]['load'][1]}).",
        "",
        bu.markdown_table(header, rows),
        "",
        "\"vs X\" = median time of X / median time of the row (above 1: the row is faster than X). "
        "native = JAX's own transpose rules; patch = `conv_patch_grad` (im2col kernel gradient); "
        "canonical = `conv_canonical_grad` (what `jaxfednas.nn.Conv` uses on CPU).",
        "",
        "Numerics (one gradient vs native, then the whole scan): " + " | ".join(checks) + ".",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,32", help="comma list of input heights/widths")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cin", type=int, default=32)
    p.add_argument("--cout", type=int, default=64)
    p.add_argument("--kernel", type=int, default=3, help="square kernel size")
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--input-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="also differentiate (and use) the input gradient (default; --no-input-grad: kernel only)")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    args = p.parse_args(argv)

    results = []
    for hw in (int(s) for s in args.sizes.split(",")):
        load0 = bu.load_line()
        res = bench_size(args, hw)
        res["load"] = (load0, bu.load_line())
        med = {n: bu.median(t) for n, t in res["times"].items()}
        print(f"[conv_grad] {hw}x{hw}: " + ", ".join(f"{n} {t:.4f}s" for n, t in med.items())
              + f"; native/canonical {med['native'] / med['canonical']:.1f}x", flush=True)
        results.append(res)
    body = report(args, results)
    print()
    print(body)
    if not args.no_write:
        title = ("Conv gradients inside lax.scan: native vs im2col patches (conv_patch_grad) "
                 "vs canonical convolutions (conv_canonical_grad)")
        how = bu.write_results(title, bu.command_line("studies/conv_grad.py"), bu.machine_info(), body)
        print(f"\n{how} {bu.RESULTS}")


if __name__ == "__main__":
    main()
