"""Compute precision of client training (``run.precision``).

``"fp32"`` (the default) computes everything in float32. ``"bf16"`` computes the forward
and backward passes of client training in bfloat16 while everything that is *kept* stays
float32: parameters, architecture parameters α, BatchNorm running statistics, optimizer
state, gradients, the loss and the logits it is taken of. :func:`compute_in` wraps a
module's ``apply`` at the training call sites of an algorithm:

* the floating leaves of the ``params`` and ``arch`` collections and the floating array
  arguments (inputs, masks, gates) are cast to bfloat16 before ``apply``;
* ``batch_stats`` is passed as it is (float32): Flax's ``BatchNorm`` and
  :class:`jaxfednas.nn.BatchNorm` compute the batch statistics in float32 from a bfloat16
  input and keep the running averages float32, returning activations in the input's dtype;
* every bfloat16 leaf of the result (logits, mutated collections) is cast back to float32.

The cast's transpose is a cast back, so the gradients with respect to the float32
parameters come out float32 and the optimizer steps the float32 master copy (mixed
precision with float32 master weights; no loss scaling is needed: bfloat16 has float32's
exponent range). Evaluation always runs in float32.

With ``"fp32"`` :func:`compute_in` returns ``apply`` itself: the default program is the
one built without this module.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: ``run.precision`` values and the dtype client training computes in.
DTYPES: dict[str, Any] = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
#: variable collections cast to the compute dtype (``batch_stats`` stays float32)
CAST_COLLECTIONS: tuple[str, ...] = ("params", "arch")


def check_precision(precision: str) -> None:
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r} is not one of {list(DTYPES)}")


def cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating array leaf cast to ``dtype`` (integers, booleans, PRNG
    keys and Python scalars unchanged)."""
    def cast(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def to_float32(tree: Any) -> Any:
    """``tree`` with every bfloat16 leaf cast to float32 (other leaves unchanged)."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if getattr(x, "dtype", None) == jnp.bfloat16 else x, tree)


def compute_in(precision: str, apply: Callable) -> Callable:
    """``apply`` (a Flax ``apply(variables, *args, **kwargs)``) computing in ``precision``:
    ``"fp32"`` returns ``apply`` unchanged; ``"bf16"`` returns a function of the same
    signature that casts the ``params`` / ``arch`` collections and the floating array
    arguments to bfloat16, keeps ``batch_stats`` (and any other collection) as given, and
    casts every bfloat16 leaf of the result back to float32. See the module docstring."""
    check_precision(precision)
    if precision == "fp32":
        return apply
    dtype = DTYPES[precision]

    @functools.wraps(apply)
    def apply_in(variables, *args, **kwargs):
        variables = {k: cast_floating(v, dtype) if k in CAST_COLLECTIONS else v for k, v in variables.items()}
        args = cast_floating(args, dtype)
        kwargs = {k: v if k in ("rngs", "mutable") else cast_floating(v, dtype) for k, v in kwargs.items()}
        return to_float32(apply(variables, *args, **kwargs))

    return apply_in
