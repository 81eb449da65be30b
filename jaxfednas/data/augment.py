"""On-device augmentation for NHWC float batches (after normalisation).

The papers' pipelines (docs/authors_code.md §1.4): random crop with zero padding, random
horizontal flip and, for FedML's CIFAR loaders, Cutout(16) applied *after*
normalisation. Each example draws its own randomness from ``key``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Augment:
    """Augmentation settings. ``crop_padding=0``, ``flip=False``, ``cutout=0`` is identity."""

    crop_padding: int = 0
    flip: bool = False
    cutout: int = 0  # side of the zeroed square; 0 disables

    def __post_init__(self):
        for name in ("crop_padding", "cutout"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Augment.{name} must be an integer >= 0, got {v!r}")

    @property
    def enabled(self) -> bool:
        return self.crop_padding > 0 or self.flip or self.cutout > 0


def _one(key: jax.Array, x: jax.Array, aug: Augment) -> jax.Array:
    h, w, _ = x.shape
    k_crop, k_flip, k_cut = jax.random.split(key, 3)
    if aug.crop_padding:
        p = aug.crop_padding
        padded = jnp.pad(x, ((p, p), (p, p), (0, 0)))
        oy, ox = jax.random.randint(k_crop, (2,), 0, 2 * p + 1)
        x = jax.lax.dynamic_slice(padded, (oy, ox, 0), (h, w, x.shape[2]))
    if aug.flip:
        x = jnp.where(jax.random.bernoulli(k_flip), x[:, ::-1, :], x)
    if aug.cutout:
        # DARTS' Cutout: centre uniform over the image, square clipped at borders.
        cy = jax.random.randint(k_cut, (), 0, h)
        cx = jax.random.randint(jax.random.fold_in(k_cut, 1), (), 0, w)
        half = aug.cutout // 2
        ys = jnp.arange(h)[:, None]
        xs = jnp.arange(w)[None, :]
        inside = (ys >= cy - half) & (ys < cy + half) & (xs >= cx - half) & (xs < cx + half)
        x = jnp.where(inside[:, :, None], 0.0, x)
    return x


def augment_batch(key: jax.Array, x: jax.Array, aug: Augment) -> jax.Array:
    """Augment a batch ``[B, H, W, C]``; returns ``x`` unchanged when ``aug`` is off."""
    if not aug.enabled:
        return x
    keys = jax.random.split(key, x.shape[0])
    return jax.vmap(_one, in_axes=(0, 0, None))(keys, x, aug)
