"""DARTS candidate operations (Liu et al., "DARTS: Differentiable Architecture Search",
arXiv:1806.09055, Sec. 3.1 and App. A) as Flax linen modules on NHWC images.

Every op is called as ``op(x, train, mask=None)``: ``train`` selects batch statistics
in BatchNorm, ``mask`` ([B] booleans) keeps the padded rows of a partial batch out of
those statistics. Convolutions carry no bias and use the pre-activation order
ReLU -> conv -> BN. BatchNorm uses PyTorch's defaults (momentum 0.1, i.e. Flax
``momentum=0.9``; eps 1e-5); ``affine=False`` drops scale and shift, as in search.
Its running variance takes the biased batch variance (Flax); with
``unbiased_running_var=True`` (a field of every op and of the search network) the unbiased
one, as PyTorch's ``running_var``.

Every depthwise convolution in DARTS is directly followed by a 1x1 convolution:
:class:`jaxfednas.nn.SeparableConv`, with three formulations of the same math picked
per backend by ``dw_impl`` (see :mod:`jaxfednas.nn`).

Normalisation (``norm``, every op and the search network): ``"batch"`` (default) is
DARTS' BatchNorm with batch statistics. BatchNorm couples the examples of a batch, so
one example's gradient depends on the others and per-example clipping no longer
bounds its influence; differentially private search (DP-FNAS) therefore uses a
per-example normalisation: ``"group"`` (GroupNorm with ``gcd(C // 2, 8)`` groups: at
most 8 and at least two channels per group) or ``"layer"`` (GroupNorm with one group:
all of H, W and C). Not instance norm (one channel per group, e.g. Opacus'
``GroupNorm(min(32, C), C)`` at small C): every op of a mixed edge ends in a
normalisation, so each channel of a cell's output would have zero spatial mean and the
global average pool in front of the classifier would see nothing. With g channels per
group the pooled features of an op lose C/g dimensions (the group sums), one for
"layer". Both normalise each
example by its own statistics, keep no running averages (no ``batch_stats``) and
behave the same in training and evaluation. This is a deliberate deviation from the
papers' search network, made only where DP needs it (DESIGN invariant 4).

Dense convolutions use :class:`jaxfednas.nn.Conv`.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfednas.nn import Conv, SeparableConv

PRIMITIVES: tuple[str, ...] = (
    "none",
    "max_pool_3x3",
    "avg_pool_3x3",
    "skip_connect",
    "sep_conv_3x3",
    "sep_conv_5x5",
    "dil_conv_3x3",
    "dil_conv_5x5",
)
"""The DARTS space in the order of the reference code (index 0 is ``none``)."""

PRIMITIVES_S2: tuple[str, ...] = ("skip_connect", "sep_conv_3x3")
"""The two-op "s2" space of RobustDARTS / darts-pt (FedNAS ablation, SPIDER)."""

PRIMITIVE_SETS: dict[str, tuple[str, ...]] = {
    "darts": PRIMITIVES,
    "s2": PRIMITIVES_S2,
    "tiny": ("skip_connect", "avg_pool_3x3", "sep_conv_3x3"),
}
"""Candidate-op sets by name (the ``primitives`` setting of the DARTS-space algorithms);
``tiny`` is for tests and smoke runs."""

OPS: tuple[str, ...] = PRIMITIVES + ("conv_7x1_1x7",)
"""Every op :func:`make_op` builds (``conv_7x1_1x7`` is in DARTS' table, in no primitive set)."""

NORMS = ("batch", "group", "layer")
GROUPS = 8  # "group" norm: gcd(C // 2, GROUPS) groups (>= 2 channels each)

BN_MOMENTUM = 0.9  # Flax convention: running = 0.9 * running + 0.1 * batch (PyTorch momentum 0.1)
BN_EPS = 1e-5

def unbiased_denominator(n):
    """``n - 1`` (at least 1): the unbiased variance is ``var + var / (n - 1)``."""
    return jnp.maximum(n - 1, 1)


def batch_norm(x, train: bool, mask=None, affine: bool = True, name: str | None = None, norm: str = "batch",
               unbiased_running_var: bool = False):
    """BatchNorm with the reference constants; ``mask`` [B] excludes padded examples.

    ``unbiased_running_var``: a training-mode call updates the running variance with the
    unbiased batch variance ``n/(n-1) var``, ``n`` the real examples times the positions it
    normalises over -- PyTorch's ``BatchNorm2d`` rule; False (default): the biased ``var``,
    as Flax. The forward and the gradients are the same either way.

    ``norm="group"`` / ``"layer"`` replace it by a per-example GroupNorm (``gcd(C // 2, 8)``
    groups / one group; same eps, scale and shift only if ``affine``) that ignores
    ``train`` and ``mask``: every example is normalised by its own statistics.

    Call inside a compact method: the module is created in the caller's scope.
    """
    if norm != "batch":
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        groups = max(1, math.gcd(x.shape[-1] // 2, GROUPS)) if norm == "group" else 1
        return nn.GroupNorm(num_groups=groups, epsilon=BN_EPS, use_scale=affine, use_bias=affine, name=name)(x)
    m = None if mask is None else mask[:, None, None, None]
    bn = nn.BatchNorm(
        use_running_average=not train, momentum=BN_MOMENTUM, epsilon=BN_EPS,
        use_scale=affine, use_bias=affine, name=name,
    )
    if not (train and unbiased_running_var) or bn.is_initializing():
        return bn(x, mask=m)
    old = bn.get_variable("batch_stats", "var")
    y = bn(x, mask=m)
    # Flax stored m*old + (1-m)*var (biased); add (1-m)*var/(n-1) for PyTorch's n/(n-1)*var
    new = bn.get_variable("batch_stats", "var")
    n = (x.shape[0] if mask is None else mask.sum()) * math.prod(x.shape[1:-1])
    bn.put_variable("batch_stats", "var", new + (new - BN_MOMENTUM * old) / unbiased_denominator(n))
    return y


def _pad2(p: int):
    return ((p, p), (p, p))


class Zero(nn.Module):
    """``none``: zeros, spatially subsampled (every ``stride``-th pixel) when strided."""

    stride: int = 1

    def __call__(self, x, train: bool = False, mask=None):
        s = self.stride
        return jnp.zeros_like(x[:, ::s, ::s, :])


class Identity(nn.Module):
    def __call__(self, x, train: bool = False, mask=None):
        return x


class MaxPool3x3(nn.Module):
    """3x3 max pool, padding 1 (padded cells never win: they are -inf)."""

    stride: int = 1

    def __call__(self, x, train: bool = False, mask=None):
        s = self.stride
        return nn.max_pool(x, (3, 3), (s, s), padding=_pad2(1))


class AvgPool3x3(nn.Module):
    """3x3 average pool, padding 1, padding excluded from the count (count_include_pad=False)."""

    stride: int = 1

    def __call__(self, x, train: bool = False, mask=None):
        return avg_pool_3x3(x, self.stride)


def avg_pool_3x3(x, stride: int):
    """3x3 average pooling, padding 1, padding excluded from the count (a host constant:
    counting with a second ``reduce_window`` over ones made XLA constant-fold it slowly)."""
    total = lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, stride, stride, 1),
                              ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = x.shape[1:3]
    ho, wo = total.shape[1:3]
    ones = np.pad(np.ones((h, w), np.float32), 1)
    count = sum(ones[u:u + (ho - 1) * stride + 1:stride, v:v + (wo - 1) * stride + 1:stride]
                for u in range(3) for v in range(3))
    return total / jnp.asarray(count, x.dtype)[None, :, :, None]


class ReLUConvBN(nn.Module):
    """ReLU -> k x k conv (C_in -> ``C_out``) -> BN."""

    C_out: int
    kernel_size: int = 1
    stride: int = 1
    padding: int = 0
    affine: bool = True
    norm: str = "batch"
    unbiased_running_var: bool = False  # PyTorch's running variance (see batch_norm)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        k, s = self.kernel_size, self.stride
        x = Conv(self.C_out, (k, k), (s, s), padding=_pad2(self.padding), use_bias=False)(nn.relu(x))
        return batch_norm(x, train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)


class FactorizedReduce(nn.Module):
    """ReLU, two stride-2 1x1 convs (on x and on x shifted by one pixel), concat -> BN.

    Halves H and W (which must be even) and maps C_in -> ``C_out`` (even).
    """

    C_out: int
    affine: bool = True
    norm: str = "batch"
    unbiased_running_var: bool = False  # PyTorch's running variance (see batch_norm)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        if self.C_out % 2:
            raise ValueError(f"FactorizedReduce needs an even C_out, got {self.C_out}")
        if x.shape[1] % 2 or x.shape[2] % 2:
            raise ValueError(f"FactorizedReduce needs even H and W, got {x.shape[1:3]}")
        x = nn.relu(x)
        half = self.C_out // 2
        a = Conv(half, (1, 1), (2, 2), padding="VALID", use_bias=False)(x)
        b = Conv(half, (1, 1), (2, 2), padding="VALID", use_bias=False)(x[:, 1:, 1:, :])
        return batch_norm(jnp.concatenate([a, b], axis=-1), train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)


class DilConv(nn.Module):
    """ReLU -> depthwise k x k (dilation, stride) -> 1x1 conv -> BN (applied once)."""

    C_out: int
    kernel_size: int
    stride: int
    padding: int
    dilation: int
    affine: bool = True
    dw_impl: str | None = None
    norm: str = "batch"
    unbiased_running_var: bool = False  # PyTorch's running variance (see batch_norm)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = SeparableConv(self.C_out, self.kernel_size, self.stride, self.padding, self.dilation, self.dw_impl)(
            nn.relu(x))
        return batch_norm(x, train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)


class SepConv(nn.Module):
    """The separable block applied twice; only the first depthwise conv is strided.

    ReLU -> dw k x k (stride) -> 1x1 (C_in) -> BN -> ReLU -> dw k x k -> 1x1 (C_out) -> BN.
    """

    C_out: int
    kernel_size: int
    stride: int
    padding: int
    affine: bool = True
    dw_impl: str | None = None
    norm: str = "batch"
    unbiased_running_var: bool = False  # PyTorch's running variance (see batch_norm)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        c_in, k, p = x.shape[-1], self.kernel_size, self.padding
        x = SeparableConv(c_in, k, self.stride, p, 1, self.dw_impl)(nn.relu(x))
        x = batch_norm(x, train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)
        x = SeparableConv(self.C_out, k, 1, p, 1, self.dw_impl)(nn.relu(x))
        return batch_norm(x, train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)


class Conv7x1_1x7(nn.Module):
    """ReLU -> 1x7 conv (stride (1, s)) -> 7x1 conv (stride (s, 1)) -> BN."""

    C_out: int
    stride: int = 1
    affine: bool = True
    norm: str = "batch"
    unbiased_running_var: bool = False  # PyTorch's running variance (see batch_norm)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        s = self.stride
        x = Conv(self.C_out, (1, 7), (1, s), padding=((0, 0), (3, 3)), use_bias=False)(nn.relu(x))
        x = Conv(self.C_out, (7, 1), (s, 1), padding=((3, 3), (0, 0)), use_bias=False)(x)
        return batch_norm(x, train, mask, self.affine, norm=self.norm,
                          unbiased_running_var=self.unbiased_running_var)


def make_op(name: str, C: int, stride: int, affine: bool, *, dw_impl: str | None = None,
            module_name: str | None = None, norm: str = "batch", unbiased_running_var: bool = False) -> nn.Module:
    """The candidate op ``name`` for C -> C channels at ``stride`` (1 or 2).

    ``module_name`` is the Flax name of the returned module (its parameter scope);
    ``norm`` its normalisation (``"batch"``, or per-example ``"group"`` / ``"layer"``);
    ``unbiased_running_var`` its BatchNorm's running-variance rule (:func:`batch_norm`).
    Pooling ops come without BN; the search :class:`~jaxfednas.search_spaces.darts.search.MixedOp`
    adds BN(affine=False) after them, the evaluation network does not.
    """
    if stride not in (1, 2):
        raise ValueError(f"stride must be 1 or 2, got {stride}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    kw = {"name": module_name}
    nkw = {"name": module_name, "norm": norm, "unbiased_running_var": unbiased_running_var}
    if name == "none":
        return Zero(stride, **kw)
    if name == "max_pool_3x3":
        return MaxPool3x3(stride, **kw)
    if name == "avg_pool_3x3":
        return AvgPool3x3(stride, **kw)
    if name == "skip_connect":
        return Identity(**kw) if stride == 1 else FactorizedReduce(C, affine, **nkw)
    if name == "sep_conv_3x3":
        return SepConv(C, 3, stride, 1, affine, dw_impl, **nkw)
    if name == "sep_conv_5x5":
        return SepConv(C, 5, stride, 2, affine, dw_impl, **nkw)
    if name == "dil_conv_3x3":
        return DilConv(C, 3, stride, 2, 2, affine, dw_impl, **nkw)
    if name == "dil_conv_5x5":
        return DilConv(C, 5, stride, 4, 2, affine, dw_impl, **nkw)
    if name == "conv_7x1_1x7":
        return Conv7x1_1x7(C, stride, affine, **nkw)
    raise ValueError(f"unknown op {name!r}; expected one of {OPS}")


def is_identity(name: str, stride: int) -> bool:
    """True for the ops that are a plain identity (no drop path on them in DARTS)."""
    return name == "skip_connect" and stride == 1


def validate_primitives(primitives) -> tuple[str, ...]:
    primitives = tuple(primitives)
    if not primitives:
        raise ValueError("primitives must name at least one op")
    bad = [p for p in primitives if p not in OPS]
    if bad:
        raise ValueError(f"primitives: unknown op(s) {bad}; expected names from {OPS}")
    if len(set(primitives)) != len(primitives):
        raise ValueError(f"primitives must not repeat an op, got {primitives}")
    return primitives
