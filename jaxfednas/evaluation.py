"""Evaluation: global test accuracy and per-client accuracy on clients' own test splits.

* :func:`global_accuracy` — one model on the server's global test set;
* :func:`client_accuracies` — every client on its own split (test or val), with the
  shared model or each client's own row of a per-client state, placed by the runtime;
* :func:`evaluate_examples` / :func:`client_accuracy_summary` — the pieces under them;
* :func:`select_by_validation` — per client, the candidate model (round, epoch, ...)
  with the best validation score and its test score (model selection that never reads test).

Models enter as logits functions (``logits_of(variables) -> (x -> logits)``), so any
network, subnet or recalibrated child can be evaluated the same way.

Names say what is averaged: ``client_test_acc_mean_unweighted`` treats every
client alike; ``..._weighted`` weights a client by its number of test examples
(so it equals the pooled accuracy over all clients' test examples). Clients
without test examples are left out of both.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxfednas.runtime import Placement, map_clients


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


def client_accuracy_summary(
    correct: jax.Array, counts: jax.Array, prefix: str = "client_test", tag: str = ""
) -> dict[str, jax.Array]:
    """Mean and std of per-client accuracy, unweighted and weighted by test size, named
    ``{prefix}_acc{tag}`` (per client) and ``{prefix}_acc{tag}_{mean,std}_{unweighted,weighted}``."""
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
        f"{prefix}_acc{tag}": jnp.where(valid, acc, jnp.nan),
        f"{prefix}_acc{tag}_mean_unweighted": mean_u,
        f"{prefix}_acc{tag}_std_unweighted": std_u,
        f"{prefix}_acc{tag}_mean_weighted": mean_w,
        f"{prefix}_acc{tag}_std_weighted": std_w,
    }


def global_accuracy(logits_fn: Callable[[jax.Array], jax.Array], data, batch_size: int) -> dict[str, jax.Array]:
    """``global_test_acc`` and ``global_test_loss`` of ``logits_fn`` on the server's test set."""
    r = evaluate_examples(logits_fn, data.server_x, data.server_y, data.server_y.shape[0], batch_size=batch_size)
    return {"global_test_acc": r["correct"] / r["count"], "global_test_loss": r["loss_sum"] / r["count"]}


def client_accuracies(
    logits_of: Callable,
    variables,
    data,
    batch_size: int,
    *,
    placement: Placement,
    personal: bool = False,
    split: str = "test",
    tag: str = "",
) -> dict[str, jax.Array]:
    """Every client's accuracy on its own ``split``, summarised by
    :func:`client_accuracy_summary` as ``client_<split>_acc<tag>...`` (``tag="_global"``
    names the shared model's numbers beside personalized ones).

    ``logits_of(variables)`` returns the logits function of one model. With
    ``personal=False`` every client evaluates the shared ``variables``; with
    ``personal=True`` client k evaluates row k of ``variables`` (a leading client axis).
    """
    def one(args, shared):
        client, v = args if personal else (args, shared)
        return evaluate_examples(logits_of(v), client.x, client.y, client.count, batch_size=batch_size)

    clients = data.all_clients(split)
    per_client = (clients, variables) if personal else clients
    r = map_clients(one, per_client, None if personal else variables, placement=placement)
    return client_accuracy_summary(r["correct"], r["count"], prefix=f"client_{split}", tag=tag)


def select_by_validation(val_score: jax.Array, test_score: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Model selection by validation: for every client (leading axis) the candidate (last
    axis: rounds, local epochs, ...) with the highest ``val_score``, the **last** among
    ties (with equal validation evidence, the candidate trained longest: a client without
    validation examples keeps the final one), and ``test_score`` at that candidate.
    ``test_score`` is only read, never compared. Scores are best given as counts of
    correct predictions (exact ties); NaN scores are not supported.

    >>> idx, test = select_by_validation(jnp.array([[3, 5, 5], [2, 1, 0]]), jnp.array([[6, 7, 8], [9, 8, 1]]))
    >>> idx.tolist(), test.tolist()
    ([2, 0], [8, 9])
    """
    val_score, test_score = jnp.asarray(val_score), jnp.asarray(test_score)
    if val_score.shape != test_score.shape or val_score.ndim < 1:
        raise ValueError(f"val_score {val_score.shape} and test_score {test_score.shape} must have one shape "
                         "(..., candidates)")
    last = val_score.shape[-1] - 1
    idx = last - jnp.argmax(jnp.flip(val_score, -1), axis=-1)  # argmax returns the first maximum
    return idx, jnp.take_along_axis(test_score, idx[..., None], axis=-1)[..., 0]
