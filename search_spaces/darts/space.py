"""The DARTS supernet as a choice space (:mod:`jaxfednas.search_spaces.choice`): one dimension per
edge of each cell type, its choices the candidate ops — PerFedRLNAS's DARTS space.

A subnet keeps exactly one op on every edge (all ``2 × E`` edges, no top-2 pruning while
searching; ``none`` may be chosen where it is a candidate, as in the authors' code,
docs/authors_code.md §4.1), the same op for every cell of a type. It runs as the
supernet under a one-hot mask (:class:`~jaxfednas.search_spaces.darts.masks.Subnet`): one compiled
program serves every subnet. Built on a supernet with ``single_path=True`` every op sits
under a ``cond`` on its mask entry, so a client mapped on its own computes only its
chosen op per edge (forward, backward, BatchNorm statistics); with ``single_path=False``
the other ops are computed and multiplied by zero.

Costs are exact and additive over edges: a subnet's parameters, multiply-adds and
convolution outputs are those of the always-present parts (stem, preprocessing,
classifier) plus, for every dimension, those of the chosen op in every cell of that
type. The tables are read once off the network itself (parameters: the variable mask,
linear in the choice; multiply-adds and outputs: :func:`jaxfednas.cost.count_macs` /
:func:`~jaxfednas.cost.count_conv_outputs` of each op at its cell's shape).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.cost import count_conv_outputs, count_macs
from jaxfednas.search_spaces.choice import Dimension, SubnetCost, check_choice, describe
from .masks import CELLS, Subnet, variable_mask
from .operations import make_op
from .search import DartsSearchNetwork, cell_plan, edge_table, num_edges


@dataclasses.dataclass(frozen=True)
class DartsChoiceSpace:
    """``net``'s (edge, op) table as ``2 × num_edges(steps)`` dimensions (normal cell's
    edges, then the reduction cell's, each in DARTS edge order) over ``image_shape``
    (H, W, C) inputs."""

    net: DartsSearchNetwork
    image_shape: tuple
    name: str = "darts"

    @property
    def single_path(self) -> bool:
        """True for a supernet built with ``single_path=True`` (each op under a ``cond``)."""
        return bool(self.net.single_path)

    @property
    def dims(self) -> tuple[Dimension, ...]:
        ops = tuple(self.net.primitives)
        return tuple(Dimension(f"{c}.{src}->{node + 2}", ops) for c in CELLS for _, src, node in edge_table(self.net.steps))

    @property
    def num_edges(self) -> int:
        return num_edges(self.net.steps)

    def masks(self, choice) -> dict:
        """The one-hot ``{"normal": [E, |O|], "reduce": [E, |O|]}`` of a (traced) choice."""
        oh = jax.nn.one_hot(jnp.asarray(choice), len(self.net.primitives), dtype=jnp.float32)
        return {"normal": oh[: self.num_edges], "reduce": oh[self.num_edges:]}

    def init(self, key: jax.Array, x: jax.Array) -> dict:
        full = {c: jnp.ones((self.num_edges, len(self.net.primitives)), jnp.float32) for c in CELLS}
        v = self.net.init(key, x, arch_weights=full)
        return {"params": v["params"], "batch_stats": v["batch_stats"]}

    def subnet(self, choice) -> Subnet:
        return Subnet(self.net, self.masks(choice))

    def variable_mask(self, choice, variables: dict) -> dict:
        m, n = self.masks(choice), self.net
        return {k: variable_mask(m, variables[k], n.primitives, n.steps, n.layers) for k in variables}

    def describe(self, choice) -> dict:
        return describe(self.dims, choice)

    def cost(self, choice) -> SubnetCost:
        c = check_choice(self.dims, choice)
        base, table = self._tables
        rows = np.arange(len(c))
        total = base + table[rows, c].sum(0)
        return SubnetCost(*(int(round(v)) for v in total))

    def traced_cost(self, choice) -> jax.Array:
        """:meth:`cost` of a traced choice as float32 ``[3]`` (params, macs, activation floats)."""
        base, table = self._tables
        c = jnp.asarray(choice)
        return jnp.asarray(base, jnp.float32) + jnp.asarray(table, jnp.float32)[jnp.arange(c.shape[0]), c].sum(0)

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """``base [3]`` and ``table [D, |O|, 3]`` of (params, macs, conv outputs), computed on
        first use (host values even when that first use is inside a trace, where they are
        evaluated op by op: slower, so algorithms touch them at build time)."""
        try:
            return self._compute_tables()
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            with jax.ensure_compile_time_eval():
                return self._compute_tables()

    def largest_choice(self) -> np.ndarray:
        """Per dimension the op with the most parameters + activation floats: the subnet
        with the largest training memory at batch size 1 (memory is additive here)."""
        _, table = self._tables
        return np.argmax(table[..., 0] + table[..., 2], -1).astype(np.int32)

    def smallest_choice(self) -> np.ndarray:
        """Per dimension the op with the fewest parameters + activation floats."""
        _, table = self._tables
        return np.argmin(table[..., 0] + table[..., 2], -1).astype(np.int32)

    def _compute_tables(self) -> tuple[np.ndarray, np.ndarray]:
        net, ops, steps = self.net, tuple(self.net.primitives), self.net.steps
        n_e, n_o = self.num_edges, len(ops)
        x = jnp.zeros((1,) + tuple(self.image_shape), jnp.float32)
        shapes = jax.eval_shape(lambda: self.init(jax.random.key(0), x))["params"]

        def n_params(flat):  # linear in the mask: its gradient is the per-(edge, op) table
            params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            keep = variable_mask({"normal": flat[:n_e], "reduce": flat[n_e:]}, params, ops, steps, net.layers)
            return sum(jnp.broadcast_to(k, p.shape).sum() for k, p in zip(jax.tree.leaves(keep), jax.tree.leaves(params)))

        p_base, p_table = jax.jit(jax.value_and_grad(n_params))(jnp.zeros((2 * n_e, n_o)))
        p_base, p_table = float(p_base), np.asarray(p_table, np.float64)

        op_cost = functools.lru_cache(None)(_op_cost)
        table = np.zeros((2 * n_e, n_o, 3))
        table[..., 0] = p_table
        h, w = self.image_shape[:2]
        for spec in cell_plan(net.C, net.layers, net.multiplier, net.stem_multiplier):
            h_out, w_out = (-(-h // 2), -(-w // 2)) if spec.reduction else (h, w)
            cell = 1 if spec.reduction else 0
            for e, src, _ in edge_table(steps):
                stride = 2 if spec.reduction and src < 2 else 1
                hw = (h, w) if stride == 2 else (h_out, w_out)
                for j, op in enumerate(ops):
                    table[cell * n_e + e, j, 1:] += op_cost(op, spec.C, stride, hw)
            h, w = h_out, w_out
        traced = net.clone(dw_impl="grouped", single_path=False)
        full = {c: jnp.ones((n_e, n_o), jnp.float32) for c in CELLS}
        v = jax.eval_shape(lambda: traced.init(jax.random.key(0), x, arch_weights=full))

        def fwd(v, x):
            return traced.apply(v, x, arch_weights=full)

        everything = np.array([count_macs(fwd, v, x), count_conv_outputs(fwd, v, x)], np.float64)
        base = np.array([p_base, *(everything - table[..., 1:].sum((0, 1)))])
        return base, table


def _op_cost(op: str, C: int, stride: int, hw: tuple[int, int]) -> np.ndarray:
    """(multiply-adds, convolution outputs) of one candidate op on a ``[1, H, W, C]`` input."""
    mod = make_op(op, C, stride, affine=False, dw_impl="grouped")
    x = jax.ShapeDtypeStruct((1, *hw, C), jnp.float32)
    v = jax.eval_shape(lambda: mod.init(jax.random.key(0), jnp.zeros(x.shape), train=False))

    def fwd(v, x):
        return mod.apply(v, x, train=False)

    return np.array([count_macs(fwd, v, jnp.zeros(x.shape)), count_conv_outputs(fwd, v, jnp.zeros(x.shape))],
                    np.float64)


__all__ = ["DartsChoiceSpace"]
