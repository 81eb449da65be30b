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
benchmark (``benchmarks/studies/conv_grad.py``). On GPU the native convolution is used.

Depthwise convolutions (the DARTS and ShuffleNet spaces): :func:`depthwise_conv` and
:class:`DepthwiseConv` alone, :class:`SeparableConv` when a 1x1 convolution follows
(every DARTS sep/dil conv). The pair has four formulations with the same math,
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
* ``"hybrid"`` -- the grouped convolution forward and for the input gradient, its kernel
  gradient as k*k per-tap products of a strided slice of the padded input with the
  cotangent, each reduced over batch and space (:func:`depthwise_conv_hybrid`): a candidate
  for XLA:GPU, whose grouped-convolution kernel gradient is the known slow part (public JAX
  issues #13800, #26266); ``benchmarks/gpu.py`` times it beside the others.

:func:`default_depthwise_impl` picks per backend; ``benchmarks/studies/darts_ops.py`` holds the
numbers behind the choice (also in ``benchmarks/RESULTS.md``).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from functools import partial
from typing import Any
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_DN = ("NHWC", "HWIO", "NHWC")

_TARGET_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("jaxfednas_target_platform", default=None)


@contextlib.contextmanager
def compile_for(platform: str):
    """Inside the block (at trace time), every choice made per backend -- the depthwise
    formulation, the CPU-friendly gradients, the grouped cells' default, the placement's
    and the CPU scheduler's -- is made for ``platform`` (``"cpu"``, ``"gpu"`` or
    ``"tpu"``) instead of JAX's default backend: what deviceless compilation for a GPU the
    machine does not have needs (:mod:`jaxfednas.kernels`)."""
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_platform() -> str:
    """The backend programs are traced for: :func:`compile_for`'s, else ``jax.default_backend()``."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


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
    return target_platform() == "cpu"


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


DEPTHWISE_IMPLS = ("grouped", "slices", "fused", "hybrid")


def default_depthwise_impl() -> str:
    """``"fused"`` on CPU, ``"grouped"`` elsewhere (numbers: ``benchmarks/studies/darts_ops.py``)."""
    return "fused" if target_platform() == "cpu" else "grouped"


def resolve_depthwise_impl(impl: str | None) -> str:
    """``impl`` checked, ``None`` replaced by :func:`default_depthwise_impl`."""
    impl = default_depthwise_impl() if impl is None else impl
    if impl not in DEPTHWISE_IMPLS:
        raise ValueError(f"dw_impl must be one of {DEPTHWISE_IMPLS} or None, got {impl!r}")
    return impl


def depthwise_conv(x, w, stride: int = 1, dilation: int = 1, padding: int = 0, impl: str | None = None):
    """Depthwise 2-D convolution of NHWC ``x`` with a ``[k, k, 1, C]`` (HWIO, grouped) kernel.

    Symmetric zero ``padding``, square ``stride`` and ``dilation``. ``impl`` is
    ``"grouped"``, ``"slices"``, ``"hybrid"`` or ``None`` (the backend default, with
    ``"fused"`` read as ``"slices"``: a lone depthwise conv has no 1x1 conv to fold into);
    all give the same values and gradients up to float rounding.
    """
    impl = resolve_depthwise_impl(impl)
    if impl == "fused":
        impl = "slices"
    k, k2, one, c = w.shape
    if k != k2 or one != 1 or c != x.shape[-1]:
        raise ValueError(f"depthwise kernel must be [k, k, 1, C={x.shape[-1]}], got {w.shape}")
    w = w.astype(x.dtype)
    if impl == "grouped":
        return _grouped(x, w, stride, dilation, padding)
    if impl == "hybrid":
        return depthwise_conv_hybrid(x, w, stride, dilation, padding)
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


def _grouped(x, w, stride: int, dilation: int, padding: int):
    return lax.conv_general_dilated(
        x, w, (stride, stride), ((padding, padding), (padding, padding)),
        rhs_dilation=(dilation, dilation), dimension_numbers=_DN, feature_group_count=w.shape[-1],
    )


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def depthwise_conv_hybrid(x, w, stride: int, dilation: int, padding: int):
    """The grouped depthwise convolution (``[k, k, 1, C]`` kernel) whose kernel gradient is
    computed tap by tap: ``dw[u, v, 0, c] = sum_{b, i, j} xp[b, s i + d u, s j + d v, c] *
    g[b, i, j, c]`` (``xp`` the padded input) -- k*k products reduced over batch and space
    instead of the grouped convolution with ``batch_group_count`` that JAX's transpose rule
    emits. Forward and input gradient are the grouped convolution's own."""
    return _grouped(x, w, stride, dilation, padding)


def _hybrid_fwd(x, w, stride, dilation, padding):
    return _grouped(x, w, stride, dilation, padding), (x, w)


def _hybrid_bwd(stride, dilation, padding, res, g):
    x, w = res
    _, vjp_x = jax.vjp(lambda x_: _grouped(x_, w, stride, dilation, padding), x)
    (dx,) = vjp_x(g)
    k, b, ho, wo = w.shape[0], g.shape[0], g.shape[1], g.shape[2]
    xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0))) if padding else x
    g32 = g.astype(jnp.float32)
    taps = [
        jnp.sum(lax.slice(xp, (0, u * dilation, v * dilation, 0),
                          (b, u * dilation + (ho - 1) * stride + 1, v * dilation + (wo - 1) * stride + 1, x.shape[-1]),
                          (1, stride, stride, 1)).astype(jnp.float32) * g32, axis=(0, 1, 2))
        for u in range(k) for v in range(k)
    ]
    dw = jnp.stack(taps).reshape(w.shape).astype(w.dtype)
    return dx, dw


depthwise_conv_hybrid.defvjp(_hybrid_fwd, _hybrid_bwd)


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


# --- BatchNorm with a closed-form backward --------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def batch_norm_train(y, w, eps: float = 1e-5):
    """Training-mode BatchNorm without scale and shift over the rows with weight ``w`` (``[B]``,
    1 = a real example, 0 = padding): ``((y - mean) * rsqrt(var + eps), mean, var)``, ``mean``
    and ``var`` per channel (last axis of ``y``) over the real rows and every other axis,
    ``var = max(E[y^2] - mean^2, 0)`` -- Flax's masked BatchNorm forward
    (``use_fast_variance``). The backward is that formula's derivative written out: two
    per-channel sums (``sum g``, ``sum g (y - mean)``) and one elementwise pass, where
    autodiff of the forward emits ~10x the operations (compile time: a supernet has
    hundreds of BatchNorms)."""
    return _bn_forward(y, w, eps)[0]


def _row_weights(y, w):
    """``w`` ([B]) as a ``[B, 1, ..., 1]`` column of ``y``'s dtype."""
    return w.astype(y.dtype).reshape((-1,) + (1,) * (y.ndim - 1))


def _channel_sums(*terms):
    """Each of ``terms`` (equal shapes) summed over every axis but the last. On CPU one
    reduction each; elsewhere one reduction of the terms stacked (XLA:GPU launches a kernel
    per reduction it does not fuse with a sibling, and a BatchNorm's two sums mostly were
    not: ``benchmarks/kernels.py``)."""
    axes = tuple(range(terms[0].ndim - 1))
    if use_fast_grad():
        return tuple(t.sum(axes) for t in terms)
    both = jnp.stack(terms).sum(tuple(a + 1 for a in axes))
    return tuple(both[i] for i in range(len(terms)))


def _bn_stats(y, w, eps):
    """``(mean, E[y^2] - mean^2, rsqrt(var + eps), n)`` per channel over the real rows."""
    wb = _row_weights(y, w)
    n = w.astype(y.dtype).sum() * math.prod(y.shape[1:-1])
    s1, s2 = _channel_sums(y * wb, y * y * wb)
    mean = s1 / n
    raw = s2 / n - mean * mean
    return mean, raw, lax.rsqrt(jnp.maximum(0.0, raw) + eps), n


def _bn_forward(y, w, eps):
    mean, raw, r, n = _bn_stats(y, w, eps)
    return ((y - mean) * r, mean, jnp.maximum(0.0, raw)), (y, w, mean, r, raw, n)


def _bn_input_grad(y, w, n, mean, r, raw, g_scaled, sum_g, sum_gc, g_mean, g_var):
    """d/dy of ``(out, mean, var)`` given ``g_scaled`` (the cotangent of ``(y - mean) * r``) and its
    per-channel sums ``sum g``, ``sum g (y - mean)``: var = max(0, E[y^2] - mean^2) enters
    through r = rsqrt(var + eps) and the clamp, mean through out and through raw's -mean^2."""
    d_raw = (g_var - 0.5 * r * r * r * sum_gc) * (raw > 0)
    d_mean = g_mean - r * sum_g - 2.0 * mean * d_raw
    return g_scaled * r + _row_weights(y, w) * ((d_mean + 2.0 * d_raw * y) / n)


def _bn_bwd(eps, res, cotangents):
    y, w, mean, r, raw, n = res
    g, g_mean, g_var = cotangents
    sum_g, sum_gc = _channel_sums(g, g * (y - mean))
    return _bn_input_grad(y, w, n, mean, r, raw, g, sum_g, sum_gc, g_mean, g_var), jnp.zeros_like(w)


batch_norm_train.defvjp(_bn_forward, _bn_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def batch_norm_affine_train(y, w, scale, bias, eps: float = 1e-5):
    """:func:`batch_norm_train` followed by ``* scale + bias`` (per channel), in one closed-form
    backward: two per-channel sums of the output's cotangent (``sum g``, ``sum g (y - mean)``)
    give the bias, scale and input gradients together."""
    return _bn_affine_forward(y, w, scale, bias, eps)[0]


def _bn_affine_forward(y, w, scale, bias, eps):
    mean, raw, r, n = _bn_stats(y, w, eps)
    out = (y - mean) * (r * scale) + bias
    return (out, mean, jnp.maximum(0.0, raw)), (y, w, mean, r, raw, n, scale)


def _bn_affine_bwd(eps, res, cotangents):
    y, w, mean, r, raw, n, scale = res
    g, g_mean, g_var = cotangents
    d_bias, sum_gc = _channel_sums(g, g * (y - mean))
    dy = _bn_input_grad(y, w, n, mean, r, raw, g * scale, scale * d_bias, scale * sum_gc, g_mean, g_var)
    return dy, jnp.zeros_like(w), r * sum_gc, d_bias


batch_norm_affine_train.defvjp(_bn_affine_forward, _bn_affine_bwd)


class BatchNorm(nn.Module):
    """A drop-in for ``flax.linen.BatchNorm`` over the last axis (the same variables: params
    ``scale`` / ``bias``, batch_stats ``mean`` / ``var``; the same masked statistics and
    running-average update) whose training-mode gradient is :func:`batch_norm_affine_train`'s
    closed form. ``mask``: ``None`` or booleans of shape ``[B, 1, ..., 1]`` (or ``[B]``),
    padded rows excluded from the statistics. Same results as Flax's up to float rounding
    (``tests/unit/jaxfednas/test_nn.py``). The ShuffleNet blocks use it: DFNAS' cross_silo local search
    (batch 64, 2-core CPU, ``benchmarks/dfnas_cost.py``) 1.00 -> 0.83 s/step, XLA temp
    2216 -> 1366 MiB, 21.7k -> 18.1k fusions in a round; compile time unchanged."""

    use_running_average: bool = False
    momentum: float = 0.99
    epsilon: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True
    scale_init: Any = nn.initializers.ones
    bias_init: Any = nn.initializers.zeros

    @nn.compact
    def __call__(self, x, mask=None, use_running_average: bool | None = None):
        if use_running_average is None:
            use_running_average = self.use_running_average
        in_dtype = x.dtype
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # statistics in float32 at least, as Flax
        c = x.shape[-1]
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
        scale = self.param("scale", self.scale_init, (c,), jnp.float32) if self.use_scale else jnp.ones((c,))
        bias = self.param("bias", self.bias_init, (c,), jnp.float32) if self.use_bias else jnp.zeros((c,))
        # the output's dtype as Flax's: the input's and the parameters' (bfloat16 when all are)
        dtype = jnp.result_type(in_dtype, *([scale.dtype] if self.use_scale else []),
                                *([bias.dtype] if self.use_bias else []))
        scale, bias = scale.astype(x.dtype), bias.astype(x.dtype)  # float32 given bfloat16 parameters
        if use_running_average:  # Flax's order of operations: (x - mean) * (rsqrt(var + eps) * scale) + bias
            return ((x - ra_mean.value) * (lax.rsqrt(ra_var.value + self.epsilon) * scale) + bias).astype(dtype)
        if mask is None:
            w = jnp.ones((x.shape[0],), x.dtype)
        elif mask.size == x.shape[0]:
            w = mask.reshape(x.shape[0]).astype(x.dtype)
        else:
            raise ValueError(f"BatchNorm mask must hold one value per example ([B, 1, ...]), got shape "
                             f"{mask.shape} for input {x.shape}")
        y, mean, var = batch_norm_affine_train(x, w, scale, bias, self.epsilon)
        if not self.is_initializing():
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
        return y.astype(dtype)
