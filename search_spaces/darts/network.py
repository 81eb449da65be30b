"""The DARTS evaluation ("augment") network built from a :class:`Genotype`.

``NetworkCIFAR`` of Liu et al. (arXiv:1806.09055, Sec. 3.2): stem conv 3x3 -> BN,
``layers`` cells (reductions at ``layers//3`` and ``2*layers//3``), global average pool,
linear classifier. Ops and preprocessing use affine BN; pooling ops have no BN; a node
is ``op1(h_a) + op2(h_b)``. Drop path (per example, keep ``1 - p``, rescaled by
``1/(1 - p)``) acts on every non-identity op output in training mode and needs a
``"dropout"`` rng. The optional CIFAR auxiliary head sits after cell ``2*layers//3``;
its loss weight in DARTS is :data:`AUX_WEIGHT`. DARTS sizes the head for the 8x8 maps that
32x32 images leave there; smaller maps (8x8 digits leave 2x2) get a smaller pool
(:func:`aux_pool`).

``build(genotype, ...)`` is an alias of the constructor. Repeated normal cells are
scanned exactly as in :mod:`jaxfednas.search_spaces.darts.search`.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.nn import Conv

from .genotypes import Genotype
from .operations import batch_norm, FactorizedReduce, is_identity, make_op, ReLUConvBN
from .search import cell_groups, cell_plan, CellSpec, reduction_indices, run_cells

AUX_WEIGHT = 0.4
"""Weight of the auxiliary-head cross entropy in the DARTS training loss."""


def drop_path(x, drop_prob, rng):
    """Zero whole examples with probability ``drop_prob`` and rescale the rest by ``1/(1-p)``
    (one Bernoulli draw per example, shared by its pixels and channels, as DARTS' ``drop_path``)."""
    keep = 1.0 - drop_prob
    m = jax.random.bernoulli(rng, keep, (x.shape[0], 1, 1, 1))
    return jnp.where(m, x / keep, jnp.zeros((), x.dtype))


class EvalCell(nn.Module):
    """One discrete cell; ``genotype`` supplies ``normal``/``reduce`` and their concat lists."""

    genotype: Genotype
    C: int
    reduction: bool
    reduction_prev: bool
    dw_impl: str | None = None

    @nn.compact
    def __call__(self, s0, s1, train: bool = False, mask=None, drop_prob=None):
        if self.reduction_prev:
            s0 = FactorizedReduce(self.C, affine=True, name="preprocess0")(s0, train, mask)
        else:
            s0 = ReLUConvBN(self.C, 1, 1, 0, affine=True, name="preprocess0")(s0, train, mask)
        s1 = ReLUConvBN(self.C, 1, 1, 0, affine=True, name="preprocess1")(s1, train, mask)
        gene = self.genotype.reduce if self.reduction else self.genotype.normal
        concat = self.genotype.reduce_concat if self.reduction else self.genotype.normal_concat
        states = [s0, s1]
        for i in range(len(gene) // 2):
            node = None
            for k in (2 * i, 2 * i + 1):
                name, idx = gene[k]
                stride = 2 if self.reduction and idx < 2 else 1
                h = make_op(name, self.C, stride, True, dw_impl=self.dw_impl, module_name=f"op_{k}")(
                    states[idx], train, mask
                )
                if train and drop_prob is not None and not is_identity(name, stride):
                    h = drop_path(h, drop_prob, self.make_rng("dropout"))
                node = h if node is None else node + h
            states.append(node)
        return jnp.concatenate([states[i] for i in concat], axis=-1)


def aux_pool(size: int) -> tuple[int, int]:
    """Window and stride of the auxiliary head's average pool over ``size`` pixels (one axis).

    DARTS' 5 / stride 3 (no padding) turns the 8x8 maps of 32x32 images into 2x2, which
    the head's 2x2 conv reduces to 1x1. It leaves fewer than 2 pixels below 8, so there the
    pool is ``size - 1`` wide with stride 1: still 2x2 out, from overlapping windows as in
    DARTS (on 2x2 maps, e.g. 8x8 digits after two reductions, a no-op). Below 2 pixels
    the head cannot run.
    """
    if size >= 8:
        return 5, 3
    if size >= 2:
        return size - 1, 1
    raise ValueError(f"the auxiliary head needs feature maps of at least 2x2 pixels, got {size} pixels")


def aux_input_size(image_hw: tuple[int, int], layers: int) -> tuple[int, int]:
    """Height and width of the maps the auxiliary head sees: the cell output after cell
    ``2*layers//3`` (every reduction up to it halves the image; the stem keeps it)."""
    n = sum(1 for i in reduction_indices(layers) if i <= 2 * layers // 3)
    h, w = image_hw
    return h >> n, w >> n


class AuxiliaryHeadCIFAR(nn.Module):
    """ReLU -> avg pool 5/3 -> 1x1 conv 128 -> BN -> ReLU -> 2x2 conv 768 -> BN -> ReLU -> linear.

    Meant for 8x8 inputs (pool to 2x2, the 2x2 conv to 1x1); smaller inputs (2 to 7
    pixels a side) pool with :func:`aux_pool`'s smaller window to 2x2 as well.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        (kh, sh), (kw, sw) = aux_pool(x.shape[1]), aux_pool(x.shape[2])
        x = nn.avg_pool(nn.relu(x), (kh, kw), (sh, sw), padding="VALID")
        x = Conv(128, (1, 1), use_bias=False)(x)
        x = nn.relu(batch_norm(x, train, mask, affine=True))
        x = Conv(768, (2, 2), padding="VALID", use_bias=False)(x)
        x = nn.relu(batch_norm(x, train, mask, affine=True))
        return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


class DartsNetwork(nn.Module):
    """Evaluation network (NHWC images). Returns logits, or ``(logits, aux_logits)`` when
    ``train`` and ``auxiliary``.

    ``drop_path_prob`` is the default drop-path rate; ``__call__(..., drop_path_prob=p)``
    overrides it with a (possibly traced) value so a per-epoch ramp does not recompile.
    """

    genotype: Genotype
    C: int
    num_classes: int
    layers: int
    auxiliary: bool = False
    drop_path_prob: float = 0.0
    stem_multiplier: int = 3
    dw_impl: str | None = None
    scan_cells: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, drop_path_prob=None):
        if not isinstance(self.genotype, Genotype):
            raise ValueError(f"genotype must be a Genotype, got {type(self.genotype).__name__}")
        for field, v in (("C", self.C), ("num_classes", self.num_classes), ("layers", self.layers)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{field} must be an int >= 1, got {v!r}")
        if not 0.0 <= float(self.drop_path_prob) < 1.0:
            raise ValueError(f"drop_path_prob must be in [0, 1), got {self.drop_path_prob}")
        if self.C % 2:
            raise ValueError(f"C must be even (FactorizedReduce splits channels in two), got {self.C}")
        p = drop_path_prob
        if p is None and self.drop_path_prob > 0:
            p = self.drop_path_prob
        if not train:
            p = None

        s = Conv(self.stem_multiplier * self.C, (3, 3), padding=((1, 1), (1, 1)), use_bias=False,
                 name="stem_conv")(x)
        s = batch_norm(s, train, mask, affine=True, name="stem_bn")

        plan = cell_plan(self.C, self.layers, len(self.genotype.normal_concat), self.stem_multiplier,
                         reduce_multiplier=len(self.genotype.reduce_concat))
        aux_index = 2 * self.layers // 3
        aux_out = []

        def make_cell(spec: CellSpec, name: str):
            return EvalCell(self.genotype, spec.C, spec.reduction, spec.reduction_prev, self.dw_impl, name=name)

        def call_cell(cell, s0, s1):
            return cell(s0, s1, train, mask, p)

        def after_cell(i, out):
            # Created at init even in eval mode, so the parameters always exist.
            if i == aux_index and self.auxiliary and (train or self.is_initializing()):
                aux_out.append(AuxiliaryHeadCIFAR(self.num_classes, name="auxiliary_head")(out, train, mask))

        _, s1 = run_cells(cell_groups(plan, self.scan_cells), make_cell, call_cell, s, s, after_cell,
                          split_rngs={"params": True, "dropout": True})
        logits = nn.Dense(self.num_classes, name="classifier")(jnp.mean(s1, axis=(1, 2)))
        if self.auxiliary and train:
            return logits, aux_out[0]
        return logits


def build(genotype: Genotype, C: int, num_classes: int, layers: int, **kwargs) -> DartsNetwork:
    """The evaluation network of ``genotype`` (DARTS CIFAR: C=36, layers=20, auxiliary=True)."""
    return DartsNetwork(genotype, C, num_classes, layers, **kwargs)


@functools.lru_cache(maxsize=4096)
def network_params(genotype: Genotype, C: int, num_classes: int, layers: int, image_shape: tuple[int, ...]) -> int:
    """Weights of :func:`build`'s network without the auxiliary head (as DARTS counts them),
    from shapes only (no compile): the cost :func:`jaxfednas.search_spaces.sampling.matched` compares
    when a random cell is drawn at a searched cell's size."""
    net = DartsNetwork(genotype, C, num_classes, layers)
    x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
    shapes = jax.eval_shape(lambda x: net.init(jax.random.key(0), x), x)
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"]))
