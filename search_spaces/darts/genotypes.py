"""Discrete DARTS cells (genotypes) and their derivation from architecture weights.

A :class:`Genotype` lists, for each intermediate node of a cell, two ``(op, input)``
pairs; inputs 0 and 1 are the cell inputs ``c_{k-2}``, ``c_{k-1}`` and 2.. the earlier
intermediate nodes. :func:`derive` is DARTS' ``genotype()`` (Liu et al.,
arXiv:1806.09055, Sec. 2.4): softmax each edge's ``alpha``; an edge's strength is its
largest non-``none`` weight; each node keeps its two strongest incoming edges (stable
sort, so a tie goes to the lower input index) with their argmax non-``none`` op.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any
from collections.abc import Sequence

import numpy as np

from .operations import OPS, PRIMITIVES


def _pairs(value, field: str) -> tuple[tuple[str, int], ...]:
    try:
        out = tuple((str(op), int(idx)) for op, idx in value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Genotype.{field} must be a sequence of (op_name, input_index) pairs, got {value!r}") from e
    if not out or len(out) % 2:
        raise ValueError(f"Genotype.{field} needs two (op, input) pairs per node, got {len(out)} pairs")
    for k, (op, idx) in enumerate(out):
        if op not in OPS:
            raise ValueError(f"Genotype.{field}[{k}]: unknown op {op!r}; expected one of {OPS}")
        node = k // 2
        if not 0 <= idx < 2 + node:
            raise ValueError(f"Genotype.{field}[{k}]: node {node} can only read inputs 0..{node + 1}, got {idx}")
    return out


def _concat(value, field: str, steps: int) -> tuple[int, ...]:
    out = tuple(int(i) for i in value)
    if not out or any(not 2 <= i < 2 + steps for i in out):
        raise ValueError(f"Genotype.{field} must index intermediate nodes 2..{steps + 1}, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class Genotype:
    """A normal and a reduction cell; lists are turned into tuples, so it is hashable."""

    normal: tuple[tuple[str, int], ...]
    normal_concat: tuple[int, ...]
    reduce: tuple[tuple[str, int], ...]
    reduce_concat: tuple[int, ...]

    def __post_init__(self):
        normal, reduce = _pairs(self.normal, "normal"), _pairs(self.reduce, "reduce")
        object.__setattr__(self, "normal", normal)
        object.__setattr__(self, "reduce", reduce)
        object.__setattr__(self, "normal_concat", _concat(self.normal_concat, "normal_concat", len(normal) // 2))
        object.__setattr__(self, "reduce_concat", _concat(self.reduce_concat, "reduce_concat", len(reduce) // 2))

    @property
    def steps(self) -> int:
        return len(self.normal) // 2

    def to_dict(self) -> dict[str, Any]:
        return {
            "normal": [[op, i] for op, i in self.normal],
            "normal_concat": list(self.normal_concat),
            "reduce": [[op, i] for op, i in self.reduce],
            "reduce_concat": list(self.reduce_concat),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Genotype:
        missing = {"normal", "normal_concat", "reduce", "reduce_concat"} - set(d)
        if missing:
            raise ValueError(f"Genotype dict is missing {sorted(missing)}")
        return cls(d["normal"], d["normal_concat"], d["reduce"], d["reduce_concat"])

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, s: str) -> Genotype:
        return cls.from_dict(json.loads(s))


SHORT_OPS = {"skip_connect": "skip", "sep_conv_3x3": "sep3", "sep_conv_5x5": "sep5", "dil_conv_3x3": "dil3",
             "dil_conv_5x5": "dil5", "avg_pool_3x3": "avg3", "max_pool_3x3": "max3"}
"""Short names of the DARTS ops for tables (:func:`cell_text`)."""


def cell_text(pairs: Sequence[tuple[str, int]]) -> str:
    """One cell of a :class:`Genotype` on one line, for a table: ``op(input)+op(input)`` per
    node (short op names, :data:`SHORT_OPS`), nodes separated by ``/``.

    >>> cell_text([("sep_conv_3x3", 0), ("skip_connect", 1), ("max_pool_3x3", 2), ("none", 0)])
    'sep3(0)+skip(1) / max3(2)+none(0)'
    """
    ops = [f"{SHORT_OPS.get(op, op)}({i})" for op, i in pairs]
    return " / ".join("+".join(ops[n:n + 2]) for n in range(0, len(ops), 2))


def edges_text(pairs: Sequence[tuple[str, int]]) -> str:
    """One cell of a :class:`Genotype` as its edges, ``op<-input`` in order (full op names).

    >>> edges_text([("sep_conv_3x3", 0), ("skip_connect", 1)])
    'sep_conv_3x3<-0 skip_connect<-1'
    """
    return " ".join(f"{op}<-{i}" for op, i in pairs)


_CONCAT = (2, 3, 4, 5)

DARTS_V1 = Genotype(
    normal=(("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("skip_connect", 0), ("sep_conv_3x3", 1),
            ("skip_connect", 0), ("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("skip_connect", 2)),
    normal_concat=_CONCAT,
    reduce=(("max_pool_3x3", 0), ("max_pool_3x3", 1), ("skip_connect", 2), ("max_pool_3x3", 0),
            ("max_pool_3x3", 0), ("skip_connect", 2), ("skip_connect", 2), ("avg_pool_3x3", 0)),
    reduce_concat=_CONCAT,
)
"""DARTS (first order), CIFAR-10 (DARTS paper, Fig. 4-5 / released ``genotypes.py``)."""

DARTS_V2 = Genotype(
    normal=(("sep_conv_3x3", 0), ("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("sep_conv_3x3", 1),
            ("sep_conv_3x3", 1), ("skip_connect", 0), ("skip_connect", 0), ("dil_conv_3x3", 2)),
    normal_concat=_CONCAT,
    reduce=(("max_pool_3x3", 0), ("max_pool_3x3", 1), ("skip_connect", 2), ("max_pool_3x3", 1),
            ("max_pool_3x3", 0), ("skip_connect", 2), ("skip_connect", 2), ("max_pool_3x3", 1)),
    reduce_concat=_CONCAT,
)
"""DARTS, second order, on CIFAR-10 (2.76% error, 3.3M parameters with C=36, 20 cells)."""

DARTS = DARTS_V2

FEDNAS_V1 = Genotype(
    normal=(("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("sep_conv_3x3", 2), ("sep_conv_5x5", 0),
            ("sep_conv_3x3", 1), ("sep_conv_5x5", 3), ("dil_conv_5x5", 3), ("sep_conv_3x3", 4)),
    normal_concat=_CONCAT,
    reduce=(("max_pool_3x3", 0), ("skip_connect", 1), ("max_pool_3x3", 0), ("max_pool_3x3", 2),
            ("max_pool_3x3", 0), ("dil_conv_5x5", 1), ("max_pool_3x3", 0), ("dil_conv_5x5", 2)),
    reduce_concat=_CONCAT,
)
"""The cell FedNAS hard-codes for its training stage ("FedNAS_V1" in FedML)."""


def _softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(axis=-1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(axis=-1, keepdims=True)


def _parse(w: np.ndarray, primitives: tuple[str, ...], steps: int, field: str) -> tuple[tuple[str, int], ...]:
    n_edges = sum(2 + i for i in range(steps))
    if w.shape != (n_edges, len(primitives)):
        raise ValueError(f"{field} must have shape ({n_edges}, {len(primitives)}) for steps={steps} and "
                         f"{len(primitives)} primitives, got {w.shape}")
    candidates = [k for k, p in enumerate(primitives) if p != "none"]
    if not candidates:
        raise ValueError("primitives must contain an op other than 'none'")
    gene, start = [], 0
    for i in range(steps):
        n_in = 2 + i
        rows = w[start:start + n_in]
        score = [max(rows[j, k] for k in candidates) for j in range(n_in)]
        # Python's sort is stable: equal scores keep ascending input order.
        edges = sorted(range(n_in), key=lambda j: -score[j])[:2]
        for j in edges:
            best = candidates[0]
            for k in candidates[1:]:
                if rows[j, k] > rows[j, best]:  # strict: a tie keeps the earlier op
                    best = k
            gene.append((primitives[best], j))
        start += n_in
    return tuple(gene)


def derive_from_weights(weights_normal, weights_reduce, primitives: Sequence[str] = PRIMITIVES,
                        steps: int = 4, multiplier: int = 4) -> Genotype:
    """The genotype of already-normalised op weights ``[num_edges, |primitives|]``."""
    primitives = tuple(primitives)
    wn = np.asarray(weights_normal, dtype=np.float64)
    wr = np.asarray(weights_reduce, dtype=np.float64)
    concat = tuple(range(2 + steps - multiplier, 2 + steps))
    return Genotype(
        normal=_parse(wn, primitives, steps, "weights_normal"),
        normal_concat=concat,
        reduce=_parse(wr, primitives, steps, "weights_reduce"),
        reduce_concat=concat,
    )


def derive(alphas_normal, alphas_reduce, primitives: Sequence[str] = PRIMITIVES, steps: int = 4,
           multiplier: int = 4) -> Genotype:
    """DARTS' ``genotype()``: row-wise softmax of each ``alpha`` array, then :func:`derive_from_weights`.

    The softmax runs in float64 on the host, so float32 near-ties resolve the same way on
    every backend.
    """
    an = np.asarray(alphas_normal, dtype=np.float64)
    ar = np.asarray(alphas_reduce, dtype=np.float64)
    return derive_from_weights(_softmax(an), _softmax(ar), primitives, steps, multiplier)
