"""An elastic MobileNetV3 supernet in the style of Once-for-All, as a choice space
(:mod:`jaxfednas.search_spaces.choice`) for PerFedRLNAS.

PerFedRLNAS (Yao & Li, "PerFedRLNAS: One-for-All Personalized Federated Neural
Architecture Search", AAAI 2024) searches, besides DARTS and NASViT, the MobileNetV3
supernet of Once-for-All (Cai et al., "Once-for-All: Train One Network and Specialize it
for Efficient Deployment", arXiv:1908.09791): every stage of inverted-residual blocks has
an elastic depth, kernel size, expand ratio and width, and the authors' code samples one
value per stage for each (per-stage lists such as ``mb3: c ∈ {40, 80}, d ∈ {2, 3, 4},
k ∈ {3, 5}, t ∈ {3, 4, 5}``; docs: reference-implementations.md §4.1), one categorical
dimension each with a softmax policy (PerFedRLNAS Eq. 4).

Layout (``H × W × C`` images)::

    stem    3×3 conv (stride ``stem_stride``, ``stem_channels``) -> BN -> act
    stageN  ``depth`` inverted-residual blocks (MobileNetV2/V3; the first one strided):
            1×1 expand (w_in -> e·w_in) -> BN -> act -> k×k depthwise -> BN -> act
            -> 1×1 project (-> w) -> BN   (+ input, in every block but the first)
            dims: stageN.depth, stageN.kernel, stageN.expand, stageN.width
    head    1×1 conv (w_last -> ``last_channels``) -> BN -> act -> global mean -> linear

How a subnet reads the supernet's weights (OFA's weight sharing, progressive shrinking's
"elastic" kernel, depth and width): depth ``d`` runs the first ``d`` blocks of the stage
and skips the others (identity); kernel ``k`` uses the centre ``k × k`` of the largest
depthwise kernel; width ``w`` the first ``w`` output channels of the stage's projections
(and the first ``w`` input channels of whatever reads the stage); expand ratio ``e`` the
first ``e · w_in`` hidden channels of a block, ``w_in`` being the width actually entering
the block (the previous stage's chosen width for a stage's first block), as in OFA's
``DynamicMBConvLayer``. One choice per stage is shared by the stage's blocks, as in the
authors' per-stage lists. BatchNorm normalises the active channels only and updates only
their running statistics.

Deliberate simplifications of OFA's MobileNetV3 (say so when comparing numbers):

* **centre slicing without OFA's kernel transformation matrices** (OFA maps the centre
  of a larger kernel through a learned 25×25 / 9×9 matrix before using it as a 5×5 /
  3×3 kernel); here the smaller kernel *is* the centre;
* **no squeeze-excite** (OFA uses SE in 3 of its 5 stages): it would make every block's
  cost depend on an extra reduction width and adds nothing to what is being tested —
  weight sharing over depth, kernel, expand ratio and width;
* no channel sorting (OFA re-orders channels by importance before shrinking widths),
  no fixed first 16-channel block after the stem and no second 1×1 "feature mix" layer
  before the classifier; no input-resolution dimension (the authors' wrapper carries one
  but never resizes the 32×32 images);
* BatchNorm as in the rest of this library: Flax's running-average convention
  (momentum 0.9, eps 1e-5, biased variance), statistics over the real examples only.

**Single path.** With a traced ``choice`` every convolution is a ``lax.switch`` whose
branches slice the weights at static sizes, and every block beyond the stage's smallest
depth sits in a ``lax.cond`` (skipped blocks cost nothing). Activations are zero-padded
to the largest width so that shapes are static; padded channels are exact zeros, and
every layer slices them away before reading a weight. Per block:

* the 1×1 expand conv switches over (w_in, e) and the 1×1 projection over (h, w), so
  both run at the subnet's channel counts — together the bulk of the multiply-adds;
* the depthwise conv switches over the kernel ``k`` only and runs over the block's
  *padded* hidden channels (zeros in, zeros out; their kernel entries get an exact zero
  gradient): slicing its channels too multiplies its branches by the number of hidden
  widths, and every depthwise branch's backward is costly to compile on XLA:CPU (and,
  as a ``"grouped"`` convolution inside a switch, slow to run: 35 s per step for one
  32×32×192 7×7 layer at batch 32). With (k, h) branches a "small" step compiled in
  38 s; with k only, 15-23 s (cifar 35-45 s) on the shared 2-core box;
* on CPU the depthwise conv is :func:`depthwise_taps` (k² shifted products with a
  hand-written backward): autodiff of that form keeps k² full-size products alive at
  once (the fixed "cifar" supernet's step: 9.2 GiB of XLA temporaries, 5.9 s; with it
  1.8 GiB, 2.5 s);
* BatchNorm and activations run element-wise on the padded tensors, masked to the
  active channels: with them inside the branches a "tiny" step compiled 2-3× slower;
* separate switches per layer keep the compiled branches additive
  (``|W_in|·|E| + |K| + |H|·|W|`` per block) instead of the product of all four dimensions;
* each branch is rematerialised (``jax.checkpoint``, also with a concrete choice):
  differentiating a switch otherwise keeps the residuals of *every* branch (zero-filled
  for those not taken), i.e. a copy of the input sliced at every width. A branch is
  linear (a sliced convolution), so the recomputation is only the slicing.

So a small subnet pays its own multiply-adds in its 1×1 convolutions, its kernel's in
the depthwise conv (at the padded width) and the padded width's element-wise work;
memory is that of the padded (largest) network. ``benchmarks/elastic_single_path.py``
(CPU, batch 32): the smallest "cifar" subnet under a traced choice takes 0.34× the
supernet's step time (the smallest child compiled alone: 0.07×), the largest 0.99×.
With a concrete (numpy) ``choice`` Python picks the branches and blocks and nothing is
padded inside a block: the traced program is the child network alone, which
:func:`jaxfednas.cost.count_macs` counts exactly.

Presets (:data:`SPACES`): ``"cifar"`` — OFA's MobileNetV3-Large ranges (kernels {3, 5, 7},
expand {3, 4, 6}, depth {2, 3, 4} in 5 stages), widths {w, 1.2·w} per stage from OFA's
two released width multipliers (stage widths 24, 40, 80, 112, 160 and 32, 48, 96, 136,
192); **32×32 stride schedule (our decision)**: OFA's ImageNet net downsamples 32× (stem
2, stages 2, 2, 2, 1, 2), which would leave a 32×32 image at 1×1, so the stem and the
first stage keep the resolution: 32 → 32 → 16 → 8 → 8 → 4 (stages 1, 2, 2, 1, 2), the
CIFAR adaptation used for ResNets and MobileNetV2; ReLU in the first two stages,
hard-swish after, as MobileNetV3. ``"small"`` — 8×8 digits: 4 stages 8 → 8 → 4 → 2 → 2,
kernels {3, 5}, expand {3, 4, 6}, depth {1, 2, 3} (stage 1: {1, 2}). ``"tiny"`` — tests.

Example::

    space = ElasticMobileNet.from_preset("small", num_classes=10, image_shape=(8, 8, 1))
    variables = space.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    logits = space.subnet(space.largest_choice()).apply(variables, x, train=False)
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, ClassVar, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfednas.nn import depthwise_conv, resolve_depthwise_impl
from jaxfednas.search_spaces.choice import Dimension, SubnetCost, check_choice, describe
from jaxfednas.search_spaces.sliced import as_choice, conv_nhwc, flax_apply, pad, select

BN_EPS = 1e-5
BN_MOMENTUM = 0.9  # Flax convention: running = 0.9 * running + 0.1 * batch (PyTorch momentum 0.1)
ACTIVATIONS: dict[str, Callable] = {"relu": jax.nn.relu, "hswish": jax.nn.hard_swish}
STEM_KERNEL = 3
FIELDS = ("depth", "kernel", "expand", "width")  # the dimensions of a stage, in choice order


class Stage(NamedTuple):
    """The choices of one stage (each ascending) and its fixed stride and activation."""

    widths: tuple[int, ...]
    depths: tuple[int, ...]
    kernels: tuple[int, ...]
    expands: tuple[int, ...]
    stride: int = 1
    act: str = "relu"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The supernet's layout: ``stages`` between a fixed stem and a fixed head."""

    name: str
    stages: tuple[Stage, ...]
    stem_channels: int = 16
    stem_stride: int = 1
    last_channels: int = 128
    stem_act: str = "hswish"
    head_act: str = "hswish"

    def __post_init__(self):
        if not self.stages:
            raise ValueError(f"geometry {self.name!r} needs at least one stage")
        for i, st in enumerate(self.stages, 1):
            for field in ("widths", "depths", "kernels", "expands"):
                values = getattr(st, field)
                if not values or any(not isinstance(v, (int, np.integer)) or v < 1 for v in values) \
                        or list(values) != sorted(set(values)):
                    raise ValueError(f"{self.name}: stage{i}.{field} must be distinct positive integers in "
                                     f"ascending order, got {values}")
            if any(k % 2 == 0 for k in st.kernels):
                raise ValueError(f"{self.name}: stage{i} kernels must be odd (centre slicing), got {st.kernels}")
            if st.stride not in (1, 2):
                raise ValueError(f"{self.name}: stage{i} stride must be 1 or 2, got {st.stride}")
            if st.act not in ACTIVATIONS:
                raise ValueError(f"{self.name}: stage{i} act must be one of {sorted(ACTIVATIONS)}, got {st.act!r}")
        for act in (self.stem_act, self.head_act):
            if act not in ACTIVATIONS:
                raise ValueError(f"{self.name}: activation must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        if self.stem_channels < 1 or self.last_channels < 1 or self.stem_stride not in (1, 2):
            raise ValueError(f"{self.name}: stem/last channels must be >= 1 and the stem stride 1 or 2")


def _ofa_stage(widths, stride, act, kernels=(3, 5, 7), expands=(3, 4, 6), depths=(2, 3, 4)) -> Stage:
    return Stage(widths, depths, kernels, expands, stride, act)


SPACES: dict[str, Geometry] = {
    # OFA MobileNetV3-Large ranges; widths from OFA's w1.0 / w1.2 nets; 32x32 strides (module docstring).
    "cifar": Geometry("cifar", (
        _ofa_stage((24, 32), 1, "relu"),
        _ofa_stage((40, 48), 2, "relu"),
        _ofa_stage((80, 96), 2, "hswish"),
        _ofa_stage((112, 136), 1, "hswish"),
        _ofa_stage((160, 192), 2, "hswish"),
    ), stem_channels=16, stem_stride=1, last_channels=960),
    "small": Geometry("small", (
        Stage((16, 24), (1, 2), (3, 5), (3, 4, 6), 1, "relu"),
        Stage((24, 32), (1, 2, 3), (3, 5), (3, 4, 6), 2, "relu"),
        Stage((32, 48), (1, 2, 3), (3, 5), (3, 4, 6), 2, "hswish"),
        Stage((48, 64), (1, 2, 3), (3, 5), (3, 4, 6), 1, "hswish"),
    ), stem_channels=16, stem_stride=1, last_channels=128),
    "tiny": Geometry("tiny", (
        Stage((8, 16), (1, 2), (3, 5), (2, 4), 1, "relu"),
        Stage((16, 24), (1, 2), (3, 5), (2, 4), 2, "hswish"),
    ), stem_channels=8, stem_stride=1, last_channels=32),
}


def get_geometry(name: str) -> Geometry:
    if name not in SPACES:
        raise ValueError(f"unknown elastic MobileNet preset {name!r}; available: {sorted(SPACES)}")
    return SPACES[name]


class StageDims(NamedTuple):
    """Positions of a stage's four dimensions in a choice vector."""

    depth: int
    kernel: int
    expand: int
    width: int


class Block(NamedTuple):
    """Static plan of one inverted-residual block (stage ``stage``, 1-based ``index``)."""

    stage: int  # 1-based
    index: int  # 1-based position in the stage: active iff index <= the stage's depth
    in_widths: tuple[int, ...]  # the widths that can enter it
    in_dim: int | None  # the dimension choosing the input width (None: the fixed stem width)
    dims: StageDims
    stride: int
    act: str
    residual: bool
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]

    @property
    def name(self) -> tuple[str, str]:
        return f"stage{self.stage}", f"block{self.index}"


class _Leaf(NamedTuple):
    """One variable of the supernet: shape, initialiser and what each axis is sliced by."""

    shape: tuple
    init: str  # "conv:<fan_out>" | "normal:<std>" | "ones" | "zeros"
    axes: tuple  # per axis: None | ("width", d) | ("hidden", d_in | None, d_expand) | ("kernel", d)
    depth: tuple | None = None  # (d_depth, index): the whole leaf is unused when depth < index


def _out_size(n: int, stride: int) -> int:
    return (n - 1) // stride + 1  # symmetric padding k // 2, odd k: ceil(n / stride)


@dataclasses.dataclass(frozen=True)
class ElasticMobileNet:
    """An OFA-style elastic MobileNetV3 over ``image_shape`` ``(H, W, C)`` images with
    ``num_classes`` outputs (see the module docstring); ``from_preset`` builds one from
    :data:`SPACES`. ``dw_impl``: the depthwise convolution's formulation
    (:func:`jaxfednas.nn.depthwise_conv`; None: the backend's default, ``"slices"`` on
    CPU — XLA:CPU runs the kernel gradient of a ``"grouped"`` depthwise conv inside a
    ``lax.switch`` through a generic loop, seconds per layer at 32×32 — ``"grouped"``
    elsewhere)."""

    geometry: Geometry
    num_classes: int
    image_shape: tuple[int, int, int]
    dw_impl: str | None = None
    single_path: ClassVar[bool] = True  # a traced choice runs only the chosen path

    def __post_init__(self):
        if not isinstance(self.geometry, Geometry):
            raise TypeError(f"geometry must be a Geometry (e.g. SPACES['small']), got {type(self.geometry).__name__}")
        shape = tuple(self.image_shape)
        if len(shape) != 3 or any(int(s) < 1 for s in shape):
            raise ValueError(f"image_shape must be (H, W, C) positive integers, got {self.image_shape}")
        object.__setattr__(self, "image_shape", tuple(int(s) for s in shape))
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.dw_impl is not None:
            resolve_depthwise_impl(self.dw_impl)

    @classmethod
    def from_preset(cls, preset: str, *, num_classes: int, image_shape: tuple[int, int, int],
                    dw_impl: str | None = None) -> ElasticMobileNet:
        """The space of a named geometry (:data:`SPACES`) for these images and classes."""
        return cls(get_geometry(preset), num_classes, tuple(image_shape), dw_impl)

    @property
    def name(self) -> str:
        return f"elastic_mobilenet:{self.geometry.name}"

    # ---- dimensions and static plan ------------------------------------------------------

    @functools.cached_property
    def dims(self) -> tuple[Dimension, ...]:
        """Per stage, in this order, ``stageN.depth``, ``stageN.kernel``, ``stageN.expand``
        and ``stageN.width`` (choices ascending: the last index is the largest)."""
        return tuple(Dimension(f"stage{i}.{f}", getattr(st, f + "s"))
                     for i, st in enumerate(self.geometry.stages, 1) for f in FIELDS)

    @functools.cached_property
    def dim_index(self) -> dict[str, int]:
        """``{dimension name: its position in a choice vector}``."""
        return {d.name: j for j, d in enumerate(self.dims)}

    def largest_choice(self) -> np.ndarray:
        """The supernet itself: the last (largest) choice of every dimension."""
        return np.array([len(d.choices) - 1 for d in self.dims], np.int32)

    def smallest_choice(self) -> np.ndarray:
        return np.zeros(len(self.dims), np.int32)

    @property
    def stem_hw(self) -> tuple[int, int]:
        s = self.geometry.stem_stride
        return _out_size(self.image_shape[0], s), _out_size(self.image_shape[1], s)

    @functools.cached_property
    def blocks(self) -> tuple[Block, ...]:
        """Every block of the supernet (the largest depth of every stage), in order."""
        g, out, hw = self.geometry, [], self.stem_hw
        in_widths, in_dim = (g.stem_channels,), None
        for i, st in enumerate(g.stages, 1):
            dims = StageDims(*(self.dim_index[f"stage{i}.{f}"] for f in FIELDS))
            for j in range(1, max(st.depths) + 1):
                stride = st.stride if j == 1 else 1
                out_hw = (_out_size(hw[0], stride), _out_size(hw[1], stride))
                out.append(Block(i, j, in_widths, in_dim, dims, stride, st.act, j > 1, hw, out_hw))
                hw, in_widths, in_dim = out_hw, st.widths, dims.width
        return tuple(out)

    @property
    def head_hw(self) -> tuple[int, int]:
        return self.blocks[-1].out_hw

    # ---- variables ----------------------------------------------------------------------

    @functools.cached_property
    def _layout(self) -> dict:
        """The variables as a tree of :class:`_Leaf` (``params`` and ``batch_stats``)."""
        g = self.geometry

        def bn(c, axis, depth=None):
            return ({"scale": _Leaf((c,), "ones", (axis,), depth), "bias": _Leaf((c,), "zeros", (axis,), depth)},
                    {"mean": _Leaf((c,), "zeros", (axis,), depth), "var": _Leaf((c,), "ones", (axis,), depth)})

        k0, c_in, c0 = STEM_KERNEL, self.image_shape[2], g.stem_channels
        p_bn, s_bn = bn(c0, None)
        params = {"stem": {"conv": {"kernel": _Leaf((k0, k0, c_in, c0), f"conv:{k0 * k0 * c0}", (None,) * 4)},
                           "bn": p_bn}}
        stats = {"stem": {"bn": s_bn}}
        for b in self.blocks:
            st = g.stages[b.stage - 1]
            d = b.dims
            depth = (d.depth, b.index) if b.index > min(st.depths) else None
            w_in = None if b.in_dim is None else ("width", b.in_dim)
            hid = ("hidden", b.in_dim, d.expand)
            wi_max, h_max, w_max, k_max = max(b.in_widths), max(st.expands) * max(b.in_widths), max(st.widths), \
                max(st.kernels)
            pe, se = bn(h_max, hid, depth)
            pd, sd = bn(h_max, hid, depth)
            pp, sp = bn(w_max, ("width", d.width), depth)
            stage_p, stage_s = params.setdefault(b.name[0], {}), stats.setdefault(b.name[0], {})
            stage_p[b.name[1]] = {
                "expand": {"kernel": _Leaf((wi_max, h_max), f"conv:{h_max}", (w_in, hid), depth)},
                "expand_bn": pe,
                "dw": {"kernel": _Leaf((k_max, k_max, 1, h_max), f"conv:{k_max * k_max * h_max}",
                                       (("kernel", d.kernel), ("kernel", d.kernel), None, hid), depth)},
                "dw_bn": pd,
                "project": {"kernel": _Leaf((h_max, w_max), f"conv:{w_max}", (hid, ("width", d.width)), depth)},
                "project_bn": pp,
            }
            stage_s[b.name[1]] = {"expand_bn": se, "dw_bn": sd, "project_bn": sp}
        last = self.blocks[-1]
        w_last, L = ("width", last.dims.width), g.last_channels
        p_bn, s_bn = bn(L, None)
        params["head"] = {"conv": {"kernel": _Leaf((max(g.stages[-1].widths), L), f"conv:{L}", (w_last, None))},
                          "bn": p_bn,
                          "classifier": {"kernel": _Leaf((L, self.num_classes), "normal:0.01", (None, None)),
                                         "bias": _Leaf((self.num_classes,), "zeros", (None,))}}
        stats["head"] = {"bn": s_bn}
        return {"params": params, "batch_stats": stats}

    def init(self, key: jax.Array, x: jax.Array) -> dict:
        """The supernet's variables ``{"params", "batch_stats"}`` (``x``: an example batch;
        only its shape is checked). torchvision's MobileNetV3 init over the largest
        shapes: convolutions He normal with fan-out (kernel area × output channels, as
        PyTorch computes it, also for depthwise kernels), BN scale 1 and shift 0, the
        classifier N(0, 0.01) with zero bias; running statistics mean 0, variance 1."""
        self._check_input(x)
        leaves, tree = jax.tree.flatten(self._layout, is_leaf=lambda v: isinstance(v, _Leaf))
        sizes = [int(np.prod(leaf.shape)) for leaf in leaves]
        noise = jax.random.normal(key, (sum(sizes),), jnp.float32)  # one draw, cut into the leaves
        starts = np.cumsum([0] + sizes[:-1])
        return jax.tree.unflatten(tree, [_init_leaf(noise[a:a + n].reshape(leaf.shape), leaf)
                                         for a, n, leaf in zip(starts, sizes, leaves)])

    def _check_input(self, x) -> None:
        if tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(f"space {self.name!r} takes [B, {', '.join(map(str, self.image_shape))}] inputs, "
                             f"got shape {tuple(x.shape)}")

    # ---- protocol ----------------------------------------------------------------------

    def subnet(self, choice) -> ElasticSubnet:
        """The subnet ``choice`` (int ``[D]``: traced, or concrete and then checked) over
        the supernet's variables, applied like a Flax module (:class:`ElasticSubnet`)."""
        return ElasticSubnet(self, as_choice(self.dims, choice))

    def variable_mask(self, choice, variables: dict) -> dict:
        """0/1 float32 tree like ``variables`` (``params`` and/or ``batch_stats``), each leaf
        broadcastable to its variable: 1 exactly on the entries the subnet reads — its
        blocks, the centre ``k × k`` of each depthwise kernel, the first ``e · w_in`` hidden
        and first ``w`` output channels — and on the BatchNorm statistics it updates.
        ``choice`` may be traced (jnp ops only; vmap over choices works)."""
        c = as_choice(self.dims, choice)
        xp = np if isinstance(c, np.ndarray) else jnp
        unknown = sorted(set(variables) - set(self._layout))
        if unknown:
            raise ValueError(f"space {self.name!r} has no variable collections {unknown}")
        return {k: jax.tree.map(lambda leaf: self._leaf_mask(leaf, c, xp), self._layout[k],
                                is_leaf=lambda v: isinstance(v, _Leaf)) for k in variables}

    def _value(self, d: int | None, c, xp):
        """The chosen value of dimension ``d`` (``None``: the stem width)."""
        if d is None:
            return self.geometry.stem_channels
        if xp is np:
            return int(self.dims[d].choices[int(c[d])])
        return jnp.asarray(self.dims[d].choices, jnp.int32)[c[d]]

    def _leaf_mask(self, leaf: _Leaf, c, xp):
        out = xp.ones((1,) * len(leaf.shape), np.float32)
        for ax, (axis, size) in enumerate(zip(leaf.axes, leaf.shape)):
            if axis is None:
                continue
            a = xp.arange(size)
            if axis[0] == "width":
                keep = a < self._value(axis[1], c, xp)
            elif axis[0] == "hidden":
                keep = a < self._value(axis[1], c, xp) * self._value(axis[2], c, xp)
            else:  # kernel: the centre k of the largest kernel
                keep = xp.abs(a - size // 2) <= self._value(axis[1], c, xp) // 2
            out = out * keep.astype(np.float32).reshape((1,) * ax + (size,) + (1,) * (len(leaf.shape) - ax - 1))
        if leaf.depth is not None:
            d, index = leaf.depth
            out = out * xp.asarray(self._value(d, c, xp) >= index, np.float32)
        return out

    def describe(self, choice) -> dict:
        """``{dimension name: chosen value}`` (host side)."""
        return describe(self.dims, choice)

    def cost(self, choice) -> SubnetCost:
        """Exact size and cost of a subnet, from closed formulas (per example).

        * ``params``: the scalars the subnet reads (= the sum of :meth:`variable_mask` over
          ``params``; BatchNorm scale and shift counted, running statistics not):
          stem ``9 C c₀ + 2 c₀``; per active block ``w_in h + k² h + h w + 2 (2h + w)``
          with ``h = e · w_in``; head ``w_last L + 2 L + L n + n``;
        * ``macs``: multiply-accumulates of every convolution and matrix product: stem
          ``H₀ W₀ · 9 C c₀``; per block ``H_in W_in w_in h`` (expand, at the block's input
          resolution) ``+ H_out W_out h k²`` (depthwise, strided) ``+ H_out W_out h w``
          (project); head ``H_f W_f w_last L + L n``;
        * ``activation_floats``: the outputs of those same convolutions and matrix products
          (the convention of :func:`jaxfednas.cost.count_conv_outputs`, shared with the
          DARTS and hybrid spaces): stem ``H₀ W₀ c₀``; per block ``H_in W_in h + H_out W_out
          h + H_out W_out w``; head ``H_f W_f L + n`` (the logits). BatchNorm, activation,
          residual-sum and pooled outputs are not counted (each BN/activation output has
          its conv's size, so a framework keeping all of them holds ~3× this).

        Channel counts are the subnet's own, not the zero-padded ones.
        """
        c = check_choice(self.dims, choice)
        params = sum(int(np.broadcast_to(self._leaf_mask(leaf, c, np), leaf.shape).sum())
                     for leaf in jax.tree.leaves(self._layout["params"], is_leaf=lambda x: isinstance(x, _Leaf)))
        g = self.geometry
        (h0, w0), c0 = self.stem_hw, g.stem_channels
        macs = h0 * w0 * STEM_KERNEL ** 2 * self.image_shape[2] * c0
        acts = h0 * w0 * c0
        for b in self.blocks:
            v = {f: self._value(d, c, np) for f, d in b.dims._asdict().items()}
            if b.index > v["depth"]:
                continue
            w_in = self._value(b.in_dim, c, np)
            hidden = v["expand"] * w_in
            n_in, n_out = b.in_hw[0] * b.in_hw[1], b.out_hw[0] * b.out_hw[1]
            macs += n_in * w_in * hidden + n_out * hidden * v["kernel"] ** 2 + n_out * hidden * v["width"]
            acts += n_in * hidden + n_out * hidden + n_out * v["width"]
        w_last = self._value(self.blocks[-1].dims.width, c, np)
        (hf, wf), L, n = self.head_hw, g.last_channels, self.num_classes
        macs += hf * wf * w_last * L + L * n
        acts += hf * wf * L + n
        return SubnetCost(params, macs, acts)

    # ---- the switch tables of a block ---------------------------------------------------

    @functools.cached_property
    def _tables(self) -> dict:
        """``{block name: tables}``: :meth:`_block_tables` of every block."""
        return {b.name: self._block_tables(b) for b in self.blocks}

    def _block_tables(self, b: Block) -> dict:
        """The static branches of block ``b``'s three layers and, per layer, a table from
        choice indices to a branch: ``expand`` over (w_in, h) indexed by (w_in, expand),
        ``dw`` over k indexed by (kernel,), ``project`` over (h, w) indexed by (w_in,
        expand, width); ``h = e · w_in``. The input width of a stage's later blocks is the
        stage's own width, so for them only the pairs with ``w_in = w`` are reachable."""
        st = self.geometry.stages[b.stage - 1]
        n_in, n_e, n_k, n_w = len(b.in_widths), len(st.expands), len(st.kernels), len(st.widths)
        same = b.in_dim == b.dims.width
        out = {name: ([], -np.ones(shape, np.int32)) for name, shape in
               (("expand", (n_in, n_e)), ("dw", (n_k,)), ("project", (n_in, n_e, n_w)))}

        def slot(name, key, index):
            branches, table = out[name]
            if key not in branches:
                branches.append(key)
            table[index] = branches.index(key)

        for i, e, k, w in itertools.product(range(n_in), range(n_e), range(n_k), range(n_w)):
            if same and i != w:
                continue
            h = st.expands[e] * b.in_widths[i]
            slot("expand", (b.in_widths[i], h), (i, e))
            slot("dw", (st.kernels[k],), (k,))
            slot("project", (h, st.widths[w]), (i, e, w))
        return {name: (tuple(br), table) for name, (br, table) in out.items()}


def _init_leaf(noise: jax.Array, leaf: _Leaf) -> jax.Array:
    """``leaf``'s initial value from standard normal ``noise`` of its shape."""
    kind, _, arg = leaf.init.partition(":")
    if kind == "ones":
        return jnp.ones(leaf.shape, jnp.float32)
    if kind == "zeros":
        return jnp.zeros(leaf.shape, jnp.float32)
    std = float(np.sqrt(2.0 / int(arg))) if kind == "conv" else float(arg)
    return std * noise


def _batch_norm(x, p: dict, s: dict, train: bool, mask, active=None):
    """BatchNorm of ``x`` ``[..., c]`` by the first ``c`` entries of ``p`` / ``s``, where
    the channels from ``active`` on (int or traced; None: none) are zero padding: those
    stay exactly zero and keep their running statistics, as do the entries past ``c``.
    In training: statistics over the real examples (``mask``, [B] bool), running averages
    updated (Flax's convention: momentum 0.9, biased variance)."""
    c = x.shape[-1]
    keep = None if active is None or (isinstance(active, (int, np.integer)) and active >= c) \
        else jnp.arange(c) < active
    mean, var = s["mean"][:c], s["var"][:c]
    new = s
    dtype, x = x.dtype, x.astype(jnp.float32)  # statistics in float32 (a bfloat16 x: jaxfednas.precision)
    if train:
        axes = tuple(range(x.ndim - 1))
        m = mask.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
        n = jnp.maximum(m.sum() * (x.size // (x.shape[0] * c)), 1.0)
        mean_b = (x * m).sum(axes) / n
        var_b = (jnp.square(x - mean_b) * m).sum(axes) / n
        new = {}
        for k, old, b in (("mean", mean, mean_b), ("var", var, var_b)):
            run = BN_MOMENTUM * old + (1 - BN_MOMENTUM) * b
            new[k] = s[k].at[:c].set(run if keep is None else jnp.where(keep, run, old))
        mean, var = mean_b, var_b
    y = ((x - mean) * lax.rsqrt(var + BN_EPS) * p["scale"][:c] + p["bias"][:c]).astype(dtype)
    return (y if keep is None else jnp.where(keep, y, jnp.zeros((), dtype))), new


def _pointwise(x, kernel, c_in: int, c_out: int):
    """1×1 convolution of the first ``c_in`` channels by ``kernel[:c_in, :c_out]``."""
    return x[..., :c_in] @ kernel[:c_in, :c_out]


def _taps(xp, w, stride: int, out_hw: tuple[int, int]):
    """``sum_{u,v} xp[:, u::stride, v::stride] * w[u, v, 0]`` over ``out_hw``: a depthwise
    correlation of the already padded ``xp`` (one fused loop on XLA:CPU)."""
    b, _, _, c = xp.shape
    (ho, wo), k = out_hw, w.shape[0]
    out = None
    for u in range(k):
        for v in range(k):
            tap = lax.slice(xp, (0, u, v, 0), (b, u + (ho - 1) * stride + 1, v + (wo - 1) * stride + 1, c),
                            (1, stride, stride, 1)) * w[u, v, 0]
            out = tap if out is None else out + tap
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def depthwise_taps(x, w, stride: int):
    """Depthwise k×k convolution (padding k // 2, odd k) of NHWC ``x`` by ``w``
    ``[k, k, 1, C]`` as k² shifted products, with a hand-written backward for XLA:CPU.

    The forward is :func:`jaxfednas.nn.depthwise_conv`'s ``"slices"`` form. Its autodiff
    kernel gradient is k² products ``slice(x) · g`` that XLA:CPU materialises all at once
    before reducing them (one 7×7 layer at 32×32×192, batch 32: 1.15 GiB of temporaries);
    here the kernel gradient is a ``fori_loop`` over the taps (24 MiB, 3× faster) and
    the input gradient the same shifted-product form on the stride-dilated, padded
    cotangent with the flipped kernel.
    """
    return _depthwise_taps_fwd(x, w, stride)[0]


def _depthwise_geometry(x, w, stride: int):
    k, (h, wd) = w.shape[0], x.shape[1:3]
    p = k // 2
    return k, p, (h + 2 * p, wd + 2 * p), ((h + 2 * p - k) // stride + 1, (wd + 2 * p - k) // stride + 1)


def _depthwise_taps_fwd(x, w, stride: int):
    k, p, _, out_hw = _depthwise_geometry(x, w, stride)
    xp = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    return _taps(xp, w.astype(x.dtype), stride, out_hw), (x, w)


def _depthwise_taps_bwd(stride: int, res, g):
    x, w = res
    k, p, (hp, wp), (ho, wo) = _depthwise_geometry(x, w, stride)
    b, h, wd, c = x.shape
    # input gradient: correlate the dilated cotangent (padded by k - 1) with the flipped kernel
    cfg = [(0, 0, 0), (k - 1, hp - (ho - 1) * stride - 1, stride - 1), (k - 1, wp - (wo - 1) * stride - 1, stride - 1),
           (0, 0, 0)]
    gp = lax.pad(g, jnp.zeros((), g.dtype), cfg)
    dx = _taps(gp, w[::-1, ::-1].astype(g.dtype), 1, (hp, wp))[:, p:p + h, p:p + wd]
    xp = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))

    def tap(t, acc):  # one tap per iteration keeps one product alive, not k²
        window = lax.dynamic_slice(xp, (0, t // k, t % k, 0), (b, (ho - 1) * stride + 1, (wo - 1) * stride + 1, c))
        return acc.at[t].set((window[:, ::stride, ::stride] * g).sum((0, 1, 2)))

    dw = lax.fori_loop(0, k * k, tap, jnp.zeros((k * k, c), g.dtype))
    return dx, dw.reshape(k, k, 1, c).astype(w.dtype)


depthwise_taps.defvjp(_depthwise_taps_fwd, _depthwise_taps_bwd)


def _depthwise(x, w, stride: int, impl: str | None):
    """The block's depthwise conv: ``"grouped"`` as a grouped convolution, otherwise
    (``"slices"``, ``"fused"``; the CPU default) :func:`depthwise_taps`."""
    impl = resolve_depthwise_impl(impl)
    if impl == "grouped":
        return depthwise_conv(x, w, stride, 1, w.shape[0] // 2, "grouped")
    return depthwise_taps(x, w, stride)


def _stem_conv(x, kernel, stride: int):
    return conv_nhwc(x, kernel, stride, ((STEM_KERNEL // 2,) * 2,) * 2)


class ElasticSubnet(NamedTuple):
    """The subnet ``choice`` of ``space``, applied like a Flax module:
    ``apply(variables, x, *, train=False, mask=None, mutable=False)`` returns the logits,
    or ``(logits, {"batch_stats": ...})`` when ``"batch_stats"`` is mutable — the whole
    tree, entries the subnet does not update unchanged. ``train`` normalises with the
    statistics of the real examples (``mask``, [B] bool) and updates the running ones."""

    space: ElasticMobileNet
    choice: Any  # int32 [D]: numpy (checked) or traced

    def _index(self, d: int | None):
        """The choice index of dimension ``d`` (0 for the fixed stem width)."""
        if d is None:
            return 0
        return int(self.choice[d]) if isinstance(self.choice, np.ndarray) else self.choice[d]

    def apply(self, variables: dict, x, *, train: bool = False, mask=None, mutable=False):
        return flax_apply(self, variables, x, train=train, mask=mask, mutable=mutable)

    def _forward(self, params, stats, x, train: bool, mask):
        space, g = self.space, self.space.geometry
        new = {}
        h = _stem_conv(x, params["stem"]["conv"]["kernel"], g.stem_stride)
        h, s = _batch_norm(h, params["stem"]["bn"], stats["stem"]["bn"], train, mask)
        h = ACTIVATIONS[g.stem_act](h)
        new["stem"] = {"bn": s}
        for b in space.blocks:
            (stage, block), st = b.name, g.stages[b.stage - 1]
            p, s = params[stage][block], stats[stage][block]

            def run(h, p, s, mask, b=b):
                return self._block(b, h, p, s, train, mask)

            if b.index <= min(st.depths):
                h, s = run(h, p, s, mask)
            else:
                depth = self._index(b.dims.depth)
                if isinstance(depth, int):
                    if b.index <= st.depths[depth]:
                        h, s = run(h, p, s, mask)
                else:
                    active = jnp.asarray(st.depths, jnp.int32)[depth] >= b.index
                    h, s = lax.cond(active, run, lambda h, p, s, mask: (h, s), h, p, s, mask)
            new.setdefault(stage, {})[block] = s
        last, ph = space.blocks[-1], params["head"]
        widths, L = g.stages[-1].widths, g.last_channels
        h = select(self._index(last.dims.width), [functools.partial(_pointwise, c_in=w, c_out=L) for w in widths],
                   h, ph["conv"]["kernel"], remat=True)
        h, s = _batch_norm(h, ph["bn"], stats["head"]["bn"], train, mask)
        new["head"] = {"bn": s}
        h = ACTIVATIONS[g.head_act](h).mean(axis=(1, 2))
        return h @ ph["classifier"]["kernel"] + ph["classifier"]["bias"], new

    def _block(self, b: Block, x, p: dict, s: dict, train: bool, mask):
        """One inverted-residual block on ``x`` (zero-padded to the largest input width):
        returns its output zero-padded to the stage's largest width, and its statistics.
        The three convolutions are switches over their static slice sizes; BatchNorm
        and activations run on the padded tensors, masked to the active channels."""
        space = self.space
        st = space.geometry.stages[b.stage - 1]
        act = ACTIVATIONS[b.act]
        tables = space._tables[b.name]
        concrete = isinstance(self.choice, np.ndarray)
        xp = np if concrete else jnp
        i, e = self._index(b.in_dim), self._index(b.dims.expand)
        k, w = self._index(b.dims.kernel), self._index(b.dims.width)
        hidden = space._value(b.in_dim, self.choice, xp) * space._value(b.dims.expand, self.choice, xp)
        width = space._value(b.dims.width, self.choice, xp)
        # traced: the hidden channels zero-padded to the largest; concrete: the child's own
        h_pad, w_max = (hidden if concrete else max(st.expands) * max(b.in_widths)), max(st.widths)

        def expand(w_in, h):
            return lambda x, kernel: pad(_pointwise(x, kernel, w_in, h), h_pad)

        def dw(k):
            def run(x, kernel):  # every (padded) hidden channel: zeros in, zeros out
                c = (kernel.shape[0] - k) // 2
                return _depthwise(x, kernel[c:c + k, c:c + k, :, :h_pad], b.stride, space.dw_impl)
            return run

        def project(h, w):
            return lambda x, kernel: pad(_pointwise(x, kernel, h, w), w_max)

        def layer(name, make, index, y):
            branches, table = tables[name]
            t = int(table[index]) if concrete else jnp.asarray(table)[index]
            # rematerialised: a branch is linear (a sliced convolution), so the recomputation is
            # only the slicing, and a "slices" depthwise conv does not keep its k² shifted copies
            return select(t, [make(*key) for key in branches], y, p[name]["kernel"], remat=True)

        y = layer("expand", expand, (i, e), x)
        y, s_e = _batch_norm(y, p["expand_bn"], s["expand_bn"], train, mask, hidden)
        y = layer("dw", dw, (k,), act(y))
        y, s_d = _batch_norm(y, p["dw_bn"], s["dw_bn"], train, mask, hidden)
        y = layer("project", project, (i, e, w), act(y))
        y, s_p = _batch_norm(y, p["project_bn"], s["project_bn"], train, mask, width)
        if b.residual:
            y = y + x
        return y, {"expand_bn": s_e, "dw_bn": s_d, "project_bn": s_p}


__all__ = ["ACTIVATIONS", "BN_EPS", "BN_MOMENTUM", "Block", "ElasticMobileNet", "ElasticSubnet", "Geometry",
           "SPACES", "Stage", "StageDims", "depthwise_taps", "get_geometry"]
