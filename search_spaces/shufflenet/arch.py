"""Discrete architectures of the ShuffleNetV2 choice-block space.

A :class:`ShuffleArch` is one candidate index per choice block. :func:`derive` is the
DSNAS/DFNAS deployment rule (argmax of α per block, ties to the lower index);
:func:`build` gives the child network that holds only the chosen units, and
:func:`child_variables` cuts its weights and BatchNorm statistics out of the
supernet's, so the child computes exactly what the supernet computes on that path.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.cost import count_macs

from .blocks import BN_EPS
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
    def from_json(cls, text: str) -> "ShuffleArch":
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
