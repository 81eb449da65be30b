"""ShuffleNetV2 choice-block candidates (Ma et al., "ShuffleNet V2", arXiv:1807.11164),
in the layout of the SPOS / DSNAS one-shot supernet (docs/authors_code.md §3.1).

Every candidate maps ``inp`` input channels to ``oup`` output channels:

* a **stride-1 unit** (``first=False``, input has ``oup`` channels) splits its input
  by a channel shuffle: even-indexed channels pass through, odd-indexed channels go
  through the main branch; ``out = concat(pass, main)``;
* a **first unit of a stage** (``first=True``, usually stride 2) has a projection
  branch on the full input (depthwise k×k with the stride, BN, 1×1, BN, ReLU; keeps
  ``inp`` channels) beside the main branch on the full input;
* main branch ``"k3" / "k5" / "k7"``: 1×1 (→ mid) BN ReLU, depthwise k×k (stride) BN,
  1×1 (→ oup − inp) BN ReLU, with ``mid = oup // 2``;
* main branch ``"xception"``: three [depthwise 3×3 BN, 1×1 BN ReLU] pairs, the first
  depthwise with the stride, the last 1×1 to ``oup − inp`` channels.

Constants follow DSNAS: BatchNorm with affine parameters (``--bn_affine``), conv
weights N(0, std 1/fan-in-per-group) — std 1 for depthwise kernels — BN scale 1 and
shift 1e-4. BatchNorm eps is a parameter: PyTorch's 1e-5 by default; DSNAS' ImageNet
commands use 1e-2 (``--bn_eps 1e-2``, batch 1024), which on small batches and narrow
units slows the single-path supernet down (digits, 10 local epochs of one client:
48 % vs 30 % training accuracy).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfednas.nn import BatchNorm, Conv
from jaxfednas.nn import default_depthwise_impl, depthwise_conv, target_platform

BN_EPS = 1e-5  # PyTorch's default; DSNAS_BN_EPS for parity with DSNAS' ImageNet runs
DSNAS_BN_EPS = 1e-2
BN_MOMENTUM = 0.9  # Flax convention; PyTorch momentum 0.1
CANDIDATES = ("k3", "k5", "k7", "xception")
KERNELS = {"k3": 3, "k5": 5, "k7": 7, "xception": 3}


def spos_init(fan_in: int):
    """DSNAS/SPOS conv init: N(0, std = 1 / fan_in) (fan_in = input channels per group)."""
    return nn.initializers.normal(stddev=1.0 / fan_in)


def channel_split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SPOS' ``channel_shuffle``: (even-indexed channels, odd-indexed channels)."""
    if x.shape[-1] % 2:
        raise ValueError(f"channel split needs an even channel count, got {x.shape[-1]}")
    return x[..., 0::2], x[..., 1::2]


class _Layers(nn.Module):
    """Shared helpers of the candidates (created in the caller's compact scope)."""

    @staticmethod
    def bn(h, train: bool, mask, eps: float = BN_EPS):
        m = None if mask is None else mask[:, None, None, None]
        return BatchNorm(  # jaxfednas.nn's: Flax's variables, a closed-form backward
            use_running_average=not train, momentum=BN_MOMENTUM, epsilon=eps,
            bias_init=nn.initializers.constant(1e-4),
        )(h, mask=m)

    @staticmethod
    def pw(h, features: int):
        """1×1 convolution = a dense layer over channels (no bias)."""
        return nn.Dense(features, use_bias=False, kernel_init=spos_init(h.shape[-1]))(h)


def auto_depthwise_impl(image_side: int) -> str:
    """The faster depthwise form for this backend and input size: XLA:CPU compiles the
    backward of grouped convolutions inside ``lax.switch`` / ``lax.scan`` to slow generic
    loops (5-7x at 32x32, benchmarks/RESULTS.md) but is fine with them on tiny maps (8x8
    digits: grouped 137 ms vs slices 270 ms per step); GPUs want grouped."""
    if target_platform() != "cpu":
        return "grouped"
    return "slices" if image_side >= 16 else "grouped"


def _depthwise(x, w, stride: int, padding: int, impl):
    return depthwise_conv(x, w, stride, 1, padding, impl)


# The "slices" form (k² shifted products; fast on XLA:CPU) would keep k² shifted copies
# of its input for the backward pass; under lax.switch nothing can be fused across the
# branch boundary, so they would all be materialised. Recomputing them is cheaper.
_depthwise_remat = jax.checkpoint(_depthwise, static_argnums=(2, 3, 4))


class DepthwiseKxK(nn.Module):
    kernel_size: int
    stride: int = 1
    dw_impl: str | None = None

    @nn.compact
    def __call__(self, x):
        k = self.kernel_size
        w = self.param("kernel", spos_init(1), (k, k, 1, x.shape[-1]))
        impl = default_depthwise_impl() if self.dw_impl is None else self.dw_impl
        f = _depthwise if impl in ("grouped", "hybrid") else _depthwise_remat
        return f(x, w, self.stride, k // 2, impl)


class ShuffleUnit(nn.Module):
    """One candidate of a choice block (see the module docstring)."""

    candidate: str
    inp: int
    oup: int
    stride: int
    first: bool
    dw_impl: str | None = None
    bn_eps: float = BN_EPS

    @nn.compact
    def __call__(self, x, mask=None, train: bool = False):  # positional: remat-able (train static)
        pw = _Layers.pw

        def bn(h, train, mask):
            return _Layers.bn(h, train, mask, self.bn_eps)
        if self.first:
            passthrough, main = x, x
        else:
            passthrough, main = channel_split(x)
        inp = main.shape[-1]
        if inp != self.inp:
            raise ValueError(f"{self.candidate} unit expects {self.inp} main-branch channels, got {inp}")
        mid, out = self.oup // 2, self.oup - self.inp
        k = KERNELS[self.candidate]
        if self.candidate == "xception":
            h = main
            for i, (stride, width) in enumerate(((self.stride, mid), (1, mid), (1, out))):
                h = bn(DepthwiseKxK(3, stride, self.dw_impl, name=f"dw{i}")(h), train, mask)
                h = nn.relu(bn(pw(h, width), train, mask))
        else:
            h = nn.relu(bn(pw(main, mid), train, mask))
            h = bn(DepthwiseKxK(k, self.stride, self.dw_impl, name="dw")(h), train, mask)
            h = nn.relu(bn(pw(h, out), train, mask))
        if self.first:
            p = bn(DepthwiseKxK(k, self.stride, self.dw_impl, name="proj_dw")(passthrough), train, mask)
            passthrough = nn.relu(bn(pw(p, self.inp), train, mask))
        return jnp.concatenate([passthrough, h], axis=-1)


class Stem(nn.Module):
    """3×3 conv (N(0, 0.01) weights) → BN → ReLU."""

    features: int
    stride: int = 1
    bn_eps: float = BN_EPS

    @nn.compact
    def __call__(self, x, *, train: bool = False, mask=None):
        h = Conv(self.features, (3, 3), (self.stride, self.stride), padding=((1, 1), (1, 1)), use_bias=False,
                 kernel_init=nn.initializers.normal(0.01))(x)
        return nn.relu(_Layers.bn(h, train, mask, self.bn_eps))


class Head(nn.Module):
    """1×1 conv to ``last_channels`` → BN → ReLU → global average pool → linear (no bias)."""

    last_channels: int
    num_classes: int
    bn_eps: float = BN_EPS

    @nn.compact
    def __call__(self, x, *, train: bool = False, mask=None):
        h = nn.relu(_Layers.bn(_Layers.pw(x, self.last_channels), train, mask, self.bn_eps))
        h = h.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, use_bias=False, kernel_init=nn.initializers.normal(0.01))(h)


def make_unit(candidate: str, inp: int, oup: int, stride: int, first: bool, dw_impl: str | None = None,
              bn_eps: float = BN_EPS) -> Any:
    if candidate not in CANDIDATES:
        raise ValueError(f"unknown candidate {candidate!r}; expected one of {CANDIDATES}")
    return ShuffleUnit(candidate, inp, oup, stride, first, dw_impl, bn_eps)
