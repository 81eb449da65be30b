"""Evaluation: global test accuracy and per-client accuracy on clients' own test splits.

Names say what is averaged: ``client_test_acc_mean_unweighted`` treats every
client alike; ``..._weighted`` weights a client by its number of test examples
(so it equals the pooled accuracy over all clients' test examples). Clients
without test examples are left out of both.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax


def evaluate_examples(
    logits_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    y: jax.Array,
    count: jax.Array | int,
    *,
    batch_size: int,
) -> dict[str, jax.Array]:
    """Correct predictions and summed loss over the first ``count`` rows of ``x``.

    ``logits_fn`` maps a raw batch ``[B, ...]`` to logits ``[B, classes]``; rows
    are visited in fixed batches of ``batch_size`` with a ``lax.map``.
    """
    n = x.shape[0]
    b = min(batch_size, n)
    nb = math.ceil(n / b)
    pad = nb * b - n
    xp = jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]) if pad else x
    yp = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)]) if pad else y
    mask = jnp.arange(nb * b) < count

    def one(args):
        xb, yb, mb = args
        logits = logits_fn(xb)
        correct = (jnp.argmax(logits, -1) == yb) & mb
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb) * mb
        return correct.sum(), loss.sum()

    correct, loss = jax.lax.map(
        one, (xp.reshape((nb, b) + x.shape[1:]), yp.reshape(nb, b), mask.reshape(nb, b))
    )
    return {"correct": correct.sum(), "loss_sum": loss.sum(), "count": jnp.asarray(count, jnp.int32)}


def client_accuracy_summary(correct: jax.Array, counts: jax.Array, prefix: str = "client_test") -> dict[str, jax.Array]:
    """Mean and std of per-client accuracy, unweighted and weighted by test size."""
    counts = counts.astype(jnp.float32)
    valid = counts > 0
    acc = jnp.where(valid, correct / jnp.where(valid, counts, 1.0), 0.0)
    n_valid = jnp.maximum(valid.sum(), 1)
    mean_u = jnp.where(valid, acc, 0.0).sum() / n_valid
    std_u = jnp.sqrt(jnp.where(valid, (acc - mean_u) ** 2, 0.0).sum() / n_valid)
    w = counts / jnp.maximum(counts.sum(), 1.0)
    mean_w = (w * acc).sum()
    std_w = jnp.sqrt((w * (acc - mean_w) ** 2).sum())
    if_any = lambda v: jnp.where(valid.any(), v, jnp.nan)  # noqa: E731 — no client has test data
    mean_u, std_u, mean_w, std_w = map(if_any, (mean_u, std_u, mean_w, std_w))
    return {
        f"{prefix}_acc": jnp.where(valid, acc, jnp.nan),
        f"{prefix}_acc_mean_unweighted": mean_u,
        f"{prefix}_acc_std_unweighted": std_u,
        f"{prefix}_acc_mean_weighted": mean_w,
        f"{prefix}_acc_std_weighted": std_w,
    }
