"""A small hybrid convolution / attention supernet in the spirit of NASViT, as a choice
space (:mod:`jaxfednas.search_spaces.choice`) for PerFedRLNAS.

NASViT (Gong et al., "NASViT: Neural Architecture Search for Efficient Vision
Transformers with Gradient Conflict-Aware Supernet Training", ICLR 2022) searches a
supernet of MBConv stages followed by transformer stages, every stage with elastic
width and depth (and kernel size for convolutions), a sampled subnet reading the first
channels, first blocks and centre kernel of the shared weights. PerFedRLNAS (Yao & Li,
"PerFedRLNAS: One-for-All Personalized Federated Neural Architecture Search", AAAI 2024)
searches NASViT's space per client; its Table 1 gives an example of such a space: input
resolution {128, 192, 224, 256}; convolution blocks of width {16, 24}, 1 block, kernel
{3, 5, 7}; transformer blocks of width {16, 24, 32}, 1-5 blocks — one categorical
dimension each, with a softmax policy per dimension (Eq. 4).

Layout (``H × W × C`` images, every stage searchable)::

    stem      3×3 conv (stride ``stem_stride``, fixed width) -> BN -> ReLU
    convN     entry: 3×3 conv (stride) -> BN -> ReLU, then ``depth`` residual blocks
              h <- ReLU(h + BN(conv_k×k(h)))            dims: width, depth, kernel
    tokens    ``patch × patch`` conv with stride ``patch`` (+ bias) -> learned position
              embedding: ``(H' / patch) · (W' / patch)`` tokens     (entry of vit1)
    vitN      entry (N > 1): linear projection to the stage width, then ``depth``
              pre-LayerNorm blocks  h <- h + MHSA(LN(h));  h <- h + MLP(LN(h))
              MHSA: ``heads`` heads of ``head_dim`` channels; MLP: width × ratio,
              GELU                                  dims: width, depth, heads, mlp_ratio
    head      LayerNorm -> mean over tokens -> linear

How a subnet reads the supernet's weights (NASViT's weight sharing): a width ``w``
uses the first ``w`` channels of every tensor of its stage (LayerNorm normalises over
those ``w`` only), a depth ``d`` the first ``d`` blocks (the others are skipped), a
kernel ``k`` the centre ``k × k`` of the largest kernel, ``h`` heads the first
``h · head_dim`` columns of the query, key and value projections (and rows of the output
projection), a ratio ``r`` the first ``r · w`` hidden units of the MLP.

**Single path.** With a traced ``choice`` every width, kernel, head and ratio is a
``lax.switch`` whose branches have static shapes (nested: the width outside, the kernel
/ heads / ratio inside), and every block beyond the smallest depth a ``lax.cond``; a
stage compiles ``widths × max depth × (kernels | heads + ratios)`` block bodies. The
blocks' weights are stacked ``[max depth, ...]`` but the blocks are unrolled (a
``lax.scan`` ran twice as slowly on XLA:CPU), and on CPU convolutions take their
gradient as canonical convolutions (see :func:`~jaxfednas.search_spaces.sliced.conv_nhwc`). Between stages activations are
zero-padded to the stage's largest width: the padded channels are exact zeros and the
next stage slices them away before reading any weight. With a concrete (numpy)
``choice`` Python picks the branches: the traced program is the child network alone,
which :func:`jaxfednas.cost.count_macs` then counts exactly.

Measured on the shared 2-core CPU (jax 0.10.2, batch 32, one jitted
``value_and_grad`` training step, full XLA optimisation): ``"small"`` compiles in
~10 s (+1.5-3.5 s tracing; 20-30 s while other jobs held the cores) and steps in 4-5 ms
(smallest subnet) / 15-19 ms (largest; the plain child network: 2 / 15 ms);
``"cifar"`` compiles in ~31 s (+7 s tracing, under load).

**Not searched: input resolution.** Table 1's first dimension resizes the input; the
authors' NASViT wrapper carries a resolution in the action vector but no resize was
found, the 32×32 CIFAR images go in as they are (docs/authors_code.md §4.1), and a
resize would change every stage's geometry (hence the position embedding) per subnet.
The resolution is fixed per space. Also simpler than NASViT: plain residual k×k conv
blocks instead of MBConv (no expansion-ratio dimension), a plain pre-LayerNorm
transformer block, no downsampling between transformer stages.

Presets in :data:`SPACES`: ``"cifar"`` (32×32×3: Table 1's conv widths and kernels and
transformer widths, two stages of each), ``"small"`` (8×8×1 digits: one stage of each,
Table 1's lists), ``"tiny"`` (tests: two stages of each, two choices per dimension).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfednas.search_spaces.choice import Dimension, SubnetCost, check_choice, describe
from jaxfednas.search_spaces.sliced import as_choice, conv_nhwc, flax_apply, pad, select

BN_EPS = 1e-5
BN_MOMENTUM = 0.9  # Flax convention: running = 0.9 * running + 0.1 * batch
LN_EPS = 1e-6  # timm's ViT
VIT_STD = 0.02  # ViT's truncated-normal init of transformer weights


class ConvStage(NamedTuple):
    """Choices of one convolution stage (ascending): its width, depth (residual blocks
    after the entry conv) and kernel size (odd), and the entry conv's stride."""

    widths: tuple[int, ...]
    depths: tuple[int, ...]
    kernels: tuple[int, ...]
    stride: int = 1


class ViTStage(NamedTuple):
    """Choices of one transformer stage (ascending): embedding width, depth, number of
    attention heads (of ``HybridViT.head_dim`` channels each) and MLP expansion ratio."""

    widths: tuple[int, ...]
    depths: tuple[int, ...]
    heads: tuple[int, ...]
    mlp_ratios: tuple[int, ...]


class _Leaf(NamedTuple):
    """One supernet variable: its shape, initializer and, per axis, which dimension
    decides how much of it a subnet reads (``None``: all of it)."""

    shape: tuple[int, ...]
    init: str  # "he", "lecun", "vit", "zeros", "ones"
    axes: tuple  # per axis: None | ("width"|"depth"|"kernel"|"heads", d) | ("hidden", d_width, d_ratio)


def _ascending(name: str, values: tuple, what: str) -> None:
    if not values or any(not isinstance(v, (int, np.integer)) or v < 1 for v in values) or \
            list(values) != sorted(set(values)):
        raise ValueError(f"{name}: {what} must be distinct positive integers in ascending order, got {values}")


@dataclasses.dataclass(frozen=True)
class HybridViT:
    """A hybrid conv / transformer supernet over ``image_shape`` ``(H, W, C)`` inputs as
    a choice space: ``conv_stages`` then ``vit_stages`` (see the module docstring)."""

    name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    conv_stages: tuple[ConvStage, ...]
    vit_stages: tuple[ViTStage, ...]
    stem_channels: int = 16
    stem_stride: int = 1
    patch: int = 2
    head_dim: int = 8
    single_path: ClassVar[bool] = True  # a traced choice runs only the chosen path

    def __post_init__(self):
        if len(self.image_shape) != 3 or self.num_classes < 1:
            raise ValueError(f"{self.name}: image_shape is (H, W, C) and num_classes >= 1, got "
                             f"{self.image_shape}, {self.num_classes}")
        if not self.conv_stages or not self.vit_stages:
            raise ValueError(f"{self.name}: a hybrid space needs at least one conv stage and one transformer stage")
        for i, st in enumerate(self.conv_stages, 1):
            for field in ("widths", "depths", "kernels"):
                _ascending(self.name, getattr(st, field), f"conv{i}.{field}")
            if any(k % 2 == 0 for k in st.kernels):
                raise ValueError(f"{self.name}: conv{i} kernels must be odd (centre slicing), got {st.kernels}")
            if st.stride not in (1, 2):
                raise ValueError(f"{self.name}: conv{i} stride must be 1 or 2, got {st.stride}")
        for t, st in enumerate(self.vit_stages, 1):
            for field in ("widths", "depths", "heads", "mlp_ratios"):
                _ascending(self.name, getattr(st, field), f"vit{t}.{field}")
        h, w = self.conv_resolution
        if h % self.patch or w % self.patch:
            raise ValueError(f"{self.name}: the last conv stage's {h}x{w} maps do not split into "
                             f"{self.patch}x{self.patch} patches")

    @classmethod
    def from_preset(cls, name: str, *, num_classes: int | None = None,
                    image_shape: tuple[int, int, int] | None = None) -> HybridViT:
        """Preset ``name`` of :data:`SPACES` for a dataset's classes and ``(H, W, C)`` images
        (the geometry is checked again: the last conv maps must split into patches)."""
        base = get_space(name)
        return dataclasses.replace(base, num_classes=base.num_classes if num_classes is None else int(num_classes),
                                   image_shape=base.image_shape if image_shape is None else tuple(image_shape))

    # ---- geometry -------------------------------------------------------------------

    @property
    def stem_resolution(self) -> tuple[int, int]:
        return tuple(-(-s // self.stem_stride) for s in self.image_shape[:2])

    def conv_resolutions(self) -> tuple[tuple[int, int], ...]:
        """``(H, W)`` of every conv stage's output ("SAME" padding: ceil division)."""
        out, (h, w) = [], self.stem_resolution
        for st in self.conv_stages:
            h, w = -(-h // st.stride), -(-w // st.stride)
            out.append((h, w))
        return tuple(out)

    @property
    def conv_resolution(self) -> tuple[int, int]:
        return self.conv_resolutions()[-1]

    @property
    def num_tokens(self) -> int:
        h, w = self.conv_resolution
        return (h // self.patch) * (w // self.patch)

    @functools.cached_property
    def dims(self) -> tuple[Dimension, ...]:
        out = []
        for i, st in enumerate(self.conv_stages, 1):
            out += [Dimension(f"conv{i}.width", st.widths), Dimension(f"conv{i}.depth", st.depths),
                    Dimension(f"conv{i}.kernel", st.kernels)]
        for t, st in enumerate(self.vit_stages, 1):
            out += [Dimension(f"vit{t}.width", st.widths), Dimension(f"vit{t}.depth", st.depths),
                    Dimension(f"vit{t}.heads", st.heads), Dimension(f"vit{t}.mlp_ratio", st.mlp_ratios)]
        return tuple(out)

    @functools.cached_property
    def dim_index(self) -> dict[str, int]:
        """``{dimension name: its position in a choice vector}``."""
        return {d.name: j for j, d in enumerate(self.dims)}

    # ---- variables ------------------------------------------------------------------

    @functools.cached_property
    def _layout(self) -> dict:
        """The variables as a tree of :class:`_Leaf` (``params`` and ``batch_stats``)."""
        ix = self.dim_index
        params, stats = {}, {}

        def bn(c, axis):
            return ({"scale": _Leaf((c,), "ones", (axis,)), "bias": _Leaf((c,), "zeros", (axis,))},
                    {"mean": _Leaf((c,), "zeros", (axis,)), "var": _Leaf((c,), "ones", (axis,))})

        def stacked_bn(n, c, depth, axis):
            return ({"scale": _Leaf((n, c), "ones", (depth, axis)), "bias": _Leaf((n, c), "zeros", (depth, axis))},
                    {"mean": _Leaf((n, c), "zeros", (depth, axis)), "var": _Leaf((n, c), "ones", (depth, axis))})

        c_in, prev, cs = self.image_shape[2], None, self.stem_channels
        p_bn, s_bn = bn(cs, None)
        params["stem"] = {"conv": _Leaf((3, 3, c_in, cs), "he", (None,) * 4), "bn": p_bn}
        stats["stem"] = {"bn": s_bn}
        c_prev = cs
        for i, st in enumerate(self.conv_stages, 1):
            w, d, k = (("width", ix[f"conv{i}.width"]), ("depth", ix[f"conv{i}.depth"]),
                       ("kernel", ix[f"conv{i}.kernel"]))
            cm, dm, km = max(st.widths), max(st.depths), max(st.kernels)
            pe_bn, se_bn = bn(cm, w)
            pb_bn, sb_bn = stacked_bn(dm, cm, d, w)
            params[f"conv{i}"] = {
                "entry": {"conv": _Leaf((3, 3, c_prev, cm), "he", (None, None, prev, w)), "bn": pe_bn},
                "blocks": {"conv": _Leaf((dm, km, km, cm, cm), "he", (d, k, k, w, w)), "bn": pb_bn},
            }
            stats[f"conv{i}"] = {"entry": {"bn": se_bn}, "blocks": {"bn": sb_bn}}
            c_prev, prev = cm, w
        for t, st in enumerate(self.vit_stages, 1):
            e, d = ("width", ix[f"vit{t}.width"]), ("depth", ix[f"vit{t}.depth"])
            h, hid = ("heads", ix[f"vit{t}.heads"]), ("hidden", ix[f"vit{t}.width"], ix[f"vit{t}.mlp_ratio"])
            em, dm = max(st.widths), max(st.depths)
            qkv, hm = max(st.heads) * self.head_dim, max(st.mlp_ratios) * max(st.widths)
            if t == 1:
                p = self.patch
                entry = {"kernel": _Leaf((p, p, c_prev, em), "he", (None, None, prev, e)),
                         "bias": _Leaf((em,), "zeros", (e,)),
                         "pos": _Leaf((self.num_tokens, em), "vit", (None, e))}
            else:
                entry = {"kernel": _Leaf((c_prev, em), "lecun", (prev, e)), "bias": _Leaf((em,), "zeros", (e,))}

            def ln(d=d, e=e, em=em, dm=dm):
                return {"scale": _Leaf((dm, em), "ones", (d, e)), "bias": _Leaf((dm, em), "zeros", (d, e))}

            def dense(n_in, n_out, a_in, a_out, d=d, dm=dm):
                return {"kernel": _Leaf((dm, n_in, n_out), "vit", (d, a_in, a_out)),
                        "bias": _Leaf((dm, n_out), "zeros", (d, a_out))}

            params[f"vit{t}"] = {"entry": entry, "blocks": {
                "ln1": ln(), "query": dense(em, qkv, e, h), "key": dense(em, qkv, e, h), "value": dense(em, qkv, e, h),
                "out": dense(qkv, em, h, e), "ln2": ln(), "fc1": dense(em, hm, e, hid), "fc2": dense(hm, em, hid, e)}}
            c_prev, prev = em, e
        params["norm"] = {"scale": _Leaf((c_prev,), "ones", (prev,)), "bias": _Leaf((c_prev,), "zeros", (prev,))}
        params["head"] = {"kernel": _Leaf((c_prev, self.num_classes), "vit", (prev, None)),
                          "bias": _Leaf((self.num_classes,), "zeros", (None,))}
        return {"params": params, "batch_stats": stats}

    def init(self, key: jax.Array, x: jax.Array) -> dict:
        """The supernet's variables ``{"params", "batch_stats"}`` (``x``: an example batch,
        only its shape is checked). Convolutions: He normal over the largest kernel's
        fan-in; transformer weights: truncated normal std 0.02 (ViT); entry projections:
        LeCun normal; biases 0, norm scales 1."""
        self._check_input(x)
        leaves, tree = jax.tree.flatten(self._layout, is_leaf=lambda v: isinstance(v, _Leaf))
        sizes = {kind: sum(math.prod(leaf.shape) for leaf in leaves if leaf.init in kinds)
                 for kind, kinds in (("normal", ("he", "lecun")), ("trunc", ("vit",)))}

        @jax.jit  # two draws for the whole tree (leaf by leaf, every draw would compile on its own)
        def init(key):
            k_normal, k_trunc = jax.random.split(key)
            draws = {"normal": jax.random.normal(k_normal, (sizes["normal"],), jnp.float32),
                     "trunc": jax.random.truncated_normal(k_trunc, -2.0, 2.0, (sizes["trunc"],), jnp.float32)}
            used, out = {"normal": 0, "trunc": 0}, []
            for leaf in leaves:
                kind = {"he": "normal", "lecun": "normal", "vit": "trunc"}.get(leaf.init)
                if kind is None:
                    out.append(jnp.full(leaf.shape, 1.0 if leaf.init == "ones" else 0.0, jnp.float32))
                    continue
                n = math.prod(leaf.shape)
                out.append(draws[kind][used[kind]:used[kind] + n].reshape(leaf.shape) * _init_scale(leaf))
                used[kind] += n
            return jax.tree.unflatten(tree, out)

        return init(key)

    def _check_input(self, x) -> None:
        if tuple(x.shape[1:]) != tuple(self.image_shape):
            raise ValueError(f"space {self.name!r} takes [B, {', '.join(map(str, self.image_shape))}] inputs, "
                             f"got shape {tuple(x.shape)}")

    # ---- protocol -------------------------------------------------------------------

    def subnet(self, choice) -> HybridSubnet:
        """The subnet ``choice`` (int ``[D]``; traced, or concrete and then checked) over the
        supernet's variables, applied like a Flax module."""
        return HybridSubnet(self, as_choice(self.dims, choice))

    def variable_mask(self, choice, variables: dict) -> dict:
        """0/1 float32 tree like ``variables`` (``params`` and/or ``batch_stats``), each leaf
        broadcastable to its variable: 1 exactly on the entries the subnet reads (and the
        BatchNorm statistics it updates). ``choice`` may be traced."""
        c = as_choice(self.dims, choice)
        xp = np if isinstance(c, np.ndarray) else jnp
        unknown = sorted(set(variables) - set(self._layout))
        if unknown:
            raise ValueError(f"space {self.name!r} has no variable collections {unknown}")
        return {k: jax.tree.map(lambda leaf: self._leaf_mask(leaf, c, xp), self._layout[k],
                                is_leaf=lambda v: isinstance(v, _Leaf)) for k in variables}

    def _axis_mask(self, axis, size: int, c, xp):
        if axis is None:
            return None
        values = lambda d: self.dims[d].choices[int(c[d])] if xp is np else jnp.asarray(self.dims[d].choices)[c[d]]  # noqa: E731
        a = xp.arange(size)
        kind = axis[0]
        if kind in ("width", "depth"):
            keep = a < values(axis[1])
        elif kind == "kernel":
            keep = xp.abs(a - size // 2) <= values(axis[1]) // 2
        elif kind == "heads":
            keep = a < values(axis[1]) * self.head_dim
        else:  # hidden: width x ratio
            keep = a < values(axis[1]) * values(axis[2])
        return keep.astype(np.float32)

    def _leaf_mask(self, leaf: _Leaf, c, xp):
        out = xp.ones((1,) * len(leaf.shape), np.float32)
        for ax, (axis, size) in enumerate(zip(leaf.axes, leaf.shape)):
            m = self._axis_mask(axis, size, c, xp)
            if m is not None:
                out = out * m.reshape((1,) * ax + (size,) + (1,) * (len(leaf.shape) - ax - 1))
        return out

    def describe(self, choice) -> dict:
        """``{dimension name: chosen value}`` (host side)."""
        return describe(self.dims, choice)

    def cost(self, choice) -> SubnetCost:
        """Exact size and cost of a subnet, from closed formulas (per example).

        * ``params``: the scalars the subnet reads (= the sum of :meth:`variable_mask` over
          ``params``; BatchNorm statistics not counted);
        * ``macs``: multiply-accumulates of every convolution and matrix product: stem,
          entry and block convs, patch projection, stage projections, query / key /
          value / output projections, attention logits ``Q Kᵀ`` (``heads · T² ·
          head_dim``) and ``A V`` (same), both MLP layers and the classifier;
        * ``activation_floats``: the outputs of those same convolutions and matrix
          products (the convention of :func:`jaxfednas.cost.count_conv_outputs` and of
          the DARTS space): stem ``H₀W₀C``, per conv layer ``H W w``, patch and stage
          projections ``T e``, per block ``3 T h d`` (q, k, v), ``h T²`` (logits),
          ``T h d`` (A V), ``T e`` (output), ``T r e`` (fc1), ``T e`` (fc2), and the logits.
          Norms, activations and softmax outputs are not counted.
        """
        c = check_choice(self.dims, choice)
        return SubnetCost(*(int(v) for v in self._costs(c, np)))

    def traced_cost(self, choice) -> jax.Array:
        """:meth:`cost` of a (traced) choice as float32 ``[3]`` (params, macs,
        activation_floats), for jitted code; ``vmap`` it over several choices."""
        c = as_choice(self.dims, choice)
        return jnp.stack([jnp.asarray(v, jnp.float32) for v in self._costs(jnp.asarray(c), jnp)])

    def _costs(self, c, xp) -> tuple:
        """(params, macs, activation_floats) of ``c``: host integers (``xp = np``) or
        float32 arrays (``xp = jnp``, ``c`` possibly traced)."""
        def val(name):
            d = self.dim_index[name]
            return self.dims[d].choices[int(c[d])] if xp is np else jnp.asarray(self.dims[d].choices, jnp.float32)[c[d]]

        params = 0
        for leaf in jax.tree.leaves(self._layout["params"], is_leaf=lambda x: isinstance(x, _Leaf)):
            n = 1
            for axis, size in zip(leaf.axes, leaf.shape):
                m = self._axis_mask(axis, size, c, xp)
                n = n * (size if m is None else int(m.sum()) if xp is np else m.sum())
            params = params + n
        macs = acts = 0
        (h, w), cs = self.stem_resolution, self.stem_channels
        macs += h * w * 9 * self.image_shape[2] * cs
        acts += h * w * cs
        c_prev = cs
        for i, (h, w) in enumerate(self.conv_resolutions(), 1):
            width, depth, k = val(f"conv{i}.width"), val(f"conv{i}.depth"), val(f"conv{i}.kernel")
            macs = macs + h * w * 9 * c_prev * width + depth * h * w * k * k * width * width
            acts = acts + (1 + depth) * h * w * width
            c_prev = width
        n, dh = self.num_tokens, self.head_dim
        for t in range(1, len(self.vit_stages) + 1):
            e, depth, heads = val(f"vit{t}.width"), val(f"vit{t}.depth"), val(f"vit{t}.heads")
            qkv, hidden = heads * dh, val(f"vit{t}.mlp_ratio") * e
            macs = macs + n * (self.patch ** 2 if t == 1 else 1) * c_prev * e
            acts = acts + n * e
            macs = macs + depth * (n * e * 3 * qkv + 2 * n * n * qkv + n * qkv * e + 2 * n * e * hidden)
            acts = acts + depth * (3 * n * qkv + heads * n * n + n * qkv + n * e + n * hidden + n * e)
            c_prev = e
        return params, macs + c_prev * self.num_classes, acts + self.num_classes


def _init_scale(leaf: _Leaf) -> float:
    """Standard deviation of a random leaf: 0.02 (ViT) or He / LeCun over the fan-in of a
    ``[(blocks,) ..., fan-in axes ..., out]`` kernel (the stacked block axis is not fan-in)."""
    if leaf.init == "vit":
        return VIT_STD
    n_lead = 1 if leaf.axes and leaf.axes[0] is not None and leaf.axes[0][0] == "depth" else 0
    return math.sqrt((2.0 if leaf.init == "he" else 1.0) / math.prod(leaf.shape[n_lead:-1]))


def _batch_norm(x, p: dict, s: dict, train: bool, mask):
    """BatchNorm over the ``C = x.shape[-1]`` leading channels of ``p`` / ``s``; in
    training, statistics of the real examples (``mask``) and running averages updated on
    those ``C`` entries only (the rest of ``s`` returned unchanged)."""
    c = x.shape[-1]
    scale, bias = p["scale"][:c], p["bias"][:c]
    dtype, x = x.dtype, x.astype(jnp.float32)  # statistics in float32 (a bfloat16 x: jaxfednas.precision)
    if not train:
        return ((x - s["mean"][:c]) * lax.rsqrt(s["var"][:c] + BN_EPS) * scale + bias).astype(dtype), s
    m = mask.astype(x.dtype)[:, None, None, None]
    n = jnp.maximum(m.sum() * x.shape[1] * x.shape[2], 1.0)
    mean = (x * m).sum((0, 1, 2)) / n
    var = (jnp.square(x - mean) * m).sum((0, 1, 2)) / n
    new = {k: s[k].at[:c].set(BN_MOMENTUM * s[k][:c] + (1 - BN_MOMENTUM) * b) for k, b in (("mean", mean), ("var", var))}
    return ((x - mean) * lax.rsqrt(var + BN_EPS) * scale + bias).astype(dtype), new


def _layer_norm(x, p: dict):
    """LayerNorm over the active width ``x.shape[-1]`` (the first entries of ``p``)."""
    c = x.shape[-1]
    dtype, x = x.dtype, x.astype(jnp.float32)  # statistics in float32 (a bfloat16 x: jaxfednas.precision)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * lax.rsqrt(var + LN_EPS) * p["scale"][:c] + p["bias"][:c]).astype(dtype)


def _dense(x, p: dict, n_out: int):
    return x @ p["kernel"][: x.shape[-1], :n_out] + p["bias"][:n_out]


def _blocks(block, h, params, stats, depth, min_depth: int):
    """Run the stacked blocks of a stage: the first ``depth`` apply ``block(h, p_j, s_j)
    -> (h, s_j)``, the others are skipped (identity, statistics unchanged). Blocks below
    ``min_depth`` always run; the others are a ``lax.cond`` for a traced depth and are left
    out of the program for a concrete one. Unrolled: XLA:CPU runs a ``lax.scan`` over the
    blocks twice as slowly (measured on "small": 39 vs 21 ms per training step)."""
    new = []
    for j in range(jax.tree.leaves(params)[0].shape[0]):
        p, s = jax.tree.map(lambda a: a[j], params), jax.tree.map(lambda a: a[j], stats)
        if j < min_depth or (isinstance(depth, int) and j < depth):
            h, s = block(h, p, s)
        elif not isinstance(depth, int):
            h, s = lax.cond(j < depth, lambda h, p=p, s=s: block(h, p, s), lambda h, s=s: (h, s), h)
        new.append(s)
    return h, (jax.tree.map(lambda *a: jnp.stack(a), *new) if jax.tree.leaves(stats) else stats)


class HybridSubnet(NamedTuple):
    """The subnet ``choice`` of ``space``, applied like a Flax module:
    ``apply(variables, x, *, train=False, mask=None, mutable=False)`` returns the logits,
    or ``(logits, {"batch_stats": ...})`` when ``"batch_stats"`` is mutable — the whole
    tree, entries the subnet does not update unchanged. ``train`` normalises with the
    statistics of the real examples (``mask``, [B] bool) and updates the running ones."""

    space: HybridViT
    choice: Any  # int32 [D]: numpy (checked) or traced

    def _index(self, name: str):
        j = self.space.dim_index[name]
        return int(self.choice[j]) if isinstance(self.choice, np.ndarray) else self.choice[j]

    def _value(self, name: str):
        j = self.space.dim_index[name]
        choices = self.space.dims[j].choices
        if isinstance(self.choice, np.ndarray):
            return int(choices[int(self.choice[j])])
        return jnp.asarray(choices, jnp.int32)[self.choice[j]]

    def apply(self, variables: dict, x, *, train: bool = False, mask=None, mutable=False):
        return flax_apply(self, variables, x, train=train, mask=mask, mutable=mutable)

    def _forward(self, params, stats, x, train: bool, mask):
        space = self.space
        new = {}
        h = conv_nhwc(x, params["stem"]["conv"], space.stem_stride)
        h, s = _batch_norm(h, params["stem"]["bn"], stats["stem"]["bn"], train, mask)
        new["stem"] = {"bn": s}
        h = jax.nn.relu(h)
        prev_widths, prev_index = (space.stem_channels,), 0
        for i, st in enumerate(space.conv_stages, 1):
            key = f"conv{i}"
            h, new[key] = self._conv_stage(h, params[key], stats[key], st, key, prev_widths, prev_index, train, mask)
            prev_widths, prev_index = st.widths, self._index(f"{key}.width")
        for t, st in enumerate(space.vit_stages, 1):
            key = f"vit{t}"
            h = self._vit_stage(h, params[key], st, key, t == 1, prev_widths, prev_index)
            prev_widths, prev_index = st.widths, self._index(f"{key}.width")

        def head(e):
            def run(h):
                z = _layer_norm(h[..., :e], params["norm"]).mean(1)
                return _dense(z, params["head"], space.num_classes)
            return run

        return select(prev_index, [head(e) for e in prev_widths], h), new

    def _entry(self, h, prev_widths, prev_index, fn):
        """``fn(h[..., :c])`` for the previous stage's chosen width ``c`` (a switch)."""
        return select(prev_index, [lambda h, c=c: fn(h[..., :c]) for c in prev_widths], h)

    def _conv_stage(self, h, p, s, st: ConvStage, key, prev_widths, prev_index, train, mask):
        kernel_index, depth = self._index(f"{key}.kernel"), self._value(f"{key}.depth")
        km, wm = max(st.kernels), max(st.widths)

        def block(w):
            def run(h, pj, sj):
                def conv(k):
                    lo = km // 2 - k // 2
                    return lambda h: conv_nhwc(h, pj["conv"][lo:lo + k, lo:lo + k, :w, :w], 1)
                y = select(kernel_index, [conv(k) for k in st.kernels], h)
                y, sj_bn = _batch_norm(y, pj["bn"], sj["bn"], train, mask)
                return jax.nn.relu(h + y), {"bn": sj_bn}
            return run

        def stage(w):
            def run(h):
                y = self._entry(h, prev_widths, prev_index,
                                lambda z: conv_nhwc(z, p["entry"]["conv"][:, :, : z.shape[-1], :w], st.stride))
                y, se = _batch_norm(y, p["entry"]["bn"], s["entry"]["bn"], train, mask)
                y, sb = _blocks(block(w), jax.nn.relu(y), p["blocks"], s["blocks"], depth, min(st.depths))
                return pad(y, wm), {"entry": {"bn": se}, "blocks": sb}
            return run

        return select(self._index(f"{key}.width"), [stage(w) for w in st.widths], h)

    def _vit_stage(self, h, p, st: ViTStage, key, first: bool, prev_widths, prev_index):
        space, dh = self.space, self.space.head_dim
        heads_index, ratio_index = self._index(f"{key}.heads"), self._index(f"{key}.mlp_ratio")
        depth = self._value(f"{key}.depth")

        def attention(e, n_heads):
            def run(z, pj):
                b, n, q = z.shape[0], z.shape[1], n_heads * dh
                split = lambda a: a.reshape(b, n, n_heads, dh)  # noqa: E731
                qh, kh, vh = (split(_dense(z, pj[name], q)) for name in ("query", "key", "value"))
                logits = jnp.einsum("bqhd,bkhd->bhqk", qh, kh) / np.sqrt(dh).astype(np.float32)
                attn = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(vh.dtype)  # float32 softmax
                a = jnp.einsum("bhqk,bkhd->bqhd", attn, vh).reshape(b, n, q)
                return _dense(a, pj["out"], e)
            return run

        def mlp(e, ratio):
            def run(z, pj):
                return _dense(jax.nn.gelu(_dense(z, pj["fc1"], ratio * e), approximate=False), pj["fc2"], e)
            return run

        def block(e):
            def run(h, pj, sj):
                z = _layer_norm(h, pj["ln1"])
                h = h + select(heads_index, [attention(e, n) for n in st.heads], z, pj)
                z = _layer_norm(h, pj["ln2"])
                return h + select(ratio_index, [mlp(e, r) for r in st.mlp_ratios], z, pj), sj
            return run

        def stage(e):
            def run(h):
                if first:
                    def patches(z):
                        pe = p["entry"]
                        y = conv_nhwc(z, pe["kernel"][:, :, : z.shape[-1], :e], space.patch, "VALID") + pe["bias"][:e]
                        return y.reshape(y.shape[0], -1, e) + pe["pos"][:, :e]
                    y = self._entry(h, prev_widths, prev_index, patches)
                else:
                    y = self._entry(h, prev_widths, prev_index, lambda z: _dense(z, p["entry"], e))
                y, _ = _blocks(block(e), y, p["blocks"], {}, depth, min(st.depths))
                return pad(y, max(st.widths))
            return run

        return select(self._index(f"{key}.width"), [stage(e) for e in st.widths], h)


SPACES: dict[str, HybridViT] = {
    # CIFAR-10: 32 -> stem s2 -> 16x16 -> conv1, conv2 -> 2x2 patches -> 8x8 = 64 tokens.
    "cifar": HybridViT(
        "cifar", (32, 32, 3), 10,
        conv_stages=(ConvStage((16, 24), (1, 2), (3, 5, 7)), ConvStage((24, 32), (1, 2), (3, 5, 7))),
        vit_stages=(ViTStage((16, 24, 32), (1, 2, 3, 4, 5), (2, 4), (2, 4)),
                    ViTStage((32, 48, 64), (1, 2, 3), (4, 6), (2, 4))),
        stem_channels=16, stem_stride=2, patch=2, head_dim=8),
    # 8x8 digits: Table 1's lists (conv depth 1 and 2), 2x2 patches -> 16 tokens.
    "small": HybridViT(
        "small", (8, 8, 1), 10,
        conv_stages=(ConvStage((16, 24), (1, 2), (3, 5, 7)),),
        vit_stages=(ViTStage((16, 24, 32), (1, 2, 3, 4, 5), (2, 4), (2, 4)),),
        stem_channels=16, stem_stride=1, patch=2, head_dim=8),
    # tests: every kind of dimension and transition, two choices each; 8x8 -> 4 tokens.
    "tiny": HybridViT(
        "tiny", (8, 8, 1), 10,
        conv_stages=(ConvStage((4, 8), (1, 2), (3, 5)), ConvStage((8, 12), (1, 2), (1, 3), stride=2)),
        vit_stages=(ViTStage((8, 12), (1, 2), (1, 2), (1, 2)), ViTStage((12, 16), (1, 2), (1, 2), (1, 2))),
        stem_channels=4, stem_stride=1, patch=2, head_dim=4),
}


def get_space(name: str) -> HybridViT:
    if name not in SPACES:
        raise ValueError(f"unknown hybrid space {name!r}; available: {sorted(SPACES)}")
    return SPACES[name]


__all__ = ["BN_EPS", "BN_MOMENTUM", "ConvStage", "HybridSubnet", "HybridViT", "LN_EPS", "SPACES", "ViTStage",
           "get_space"]
