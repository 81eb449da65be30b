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
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

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


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def conv_canonical_grad(x, w, strides, padding, dilation):
    """``conv_general_dilated`` (NHWC/HWIO) whose gradients are canonical convolutions."""
    return _native(x, w, strides, padding, dilation)


def _canon_fwd(x, w, strides, padding, dilation):
    return _native(x, w, strides, padding, dilation), (x, w)


def _canon_bwd(strides, padding, dilation, res, g):
    x, w = res
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
    # Kernel gradient: channels act as the batch and the batch as features;
    # the forward strides become kernel dilations and the dilations strides.
    x_t = x.transpose(3, 1, 2, 0)  # [ci, H, W, B]
    g_t = g.transpose(1, 2, 0, 3).astype(x.dtype)  # [Ho, Wo, B, co]
    dw = jax.lax.conv_general_dilated(x_t, g_t, dilation, pads, rhs_dilation=strides, dimension_numbers=_DN)
    dw = dw[:, :kh, :kw, :].transpose(1, 2, 0, 3).astype(w.dtype)
    return dx.astype(x.dtype), dw


conv_canonical_grad.defvjp(_canon_fwd, _canon_bwd)


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
