"""A search cell's edges grouped by the state they leave: the same variables and the same
math as the scanned cell (:class:`~jaxfednas.search_spaces.darts.search.SearchCell`), fewer and wider
operations (``group_edges``; the default on CPU for images of 16x16 pixels and more).

Every edge leaving a state reads the same input. Grouped by source state (a normal cell
with 4 nodes: 4 edges leave each input, 3, 2 and 1 leave nodes 0-2), the ``n`` edges of a
group run side by side on one ``[B, H, W, n*C]`` tensor (edge ``r`` owns channels
``r*C .. (r+1)*C``):

* pooling and its affine-free BatchNorm are the same function of the same input on every
  edge of the group: computed once, normalised with the shared batch statistics (in
  evaluation with each edge's own running statistics), and each edge's running
  statistics updated from them as its own BatchNorm would;
* the first convolution of every conv op (the ``depthwise x pointwise`` pair folded into one
  dense kernel, the ``"fused"`` formulation of :class:`jaxfednas.nn.SeparableConv`) of all
  ``n`` edges is one convolution ``C -> n*C`` with the edges' kernels side by side;
* the rest (second separable block of a sep conv, BatchNorm) runs per channel block, and
  ``node_i = sum_j edge_{j->i}`` adds each block to its node, sources in DARTS order.

BatchNorm is per channel, so normalising ``n*C`` channels at once is exactly ``n``
per-edge BatchNorms. Max pooling gets a custom backward (:func:`max_pool_3x3`): XLA:CPU's
``select_and_scatter`` was ~20 % of a cell's training step. BatchNorm in training gets its
closed-form backward (:func:`batch_norm_train`) and the stacked edge variables are permuted
once per cell into source-grouped order (:func:`permute_rows`), so a group's rows are one
slice: both for compile time (a cell has ~40 BatchNorms; autodiff of the forward and
row-by-row slicing emitted most of its operations).

Measured on the 2-core CPU (C=8, 5 cells, batch 32, the MiLeNAS step of
``benchmarks/fednas_search.py``): 1.25 s/step grouped vs 2.24 s with the edge scan and
1.52 s unrolled; XLA compiles ~2.2x as many fusions as the edge scan (compile time in
``benchmarks/RESULTS.md``). Variables (``params`` /
``batch_stats`` ``edges``, or ``input_edges`` / ``node_edges`` in a reduction cell, with a
leading edge axis) are those of the scanned layout, so checkpoints, masks and
:func:`~jaxfednas.search_spaces.darts.search.unroll_variables` are unchanged; results equal the
scanned cell's to float rounding (``tests/integration/search_spaces/test_darts_wide.py``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfednas.nn import batch_norm_train, conv_canonical_grad, dense_conv, use_fast_grad

from .operations import BN_EPS, BN_MOMENTUM, avg_pool_3x3, unbiased_denominator

_DN = ("NHWC", "HWIO", "NHWC")

EDGE_STACKS = ("edges", "input_edges", "node_edges")
"""A search cell's stacked edge variables in the scanned layout (normal cells ``edges``,
reduction cells ``input_edges`` and ``node_edges``); the rest of the cell is its preprocessing."""

# op -> (padding, dilation) of its (first) separable block; the kernel size is the parameters'
_SEPARABLE = {"sep_conv_3x3": (1, 1), "sep_conv_5x5": (2, 1), "dil_conv_3x3": (2, 2), "dil_conv_5x5": (4, 2)}


def edge_slots(table: list[tuple[int, int, int]], reduction: bool) -> dict[int, tuple[str, int]]:
    """Where edge ``e`` (DARTS order) lives in the scanned layout: ``(stack, row)``."""
    if not reduction:
        return {e: ("edges", e) for e, _, _ in table}
    first = [t[0] for t in table if t[1] < 2]
    rest = [t[0] for t in table if t[1] >= 2]
    return {**{e: ("input_edges", r) for r, e in enumerate(first)},
            **{e: ("node_edges", r) for r, e in enumerate(rest)}}


# --- max pooling with a CPU-friendly backward ------------------------------------------

def _windows(xp, stride: int, out_hw):
    b, _, _, c = xp.shape
    ho, wo = out_hw
    return [lax.slice(xp, (0, u, v, 0), (b, u + (ho - 1) * stride + 1, v + (wo - 1) * stride + 1, c),
                      (1, stride, stride, 1)) for u in range(3) for v in range(3)]


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def max_pool_3x3(x, stride: int):
    """3x3 max pooling, padding 1 (padding never wins), NHWC. The gradient goes to the first
    maximum of each window in row-major order -- what ``select_and_scatter`` with ``>=``
    (JAX's own max-pool gradient) does -- computed as nine shifted selects instead."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, stride, stride, 1),
                             ((0, 0), (1, 1), (1, 1), (0, 0)))


def _max_pool_fwd(x, stride):
    y = max_pool_3x3(x, stride)
    return y, (x, y)


def _max_pool_bwd(stride, res, g):
    x, y = res
    _, h, w, _ = x.shape
    ho, wo = y.shape[1:3]
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-jnp.inf)
    first = jnp.full(y.shape, 9, jnp.int8)
    for t, win in reversed(list(enumerate(_windows(xp, stride, (ho, wo))))):
        first = jnp.where(win == y, jnp.int8(t), first)
    dxp = None
    for t in range(9):
        u, v = divmod(t, 3)
        cfg = [(0, 0, 0), (u, h + 2 - u - ((ho - 1) * stride + 1), stride - 1),
               (v, w + 2 - v - ((wo - 1) * stride + 1), stride - 1), (0, 0, 0)]
        term = lax.pad(jnp.where(first == t, g, 0).astype(g.dtype), jnp.zeros((), g.dtype), cfg)
        dxp = term if dxp is None else dxp + term
    return (dxp[:, 1:1 + h, 1:1 + w],)


max_pool_3x3.defvjp(_max_pool_fwd, _max_pool_bwd)


def _conv(x, kernel, strides, padding):
    if use_fast_grad():
        return conv_canonical_grad(x, kernel.astype(x.dtype), strides, padding, (1, 1))
    return lax.conv_general_dilated(x, kernel.astype(x.dtype), strides, padding, dimension_numbers=_DN)


# --- one group of edges leaving the same state -------------------------------------------

class _Group:
    """The ``n`` edges leaving one state: their parameter / statistics rows, op weights,
    stride; collects the edges' new running statistics."""

    def __init__(self, cell, stack: str, start: int, n: int, weights, stride: int):
        self.cell, self.stack, self.start, self.n, self.w, self.stride = cell, stack, start, n, weights, stride

    def rows(self, tree):
        """This group's rows of a stack leaf in source-grouped order (a contiguous slice)."""
        return jax.tree_util.tree_map(lambda a: a[self.start:self.start + self.n], tree)

    def params(self, op):
        return self.rows(self.cell.grouped("params", self.stack, op))

    def channel_weights(self, o):  # [n*C]: edge r's weight of op o on its channel block
        return jnp.repeat(self.w[:, o], self.cell.C)

    def batch_norm(self, y, op, bn, shared: bool = False):
        """BatchNorm (affine-free) of every edge's channel block of ``y`` ([B, H, W, n*C], or
        [B, H, W, C] the same for all edges when ``shared``), running statistics
        ``batch_stats[stack][op][bn]`` (``[op]`` when ``bn`` is None) rows of this group."""
        cell, n, C = self.cell, self.n, self.cell.C
        if not cell.train:
            node = cell.grouped("batch_stats", self.stack, op)
            old = self.rows(node if bn is None else node[bn])
            if shared:
                y = jnp.tile(y, (1, 1, 1, n))
            mean, var = old["mean"].reshape(n * C), old["var"].reshape(n * C)
            return (y - mean) * lax.rsqrt(var + BN_EPS)
        out, mean, var = self._train_stats(y)
        self._record(op, bn, shared, mean, var)
        return jnp.tile(out, (1, 1, 1, n)) if shared else out

    def batch_norms(self, items):
        """:meth:`batch_norm` of each ``(y, op, bn, shared)`` of ``items`` (equal batch and
        spatial shapes). In training the tensors alike in ``shared`` are normalised as one, their
        channels side by side: BatchNorm is per channel, so each gets the same statistics and
        output as alone, from one pair of reductions (forward and backward) instead of one each."""
        if not self.cell.train:
            return [self.batch_norm(*it) for it in items]
        out = [None] * len(items)
        for shared in (False, True):
            idx = [i for i, it in enumerate(items) if it[3] == shared]
            if len(idx) == 1:
                out[idx[0]] = self.batch_norm(*items[idx[0]])
            if len(idx) < 2:
                continue
            ys = [items[i][0] for i in idx]
            normed, mean, var = self._train_stats(jnp.concatenate(ys, axis=-1))
            at = 0
            for i, y in zip(idx, ys):
                c = y.shape[-1]
                _, op, bn, _ = items[i]
                self._record(op, bn, shared, mean[at:at + c], var[at:at + c])
                y = normed[..., at:at + c]
                out[i] = jnp.tile(y, (1, 1, 1, self.n)) if shared else y
                at += c
        return out

    def _train_stats(self, y):
        cell = self.cell
        w = jnp.ones(y.shape[0], y.dtype) if cell.mask is None else cell.mask.astype(y.dtype)
        out, mean, var = batch_norm_train(y, w, BN_EPS)
        if cell.unbiased_running_var:  # PyTorch's running variance: n/(n-1) var
            var = var + var / unbiased_denominator(w.sum() * (y.shape[1] * y.shape[2]))
        return out, mean, var

    def _record(self, op, bn, shared, mean, var):
        n, C = self.n, self.cell.C
        node = self.cell.grouped("batch_stats", self.stack, op)
        old = self.rows(node if bn is None else node[bn])
        rows_mean = jnp.broadcast_to(mean, (n, C)) if shared else mean.reshape(n, C)
        rows_var = jnp.broadcast_to(var, (n, C)) if shared else var.reshape(n, C)
        self.cell.record(self, op, bn, {"mean": BN_MOMENTUM * old["mean"] + (1 - BN_MOMENTUM) * rows_mean,
                                        "var": BN_MOMENTUM * old["var"] + (1 - BN_MOMENTUM) * rows_var})

    def per_edge(self, y, fn):
        """``fn(r, block_r)`` on every edge's channel block, concatenated back."""
        C = self.cell.C
        return jnp.concatenate([fn(r, y[..., r * C:(r + 1) * C]) for r in range(self.n)], axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def permute_rows(a, perm: tuple[int, ...]):
    """``a[perm]`` for a static permutation ``perm`` of ``a``'s rows, whose gradient is the
    inverse permutation (one gather each way; JAX's own gradient of a gather is a
    scatter-add)."""
    return jnp.take(a, np.asarray(perm), axis=0)


def _permute_fwd(a, perm):
    return permute_rows(a, perm), None


def _permute_bwd(perm, _, g):
    return (jnp.take(g, np.argsort(perm), axis=0),)


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _fused(q):
    """``[n, k, k, 1, C]`` depthwise x ``[n, 1, 1, C, D]`` pointwise -> ``[n, k, k, C, D]``."""
    return q["depthwise"][:, :, :, 0, :, None] * q["pointwise"][:, 0, 0][:, None, None]


def _side_by_side(kernels):
    """``[n, kh, kw, C, D]`` -> ``[kh, kw, C, n*D]`` (edge r's outputs at r*D .. (r+1)*D)."""
    n, kh, kw, c, d = kernels.shape
    return kernels.transpose(1, 2, 3, 0, 4).reshape(kh, kw, c, n * d)


def _per_edge_conv(g: _Group, y, kernels, strides, padding):
    """Edge ``r``'s kernel ``kernels[r]`` (``[n, kh, kw, C, C]``) on its channel block of ``y``.
    On CPU one convolution per edge (XLA:CPU runs grouped convolutions slowly); elsewhere one
    grouped convolution for the whole group (``feature_group_count=n``: the edges' kernels side
    by side are its kernel), one launch instead of ``n`` -- and as many fewer in the backward."""
    if use_fast_grad():
        return g.per_edge(y, lambda r, blk: _conv(blk, kernels[r], strides, padding))
    return lax.conv_general_dilated(y, _side_by_side(kernels).astype(y.dtype), strides, padding,
                                    dimension_numbers=_DN, feature_group_count=g.n)


def _first(g: _Group, name: str, x, xr):
    """Op ``name`` on every edge of ``g`` up to its first BatchNorm: ``(y, None)`` for an op
    without one (the identity skip), else ``(y, (op, bn, shared))``, the tensor that
    BatchNorm normalises and where its statistics go (:meth:`_Group.batch_norm`)."""
    s, n, C = g.stride, g.n, g.cell.C
    if name in ("max_pool_3x3", "avg_pool_3x3"):
        pool = max_pool_3x3 if name == "max_pool_3x3" else avg_pool_3x3
        return pool(x, s), (f"{name}_bn", None, True)
    if name == "skip_connect":
        if s == 1:
            return jnp.tile(x, (1, 1, 1, n)), None
        p = g.params(name)  # FactorizedReduce: two stride-2 1x1 convs on x and x shifted by one pixel
        a = _conv(xr, _side_by_side(p["Conv_0"]["kernel"]), (2, 2), "VALID")
        b = _conv(xr[:, 1:, 1:, :], _side_by_side(p["Conv_1"]["kernel"]), (2, 2), "VALID")
        sh = a.shape[:3]
        y = jnp.concatenate([a.reshape(sh + (n, C // 2)), b.reshape(sh + (n, C // 2))], -1).reshape(sh + (n * C,))
        return y, (name, "BatchNorm_0", False)
    if name in _SEPARABLE:
        pad, dil = _SEPARABLE[name]
        return dense_conv(xr, _side_by_side(_fused(g.params(name)["SeparableConv_0"])), s, pad, dil), \
            (name, "BatchNorm_0", False)
    if name == "conv_7x1_1x7":
        p = g.params(name)
        y = _conv(xr, _side_by_side(p["Conv_0"]["kernel"]), (1, s), ((0, 0), (3, 3)))
        return _per_edge_conv(g, y, p["Conv_1"]["kernel"], (s, 1), ((3, 3), (0, 0))), (name, "BatchNorm_0", False)
    raise ValueError(f"unknown op {name!r}")


def _second(g: _Group, name: str, y):
    """A sep conv's second separable block on its normalised first one, up to BatchNorm_1."""
    pad, _ = _SEPARABLE[name]
    return _per_edge_conv(g, jax.nn.relu(y), _fused(g.params(name)["SeparableConv_1"]), (1, 1), ((pad, pad), (pad, pad)))


def _op(g: _Group, name: str, x, xr):
    """Op ``name`` on every edge of ``g``: ``[B, H', W', n*C]`` (one op at a time: CPU)."""
    y, bn = _first(g, name, x, xr)
    if bn is not None:
        y = g.batch_norm(y, *bn)
    if name.startswith("sep_conv"):
        y = g.batch_norm(_second(g, name, y), name, "BatchNorm_1")
    return y


def _ops_joint(g: _Group, names, x, xr) -> dict:
    """Every op of ``names`` on every edge of ``g``, their BatchNorms joint
    (:meth:`_Group.batch_norms`): the first BatchNorm of every op in one, then the second of
    the sep convs in one (GPUs: a launch per kind of BatchNorm instead of one per op)."""
    firsts = {k: _first(g, k, x, xr) for k in names}
    pending = [k for k in names if firsts[k][1] is not None]
    outs = {k: y for k, (y, bn) in firsts.items() if bn is None}
    outs.update(zip(pending, g.batch_norms([(firsts[k][0], *firsts[k][1]) for k in pending])))
    seps = [k for k in names if k.startswith("sep_conv")]
    outs.update(zip(seps, g.batch_norms([(_second(g, k, outs[k]), k, "BatchNorm_1", False) for k in seps])))
    return outs


def _thaw(tree):
    """A nested dict copy (so rows can be replaced without touching the input)."""
    return {k: _thaw(v) for k, v in tree.items()} if hasattr(tree, "items") else tree


class WideCell:
    """The edges of one search cell, grouped by source (see the module docstring).

    ``params`` / ``stats``: the cell's ``params`` / ``batch_stats`` collections (scanned
    layout); ``run(s0, s1, weights)`` -> ``(output, new batch_stats stacks or None)``.
    """

    def __init__(self, C, reduction, steps, multiplier, primitives, table, params, stats, train, mask,
                 unbiased_running_var: bool = False):
        self.C, self.reduction, self.steps, self.multiplier = C, reduction, steps, multiplier
        self.primitives, self.table = tuple(primitives), table
        self.params, self.stats, self.train, self.mask = params, stats, train, mask
        self.unbiased_running_var = unbiased_running_var
        self.slots = edge_slots(table, reduction)
        # the source groups: (source state, stack, first row in grouped order, edges (e, node))
        self.groups, order = [], {}
        for j in range(steps + 2):
            edges = [(e, i) for e, src, i in table if src == j]
            if edges:
                stack = self.slots[edges[0][0]][0]
                rows = order.setdefault(stack, [])
                self.groups.append((j, stack, len(rows), edges))
                rows.extend(self.slots[e][1] for e, _ in edges)
        self.perm = {stack: tuple(rows) for stack, rows in order.items()}
        self._grouped: dict = {}
        self._new: dict = {}

    def grouped(self, collection: str, stack: str, op: str):
        """``collection[stack][op]`` with its rows permuted once into source-grouped order, so
        that every group's rows are one slice."""
        key = (collection, stack, op)
        if key not in self._grouped:
            tree = (self.params if collection == "params" else self.stats)[stack][op]
            self._grouped[key] = jax.tree_util.tree_map(lambda a: permute_rows(a, self.perm[stack]), tree)
        return self._grouped[key]

    def record(self, g: _Group, op, bn, rows):
        self._new.setdefault((g.stack, op, bn), {})[g.start] = (g.n, rows)

    def new_stats(self):
        """The cell's updated ``batch_stats`` stacks (every BatchNorm row of every edge)."""
        if not self.train:
            return None
        out = _thaw({k: v for k, v in self.stats.items() if k in EDGE_STACKS})
        for (stack, op, bn), parts in self._new.items():
            node = out[stack][op]
            old = self.grouped("batch_stats", stack, op)
            old = old if bn is None else old[bn]
            target = node if bn is None else node[bn]
            inverse = np.argsort(self.perm[stack])
            for leaf in ("mean", "var"):  # groups in grouped order (a row no group updated keeps its value)
                pieces, r = [], 0
                while r < old[leaf].shape[0]:
                    n, rows = parts.get(r, (1, {leaf: old[leaf][r:r + 1]}))
                    pieces.append(rows[leaf])
                    r += n
                target[leaf] = jnp.take(jnp.concatenate(pieces), inverse, axis=0)
        return out

    def run(self, s0, s1, weights):
        states, nodes = [s0, s1], [None] * self.steps
        for j, stack, start, edges in self.groups:
            while len(states) <= j:
                states.append(nodes[len(states) - 2])
            g = _Group(self, stack, start, len(edges), weights[np.asarray([e for e, _ in edges])],
                       2 if self.reduction and j < 2 else 1)
            x = states[j]
            xr = jax.nn.relu(x)
            out = None
            names = [k for k in self.primitives if k != "none"]
            joint = None if use_fast_grad() else _ops_joint(g, names, x, xr)  # CPU: one op at a time
            for o, name in enumerate(self.primitives):
                if name == "none":
                    continue
                y = (_op(g, name, x, xr) if joint is None else joint[name]) * g.channel_weights(o)
                out = y if out is None else out + y
            if out is None:  # only 'none' leaves this state
                s = g.stride
                out = jnp.zeros((x.shape[0], -(-x.shape[1] // s), -(-x.shape[2] // s), g.n * self.C), x.dtype)
            C = self.C
            for r, (_, i) in enumerate(edges):
                y = out[..., r * C:(r + 1) * C]
                nodes[i] = y if nodes[i] is None else nodes[i] + y
        return jnp.concatenate(nodes[self.steps - self.multiplier:], axis=-1), self.new_stats()
