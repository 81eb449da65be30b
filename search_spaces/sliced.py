"""Pieces shared by the choice spaces whose subnets are slices of the supernet's weights
(:mod:`jaxfednas.search_spaces.elastic`, :mod:`jaxfednas.search_spaces.hybrid`): choice checking, a convolution
with a CPU-friendly gradient, a branch
pick that stays a real branch for traced indices, zero padding to a static width, and
Flax's ``apply`` convention for functional subnets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfednas.nn import conv_canonical_grad, use_fast_grad
from jaxfednas.search_spaces.choice import check_choice


def as_choice(dims, choice):
    """A traced choice as int32 ``[D]`` (shape and dtype checked), a concrete one as
    checked numpy int32 (``ValueError`` naming the first dimension out of range)."""
    if isinstance(choice, jax.core.Tracer):
        if choice.shape != (len(dims),) or not jnp.issubdtype(choice.dtype, jnp.integer):
            raise ValueError(f"a subnet is {len(dims)} integer choices (one per dimension), got shape "
                             f"{choice.shape} dtype {choice.dtype}")
        return choice.astype(jnp.int32)
    return check_choice(dims, np.asarray(choice))


def select(index, branches, *operands, remat: bool = False):
    """``branches[index](*operands)``: Python's pick for a concrete index, else ``lax.switch``
    (only the chosen branch runs). ``remat``: every branch under ``jax.checkpoint``, so the
    backward pass keeps the shared operands instead of every branch's residuals (a switch
    keeps those of all branches, zero-filled for the ones not taken)."""
    if remat:
        branches = [jax.checkpoint(f) for f in branches]
    if len(branches) == 1 or isinstance(index, (int, np.integer)):
        return branches[0 if len(branches) == 1 else int(index)](*operands)
    return lax.switch(index, branches, *operands)


def conv_nhwc(x, kernel, stride: int, padding="SAME"):
    """NHWC / HWIO convolution. On CPU its gradient is written as canonical convolutions
    (:func:`jaxfednas.nn.conv_canonical_grad`): inside a ``lax.switch`` / ``cond`` XLA:CPU
    otherwise runs the transposed convolutions of the backward pass through its generic
    emitter (measured: 3×3, 32 channels, batch 32: kernel gradient 25 ms instead of 0.6)."""
    if use_fast_grad():
        return conv_canonical_grad(x, kernel, (stride, stride), padding, (1, 1))
    return lax.conv_general_dilated(x, kernel, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def pad(x, width: int):
    """``x`` zero-padded on its last axis to ``width`` channels."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def flax_apply(subnet, variables: dict, x, *, train: bool = False, mask=None, mutable=False):
    """Flax's ``apply`` convention for a functional subnet with ``space._check_input(x)`` and
    ``_forward(params, stats, x, train, mask) -> (logits, new batch_stats)``: the logits, or
    ``(logits, {collection: value})`` for the ``mutable`` collections (``batch_stats``
    updated in training, unchanged in evaluation)."""
    subnet.space._check_input(x)
    if mask is None:
        mask = jnp.ones((x.shape[0],), bool)
    params, stats = variables["params"], variables["batch_stats"]
    logits, new_stats = subnet._forward(params, stats, x, train, mask)
    if mutable is True:
        mutable = tuple(variables)
    elif isinstance(mutable, str):
        mutable = (mutable,)
    if not mutable:
        return logits
    unknown = [c for c in mutable if c not in variables]
    if unknown:
        raise ValueError(f"mutable collections {unknown} are not among the variables {sorted(variables)}")
    out = {c: variables[c] for c in mutable}
    if "batch_stats" in out:
        out["batch_stats"] = new_stats if train else stats
    return logits, out


__all__ = ["as_choice", "conv_nhwc", "flax_apply", "pad", "select"]
