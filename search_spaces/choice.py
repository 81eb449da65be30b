"""One description of "a supernet with D search dimensions" (PerFedRLNAS, Table 1).

A choice space (duck-typed, see below; e.g.
:class:`~jaxfednas.search_spaces.darts.space.DartsChoiceSpace`) declares ``D`` dimensions,
dimension ``d`` with ``k_d`` choices (a DARTS edge: its ops; an elastic stage: kernel
3/5/7, depth, width ...). A subnet is
one choice per dimension, an int vector ``[D]``; it is realised over the supernet's own
weights at static shapes (a mask, a slice, or a ``lax.switch`` per dimension), so one
compiled program serves every client's subnet and weights are shared as in the paper.
One policy implementation (PerFedRLNAS' per-client logits ``[D, max k_d]``,
:func:`jaxfednas.algorithms.perfedrlnas.policy_gradient`) then serves every space.

What a space provides (duck-typed; :func:`check_space` verifies the attributes):

* ``name: str`` and ``dims: tuple[Dimension, ...]``;
* ``init(key, x) -> {"params": ..., "batch_stats": ...}``: the supernet's variables
  (``x`` an example batch);
* ``subnet(choice)`` -> an object with Flax's ``apply(variables, x, *, train, mask=None,
  mutable=...)``: the subnet ``choice`` (an int array ``[D]``, possibly traced) computed
  with the supernet's variables; ``mask`` ([B] bool) excludes padded examples from
  BatchNorm's batch statistics, as in every network of this library;
* ``variable_mask(choice, variables)`` -> a tree like ``variables`` of 0/1 float32
  leaves broadcastable to them: which supernet entries the subnet uses (its weights,
  and the BatchNorm statistics it updates). Aggregation averages each entry over the
  clients whose subnet contains it (:func:`jaxfednas.runtime.masked_weighted_mean`);
* ``cost(choice) -> SubnetCost``: exact parameter count, multiply-adds per example and
  activation memory per example of the subnet, on the host (numpy ``choice``);
* ``describe(choice) -> dict``: the subnet as JSON-friendly ``{dimension name: choice}``;
* optionally ``traced_cost(choice) -> float32 [3]``: ``cost`` of a traced choice in jnp
  (params, macs, activation floats); without it algorithms call ``cost`` through a host
  callback;
* ``single_path: bool``: True when a traced ``choice`` runs only the chosen path
  (``lax.switch`` / slicing) so clients mapped one after another pay for one subnet;
  False when unchosen candidates are computed and multiplied by zero (masks).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

BYTES_PER_FLOAT = 4


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One search dimension: a name (``"normal.edge_3"``, ``"stage2.kernel"``) and its
    ``k_d`` choices (op names, kernel sizes, ...; anything JSON can hold)."""

    name: str
    choices: tuple

    def __post_init__(self):
        if len(self.choices) < 1:
            raise ValueError(f"dimension {self.name!r} needs at least one choice")


class SubnetCost(NamedTuple):
    """A subnet's exact size and cost (host-side integers).

    Attributes:
        params: scalars in the weights it uses (BatchNorm running statistics not counted).
        macs: multiply-accumulates of one example's forward pass (convolutions, matmuls).
        activation_floats: float32 values per example that a training step keeps for the
            backward pass (each space documents which tensors it counts).
    """

    params: int
    macs: int
    activation_floats: int

    def memory_bytes(self, batch_size: int, optimizer_slots: int = 1) -> int:
        """Training memory of one client: weights, their gradient and ``optimizer_slots``
        optimizer buffers (SGD momentum: 1), plus a batch's activations; float32."""
        return BYTES_PER_FLOAT * ((2 + optimizer_slots) * self.params + batch_size * self.activation_floats)

    def to_dict(self) -> dict:
        return {"params": int(self.params), "macs": int(self.macs), "activation_floats": int(self.activation_floats)}


REQUIRED = ("name", "dims", "init", "subnet", "variable_mask", "cost", "describe", "single_path")


def check_space(space: Any) -> None:
    """``TypeError`` (one line) unless ``space`` has every attribute of the protocol."""
    missing = [a for a in REQUIRED if not hasattr(space, a)]
    if missing:
        raise TypeError(f"{type(space).__name__} is not a choice space: missing {', '.join(missing)}")
    if not space.dims:
        raise TypeError(f"space {space.name!r} declares no search dimensions")


def num_choices(dims: Sequence[Dimension]) -> np.ndarray:
    """``[D]`` int32: k_d of every dimension."""
    return np.array([len(d.choices) for d in dims], np.int32)


def choice_mask(dims: Sequence[Dimension]) -> np.ndarray:
    """``[D, max k_d]`` bool: which slots of a padded ``[D, K]`` logit table are choices."""
    k = num_choices(dims)
    return np.arange(k.max())[None, :] < k[:, None]


def check_choice(dims: Sequence[Dimension], choice) -> np.ndarray:
    """``choice`` as int32 ``[D]``; ``ValueError`` naming the first dimension out of range."""
    c = np.asarray(choice)
    if c.shape != (len(dims),) or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"a subnet is {len(dims)} integer choices (one per dimension), got shape {c.shape} "
                         f"dtype {c.dtype}")
    for d, (dim, j) in enumerate(zip(dims, c)):
        if not 0 <= j < len(dim.choices):
            raise ValueError(f"dimension {d} ({dim.name}) has {len(dim.choices)} choices, got index {int(j)}")
    return c.astype(np.int32)


def describe(dims: Sequence[Dimension], choice) -> dict:
    """``{dimension name: chosen value}`` of a subnet."""
    c = check_choice(dims, choice)
    return {dim.name: _json(dim.choices[int(j)]) for dim, j in zip(dims, c)}


def _json(v):
    return v.item() if isinstance(v, np.generic) else v


def mask_tree(tree: Any) -> Any:
    """Every leaf of ``tree`` kept: 0-d ones broadcastable to it (stem, head, ...)."""
    return jax.tree.map(lambda x: jnp.ones((1,) * jnp.ndim(x), jnp.float32), tree)


__all__ = ["BYTES_PER_FLOAT", "Dimension", "SubnetCost", "check_choice", "check_space", "choice_mask",
           "describe", "mask_tree", "num_choices"]
