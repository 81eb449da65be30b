"""Neural-network building blocks tuned per backend.

:class:`Conv` is a drop-in for ``flax.linen.Conv`` (same parameter names and
shapes) whose backward pass on CPU is written with *canonical* convolutions.

Why: inside a ``while`` loop (a ``lax.scan`` over local steps), XLA:CPU leaves
the kernel-gradient convolution that JAX's transpose rule emits in a
non-canonical dimension order (``f01b_i01o->01bf``) and runs it through its
slow generic emitter; outside loops the same convolution is canonicalised and
runs on Eigen. Measured with jax 0.10.2 on the 2-core CPU (6 SGD steps of a 3x3
conv, 16->16 channels, batch 32, 32x32, kernel and input gradient): native
scanned 0.61 s, native unrolled 0.070 s, :func:`conv_canonical_grad` scanned
0.068 s. The canonical form transposes the operands itself: the input gradient
is a stride-dilated full correlation with the flipped kernel, the kernel
gradient a convolution with batch and channels swapped (strides become
dilations). Results are bitwise equal to the native gradients in the tested
cases. :func:`conv_patch_grad` (im2col kernel gradient) is kept for the
benchmark (``benchmarks/conv_grad.py``). On GPU the native convolution is used.

Depthwise convolutions (the DARTS and ShuffleNet spaces): :func:`depthwise_conv` and
:class:`DepthwiseConv` alone, :class:`SeparableConv` when a 1x1 convolution follows
(every DARTS sep/dil conv). The pair has three formulations with the same math,
selected by ``dw_impl``:

* ``"grouped"`` -- ``lax.conv_general_dilated`` with ``feature_group_count=C``, then the
  1x1 conv (the default on GPU; XLA:CPU runs grouped convolutions slowly, and 2x
  slower again inside a ``lax.scan``);
* ``"slices"`` -- the depthwise conv as the sum over the k*k taps of a strided slice of
  the padded input times that tap's per-channel weights (:func:`depthwise_conv`), then
  the 1x1 conv (fast on CPU but slow to compile: 5x5 kernels give large fusions);
* ``"fused"`` -- one dense k x k convolution whose kernel is
  ``depthwise[u, v, 0, i] * pointwise[0, 0, i, o]`` (the default on CPU: the fastest whole
  8-op edge at the search widths and as quick to compile as a plain conv; its cost grows
  with C^2, so for wide evaluation networks -- C=36: 3x3 blocks 2.3x faster in a scan --
  pass ``dw_impl="slices"``).

:func:`default_depthwise_impl` picks per backend; ``benchmarks/darts_ops.py`` holds the
numbers behind the choice (also in ``benchmarks/RESULTS.md``).
"""
from __future__ import annotations

import contextlib
import contextvars
from functools import partial
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_DN = ("NHWC", "HWIO", "NHWC")


def _native(x, w, strides, padding, dilation):
    return jax.lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=_DN
    )


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def conv_patch_grad(x, w, strides, padding, dilation):
    """``conv_general_dilated`` (NHWC/HWIO) whose kernel gradient uses im2col patches."""
    return _native(x, w, strides, padding, dilation)


def _fwd(x, w, strides, padding, dilation):
    return _native(x, w, strides, padding, dilation), (x, w)


def _bwd(strides, padding, dilation, res, g):
    x, w = res
    _, vjp_x = jax.vjp(lambda x_: _native(x_, w, strides, padding, dilation), x)
    (dx,) = vjp_x(g)
    kh, kw, ci, co = w.shape
    patches = jax.lax.conv_general_dilated_patches(
        x, (kh, kw), strides, padding, rhs_dilation=dilation, dimension_numbers=_DN
    )  # [B, Ho, Wo, ci*kh*kw], feature order (ci, kh, kw)
    dw = jnp.einsum("bhwk,bhwo->ko", patches, g.astype(patches.dtype))
    dw = dw.reshape(ci, kh, kw, co).transpose(1, 2, 0, 3).astype(w.dtype)
    return dx, dw


conv_patch_grad.defvjp(_fwd, _bwd)


def explicit_padding(x_shape, w_shape, strides, padding, dilation) -> tuple[tuple[int, int], ...]:
    """``padding`` ('SAME', 'VALID' or pairs) as explicit ``(lo, hi)`` pairs."""
    if isinstance(padding, str):
        k_eff = [(k - 1) * d + 1 for k, d in zip(w_shape[:2], dilation)]
        return tuple(tuple(p) for p in jax.lax.padtype_to_pads(x_shape[1:3], k_eff, strides, padding))
    return tuple(tuple(p) for p in padding)


_KERNEL_GRAD_GATE: contextvars.ContextVar = contextvars.ContextVar("jaxfednas_kernel_grad_gate", default=None)


@contextlib.contextmanager
def kernel_grads_if(gate):
    """Inside the block, every convolution traced through :func:`conv_canonical_grad` (all
    convolutions of :class:`Conv`, :func:`dense_conv` and the grouped DARTS cell on CPU)
    computes its kernel gradient only where the traced boolean scalar ``gate`` is true,
    and returns a zero kernel gradient (without running the convolution) where it is
    false; input gradients are unaffected. For a loop body whose iterations need the
    kernel gradients in some iterations only (:func:`jaxfednas.optim.milenas_grads`: the
    validation pass needs ``∇_α`` alone). ``gate`` must belong to the trace the block's
    convolutions are traced in (pass it explicitly into inner ``jax.jit`` s:
    :func:`kernel_grad_gate` reads it)."""
    token = _KERNEL_GRAD_GATE.set(gate)
    try:
        yield
    finally:
        _KERNEL_GRAD_GATE.reset(token)


def kernel_grad_gate():
    """The gate of the enclosing :func:`kernel_grads_if` block, or None."""
    return _KERNEL_GRAD_GATE.get()


def conv_canonical_grad(x, w, strides, padding, dilation, gate=None):
    """``conv_general_dilated`` (NHWC/HWIO) whose gradients are canonical convolutions;
    the kernel gradient only where ``gate`` (default: :func:`kernel_grad_gate`) is not
    false."""
    gate = kernel_grad_gate() if gate is None else gate
    return _conv_canonical(x, w, strides, padding, dilation, gate)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv_canonical(x, w, strides, padding, dilation, gate):
    return _native(x, w, strides, padding, dilation)


def _canon_fwd(x, w, strides, padding, dilation, gate):
    return _native(x, w, strides, padding, dilation), (x, w, gate)


def _canon_bwd(strides, padding, dilation, res, g):
    x, w, gate = res
    kh, kw, _, _ = w.shape
    pads = explicit_padding(x.shape, w.shape, strides, padding, dilation)
    # Input gradient: full correlation of the stride-dilated cotangent with the
    # spatially flipped kernel whose in/out channels are swapped.
    w_t = jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2)
    d_pads = []
    for axis, (k, d, s, (lo, _)) in enumerate(zip((kh, kw), dilation, strides, pads)):
        n, o = x.shape[1 + axis], g.shape[1 + axis]
        k_eff = (k - 1) * d + 1
        new_lo = k_eff - 1 - lo
        d_pads.append((new_lo, n + k_eff - 1 - ((o - 1) * s + 1) - new_lo))
    dx = jax.lax.conv_general_dilated(
        g, w_t, (1, 1), d_pads, lhs_dilation=strides, rhs_dilation=dilation, dimension_numbers=_DN
    )

    def kernel_grad(x, g):
        # Kernel gradient: channels act as the batch and the batch as features;
        # the forward strides become kernel dilations and the dilations strides.
        x_t = x.transpose(3, 1, 2, 0)  # [ci, H, W, B]
        g_t = g.transpose(1, 2, 0, 3).astype(x.dtype)  # [Ho, Wo, B, co]
        dw = jax.lax.conv_general_dilated(x_t, g_t, dilation, pads, rhs_dilation=strides, dimension_numbers=_DN)
        return dw[:, :kh, :kw, :].transpose(1, 2, 0, 3).astype(w.dtype)

    if gate is None:
        dw = kernel_grad(x, g)
    else:
        dw = lax.cond(gate, kernel_grad, lambda x, g: jnp.zeros(w.shape, w.dtype), x, g)
    return dx.astype(x.dtype), dw, None


_conv_canonical.defvjp(_canon_fwd, _canon_bwd)


def use_fast_grad() -> bool:
    return jax.default_backend() == "cpu"


class Conv(nn.Module):
    """``nn.Conv`` subset (no groups) with CPU-friendly (canonical) gradients."""

    features: int
    kernel_size: Sequence[int]
    strides: Sequence[int] = (1, 1)
    padding: Any = "SAME"
    kernel_dilation: Sequence[int] = (1, 1)
    use_bias: bool = True
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        w = self.param("kernel", self.kernel_init, (kh, kw, x.shape[-1], self.features))
        strides, dil = tuple(self.strides), tuple(self.kernel_dilation)
        pad = self.padding if isinstance(self.padding, str) else tuple(tuple(p) for p in self.padding)
        if use_fast_grad():
            y = conv_canonical_grad(x, w.astype(x.dtype), strides, pad, dil)
        else:
            y = _native(x, w.astype(x.dtype), strides, pad, dil)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,))
        return y


DEPTHWISE_IMPLS = ("grouped", "slices", "fused")


def default_depthwise_impl() -> str:
    """``"fused"`` on CPU, ``"grouped"`` elsewhere (numbers: ``benchmarks/darts_ops.py``)."""
    return "fused" if jax.default_backend() == "cpu" else "grouped"


def resolve_depthwise_impl(impl: str | None) -> str:
    """``impl`` checked, ``None`` replaced by :func:`default_depthwise_impl`."""
    impl = default_depthwise_impl() if impl is None else impl
    if impl not in DEPTHWISE_IMPLS:
        raise ValueError(f"dw_impl must be one of {DEPTHWISE_IMPLS} or None, got {impl!r}")
    return impl


def depthwise_conv(x, w, stride: int = 1, dilation: int = 1, padding: int = 0, impl: str | None = None):
    """Depthwise 2-D convolution of NHWC ``x`` with a ``[k, k, 1, C]`` (HWIO, grouped) kernel.

    Symmetric zero ``padding``, square ``stride`` and ``dilation``. ``impl`` is
    ``"grouped"``, ``"slices"`` or ``None`` (the backend default, with ``"fused"`` read as
    ``"slices"``: a lone depthwise conv has no 1x1 conv to fold into); both give the same
    values and gradients up to float rounding.
    """
    impl = resolve_depthwise_impl(impl)
    if impl == "fused":
        impl = "slices"
    k, k2, one, c = w.shape
    if k != k2 or one != 1 or c != x.shape[-1]:
        raise ValueError(f"depthwise kernel must be [k, k, 1, C={x.shape[-1]}], got {w.shape}")
    w = w.astype(x.dtype)
    if impl == "grouped":
        return lax.conv_general_dilated(
            x, w, (stride, stride), ((padding, padding), (padding, padding)),
            rhs_dilation=(dilation, dilation), dimension_numbers=_DN, feature_group_count=c,
        )
    b, h, wd, _ = x.shape
    xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0))) if padding else x
    span = dilation * (k - 1) + 1
    ho = (h + 2 * padding - span) // stride + 1
    wo = (wd + 2 * padding - span) // stride + 1
    out = None
    for u in range(k):
        for v in range(k):
            r, s = u * dilation, v * dilation
            tap = lax.slice(
                xp, (0, r, s, 0), (b, r + (ho - 1) * stride + 1, s + (wo - 1) * stride + 1, c),
                (1, stride, stride, 1),
            ) * w[u, v, 0]
            out = tap if out is None else out + tap
    return out


class DepthwiseConv(nn.Module):
    """Depthwise k x k convolution (no bias); kernel ``[k, k, 1, C]`` as in a grouped conv."""

    kernel_size: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    dw_impl: str | None = None
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        k = self.kernel_size
        w = self.param("kernel", self.kernel_init, (k, k, 1, x.shape[-1]))
        return depthwise_conv(x, w, self.stride, self.dilation, self.padding, self.dw_impl)


def dense_conv(x, w, stride: int, padding: int, dilation: int):
    """NHWC / HWIO convolution, square ``stride`` / symmetric ``padding`` / ``dilation``, with
    canonical-convolution gradients on CPU (see :class:`Conv`)."""
    s, d, p = (stride, stride), (dilation, dilation), ((padding, padding), (padding, padding))
    if use_fast_grad():
        return conv_canonical_grad(x, w.astype(x.dtype), s, p, d)
    return lax.conv_general_dilated(x, w.astype(x.dtype), s, p, rhs_dilation=d, dimension_numbers=_DN)


class SeparableConv(nn.Module):
    """Depthwise k x k (stride, dilation) followed by a 1x1 conv to ``C_out``; no bias.

    Parameters ``depthwise`` ``[k, k, 1, C_in]`` and ``pointwise`` ``[1, 1, C_in, C_out]`` in
    every formulation. ``dw_impl="fused"`` runs the pair as one dense k x k convolution
    with kernel ``depthwise[u, v, 0, i] * pointwise[0, 0, i, o]`` (the same linear map;
    its cost grows with ``C_in * C_out``).
    """

    C_out: int
    kernel_size: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    dw_impl: str | None = None
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        k, c_in = self.kernel_size, x.shape[-1]
        dw = self.param("depthwise", self.kernel_init, (k, k, 1, c_in))
        pw = self.param("pointwise", self.kernel_init, (1, 1, c_in, self.C_out))
        impl = resolve_depthwise_impl(self.dw_impl)
        if impl == "fused":
            kernel = dw[:, :, 0, :, None] * pw[0, 0][None, None]
            return dense_conv(x, kernel, self.stride, self.padding, self.dilation)
        y = depthwise_conv(x, dw, self.stride, self.dilation, self.padding, impl)
        return dense_conv(y, pw, 1, 0, 1)
