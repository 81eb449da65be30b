"""Discrete architectures of the ShuffleNetV2 choice-block space.

A :class:`ShuffleArch` is one candidate index per choice block. :func:`derive` is the
DSNAS/DFNAS deployment rule (argmax of α per block, ties to the lower index);
:func:`build` gives the child network that holds only the chosen units, and
:func:`child_variables` cuts its weights and BatchNorm statistics out of the
supernet's, so the child computes exactly what the supernet computes on that path.
:func:`child_cost` counts a child's parameters and multiply-adds; :func:`macs_table`
splits the multiply-adds per block and candidate, so that a sampled path's cost is a
sum of lookups (DSNAS' FLOPs penalty).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.cost import count_macs

from .blocks import BN_EPS, Head, make_unit, Stem
from .network import get_space, ShuffleNetwork


@dataclasses.dataclass(frozen=True)
class ShuffleArch:
    """One candidate index per block of the named space (hashable, JSON round trip)."""

    space: str
    choices: tuple[int, ...]

    def __post_init__(self):
        sp = get_space(self.space)
        try:
            choices = tuple(int(c) for c in self.choices)
        except (TypeError, ValueError) as e:
            raise ValueError(f"ShuffleArch.choices must be integers, got {self.choices!r}") from e
        if len(choices) != sp.num_blocks or any(not 0 <= c < sp.num_candidates for c in choices):
            raise ValueError(
                f"ShuffleArch.choices: space {self.space!r} needs {sp.num_blocks} indices in "
                f"[0, {sp.num_candidates}), got {choices}"
            )
        object.__setattr__(self, "choices", choices)

    @property
    def names(self) -> tuple[str, ...]:
        cands = get_space(self.space).candidates
        return tuple(cands[c] for c in self.choices)

    def to_json(self) -> str:
        return json.dumps({"space": self.space, "choices": list(self.choices), "names": list(self.names)})

    @classmethod
    def from_json(cls, text: str) -> ShuffleArch:
        d = json.loads(text)
        return cls(d["space"], tuple(d["choices"]))

    def __str__(self) -> str:
        return f"{self.space}[{' '.join(self.names)}]"


def derive(alpha: Any, space: str) -> ShuffleArch:
    """argmax of α per block (``np.argmax``: a tie goes to the lower index)."""
    a = np.asarray(jax.device_get(alpha))
    return ShuffleArch(space, tuple(int(i) for i in a.argmax(-1)))


def uniform_arch(space: str, candidate: str) -> ShuffleArch:
    """The same candidate in every block, e.g. ``"k3"`` = a plain ShuffleNetV2."""
    sp = get_space(space)
    if candidate not in sp.candidates:
        raise ValueError(f"candidate {candidate!r} is not in space {space!r}: {sp.candidates}")
    return ShuffleArch(space, (sp.candidates.index(candidate),) * sp.num_blocks)


def build(arch: ShuffleArch, num_classes: int, *, dw_impl: str | None = None, bn_eps: float = BN_EPS) -> ShuffleNetwork:
    """The child network that holds and runs only ``arch``'s units."""
    return ShuffleNetwork(get_space(arch.space), num_classes, choices=arch.choices, dw_impl=dw_impl, bn_eps=bn_eps)


def child_variables(variables: dict, arch: ShuffleArch) -> dict:
    """Supernet variables -> the child's (``params``, ``batch_stats``): block ``l`` keeps
    ``units_{choice_l}`` renamed ``units_0``; stem and head are shared; α is dropped."""
    out = {}
    for col in ("params", "batch_stats"):
        if col not in variables:
            continue
        tree = dict(variables[col])
        for l, c in enumerate(arch.choices):
            tree[f"block{l}"] = {"units_0": tree[f"block{l}"][f"units_{c}"]}
        out[col] = tree
    return out


def child_cost(arch: ShuffleArch, num_classes: int, image_shape: tuple[int, ...]) -> dict[str, int]:
    """Parameters (weights + BN affine, no running statistics) and multiply-accumulates
    of one forward pass of one image through the child."""
    model = build(arch, num_classes, dw_impl="grouped")
    x = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x))
    params = sum(int(np.prod(l.shape)) for l in jax.tree.leaves(shapes["params"]))
    macs = count_macs(lambda v, x: model.apply(v, x), shapes, x)
    return {"params": params, "macs": macs}


class MacsTable(NamedTuple):
    """Multiply-adds of one image through a child of a space: ``fixed`` (stem and head)
    plus ``blocks[l, c_l]`` for every block ``l`` (:meth:`of`). Exact, because a block's
    input shape does not depend on the choices before it (every candidate of a block
    has the same output shape)."""

    fixed: int
    blocks: np.ndarray  # [blocks, candidates] int64

    def of(self, choices) -> int:
        """Multiply-adds of the child with these candidate indices (== ``child_cost``'s)."""
        choices = np.asarray(choices)
        return self.fixed + int(self.blocks[np.arange(len(choices)), choices].sum())


def _macs_and_output(module, x: jax.ShapeDtypeStruct):
    shapes = jax.eval_shape(lambda x: module.init(jax.random.key(0), x), x)
    fn = lambda v, x: module.apply(v, x)  # noqa: E731
    return count_macs(fn, shapes, x), jax.eval_shape(fn, shapes, x)


@functools.lru_cache(maxsize=32)
def macs_table(space: str, num_classes: int, image_shape: tuple[int, ...]) -> MacsTable:
    """Per-block, per-candidate multiply-adds of one image (convolutions and matrix
    products, counted from the traced computation like :func:`child_cost`): each unit is
    traced alone on its block's input shape; identical blocks are traced once. For the
    ``imagenet`` space the blocks' entries are DSNAS' own FLOPs table (tested)."""
    sp = get_space(space)
    image_shape = tuple(int(d) for d in image_shape)
    x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
    fixed, h = _macs_and_output(Stem(sp.stem_channels, sp.stem_stride), x)
    traced: dict = {}
    rows = []
    for spec in sp.plan():
        key = (spec, h.shape)
        if key not in traced:
            traced[key] = [_macs_and_output(make_unit(c, *spec, dw_impl="grouped"), h) for c in sp.candidates]
        rows.append([m for m, _ in traced[key]])
        h = traced[key][0][1]
    fixed += _macs_and_output(Head(sp.last_channels, num_classes), h)[0]
    blocks = np.asarray(rows, np.int64)
    blocks.setflags(write=False)  # cached: shared by every caller
    return MacsTable(int(fixed), blocks)
