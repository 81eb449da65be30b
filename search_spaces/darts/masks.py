"""Architectures as masks over the DARTS supernet's (edge, op) table.

A client's architecture (SPIDER's personal subnet, PerFedRLNAS's sampled subnet) is a
0/1 table per cell type, ``{"normal": [E, |O|], "reduce": [E, |O|]}`` with ``E =``
:func:`~search_spaces.darts.search.num_edges` in DARTS edge order
(:func:`~search_spaces.darts.search.edge_table`). Passed as ``arch_weights`` to
:class:`~search_spaces.darts.search.DartsSearchNetwork`, every edge computes
``sum_{o kept} o(x)`` with the supernet's own weights: the network with the other ops
removed, at static shapes, so one compiled program serves every client's architecture
(the ops removed are still computed and multiplied by zero: masks trade compute for
one compilation). A row of zeros removes the edge.

* :func:`full_mask` -- the whole supernet (every op of every edge);
* :func:`mask_from_genotype` / :func:`genotype_from_mask` -- a discrete DARTS cell pair
  (two inputs per node, one op per input) to and from a mask;
* :func:`mask_weights` -- the float ``arch_weights`` of a mask (leading axes kept, so a
  stack of per-client masks maps with ``vmap``);
* :func:`check_mask` -- shape and 0/1 checks with a one-line error.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .genotypes import Genotype
from .search import edge_table, num_edges

CELLS = ("normal", "reduce")


def _edge_of(steps: int) -> dict[tuple[int, int], int]:
    """``(src, node) -> edge`` index in DARTS order."""
    return {(src, node): e for e, src, node in edge_table(steps)}


def full_mask(primitives, steps: int) -> dict[str, np.ndarray]:
    """Every op of every edge kept (the supernet itself, with unit op weights)."""
    return {c: np.ones((num_edges(steps), len(primitives)), np.float32) for c in CELLS}


def check_mask(mask: dict, primitives, steps: int) -> None:
    """Raise ``ValueError`` (one line) unless ``mask`` is a 0/1 table of the right shape."""
    shape = (num_edges(steps), len(primitives))
    if set(mask) != set(CELLS):
        raise ValueError(f"a mask has the keys {CELLS}, got {sorted(mask)}")
    for c in CELLS:
        m = np.asarray(mask[c])
        if m.shape[-2:] != shape:
            raise ValueError(f"mask[{c!r}] must end in shape {shape} (edges, ops), got {m.shape}")
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"mask[{c!r}] must hold only 0 and 1")


def mask_from_genotype(genotype: Genotype, primitives, steps: int) -> dict[str, np.ndarray]:
    """The mask of a discrete cell pair: for node ``i`` and each of its pairs ``(op, j)``,
    edge ``(j -> i)`` keeps exactly ``op``; every other edge is removed."""
    primitives = tuple(primitives)
    if genotype.steps != steps:
        raise ValueError(f"the genotype has {genotype.steps} nodes per cell, the supernet {steps}")
    edge_of = _edge_of(steps)
    out = {}
    for c in CELLS:
        m = np.zeros((num_edges(steps), len(primitives)), np.float32)
        for k, (op, src) in enumerate(getattr(genotype, c)):
            if op not in primitives:
                raise ValueError(f"{c} cell: op {op!r} is not a candidate ({', '.join(primitives)})")
            m[edge_of[(src, k // 2)], primitives.index(op)] = 1.0
        out[c] = m
    return out


def genotype_from_mask(mask: dict, primitives, steps: int, multiplier: int | None = None) -> Genotype:
    """The discrete cell pair of a mask that keeps exactly two incoming edges per node and
    one op per kept edge (after SPIDER's op selection and topology projection); the
    cell output concatenates the last ``multiplier`` nodes (default: all ``steps``).
    ``ValueError`` names the first node or edge that is not discrete."""
    primitives = tuple(primitives)
    check_mask(mask, primitives, steps)
    multiplier = steps if multiplier is None else multiplier
    cells = {}
    for c in CELLS:
        m = np.asarray(mask[c])
        pairs = []
        for node in range(steps):
            kept = [(e, src) for e, src, n in edge_table(steps) if n == node and m[e].sum() > 0]
            if len(kept) != 2:
                raise ValueError(f"{c} cell, node {node}: {len(kept)} incoming edges kept, a genotype needs 2")
            for e, src in kept:
                ops = np.flatnonzero(m[e])
                if len(ops) != 1:
                    raise ValueError(f"{c} cell, edge {src}->{node}: {len(ops)} ops kept, a genotype needs 1")
                pairs.append((primitives[int(ops[0])], src))
        cells[c] = pairs
    concat = list(range(2 + steps - multiplier, 2 + steps))
    return Genotype(normal=cells["normal"], normal_concat=concat, reduce=cells["reduce"], reduce_concat=concat)


def mask_weights(mask: dict) -> dict:
    """``arch_weights`` for :class:`DartsSearchNetwork`: the mask as float32 arrays."""
    return {c: jnp.asarray(mask[c], jnp.float32) for c in CELLS}


__all__ = ["CELLS", "check_mask", "full_mask", "genotype_from_mask", "mask_from_genotype", "mask_weights"]
