"""The DARTS search supernet (Liu et al., arXiv:1806.09055, Sec. 2.1-2.2, Eq. 2).

Every edge of a cell is a :class:`MixedOp`, ``sum_o w_o * o(x)`` with
``w = softmax(alpha_edge)`` (DARTS Eq. 2). One ``alpha`` matrix of shape
``[num_edges, |O|]`` is shared by all normal cells and one by all reduction cells;
both live in the ``"arch"`` variable collection so weights and architecture get
separate optimizers::

    net = DartsSearchNetwork(C=16, num_classes=10, layers=8)
    variables = net.init({"params": key}, x, train=False)   # params, arch, batch_stats
    logits, updates = net.apply(variables, x, train=True, mutable=["batch_stats"])
    grad_arch = jax.grad(lambda arch: loss(net.apply({**variables, "arch": arch}, x,
                         train=True, mutable=["batch_stats"])[0]))(variables["arch"])

``arch_weights={"normal": w_n, "reduce": w_r}`` replaces ``softmax(alpha)`` by given
op weights (one-hot or masked subnets with static shapes: SPIDER, PerFedRLNAS, DFNAS).

Compile time (XLA compiles a loop body once, however often it runs):

* inside a cell, the edges run as ``lax.scan`` s over stacked per-edge parameters -- a
  normal cell is one scan over its 14 edges in DARTS order, a reduction cell one scan
  over the 8 stride-2 edges leaving its inputs and one over the 6 edges between nodes
  (``scan_edges``; parameters ``edges`` / ``input_edges`` / ``node_edges`` with a
  leading edge axis);
* normal cells of a stage whose input shapes repeat (all but the first one or two of a
  stage: the first cell after the stem sees the stem's ``3C`` channels, the first after
  a reduction has a FactorizedReduce on ``s0``) run as one ``nn.scan`` over stacked
  per-cell parameters (``scan_cells``; ``cells_<a>_<b>`` for cells ``a..b``, the others
  are ``cell_<i>``).

Measured (``benchmarks/studies/darts_ops.py``, 2-core CPU, C=16, batch 64): XLA compile of
``jit(value_and_grad)`` 38 s for 8 cells vs 222 s fully unrolled, 58 s for 14 or 20
cells. ``scan_cells=False, scan_edges=False`` unrolls everything (``cell_<i>`` /
``edge_<k>``); :func:`unroll_variables` maps variables to that layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfednas.nn import (Conv, kernel_grad_gate, kernel_grads_if, resolve_depthwise_impl, target_platform,
                          use_fast_grad)

from .operations import (NORMS, PRIMITIVE_SETS, PRIMITIVES, batch_norm, FactorizedReduce, make_op, ReLUConvBN,
                         validate_primitives)
from .wide import EDGE_STACKS, WideCell


def num_edges(steps: int = 4) -> int:
    """Edges per cell: node i has 2 + i inputs (14 for 4 steps)."""
    return sum(2 + i for i in range(steps))


@dataclass(frozen=True)
class CellSpec:
    """Static description of cell ``index`` in a DARTS-style network."""

    index: int
    C: int  # channels of each node inside the cell
    reduction: bool
    reduction_prev: bool
    C_prev_prev: int  # channels of the s0 input
    C_prev: int  # channels of the s1 input

    @property
    def signature(self) -> tuple:
        return (self.C, self.reduction, self.reduction_prev, self.C_prev_prev, self.C_prev)


def reduction_indices(layers: int) -> tuple[int, ...]:
    return tuple(sorted({layers // 3, 2 * layers // 3}))


def cell_plan(C: int, layers: int, multiplier: int, stem_multiplier: int,
              reduce_multiplier: int | None = None) -> list[CellSpec]:
    """Channels and reduction flags of every cell (reductions at layers//3, 2*layers//3).

    A normal cell outputs ``multiplier * C`` channels, a reduction cell
    ``reduce_multiplier * C`` (default: ``multiplier``).
    """
    reduce_multiplier = multiplier if reduce_multiplier is None else reduce_multiplier
    red = reduction_indices(layers)
    c_pp = c_p = stem_multiplier * C
    c_curr, reduction_prev, plan = C, False, []
    for i in range(layers):
        reduction = i in red
        if reduction:
            c_curr *= 2
        plan.append(CellSpec(i, c_curr, reduction, reduction_prev, c_pp, c_p))
        reduction_prev = reduction
        c_pp, c_p = c_p, (reduce_multiplier if reduction else multiplier) * c_curr
    return plan


def cell_groups(plan: list[CellSpec], scan_cells: bool) -> list[list[CellSpec]]:
    """Consecutive runs of identical normal cells (one group per cell when not scanning)."""
    groups: list[list[CellSpec]] = []
    for spec in plan:
        if (scan_cells and groups and not spec.reduction
                and groups[-1][-1].signature == spec.signature):
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


def group_name(group: list[CellSpec]) -> str:
    a, b = group[0].index, group[-1].index
    return f"cell_{a}" if a == b else f"cells_{a}_{b}"


def unstack_scanned(tree: dict) -> dict:
    """Rewrite a variable collection from the scanned layout to the unrolled one.

    ``{"cells_3_5": leaves[3, ...]}`` becomes ``{"cell_3": ..., "cell_4": ..., "cell_5": ...}``;
    everything else is kept as is.
    """
    out = {}
    for key, sub in tree.items():
        if key.startswith("cells_"):
            a, b = (int(t) for t in key.split("_")[1:])
            for j, i in enumerate(range(a, b + 1)):
                out[f"cell_{i}"] = jax.tree_util.tree_map(lambda v, j=j: v[j], sub)
        else:
            out[key] = sub
    return out


def run_cells(
    groups: list[list[CellSpec]],
    make_cell: Callable[[CellSpec, str], nn.Module],
    call_cell: Callable[[nn.Module, Any, Any], Any],
    s0,
    s1,
    after_cell: Callable[[int, Any], None] | None = None,
    split_rngs: dict | None = None,
):
    """Thread ``(s0, s1) <- (s1, cell(s0, s1))`` through the cells, scanning repeated ones.

    ``make_cell(spec, name)`` builds a cell module; ``call_cell(cell, s0, s1)`` runs it.
    ``after_cell(i, s1)`` sees the output of cell ``i`` for the last cell ``i`` of every
    group (every reduction cell is a group of its own; e.g. an auxiliary head).
    """
    for group in groups:
        cell = make_cell(group[0], group_name(group))
        if len(group) == 1:
            s0, s1 = s1, call_cell(cell, s0, s1)
            if after_cell is not None:
                after_cell(group[0].index, s1)
            continue

        def body(mdl, carry, _):
            a, b = carry
            return (b, call_cell(mdl, a, b)), None

        scan = nn.scan(
            body,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs=split_rngs or {"params": True},
            length=len(group),
        )
        (s0, s1), _ = scan(cell, (s0, s1), None)
        if after_cell is not None:
            after_cell(group[-1].index, s1)
    return s0, s1


class MixedOp(nn.Module):
    """``sum_o weights[o] * o(x)`` over ``primitives``; pooling ops are followed by BN(affine=False).

    ``none`` contributes exactly zero and is skipped (its weight still enters the
    softmax normaliser of the caller). With ``single_path`` every op runs under a
    ``cond`` on ``weights[o] != 0``: a one-hot (or 0/1) ``weights`` then computes only the
    ops it keeps — their forward, backward and BatchNorm statistics; the others' stay
    untouched — as long as the caller does not ``vmap`` over different weights (which
    turns the cond into computing both sides).
    """

    C: int
    stride: int
    primitives: tuple = PRIMITIVES
    dw_impl: str | None = None
    norm: str = "batch"
    single_path: bool = False
    unbiased_running_var: bool = False  # its BatchNorms' running-variance rule (operations.batch_norm)

    @nn.compact
    def __call__(self, x, weights, train: bool = False, mask=None):
        s = self.stride
        shape = (x.shape[0], -(-x.shape[1] // s), -(-x.shape[2] // s), self.C)
        out = None
        for k, name in enumerate(self.primitives):
            if name == "none":
                continue

            def run(mdl, h, name=name):
                y = make_op(name, self.C, s, False, dw_impl=self.dw_impl, module_name=name, norm=self.norm,
                            unbiased_running_var=self.unbiased_running_var)(h, train, mask)
                if "pool" in name:
                    y = batch_norm(y, train, mask, affine=False, name=f"{name}_bn", norm=self.norm,
                                   unbiased_running_var=self.unbiased_running_var)
                return y

            if self.single_path and not self.is_initializing():
                y = nn.cond(weights[k] != 0, run, lambda mdl, h: jnp.zeros(shape, h.dtype), self, x)
            else:
                y = run(self, x)
            y = weights[k] * y
            out = y if out is None else out + y
        if out is None:  # only 'none' on this edge
            out = jnp.zeros(shape, x.dtype)
        return out


GROUP_EDGES_MIN_PIXELS = 16 * 16
"""``group_edges=None`` groups a network's edges on CPU from this input size on (on
accelerators at every size): on the 8x8
digits the grouped cell's longer compile outweighs its faster steps (the main job, 10
rounds: 4 min 34 s grouped vs 3 min 18 s with the edge scan); on 32x32 it pays after
a few dozen steps (config (a): +60 s compile, -1.5 s per step)."""


def small_images_ungrouped(pixels: int) -> bool:
    """Whether ``group_edges=None`` keeps the edge scan for images of ``pixels`` pixels: on CPU
    below :data:`GROUP_EDGES_MIN_PIXELS` (a compile-time trade-off); never on accelerators,
    where the launches the grouped cell saves count at every size."""
    return pixels < GROUP_EDGES_MIN_PIXELS and target_platform() == "cpu"


def group_edges_unsupported(scan_edges: bool, norm: str, single_path: bool, dw_impl: str | None) -> str:
    """Why edges cannot run grouped by source (:mod:`.wide`), or ``""`` when they can."""
    if not scan_edges:
        return "scan_edges=True (the grouped form reads the scanned variables)"
    if norm != "batch":
        return f"norm='batch' (got {norm!r})"
    if single_path:
        return "single_path=False (single-path subnets run one op per edge under a cond)"
    if dw_impl is not None and resolve_depthwise_impl(dw_impl) != "fused":
        return f"the 'fused' depthwise formulation (got dw_impl={dw_impl!r})"
    return ""


def edges_run_grouped(group_edges: bool | None, scan_edges: bool, norm: str, single_path: bool,
                      dw_impl: str | None) -> bool:
    """Whether a cell with these settings runs its edges grouped by source: ``group_edges``
    True (``ValueError`` where :func:`group_edges_unsupported` says why it cannot), or None
    (auto) wherever it applies, on every backend (the grouped cell always runs the ``"fused"``
    formulation; an explicit other ``dw_impl`` keeps the edge scan). On CPU it makes steps
    ~2x faster at 32x32; on a GPU it launches ~9x fewer kernels than the edge scan with
    grouped depthwise convolutions (``benchmarks/kernels.py``; the step is launch-bound)."""
    why = group_edges_unsupported(scan_edges, norm, single_path, dw_impl)
    if group_edges and why:
        raise ValueError(f"group_edges=True needs {why}")
    return bool(not why and (group_edges or group_edges is None))


def edge_table(steps: int) -> list[tuple[int, int, int]]:
    """``(edge, src, node)`` for every edge in DARTS order; ``src`` indexes the states
    (0, 1 = cell inputs, 2 + j = node j)."""
    out, e = [], 0
    for i in range(steps):
        for j in range(2 + i):
            out.append((e, j, i))
            e += 1
    return out


def _scan_edges(mixed: nn.Module, buf, weights, src, dst, run):
    """``buf[dst[e]] += run(mixed_e, buf_in[src[e]], weights[e])`` for each e, one compiled body.

    ``buf`` is either a single state buffer (read and written) or a pair
    ``(inputs, nodes)`` (read from ``inputs``, written to ``nodes``).
    """
    split = isinstance(buf, tuple)

    def body(mdl, carry, xs):
        w, i_src, i_dst = xs
        source = inputs if split else carry
        h = jax.lax.dynamic_index_in_dim(source, i_src, keepdims=False)
        y = run(mdl, h, w)
        cur = jax.lax.dynamic_index_in_dim(carry, i_dst, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(carry, cur + y, i_dst, 0), None

    inputs, carry = buf if split else (None, buf)
    scan = nn.scan(body, variable_axes={"params": 0, "batch_stats": 0}, split_rngs={"params": True},
                   length=len(src))
    carry, _ = scan(mixed, carry, (weights, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)))
    return carry


@partial(jax.jit, static_argnums=range(9))
def _wide_cell(C, reduction, steps, multiplier, primitives, table, train, fast, unbiased, params, stats, s0, s1,
               weights, mask, gate):
    """A grouped cell's edges as one jitted function of its edge variables and inputs: the
    cells of a network whose edges have equal shapes (the normal cells of a stage; their
    preprocessing differs) and the two passes of a MiLeNAS step share one trace, its
    linearisation and its lowering (XLA inlines the calls: the same program). Config (b),
    8 cells: trace + lower 42 -> 19 s (``benchmarks/fednas_search.py --parts compile``).
    ``gate``: the caller's :func:`~jaxfednas.nn.kernel_grad_gate`, passed in so that it
    belongs to this trace. Every trace-time switch the cell reads is an argument, so that it
    is part of the cache key: ``fast`` (the backend's gradient form) and ``unbiased`` (the
    cell's BatchNorm running-variance rule, its ``unbiased_running_var`` field)."""
    del fast  # part of the cache key only
    with kernel_grads_if(gate):
        return WideCell(C, reduction, steps, multiplier, primitives, list(table), params, stats, train, mask,
                        unbiased).run(s0, s1, weights)


class SearchCell(nn.Module):
    """A search cell: preprocess both inputs to ``C`` channels, ``steps`` nodes of mixed edges.

    ``weights`` is ``[num_edges(steps), |primitives|]``; edges of node i come from all
    earlier states in order (inputs s0, s1, then nodes 0..i-1). Output: concat of the
    last ``multiplier`` nodes on channels.

    With ``scan_edges`` (default) the edges run as ``lax.scan`` s over stacked per-edge
    parameters, so XLA compiles one mixed op per cell instead of one per edge: a normal
    cell scans all its edges in DARTS order (``params["edges"]``, leading axis = edge);
    a reduction cell first scans the stride-2 edges leaving the two inputs
    (``input_edges``, node-major) and then the edges between nodes (``node_edges``).
    ``scan_edges=False`` unrolls them as ``edge_<k>`` (see :func:`unroll_variables`).
    ``norm`` is the normalisation of every op and preprocessing layer (see
    :mod:`.operations`).

    ``group_edges`` runs the edges grouped by the state they leave (:mod:`.wide`: the same
    variables as ``scan_edges``, pooling once per source, the first convolution of all
    edges of a source as one wide convolution, a custom max-pool backward) instead of the
    edge scan. ``None`` (default) picks it where it applies: ``dw_impl`` None or
    ``"fused"`` (the grouped cell runs the fused formulation), BatchNorm, ``scan_edges`` and
    not ``single_path``; on every backend (:func:`edges_run_grouped`).
    """

    C: int
    reduction: bool
    reduction_prev: bool
    steps: int = 4
    multiplier: int = 4
    primitives: tuple = PRIMITIVES
    dw_impl: str | None = None
    scan_edges: bool = True
    norm: str = "batch"
    single_path: bool = False
    group_edges: bool | None = None
    unbiased_running_var: bool = False  # its BatchNorms' running-variance rule (operations.batch_norm)

    def _grouped(self) -> bool:
        return edges_run_grouped(self.group_edges, self.scan_edges, self.norm, self.single_path, self.dw_impl)

    @nn.compact
    def __call__(self, s0, s1, weights, train: bool = False, mask=None):
        if self.reduction_prev:
            s0 = FactorizedReduce(self.C, affine=False, norm=self.norm, unbiased_running_var=self.unbiased_running_var,
                                  name="preprocess0")(s0, train, mask)
        else:
            s0 = ReLUConvBN(self.C, 1, 1, 0, affine=False, norm=self.norm,
                            unbiased_running_var=self.unbiased_running_var, name="preprocess0")(s0, train, mask)
        s1 = ReLUConvBN(self.C, 1, 1, 0, affine=False, norm=self.norm, unbiased_running_var=self.unbiased_running_var,
                        name="preprocess1")(s1, train, mask)
        table = edge_table(self.steps)
        if len(weights) != len(table):
            raise ValueError(f"weights must have {len(table)} rows (one per edge), got {len(weights)}")

        if self._grouped() and not self.is_initializing():
            edges = lambda col: {k: v for k, v in self.variables.get(col, {}).items() if k in EDGE_STACKS}  # noqa: E731
            out, new_stats = _wide_cell(self.C, self.reduction, self.steps, self.multiplier, tuple(self.primitives),
                                        tuple(table), bool(train), use_fast_grad(), bool(self.unbiased_running_var),
                                        edges("params"),
                                        edges("batch_stats"), s0, s1, weights, mask, kernel_grad_gate())
            if new_stats is not None and self.is_mutable_collection("batch_stats"):
                for stack, value in new_stats.items():
                    self.put_variable("batch_stats", stack, value)
            return out

        def mixed(stride, name):
            return MixedOp(self.C, stride, self.primitives, self.dw_impl, norm=self.norm, single_path=self.single_path,
                           unbiased_running_var=self.unbiased_running_var, name=name)

        def run(mdl, h, w):
            return mdl(h, w, train, mask)

        if not self.scan_edges:
            states = [s0, s1]
            for i in range(self.steps):
                node = None
                for e, j, _ in (t for t in table if t[2] == i):
                    stride = 2 if self.reduction and j < 2 else 1
                    y = run(mixed(stride, f"edge_{e}"), states[j], weights[e])
                    node = y if node is None else node + y
                states.append(node)
            return jnp.concatenate(states[-self.multiplier:], axis=-1)

        if not self.reduction:
            zeros = jnp.zeros((self.steps,) + s1.shape, s1.dtype)
            buf = jnp.concatenate([jnp.stack([s0, s1]), zeros])
            buf = _scan_edges(mixed(1, "edges"), buf, weights, [t[1] for t in table],
                              [2 + t[2] for t in table], run)
            nodes = buf[2:]
        else:
            first = [t for t in table if t[1] < 2]
            rest = [t for t in table if t[1] >= 2]
            probe = jnp.zeros_like(s0[:, ::2, ::2, :])
            nodes = jnp.zeros((self.steps,) + probe.shape, s0.dtype)
            nodes = _scan_edges(mixed(2, "input_edges"), (jnp.stack([s0, s1]), nodes),
                                weights[jnp.array([t[0] for t in first])], [t[1] for t in first],
                                [t[2] for t in first], run)
            if rest:
                nodes = _scan_edges(mixed(1, "node_edges"), nodes, weights[jnp.array([t[0] for t in rest])],
                                    [t[1] - 2 for t in rest], [t[2] for t in rest], run)
        return jnp.concatenate(list(nodes[self.steps - self.multiplier:]), axis=-1)


def unroll_variables(tree: dict) -> dict:
    """Rewrite a variable collection (``params`` or ``batch_stats``) from the scanned layout
    (cells ``cells_<a>_<b>``, edges ``edges`` / ``input_edges`` / ``node_edges``) to the
    unrolled one (``cell_<i>`` and ``edge_<k>``), e.g. to compare with ``scan_cells=False,
    scan_edges=False`` or to read one edge's weights.
    """
    def cell(sub: dict) -> dict:
        out = {k: v for k, v in sub.items() if k not in EDGE_STACKS}
        leaves = lambda t: jax.tree_util.tree_leaves(t)  # noqa: E731
        if "edges" in sub:
            n = leaves(sub["edges"])[0].shape[0] if leaves(sub["edges"]) else 0
            order = list(range(n))
            stacks = [("edges", order)]
        elif "input_edges" in sub:
            n_in = leaves(sub["input_edges"])[0].shape[0] if leaves(sub["input_edges"]) else 0
            table = edge_table(n_in // 2)
            stacks = [("input_edges", [t[0] for t in table if t[1] < 2]),
                      ("node_edges", [t[0] for t in table if t[1] >= 2])]
        else:
            return out
        for key, order in stacks:
            if key not in sub:
                continue
            for j, e in enumerate(order):
                out[f"edge_{e}"] = jax.tree_util.tree_map(lambda v, j=j: v[j], sub[key])
        return out

    out = {}
    for key, sub in unstack_scanned(tree).items():
        out[key] = cell(sub) if key.startswith("cell_") else sub
    return out


def _alpha_init(rng_module: nn.Module, shape):
    return lambda: 1e-3 * jax.random.normal(rng_module.make_rng("params"), shape, jnp.float32)


class DartsSearchNetwork(nn.Module):
    """DARTS supernet for CIFAR-like NHWC images (``Network`` of the DARTS search code).

    ``C`` initial channels (16), ``layers`` cells (8) with reductions at
    ``layers//3`` and ``2*layers//3`` (channels double there). Only the stem BN is
    affine. Variables: ``params``, ``arch`` (``alphas_normal``, ``alphas_reduce``, each
    ``[num_edges(steps), len(primitives)]``, init ``1e-3 * N(0, 1)``), ``batch_stats``.

    ``norm="batch"`` (default) is DARTS' search network. ``norm="group"`` / ``"layer"``
    replace every BatchNorm, the stem's included (affine there, affine-free elsewhere
    as in DARTS), by a per-example GroupNorm: an example's output then does not depend
    on the other examples of its batch, which per-example clipping in differentially
    private search needs (DP-FNAS; a documented deviation from the papers' network).
    Such a network has no ``batch_stats`` and behaves the same in training and
    evaluation mode.

    ``unbiased_running_var=True`` updates every BatchNorm's running variance in training
    with the unbiased batch variance (PyTorch's rule; :func:`.operations.batch_norm`),
    False (default) with the biased one (Flax's); the forward and gradients are the same.

    ``single_path=True`` puts every candidate op under a ``cond`` on its weight (see
    :class:`MixedOp`): with one-hot ``arch_weights`` only the chosen ops run (PerFedRLNAS's
    sampled subnets); same variables, same results.

    ``group_edges`` runs every cell's edges grouped by source (:mod:`.wide`); same
    variables, same results to float rounding. ``None`` (default): where it applies; on CPU
    only for inputs of at least ``GROUP_EDGES_MIN_PIXELS`` (16x16) pixels.
    """

    C: int
    num_classes: int
    layers: int
    steps: int = 4
    multiplier: int = 4
    stem_multiplier: int = 3
    primitives: tuple = PRIMITIVES
    dw_impl: str | None = None
    scan_cells: bool = True
    scan_edges: bool = True
    norm: str = "batch"
    single_path: bool = False
    group_edges: bool | None = None
    unbiased_running_var: bool = False

    def runs_grouped(self, image_shape) -> bool:
        """Whether this network's cells run grouped by source (:mod:`.wide`) on images of
        ``image_shape`` (``(H, W, C)``) on the default backend (see ``group_edges``)."""
        if self.group_edges is None and small_images_ungrouped(image_shape[0] * image_shape[1]):
            return False
        return edges_run_grouped(self.group_edges, self.scan_edges, self.norm, self.single_path, self.dw_impl)

    def _check(self):
        for field, v, lo in (("C", self.C, 1), ("num_classes", self.num_classes, 1), ("layers", self.layers, 1),
                             ("steps", self.steps, 1), ("stem_multiplier", self.stem_multiplier, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{field} must be an int >= {lo}, got {v!r}")
        if not 1 <= self.multiplier <= self.steps:
            raise ValueError(f"multiplier must be in [1, steps={self.steps}], got {self.multiplier}")
        if self.C % 2:
            raise ValueError(f"C must be even (FactorizedReduce splits channels in two), got {self.C}")
        validate_primitives(self.primitives)
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, arch_weights=None):
        self._check()
        primitives = tuple(self.primitives)
        shape = (num_edges(self.steps), len(primitives))
        a_normal = self.variable("arch", "alphas_normal", _alpha_init(self, shape)).value
        a_reduce = self.variable("arch", "alphas_reduce", _alpha_init(self, shape)).value
        if arch_weights is None:
            w_normal, w_reduce = jax.nn.softmax(a_normal, axis=-1), jax.nn.softmax(a_reduce, axis=-1)
        else:
            w_normal, w_reduce = jnp.asarray(arch_weights["normal"]), jnp.asarray(arch_weights["reduce"])
            for name, w in (("normal", w_normal), ("reduce", w_reduce)):
                if w.shape != shape:
                    raise ValueError(f"arch_weights[{name!r}] must have shape {shape}, got {w.shape}")

        if x.ndim != 4:
            raise ValueError(f"x must be NHWC images, got shape {x.shape}")
        c_stem = self.stem_multiplier * self.C
        s = Conv(c_stem, (3, 3), padding=((1, 1), (1, 1)), use_bias=False, name="stem_conv")(x)
        s = batch_norm(s, train, mask, affine=True, name="stem_bn", norm=self.norm,
                       unbiased_running_var=self.unbiased_running_var)

        plan = cell_plan(self.C, self.layers, self.multiplier, self.stem_multiplier)

        group_edges = self.group_edges  # auto (None): the cells decide (on CPU for images of 16x16 pixels and more)
        if group_edges is None and small_images_ungrouped(x.shape[1] * x.shape[2]):
            group_edges = False

        def make_cell(spec: CellSpec, name: str):
            return SearchCell(spec.C, spec.reduction, spec.reduction_prev, self.steps, self.multiplier,
                              primitives, self.dw_impl, self.scan_edges, norm=self.norm,
                              single_path=self.single_path, group_edges=group_edges,
                              unbiased_running_var=self.unbiased_running_var, name=name)

        def call_cell(cell, s0, s1):
            w = w_reduce if cell.reduction else w_normal
            return cell(s0, s1, w, train, mask)

        _, s1 = run_cells(cell_groups(plan, self.scan_cells), make_cell, call_cell, s, s)
        feat = jnp.mean(s1, axis=(1, 2))
        return nn.Dense(self.num_classes, name="classifier")(feat)


def supernet_of(cfg: Any, num_classes: int, **options) -> DartsSearchNetwork:
    """The supernet an algorithm config describes: ``cfg.C``, ``cfg.layers``, ``cfg.nodes``
    and ``cfg.primitives`` (a name in ``PRIMITIVE_SETS``; the fields of
    :class:`~jaxfednas.search_spaces.darts.config.DartsSpaceConfig`), every intermediate node
    concatenated as in DARTS (``multiplier = steps``); ``options`` pass on the rest
    (``scan_edges``, ``norm``, ...); a ``cfg.group_edges`` of ``"auto"`` / ``"on"`` / ``"off"``
    becomes ``group_edges`` None / True / False, a ``cfg.dw_impl`` other than ``"auto"`` the
    depthwise formulation (``auto``: :func:`jaxfednas.nn.default_depthwise_impl`). One
    constructor for FedNAS, DP-FNAS and SPIDER."""
    if "group_edges" not in options and hasattr(cfg, "group_edges"):
        options["group_edges"] = {"auto": None, "on": True, "off": False}[cfg.group_edges]
    if "dw_impl" not in options and getattr(cfg, "dw_impl", "auto") != "auto":
        options["dw_impl"] = cfg.dw_impl
    return DartsSearchNetwork(C=cfg.C, num_classes=num_classes, layers=cfg.layers, steps=cfg.nodes,
                              multiplier=cfg.nodes, primitives=PRIMITIVE_SETS[cfg.primitives], **options)
