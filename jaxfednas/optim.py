"""Optimisation building blocks for architecture search (optax).

* :func:`nas_optimizer` — one ``optax.partition`` over a ``{"params", "arch"}``
  tree: SGD with momentum, weight decay and gradient-norm clipping for the
  weights; Adam with (L2) weight decay for the architecture parameters. The
  defaults are DARTS'/MiLeNAS' (reference §0.5, §2.4).
* :func:`milenas_grads` — the mixed-level gradients of MiLeNAS (He et al.,
  "MiLeNAS: Efficient Neural Architecture Search via Mixed-Level
  Reformulation", CVPR 2020, arXiv:2003.12238), as used by FedNAS Eq. 4:

      w ← w − η_w ∇_w L_tr(w, α)
      α ← α − η_α (∇_α L_tr(w, α) + λ ∇_α L_val(w, α))

  Both gradients are taken at the same ``(w, α)``: one pass on the training
  batch gives ``∇_w L_tr`` and ``∇_α L_tr`` together, a second pass on the
  validation batch gives ``∇_α L_val``.
* :func:`cosine_epoch_lr` — DARTS' per-epoch cosine annealing
  ``floor + (base − floor)(1 + cos(π e / E)) / 2``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

WEIGHTS, ARCH = "weights", "arch"


def cosine_epoch_lr(base: float, floor: float, epochs: int) -> Callable[[jax.Array], jax.Array]:
    """Learning rate of local epoch ``e`` (0-based) under cosine annealing over ``epochs``.

    Matches PyTorch's ``CosineAnnealingLR(T_max=epochs, eta_min=floor)`` stepped once per epoch.
    """
    def lr(epoch):
        return floor + 0.5 * (base - floor) * (1.0 + jnp.cos(jnp.pi * epoch / epochs))

    return lr


def arch_labels(tree: dict) -> dict:
    """``"arch"`` for every leaf under the ``arch`` key, ``"weights"`` elsewhere."""
    return {k: jax.tree.map(lambda _: ARCH if k == "arch" else WEIGHTS, v) for k, v in tree.items()}


def nas_optimizer(
    *,
    w_lr: float | Callable = 0.025,
    w_momentum: float = 0.9,
    w_weight_decay: float = 3e-4,
    w_clip: float | None = 5.0,
    arch_lr: float = 3e-4,
    arch_b1: float = 0.5,
    arch_b2: float = 0.999,
    arch_weight_decay: float = 1e-3,
) -> optax.GradientTransformation:
    """Weights: clip (global norm) → + wd·w → SGD(momentum); arch: + wd·α → Adam.

    Weight decay is added to the gradient before momentum/Adam, as PyTorch's
    ``weight_decay`` does. Apply it to ``{"params": g_w, "arch": g_α}``.
    """
    w_parts = [optax.clip_by_global_norm(w_clip)] if w_clip else []
    w_parts += [optax.add_decayed_weights(w_weight_decay), optax.sgd(w_lr, momentum=w_momentum or None)]
    a_tx = optax.chain(
        optax.add_decayed_weights(arch_weight_decay), optax.adam(arch_lr, b1=arch_b1, b2=arch_b2)
    )
    return optax.partition({WEIGHTS: optax.chain(*w_parts), ARCH: a_tx}, arch_labels)


LossFn = Callable[[Any, Any, Any, dict], tuple[jax.Array, tuple[Any, dict]]]


def milenas_grads(
    loss_fn: LossFn,
    params: Any,
    arch: Any,
    batch_stats: Any,
    train_batch: dict,
    val_batch: dict,
    *,
    lam: float = 1.0,
) -> tuple[dict, Any, dict]:
    """MiLeNAS mixed-level gradients (FedNAS Eq. 4).

    Args:
      loss_fn: ``loss_fn(params, arch, batch_stats, batch) -> (loss, (new_batch_stats, metrics))``.
      lam: λ, the weight of the validation term in the architecture gradient.

    Returns:
      ``({"params": ∇_w L_tr, "arch": ∇_α L_tr + λ ∇_α L_val}, batch_stats after
      the training pass, {"train": metrics, "val": metrics})``.
    """
    (_, (stats, m_tr)), (g_w, g_a_tr) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, arch, batch_stats, train_batch
    )
    (_, (_, m_val)), g_a_val = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
        params, arch, batch_stats, val_batch
    )
    g_a = jax.tree.map(lambda a, b: a + lam * b, g_a_tr, g_a_val)
    return {"params": g_w, "arch": g_a}, stats, {"train": m_tr, "val": m_val}
