"""Optimisation building blocks for architecture search (optax).

* :func:`darts_weight_optimizer` / :func:`darts_arch_optimizer` — DARTS' two steps as
  optax: SGD with momentum, weight decay and gradient-norm clipping for the weights;
  Adam with (L2) weight decay for the architecture parameters (docs/authors_code.md
  §0.5, §2.4). ``optax.partition`` with :func:`arch_labels` steps a
  ``{"params", "arch"}`` tree with both.
* :func:`milenas_grads` — the mixed-level gradients of MiLeNAS (He et al.,
  "MiLeNAS: Efficient Neural Architecture Search via Mixed-Level
  Reformulation", CVPR 2020, arXiv:2003.12238), as used by FedNAS Eq. 4:

      w ← w − η_w ∇_w L_tr(w, α)
      α ← α − η_α (∇_α L_tr(w, α) + λ ∇_α L_val(w, α))

  Both gradients are taken at the same ``(w, α)``: one pass on the training
  batch gives ``∇_w L_tr`` and ``∇_α L_tr`` together, a second pass on the
  validation batch gives ``∇_α L_val``.
* :func:`cosine_lr` — the library's one cosine annealing
  ``floor + (base − floor)(1 + cos(π min(t, T) / T)) / 2``: per local epoch (FedNAS, as
  DARTS' ``CosineAnnealingLR``), per round (DFNAS), per server iteration (DP-FNAS).
* :func:`rate_schedule` — a configured learning rate (a number and a schedule's name,
  ``algo.lr`` and ``algo.lr_schedule``) resolved once into an optax schedule.
* :func:`active_momentum` — SGD momentum that moves only the leaves that ran this step
  (single-path supernets: PyTorch skips a parameter without a gradient).
* :func:`darts_arch_grad` — the second-order DARTS architecture gradient (Liu et al.,
  "DARTS: Differentiable Architecture Search", arXiv:1806.09055, Eq. 6-8; DP-FNAS
  Eq. 5), with the Hessian-vector product as the paper's central finite difference
  or exactly (forward-over-reverse, :func:`arch_hessian_vector`).
* The per-example DP mechanism (clipping, Gaussian noise, Poisson sampling, the
  ``dp_aggregate`` optax transformation) lives in :mod:`jaxfednas.privacy.mechanism`.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxfednas.nn import kernel_grads_if, use_fast_grad

WEIGHTS, ARCH = "weights", "arch"


def cosine_lr(base: float, floor: float, horizon: int) -> Callable[[jax.Array], jax.Array]:
    """Learning rate at step ``t`` (0-based; an epoch, a round or an iteration) of a cosine
    annealing from ``base`` to ``floor`` over ``horizon`` steps, ``floor`` after it.

    Matches PyTorch's ``CosineAnnealingLR(T_max=horizon, eta_min=floor)`` stepped once per
    ``t``. Usable as an optax schedule.
    """
    def lr(t):
        return floor + 0.5 * (base - floor) * (1.0 + jnp.cos(jnp.pi * jnp.minimum(t, horizon) / horizon))

    return lr


SCHEDULES: tuple[str, ...] = ("constant", "cosine")
"""The named learning-rate schedules of the configs' ``lr_schedule`` fields."""


def rate_schedule(name: str, base: float, *, horizon: int | None = None,
                  floor: float = 0.0) -> optax.ScalarOrSchedule:
    """A configured learning rate as optax takes one (a number or a schedule of the step ``t``
    it is stepped by: a round, an epoch or an iteration): ``constant``: the number ``base``
    (a compile-time constant of the optimizer, as optax treats a float); ``cosine``:
    :func:`cosine_lr` from ``base`` to ``floor`` over ``horizon`` steps (needed)."""
    if name == "constant":
        return float(base)
    if name == "cosine":
        if horizon is None or horizon < 1:
            raise ValueError(f"a cosine learning rate needs its horizon (run.rounds >= 1), got {horizon!r}")
        return cosine_lr(base, floor, horizon)
    raise ValueError(f"learning-rate schedule must be one of {SCHEDULES}, got {name!r}")


def rate_at(rate: optax.ScalarOrSchedule, t: Any) -> jax.Array:
    """The value of ``rate`` (:func:`rate_schedule`) at step ``t``, float32."""
    return rate(t) if callable(rate) else jnp.float32(rate)


def arch_labels(tree: dict) -> dict:
    """``"arch"`` for every leaf under the ``arch`` key, ``"weights"`` elsewhere."""
    return {k: jax.tree.map(lambda _: ARCH if k == "arch" else WEIGHTS, v) for k, v in tree.items()}


def _nas_optimizer(
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
    """The former ``nas_optimizer`` (deprecated: nothing in the library used it, and its
    keywords keep the dropped ``w_*`` names): both DARTS steps as one ``optax.partition``."""
    w_tx = darts_weight_optimizer(lr=w_lr, momentum=w_momentum, weight_decay=w_weight_decay, clip=w_clip)
    a_tx = darts_arch_optimizer(lr=arch_lr, b1=arch_b1, b2=arch_b2, weight_decay=arch_weight_decay)
    return optax.partition({WEIGHTS: w_tx, ARCH: a_tx}, arch_labels)


def darts_weight_optimizer(
    *, lr: float | Callable, momentum: float, weight_decay: float, clip: float | None
) -> optax.GradientTransformation:
    """Clip (global norm) → + wd·w → SGD(momentum): DARTS' weight step. Weight decay is
    added to the gradient before momentum, as PyTorch's ``weight_decay`` does."""
    parts = [optax.clip_by_global_norm(clip)] if clip else []
    parts += [optax.add_decayed_weights(weight_decay), optax.sgd(lr, momentum=momentum or None)]
    return optax.chain(*parts)


def darts_arch_optimizer(*, lr: float, b1: float, b2: float, weight_decay: float) -> optax.GradientTransformation:
    """+ wd·α → Adam: DARTS' architecture step (L2 decay on the gradient, as PyTorch)."""
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(lr, b1=b1, b2=b2))


def active_momentum(decay: float) -> optax.GradientTransformationExtraArgs:
    """Heavy-ball momentum ``m ← decay·m + g`` (``optax.trace``'s rule) on the leaves that
    ran this step only; the others keep their momentum and get a zero update.

    ``update(grads, state, params, active=tree)`` with ``active`` a tree like the
    params of 0/1 scalars (1: the leaf took part in this step's forward). A single-path
    supernet's unsampled units thus keep weights *and* momentum, as PyTorch's SGD skips
    parameters whose ``.grad`` is None. Chain with ``optax.scale_by_learning_rate``.
    """
    def init_fn(params):
        return optax.TraceState(trace=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None, *, active, **extra_args):
        del params, extra_args
        moved = jax.tree.map(lambda g, m: g + decay * m, updates, state.trace)
        trace = jax.tree.map(lambda a, n, o: jnp.where(a > 0, n, o), active, moved, state.trace)
        updates = jax.tree.map(lambda a, m: jnp.where(a > 0, m, jnp.zeros_like(m)), active, trace)
        return updates, optax.TraceState(trace=trace)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


LossFn = Callable[[Any, Any, Any, dict], tuple[jax.Array, tuple[Any, dict]]]


MILENAS_PASSES = ("auto", "loop", "inline")


def milenas_grads(
    loss_fn: LossFn,
    params: Any,
    arch: Any,
    batch_stats: Any,
    train_batch: dict,
    val_batch: dict,
    *,
    lam: float = 1.0,
    passes: str = "auto",
    val_stats: bool = False,
) -> tuple[dict, Any, dict]:
    """MiLeNAS mixed-level gradients (FedNAS Eq. 4).

    Args:
      loss_fn: ``loss_fn(params, arch, batch_stats, batch) -> (loss, (new_batch_stats, metrics))``.
      lam: λ, the weight of the validation term in the architecture gradient.
      passes: how the two passes (training batch → ``∇_w L_tr, ∇_α L_tr``; validation
        batch → ``∇_α L_val``) are laid out; the same gradients either way (to float
        rounding). ``"inline"``: one after the other, so XLA compiles the network's
        forward and backward twice. ``"loop"``: a ``lax.scan`` over the two batches,
        so it compiles them once (config (b) of ``benchmarks/fednas_search.py``:
        trace + lower + XLA 12.9 + 59.8 -> 7.0 + 36.8 s, the step unchanged); the
        validation iteration skips its kernel gradients through
        :func:`jaxfednas.nn.kernel_grads_if` (which the CPU convolutions honour;
        elsewhere it computes and drops them). ``"auto"``:
        ``"loop"`` on CPU when the batches have the same keys, shapes and dtypes
        (the training batch's extra keys, e.g. ``epoch``, are not passed to the
        validation pass), else ``"inline"``.
      val_stats: also return the validation pass's ``batch_stats`` (both passes start
        from ``batch_stats``), for callers that update running statistics on every
        training-mode forward as PyTorch does; no extra work.

    Returns:
      ``(grads, batch_stats, metrics)`` with
      ``grads = {"params": ∇_w L_tr, "arch": ∇_α L_tr + λ ∇_α L_val}``, ``batch_stats``
      after the training pass and ``metrics = {"train": metrics, "val": metrics}``; with
      ``val_stats`` the second item is ``(batch_stats after the training pass,
      batch_stats after the validation pass)``.
    """
    if passes not in MILENAS_PASSES:
        raise ValueError(f"passes must be one of {MILENAS_PASSES}, got {passes!r}")
    loop = passes == "loop" or (passes == "auto" and use_fast_grad())
    both = _stacked_batches(train_batch, val_batch) if loop else None
    if passes == "loop" and both is None:
        raise ValueError("passes='loop' needs training and validation batches of the same keys, shapes and dtypes")
    if both is not None:
        grads, (stats, stats_val), metrics = _milenas_loop(loss_fn, params, arch, batch_stats, both, lam)
        return grads, (stats, stats_val) if val_stats else stats, metrics
    (_, (stats, m_tr)), (g_w, g_a_tr) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, arch, batch_stats, train_batch
    )
    (_, (stats_val, m_val)), g_a_val = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
        params, arch, batch_stats, val_batch
    )
    g_a = jax.tree.map(lambda a, b: a + lam * b, g_a_tr, g_a_val)
    return {"params": g_w, "arch": g_a}, (stats, stats_val) if val_stats else stats, {"train": m_tr, "val": m_val}


def _stacked_batches(train_batch: dict, val_batch: dict) -> dict | None:
    """``{k: stack([train[k], val[k]])}`` over the validation batch's keys, or None when the
    two do not match key for key in shape and dtype."""
    if not (isinstance(train_batch, dict) and isinstance(val_batch, dict)) or not set(val_batch) <= set(train_batch):
        return None
    pairs = {k: (train_batch[k], val_batch[k]) for k in val_batch}
    if any(jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b) for a, b in pairs.values()):
        return None
    return {k: jnp.stack(ab) for k, ab in pairs.items()}


def _milenas_loop(loss_fn, params, arch, batch_stats, both, lam):
    """Eq. 4's two passes as one loop body: iteration 0 (training batch) keeps ``∇_w``,
    the statistics and ``∇_α``; iteration 1 (validation batch) ``λ ∇_α`` and its statistics.
    Returns ``(grads, (train statistics, validation statistics), metrics)``."""
    def one_pass(_, inp):
        batch, is_train = inp
        with kernel_grads_if(is_train):
            (_, (stats, m)), (g_w, g_a) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                params, arch, batch_stats, batch)
        return None, (g_w, g_a, stats, m)

    _, (g_w, g_a, stats, m) = jax.lax.scan(one_pass, None, (both, jnp.array([True, False])))
    row = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    g_a = jax.tree.map(lambda a: a[0] + lam * a[1], g_a)
    return {"params": row(g_w, 0), "arch": g_a}, (row(stats, 0), row(stats, 1)), {"train": row(m, 0), "val": row(m, 1)}


# --- DARTS second-order architecture gradient ----------------------------------------

ScalarLossFn = Callable[[Any, Any, Any], jax.Array]
HESSIAN_METHODS = ("fd", "hvp")


def arch_hessian_vector(
    loss_fn: ScalarLossFn, params: Any, arch: Any, batch: Any, v: Any, *, method: str = "fd",
    eps_scale: float = 0.01,
) -> Any:
    """``∇²_{α,w} L(w, α) · v`` — the mixed second derivative applied to a weight-space vector.

    ``method="fd"`` is DARTS' central difference (Eq. 8)::

        [∇_α L(w + ε v, α) − ∇_α L(w − ε v, α)] / (2ε),   ε = eps_scale / ‖v‖

    (the parenthesisation pt.darts and the DP-FNAS code get wrong, which scales the
    term by ε² and makes their "second order" effectively first order; docs/authors_code.md §6.2).
    ``method="hvp"`` is exact: ``∇_α ⟨∇_w L(w, α), v⟩`` (reverse over reverse). The
    forward-over-reverse form (``jax.jvp`` of ``w ↦ ∇_α L``) computes the same product
    but cannot pass through ``custom_vjp`` functions such as the CPU convolution of
    :mod:`jaxfednas.nn`. A zero ``v`` gives zeros in both methods.

    ``loss_fn(params, arch, batch) -> scalar``.
    """
    grad_a = lambda w: jax.grad(loss_fn, argnums=1)(w, arch, batch)  # noqa: E731
    if method == "hvp":
        def directional(a):  # ⟨∇_w L(w, a), v⟩
            g_w = jax.grad(loss_fn, argnums=0)(params, a, batch)
            return sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(g_w), jax.tree.leaves(v)))

        return jax.grad(directional)(arch)
    if method != "fd":
        raise ValueError(f"method must be one of {HESSIAN_METHODS}, got {method!r}")
    norm = optax.tree.norm(v)
    eps = eps_scale / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)
    g_plus = grad_a(jax.tree.map(lambda w, d: w + eps * d, params, v))
    g_minus = grad_a(jax.tree.map(lambda w, d: w - eps * d, params, v))
    return jax.tree.map(lambda a, b: (a - b) / (2.0 * eps), g_plus, g_minus)


def darts_arch_grad(
    loss_fn: ScalarLossFn,
    params: Any,
    arch: Any,
    train_batch: Any,
    val_batch: Any,
    *,
    xi: float | jax.Array,
    params_prime: Any = None,
    method: str = "fd",
    eps_scale: float = 0.01,
) -> Any:
    """Second-order DARTS architecture gradient (DARTS Eq. 7-8; DP-FNAS Eq. 5)::

        w' = w − ξ ∇_w L_tr(w, α)                          (virtual step; or ``params_prime``)
        ∇_α L_val(w', α) − ξ ∇²_{α,w} L_tr(w, α) ∇_{w'} L_val(w', α)

    the Hessian-vector product by :func:`arch_hessian_vector` (``method`` "fd" with
    ``ε = eps_scale / ‖∇_{w'} L_val‖`` as DARTS, or "hvp" exact). ``params_prime``
    replaces the plain SGD virtual step by a given ``w'`` (DARTS' own code steps with
    momentum and weight decay; DP-FNAS uses the server's real update of W). ``ξ = 0``
    (with ``params_prime`` None) is the first-order gradient ``∇_α L_val(w, α)``.

    ``loss_fn(params, arch, batch) -> scalar``.
    """
    if params_prime is None:
        g_w = jax.grad(loss_fn, argnums=0)(params, arch, train_batch)
        params_prime = jax.tree.map(lambda w, g: w - xi * g, params, g_w)
    g_a, v = jax.grad(loss_fn, argnums=(1, 0))(params_prime, arch, val_batch)
    hv = arch_hessian_vector(loss_fn, params, arch, train_batch, v, method=method, eps_scale=eps_scale)
    return jax.tree.map(lambda a, h: a - xi * h, g_a, hv)


_FORMER = {  # former public name -> (its object now, what to use)
    "nas_optimizer": ("_nas_optimizer", "optax.partition({'weights': darts_weight_optimizer(...), "
                      "'arch': darts_arch_optimizer(...)}, arch_labels)"),
    "weight_optimizer": ("darts_weight_optimizer", "darts_weight_optimizer"),
    "arch_optimizer": ("darts_arch_optimizer", "darts_arch_optimizer"),
}


def __getattr__(name: str):
    """The former names (one release): ``arch_optimizer`` also named a server's optimizer
    of α and a DP-FNAS setting, so the DARTS steps are ``darts_*`` now."""
    if name in _FORMER:
        import warnings  # noqa: PLC0415

        now, use = _FORMER[name]
        warnings.warn(f"jaxfednas.optim.{name} is deprecated: use {use}", DeprecationWarning, stacklevel=2)
        return globals()[now]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
