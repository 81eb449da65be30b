"""Cost of a network read off its own computation: multiply-accumulates and parameters.

:func:`count_macs` traces a function to a jaxpr and sums the multiply-accumulates of
every convolution and matrix product in it (batch norm, activations and pooling are not
counted — the convention behind the "FLOPs" of ShuffleNet, SPOS, DSNAS and most NAS
papers, which are multiply-adds). Sub-computations are followed: a ``scan`` counts
``length`` times, a ``cond``/``switch`` counts its most expensive branch (an upper bound
for a data-dependent choice; trace a fixed child for an exact number).

Depthwise convolutions must be traced as grouped convolutions (``dw_impl="grouped"``):
written as shifted slices they are element-wise products and would not be counted.
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

import jax


def _prod(xs) -> int:
    return int(math.prod(int(d) for d in xs))


def _sub_jaxprs(params: dict):
    for v in params.values():
        for item in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _jaxpr_macs(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
            per_output = rhs[spec[1]] * _prod(rhs[d] for d in spec[2:])
            total += _prod(eqn.outvars[0].aval.shape) * per_output
        elif name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += _prod(eqn.outvars[0].aval.shape) * _prod(lhs[d] for d in lhs_contract)
        elif name == "cond":
            total += max(_jaxpr_macs(b.jaxpr) for b in eqn.params["branches"])
        elif name == "scan":
            total += eqn.params["length"] * _jaxpr_macs(eqn.params["jaxpr"].jaxpr)
        else:
            subs = list(_sub_jaxprs(eqn.params))
            if name in ("custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call"):
                subs = subs[:1]  # the primal computation only
            total += sum(_jaxpr_macs(s) for s in subs)
    return total


def _jaxpr_outputs(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("conv_general_dilated", "dot_general"):
            total += _prod(eqn.outvars[0].aval.shape)
        elif name == "cond":
            total += max(_jaxpr_outputs(b.jaxpr) for b in eqn.params["branches"])
        elif name == "scan":
            total += eqn.params["length"] * _jaxpr_outputs(eqn.params["jaxpr"].jaxpr)
        else:
            subs = list(_sub_jaxprs(eqn.params))
            if name in ("custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call"):
                subs = subs[:1]
            total += sum(_jaxpr_outputs(s) for s in subs)
    return total


def count_conv_outputs(fn: Callable, *args: Any) -> int:
    """Values produced by the convolutions and matrix products of one call ``fn(*args)``
    (followed like :func:`count_macs`): a proxy for the activations a training step keeps."""
    return _jaxpr_outputs(jax.make_jaxpr(fn)(*args).jaxpr)


def count_macs(fn: Callable, *args: Any) -> int:
    """Multiply-accumulates of one call ``fn(*args)`` (convolutions and matmuls)."""
    return _jaxpr_macs(jax.make_jaxpr(fn)(*args).jaxpr)


def count_params(tree) -> int:
    """Total number of scalars in a pytree of arrays (or ``ShapeDtypeStruct`` objects)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        n = 1
        for d in leaf.shape:
            n *= int(d)
        total += n
    return total


def model_params(cfg, info) -> int:
    """Weights of the network one client trains under ``cfg`` (an ``ExperimentConfig`` of a
    bundled algorithm) on data described by ``info`` (a ``DataInfo``), counted from shapes
    only (``jax.eval_shape``: nothing is allocated). FedNAS counts its supernet, FedNAS'
    retraining its evaluation network, every other algorithm the network ``algo.model``
    names; as DARTS counts, without the training-only auxiliary head."""
    from jaxfednas.search_spaces.models import init_variables, make_model  # noqa: PLC0415

    if cfg.algorithm == "fednas":
        from jaxfednas.algorithms.fednas import make_supernet  # noqa: PLC0415

        model = make_supernet(cfg.algo, info)
    elif cfg.algorithm == "fednas_train":
        from jaxfednas.algorithms.fednas_train import make_network  # noqa: PLC0415

        model = make_network(cfg.algo, info)
    else:
        model = make_model(cfg.algo.model, info.num_classes, cfg.data.dataset)
    v = jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), info.image_shape))
    return count_params({k: p for k, p in v["params"].items() if k != "auxiliary_head"})
