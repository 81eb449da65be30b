"""Architectures as masks over the DARTS supernet's (edge, op) table.

A client's architecture (SPIDER's personal subnet, PerFedRLNAS's sampled subnet) is a
0/1 table per cell type, ``{"normal": [E, |O|], "reduce": [E, |O|]}`` with ``E =``
:func:`~jaxfednas.search_spaces.darts.search.num_edges` in DARTS edge order
(:func:`~jaxfednas.search_spaces.darts.search.edge_table`). Passed as ``arch_weights`` to
:class:`~jaxfednas.search_spaces.darts.search.DartsSearchNetwork`, every edge computes
``sum_{o kept} o(x)`` with the supernet's own weights: the network with the other ops
removed, at static shapes, so one compiled program serves every client's architecture
(the ops removed are still computed and multiplied by zero: masks trade compute for
one compilation). A row of zeros removes the edge.

* :func:`full_mask` -- the whole supernet (every op of every edge);
* :func:`mask_from_genotype` / :func:`genotype_from_mask` -- a discrete DARTS cell pair
  (two inputs per node, one op per input) to and from a mask;
* :class:`Subnet` -- the supernet under a fixed mask, applied like a Flax module;
* :func:`mask_weights` -- the float ``arch_weights`` of a mask (leading axes kept, so a
  stack of per-client masks maps with ``vmap``);
* :func:`check_mask` -- shape and 0/1 checks with a one-line error;
* :func:`variable_mask` -- which supernet variables a mask keeps (for updates and
  regularisers restricted to a subnet, e.g. SPIDER's ``w_share``; for parameter counts);
* :func:`incoming_edges` -- each node's incoming edges (topology projection).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .genotypes import Genotype
from .search import DartsSearchNetwork, edge_table, num_edges, reduction_indices

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


class Subnet(NamedTuple):
    """The supernet with fixed op weights (a mask, or any ``[E, |O|]`` table per cell type):
    applied like a Flax module; the ``arch`` collection is not needed."""

    net: DartsSearchNetwork
    arch_weights: dict  # {"normal": [E, |O|], "reduce": [E, |O|]}

    def apply(self, variables, x, **kwargs):
        shape = (num_edges(self.net.steps), len(self.net.primitives))
        unused = {"alphas_normal": jnp.zeros(shape), "alphas_reduce": jnp.zeros(shape)}  # op weights are fixed
        # floating op weights in x's: float32 ones would pull bfloat16 activations (jaxfednas.precision) back
        def like_x(w):
            w = jnp.asarray(w)
            both = jnp.issubdtype(w.dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)
            return w.astype(x.dtype) if both else w

        weights = jax.tree.map(like_x, self.arch_weights)
        return self.net.apply({**variables, "arch": unused}, x, arch_weights=weights, **kwargs)


def incoming_edges(steps: int) -> np.ndarray:
    """``[steps, steps + 1]`` int32: the edges into node ``i`` in DARTS order, padded
    with ``-1`` (node ``i`` has ``2 + i`` inputs)."""
    out = -np.ones((steps, steps + 1), np.int32)
    for e, _, node in edge_table(steps):
        row = out[node]
        row[np.argmax(row < 0)] = e
    return out


def _edge_groups(steps: int) -> dict[str, list[int]]:
    """Edge indices of each scanned edge group of a :class:`SearchCell` (its layout)."""
    table = edge_table(steps)
    return {"edges": [t[0] for t in table], "input_edges": [t[0] for t in table if t[1] < 2],
            "node_edges": [t[0] for t in table if t[1] >= 2]}


def variable_mask(mask: dict, tree: dict, primitives, steps: int, layers: int) -> dict:
    """A tree like ``tree`` (a :class:`DartsSearchNetwork`'s ``params`` or ``batch_stats``,
    scanned or unrolled layout) of 0/1 float32 arrays broadcastable to its leaves: 1 for
    every variable the subnet ``mask`` uses, 0 for the variables of removed (edge, op)
    pairs. Stem, preprocessing and classifier are always kept. ``mask`` may be traced
    (the result then is too), so one compiled program serves every client's mask."""
    primitives = tuple(primitives)
    groups = _edge_groups(steps)
    reductions = set(reduction_indices(layers))

    def op_rows(m, edge_ids, op):  # [n_edges] 0/1 of ``op`` on these edges
        return jnp.asarray(m)[jnp.asarray(edge_ids), primitives.index(op)]

    def ones_like(sub):
        return jax.tree.map(lambda x: jnp.ones((1,) * jnp.ndim(x), jnp.float32), sub)

    def cell(sub: dict, m, scanned: bool) -> dict:
        out = {}
        for key, group in sub.items():
            if key in groups:
                edge_ids = groups[key]
            elif key.startswith("edge_"):
                edge_ids = [int(key[5:])]
            else:
                out[key] = ones_like(group)
                continue
            ops = {}
            for name, leaves in group.items():
                op = name[:-3] if name.endswith("_bn") else name  # a pool's BN belongs to its op
                rows = op_rows(m, edge_ids, op)
                if key.startswith("edge_"):
                    rows = rows[0]
                lead = (1,) if scanned else ()

                def shaped(x, rows=rows, lead=lead):
                    return rows.reshape(lead + rows.shape + (1,) * (jnp.ndim(x) - len(lead) - rows.ndim))

                ops[name] = jax.tree.map(shaped, leaves)
            out[key] = ops
        return out

    out = {}
    for key, sub in tree.items():
        if key.startswith("cell_") or key.startswith("cells_"):
            first = int(key.split("_")[1])
            kind = "reduce" if first in reductions else "normal"
            out[key] = cell(sub, mask[kind], scanned=key.startswith("cells_"))
        else:
            out[key] = ones_like(sub)
    return out


__all__ = [
    "CELLS", "Subnet", "check_mask", "full_mask", "incoming_edges", "genotype_from_mask", "mask_from_genotype",
    "mask_weights", "variable_mask",
]
