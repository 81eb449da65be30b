r"""The per-example Gaussian mechanism of DP-SGD / DP-FNAS, on device (JAX).

One *release* of a party (DP-FNAS, Singh et al., arXiv:2006.10559, Algorithm 1; the
DP-SGD step of Abadi et al., arXiv:1607.00133) is

    I  ~ Poisson(p)      every one of the party's N examples joins independently w.p. p
    g_i = ∇ ℓ(z_i)        per example (``vmap`` of ``grad`` over the example axis)
    ḡ_i = g_i · min(1, R / ‖g_i‖₂)     ‖·‖₂ over the whole gradient pytree
    G  = (Σ_{i∈I} ḡ_i + σ R · ξ) / (p N),      ξ ~ N(0, I)

**Unit of privacy**: one example of one party's dataset (the split the release reads).
**Neighbouring relation**: add or remove one example. Under it the clipped sum
Σ ḡ_i has L2 sensitivity R, so one release is the Poisson-subsampled Gaussian
mechanism with noise multiplier σ that :mod:`jaxfednas.privacy` accounts.

Assumptions (each is a place where an implementation can silently lose the guarantee):

1. **Per-example computation.** ``g_i`` depends on ``z_i`` and the released state only.
   BatchNorm with batch statistics couples the examples of a batch, so the model must
   use a per-example normalisation (GroupNorm/LayerNorm; DARTS ``norm="group"``).
2. **Padded and masked rows contribute exactly nothing**: their rows of the
   per-example gradient are replaced by zeros with ``jnp.where`` (not multiplied by
   the mask, so a non-finite padded row cannot leak through ``0 * inf``) before
   clipping; a zero row is left at zero by clipping.
3. **Public normaliser.** The sum is divided by the *expected* batch size ``p N``
   (a public constant: ``p`` is fixed and ``N`` is treated as public, as in DP-SGD
   practice), not by the realised ``|I|`` (DP-FNAS Algorithm 1 writes ``1/|I_t|``,
   which is data dependent) and not by the physical (padded) batch (what
   ``optax.contrib.differentially_private_aggregate`` does).
4. **No overflow.** The sample is laid into a fixed ``physical_batch`` of slots
   (static shapes). If more examples are drawn than fit, the extra ones are
   dropped — a uniformly random subset of the drawn ones is kept — and the number
   dropped is returned (:class:`PoissonSample` ``overflow``) so a run can report it.
   The accountant assumes no overflow. With per-release overflow probability
   ``q = P[Binomial(N + 1, p) > physical_batch]`` (:func:`jaxfednas.privacy.overflow_probability`) a
   coupling argument gives (ε, δ + (1 + e^ε)·T·q)-DP for T releases; size the
   physical batch (:func:`auto_physical_batch`) so that ``T q`` is negligible.
5. **Fresh noise, drawn by the party** before the release leaves it, from a key that
   is never reused; everything computed from releases afterwards (server optimizers,
   momentum, weight decay, the derived architecture) is post-processing.

Diagnostics computed on the private sample (losses, accuracies, the fraction of
clipped examples, overflow counts) are *not* covered by the guarantee: they are
for the experimenter and must not be released with the model.

The functional core (:func:`clip_per_example`, :func:`clipped_sum`,
:func:`per_example_clipped_sum`, :func:`noisy_average`) takes its key as an argument
so that a federated algorithm derives every party's noise from ``(seed, round,
party)``; :func:`dp_aggregate` wraps it as an optax transformation that carries its
key in the optimizer state (like ``optax.contrib.differentially_private_aggregate``,
but dividing by the expected batch size).
"""
from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


# --------------------------------------------------------------------------------------
# Poisson subsampling into a fixed physical batch
# --------------------------------------------------------------------------------------
class PoissonSample(NamedTuple):
    """A Poisson sample laid into ``physical_batch`` slots.

    Attributes:
      idx: ``[physical_batch]`` row indices into the party's examples; the first
        ``min(num_sampled, physical_batch)`` are the sampled rows in random order,
        the rest are arbitrary valid indices (masked).
      mask: ``[physical_batch]`` True for a slot that holds a sampled example.
      num_sampled: ``|I|``, the number of examples the Poisson draw selected
        (including any that did not fit).
      overflow: ``max(0, num_sampled - physical_batch)``: examples drawn but dropped.
    """

    idx: jax.Array
    mask: jax.Array
    num_sampled: jax.Array
    overflow: jax.Array


def poisson_sample(key: jax.Array, count: jax.Array, max_examples: int, sampling_prob: float,
                   physical_batch: int) -> PoissonSample:
    """Poisson-subsample the first ``count`` of ``max_examples`` rows into ``physical_batch`` slots.

    Row ``i < count`` is selected iff ``u_i < p`` with ``u_i ~ U[0, 1)`` i.i.d.; padded
    rows (``i >= count``) never are. The slots are filled with the selected rows in
    increasing ``u`` — given the selected set, its ``u`` values are i.i.d. uniform on
    ``[0, p)``, so this order is a uniformly random permutation and, on overflow, the
    rows kept are a uniformly random subset of the selected ones.
    """
    if not 0.0 < sampling_prob <= 1.0:
        raise ValueError(f"sampling_prob must be in (0, 1], got {sampling_prob!r}")
    if physical_batch < 1:
        raise ValueError(f"physical_batch must be >= 1, got {physical_batch!r}")
    u = jax.random.uniform(key, (max_examples,))
    valid = jnp.arange(max_examples) < count
    selected = valid & (u < sampling_prob)
    order = jnp.argsort(jnp.where(valid, u, 2.0))  # selected rows first (u < p), then the rest
    idx = jnp.take(order, jnp.arange(physical_batch), mode="clip")
    num = selected.sum().astype(jnp.int32)
    mask = jnp.arange(physical_batch) < num
    return PoissonSample(idx=idx, mask=mask, num_sampled=num, overflow=jnp.maximum(num - physical_batch, 0))


def auto_physical_batch(max_examples: int, sampling_prob: float, tail: float = 1e-9) -> int:
    """Smallest physical batch whose overflow probability for ``max_examples + 1``
    examples (the largest party's add-one neighbour) is at most ``tail``; at most
    ``max_examples + 1``, which can never overflow."""
    from scipy.stats import binom

    n = int(max_examples) + 1
    b = int(binom.isf(tail, n, sampling_prob)) if sampling_prob < 1.0 else n
    while b < n and binom.sf(b, n, sampling_prob) > tail:
        b += 1
    return int(max(1, min(n, b)))


# --------------------------------------------------------------------------------------
# Per-example clipping and the Gaussian mechanism
# --------------------------------------------------------------------------------------
def mask_examples(per_example: Any, mask: jax.Array | None) -> Any:
    """Rows of ``per_example`` (leading example axis) where ``mask`` is False set to 0."""
    if mask is None:
        return per_example

    def one(g):
        return jnp.where(mask.reshape((-1,) + (1,) * (g.ndim - 1)), g, jnp.zeros_like(g))

    return jax.tree.map(one, per_example)


def per_example_norms(per_example: Any) -> jax.Array:
    """``[B]`` global L2 norm of each example's gradient over all leaves."""
    leaves = jax.tree.leaves(per_example)
    sq = sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1).astype(jnp.float32)), axis=1) for g in leaves)
    return jnp.sqrt(sq)


def clip_per_example(per_example: Any, clip_norm: float) -> tuple[Any, jax.Array]:
    """Scale each example's gradient to global L2 norm at most ``clip_norm``.

    The factor is ``R / max(‖g_i‖, R)`` = ``min(1, R/‖g_i‖)``: exactly 1 for
    ``‖g_i‖ <= R`` (no 0/0 for zero rows). Returns ``(clipped, norms before clipping)``.
    """
    if not clip_norm > 0.0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    norms = per_example_norms(per_example)
    factor = clip_norm / jnp.maximum(norms, clip_norm)

    def one(g):
        return (g * factor.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype))

    return jax.tree.map(one, per_example), norms


def clipped_sum(per_example: Any, mask: jax.Array | None, clip_norm: float | None) -> tuple[Any, jax.Array]:
    """``Σ_i ḡ_i`` over the rows where ``mask`` is True (all rows if None).

    ``clip_norm=None`` sums unclipped gradients (the non-private FNAS case, σ = 0).
    Returns ``(sum, number of masked-in examples that were clipped)``.
    """
    g = mask_examples(per_example, mask)
    if clip_norm is None:
        return jax.tree.map(lambda x: x.sum(0), g), jnp.int32(0)
    clipped, norms = clip_per_example(g, clip_norm)
    num_clipped = (norms > clip_norm).sum().astype(jnp.int32)  # masked rows are 0: never clipped
    return jax.tree.map(lambda x: x.sum(0), clipped), num_clipped


def gaussian_noise_like(key: jax.Array, tree: Any, std: float | jax.Array) -> Any:
    """Independent ``N(0, std²)`` noise with the structure, shapes and dtypes of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noise = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, noise)


def noisy_average(summed: Any, key: jax.Array, *, noise_std: float | jax.Array,
                  expected_batch_size: float | jax.Array) -> Any:
    """``(summed + N(0, noise_std²)) / expected_batch_size`` (the Gaussian mechanism).

    ``noise_std`` is ``σ R`` (noise multiplier times clipping norm); 0 adds nothing.
    """
    if isinstance(noise_std, (int, float)) and noise_std == 0:
        return jax.tree.map(lambda s: s / expected_batch_size, summed)
    noise = gaussian_noise_like(key, summed, noise_std)
    return jax.tree.map(lambda s, n: (s + n) / expected_batch_size, summed, noise)


def per_example_clipped_sum(
    example_fn: Callable[[Any], tuple[Any, Any]],
    examples: Any,
    mask: jax.Array,
    clip_norm: float | None,
    *,
    chunk: int | None = None,
) -> tuple[Any, Any, jax.Array]:
    """Per-example gradients, clipped and summed, in chunks to bound memory.

    Args:
      example_fn: ``example_fn(example) -> (gradient pytree, aux pytree)`` for ONE
        example (no leading axis); it must not look at other examples.
      examples: pytree with a leading example axis ``[P, ...]`` (a physical batch).
      mask: ``[P]`` True for real examples; other rows contribute exactly nothing
        to the gradient sum and to the aux sum.
      clip_norm: per-example L2 clipping norm R (None: no clipping).
      chunk: examples vmapped together (``None``: all ``P`` at once); chunks run
        one after another in a ``lax.scan`` (P must be a multiple of ``chunk``).

    Returns:
      ``(Σ ḡ_i, Σ aux_i, number clipped)`` over the masked-in examples.
    """
    p = mask.shape[0]

    def run(ex, m):
        g, aux = jax.vmap(example_fn)(ex)
        s, n_clip = clipped_sum(g, m, clip_norm)
        aux = jax.tree.map(lambda a: a.sum(0), mask_examples(aux, m))
        return s, aux, n_clip

    if chunk is None or chunk >= p:
        return run(examples, mask)
    if p % chunk:
        raise ValueError(f"physical batch {p} must be a multiple of chunk={chunk}")
    split = lambda t: t.reshape((p // chunk, chunk) + t.shape[1:])  # noqa: E731
    xs = (jax.tree.map(split, examples), split(mask))
    run = jax.jit(run)  # one trace: the shapes below and the scan body reuse it
    zero = jax.eval_shape(run, jax.tree.map(lambda t: t[:chunk], examples), mask[:chunk])
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero)

    def body(acc, x):
        out = run(*x)
        return jax.tree.map(jnp.add, acc, out), None

    total, _ = jax.lax.scan(body, zero, xs)
    return total


# --------------------------------------------------------------------------------------
# The mechanism as an optax transformation
# --------------------------------------------------------------------------------------
class DPAggregateState(NamedTuple):
    """State of :func:`dp_aggregate`: the key of the next release's noise."""

    rng_key: jax.Array


def dp_aggregate(clip_norm: float, noise_multiplier: float, expected_batch_size: float,
                 key: jax.Array) -> optax.GradientTransformation:
    """Clip per example, sum, add ``N(0, (σR)²)``, divide by the expected batch size.

    The input ``updates`` are per-example gradients with a leading example axis
    (a physical batch); rows of padded or unsampled slots must be zeros
    (:func:`mask_examples`). The output is the privatised average, to be chained
    with an optimizer (``optax.chain(dp_aggregate(...), optax.sgd(lr))``). The key
    lives in the state and is split at every update, so no noise is ever reused.

    Differs from ``optax.contrib.differentially_private_aggregate`` only in the
    normaliser: that one divides by the physical batch size, which under Poisson
    sampling with padding is neither the realised nor the expected batch size.
    """
    if not clip_norm > 0.0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    if noise_multiplier < 0.0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if not expected_batch_size > 0.0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")

    def init_fn(params):
        del params
        return DPAggregateState(rng_key=key)

    def update_fn(updates, state, params=None):
        del params
        summed, _ = clipped_sum(updates, None, clip_norm)
        new_key, k = jax.random.split(state.rng_key)
        out = noisy_average(summed, k, noise_std=noise_multiplier * clip_norm,
                            expected_batch_size=expected_batch_size)
        return out, DPAggregateState(rng_key=new_key)

    return optax.GradientTransformation(init_fn, update_fn)


__all__ = [
    "DPAggregateState", "PoissonSample", "auto_physical_batch", "clip_per_example", "clipped_sum",
    "dp_aggregate", "gaussian_noise_like", "mask_examples", "noisy_average",
    "per_example_clipped_sum", "per_example_norms", "poisson_sample",
]

