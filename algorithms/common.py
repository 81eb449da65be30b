"""Pieces shared by the supervised baselines: config fields, local SGD, evaluation."""
from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxfednas.search_spaces.models import check_model_name, MODELS
from jaxfednas import rng
from jaxfednas.config import ConfigError, Validated, param
from jaxfednas.data.augment import Augment, augment_batch
from jaxfednas.data.federated import ClientData, DataInfo, FederatedData, run_local_epochs
from jaxfednas.evaluation import client_accuracies, global_accuracy
from jaxfednas.precision import compute_in
from jaxfednas.runtime import map_clients, Placement, weighted_mean

AUGMENTS = ("auto", "none", "crop_flip", "crop_flip_cutout")


@dataclasses.dataclass(frozen=True)
class SupervisedConfig(Validated):
    """Local training of a fixed network (shared by FedAvg and local-only training)."""

    SECTION = "algo"
    RENAMED = {"client_lr": "lr"}
    model: str = param("auto", f"network, one of {{{', '.join(MODELS)}}} (auto: cnn for digits/synthetic, "
                       "resnet18 for CIFAR; shufflenetv2_<space>: the all-3x3 child of a DFNAS space; "
                       "shufflenetv2_<space>:<i_1>,...,<i_B>: the child with candidate i_b in block b)")
    local_epochs: int = param(1, "local epochs E per round", range=(1, 10_000))
    batch_size: int = param(32, "local minibatch size B", range=(1, 1_000_000))
    lr: float = param(0.05, "client SGD learning rate", range=(0.0, 100.0))
    momentum: float = param(0.9, "client SGD momentum", range=(0.0, 1.0))
    weight_decay: float = param(5e-4, "client weight decay (added to the gradient)", range=(0.0, 1.0))
    grad_clip: float = param(0.0, "global-norm gradient clipping (0: off)", range=(0.0, None))
    augment: str = param("auto", "on-device augmentation (auto: none for digits, crop+flip for CIFAR)", choices=AUGMENTS)
    eval_batch_size: int = param(500, "evaluation batch size", range=(1, None))

    def check(self):
        try:
            check_model_name(self.model)
        except ValueError as e:
            raise ConfigError(f"algo.model={self.model!r}: {e}") from None


def make_augment(name: str, dataset: str) -> Augment:
    if name == "auto":
        name = "none" if dataset in ("digits", "cluttered_digits", "synthetic") else "crop_flip"
    return {
        "none": Augment(),
        "crop_flip": Augment(crop_padding=4, flip=True),
        "crop_flip_cutout": Augment(crop_padding=4, flip=True, cutout=16),
    }[name]


def make_client_optimizer(cfg: SupervisedConfig, lr: float | jax.Array | None = None) -> optax.GradientTransformation:
    """The clients' SGD: gradient clipping (``cfg.grad_clip`` > 0), weight decay, momentum, at
    learning rate ``lr`` (a number or a traced scalar, e.g. a round's value of a schedule;
    None: ``cfg.lr``)."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    lr = cfg.lr if lr is None else lr
    parts += [optax.add_decayed_weights(cfg.weight_decay), optax.sgd(lr, momentum=cfg.momentum or None)]
    return optax.chain(*parts)


def make_batch_grad(model: nn.Module, info: DataInfo, augment: str, *, aux_weight: float = 0.0,
                    precision: str = "fp32") -> Callable:
    """``batch_grad(params, stats, batch, key, drop_path_prob=None) -> (grads, stats, metrics)``:
    the gradient of one minibatch's masked mean cross entropy (``key`` drives augmentation),
    the BatchNorm statistics after that training-mode pass, and ``loss_sum`` / ``correct`` /
    ``examples`` over the real (unmasked) examples. Shared by every supervised client update.

    Two options of the DARTS evaluation network (:class:`jaxfednas.search_spaces.darts.DartsNetwork`):
    ``aux_weight`` > 0 — ``model`` returns ``(logits, aux_logits)`` in training mode and the
    loss is CE + aux_weight · CE_aux (``loss_sum`` is that objective, as DARTS logs it;
    ``correct`` counts the main head); ``drop_path_prob`` (a traced scalar) is passed to the
    model with a ``"dropout"`` rng from :func:`jaxfednas.rng.drop_path_key` of ``key``. With
    both off the computation is the plain one, unchanged. ``precision``: what the forward and
    backward compute in (:func:`jaxfednas.precision.compute_in`; gradients and statistics
    come back float32)."""
    aug = make_augment(augment, info.name)
    apply = compute_in(precision, model.apply)

    def batch_grad(params, stats, batch, key, drop_path_prob=None):
        x = augment_batch(key, info.normalize(batch["x"]), aug)
        mask = batch["mask"]
        n = jnp.maximum(mask.sum(), 1)
        extra = {} if drop_path_prob is None else {
            "drop_path_prob": drop_path_prob, "rngs": {"dropout": rng.drop_path_key(key)}}

        def loss_fn(p):
            out, new_vars = apply(
                {"params": p, "batch_stats": stats}, x, train=True, mask=mask, mutable=["batch_stats"], **extra
            )
            logits, aux_logits = out if aux_weight > 0 else (out, None)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * mask
            if aux_weight > 0:
                ce = ce + aux_weight * optax.softmax_cross_entropy_with_integer_labels(aux_logits, batch["y"]) * mask
            correct = ((jnp.argmax(logits, -1) == batch["y"]) & mask).sum()
            return ce.sum() / n, (new_vars.get("batch_stats", {}), ce.sum(), correct)

        (_, (stats, loss_sum, correct)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, stats, {"loss_sum": loss_sum, "correct": correct, "examples": mask.sum()}

    return batch_grad


def make_local_train(model: nn.Module, info: DataInfo, cfg: SupervisedConfig, *, aux_weight: float = 0.0,
                     precision: str = "fp32") -> Callable:
    """``local_train(variables, client, key, drop_path_prob=None, lr=None) -> (variables,
    metrics)``: E epochs of minibatch SGD from ``variables`` on one client's data, with a fresh
    optimizer (as FedAvg's clients do every round) at learning rate ``lr`` (a number or a
    traced scalar, e.g. the round's value of ``algo.lr_schedule``; None: ``cfg.lr``);
    ``aux_weight`` and ``drop_path_prob``: see :func:`make_batch_grad` (None: no drop path,
    and no dropout rng drawn); ``precision``: see :func:`make_batch_grad`."""
    batch_grad = make_batch_grad(model, info, cfg.augment, aux_weight=aux_weight, precision=precision)

    def local_train(variables: dict, client: ClientData, key: jax.Array, drop_path_prob: jax.Array | None = None,
                    lr: jax.Array | None = None):
        opt = make_client_optimizer(cfg, lr)

        def step(carry, batch, key):
            params, stats, opt_state = carry
            grads, stats, metrics = batch_grad(params, stats, batch, key, drop_path_prob)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, stats, opt_state), metrics

        params, stats = variables["params"], variables["batch_stats"]
        carry = (params, stats, opt.init(params))
        (params, stats, _), metrics = run_local_epochs(
            step, carry, client, key, epochs=cfg.local_epochs, batch_size=cfg.batch_size
        )
        return {"params": params, "batch_stats": stats}, metrics

    return local_train


def train_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Example-weighted training loss/accuracy over the clients of a round."""
    n = jnp.maximum(metrics["examples"].sum(), 1)
    return {
        "train_loss": metrics["loss_sum"].sum() / n,
        "train_acc": metrics["correct"].sum() / n,
        "train_examples": metrics["examples"].sum(),
        "local_steps": metrics["steps"].sum(),
    }


def make_logits_fn(model: nn.Module, info: DataInfo) -> Callable:
    def logits_fn(variables):
        return lambda x: model.apply(variables, info.normalize(x), train=False)

    return logits_fn


def evaluate_global(model, info, variables, data, batch_size) -> dict[str, jax.Array]:
    """Accuracy of one model (eval mode) on the server's global test set."""
    return global_accuracy(make_logits_fn(model, info)(variables), data, batch_size)


def evaluate_clients(model, info, variables, data, batch_size, *, placement: Placement, personal: bool):
    """Each client's accuracy on its own test split, with the shared model
    (``personal=False``) or each client's row of ``variables`` (``personal=True``)."""
    return client_accuracies(make_logits_fn(model, info), variables, data, batch_size, placement=placement,
                             personal=personal)


def _moments(tree, *, inverse: bool = False):
    """Every BatchNorm ``{"mean", "var"}`` pair as ``{"mean", "var": var + mean²}`` (the
    second moment, which averages linearly across batches and clients), or back
    (``inverse``: ``var = max(m2 − mean², 0)``). Other leaves pass through."""
    if hasattr(tree, "items"):
        if set(tree) == {"mean", "var"}:
            m, v = tree["mean"], tree["var"]
            return {"mean": m, "var": jnp.maximum(v - m * m, 0.0) if inverse else v + m * m}
        return {k: _moments(v, inverse=inverse) for k, v in tree.items()}
    return tree


def client_batch_statistics(
    batch_stats_of: Callable[[Any, jax.Array, jax.Array], Any], zeros: Any, client: ClientData, *,
    batch_size: int, max_batches: int, momentum: float,
) -> tuple[Any, jax.Array]:
    """BatchNorm statistics of one client's data, for recalibrating a (sub)network.

    ``batch_stats_of(stats, x, mask)`` runs the network in training mode from running
    statistics ``stats`` and returns the updated ones; started from ``zeros`` a Flax
    BatchNorm returns ``(1 − momentum) ×`` the batch's mean and variance, so dividing by
    ``1 − momentum`` recovers them exactly. Pools them over the first ``max_batches``
    batches (in data order), weighted by real examples: the mean and the variance of all
    those examples together (the spread of the batch means included, through the second
    moments). Returns the statistics and the number of examples they summarise; average
    clients with :func:`pool_batch_statistics`.
    """
    m = client.y.shape[0]
    b = min(batch_size, m)
    nb = min(max_batches, -(-m // b))

    def body(acc, i):
        pos = i * b + jnp.arange(b)
        mask = pos < client.count
        new = _moments(jax.tree.map(lambda a: a / (1.0 - momentum),
                                    batch_stats_of(zeros, client.x[jnp.minimum(pos, m - 1)], mask)))
        w = mask.sum().astype(jnp.float32)
        # an empty batch (client shorter than the scan) contributes nothing, not NaN
        acc = jax.tree.map(lambda a, n: a + jnp.where(w > 0, w * n, 0.0), acc, new)
        return acc, w

    acc, ws = jax.lax.scan(body, _moments(zeros), jnp.arange(nb))
    n = ws.sum()
    return _moments(jax.tree.map(lambda a: a / jnp.maximum(n, 1.0), acc), inverse=True), n


def pool_batch_statistics(stats: Any, n: jax.Array) -> Any:
    """Clients' BatchNorm statistics (leading client axis, from :func:`client_batch_statistics`)
    pooled with weights ``n``: the mean and variance of all their examples together (a plain
    weighted mean of the variances would leave out the spread of the client means)."""
    return _moments(weighted_mean(_moments(stats), n), inverse=True)


def federated_batch_statistics(
    batch_stats_of: Callable[[Any, jax.Array, jax.Array], Any], zeros: Any, data: FederatedData, *,
    batch_size: int, max_batches: int, momentum: float, placement: Placement,
) -> Any:
    """Federated BatchNorm recalibration: every client measures :func:`client_batch_statistics`
    on its training split (``batch_stats_of``, ``zeros``, ``momentum`` as there), the server
    pools them with :func:`pool_batch_statistics`. Weights are not touched."""
    def one(client, _):
        return client_batch_statistics(batch_stats_of, zeros, client, batch_size=batch_size,
                                       max_batches=max_batches, momentum=momentum)

    stats, n = map_clients(one, data.all_clients("train"), None, placement=placement)
    return pool_batch_statistics(stats, n)


BN_MOMENTUM = 0.9  # every BatchNorm of the library's models and spaces (Flax: running = 0.9 running + 0.1 batch)


def recalibrated_batch_stats(model: nn.Module, info: DataInfo, variables: dict, data: FederatedData, *,
                             batch_size: int, max_batches: int, placement: Placement,
                             momentum: float = BN_MOMENTUM) -> dict:
    """Federated BatchNorm recalibration of ``variables`` (every other collection, weights and
    architecture, unchanged): every client runs ``model`` in training mode over up to
    ``max_batches`` batches of ``batch_size`` of its own training examples (in data order,
    unaugmented, padding masked) and measures each BatchNorm's mean and variance over those
    examples; the server pools them n_k/n into the mean and variance of all the examples
    together (:func:`federated_batch_statistics`). Returns the pooled ``batch_stats``."""
    fixed = {k: v for k, v in variables.items() if k != "batch_stats"}

    def stats_of(stats, x, mask):
        return model.apply({**fixed, "batch_stats": stats}, info.normalize(x), train=True, mask=mask,
                           mutable=["batch_stats"])[1]["batch_stats"]

    return federated_batch_statistics(stats_of, jax.tree.map(jnp.zeros_like, variables["batch_stats"]), data,
                                      batch_size=batch_size, max_batches=max_batches, momentum=momentum,
                                      placement=placement)
