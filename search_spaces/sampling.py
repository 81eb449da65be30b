"""Random architectures: the control every search is compared with.

Random search trained with the same recipe is the standard baseline of neural architecture
search (Li & Talwalkar, "Random Search and Reproducibility for Neural Architecture Search",
arXiv:1902.07638; Yang et al., "NAS evaluation is frustratingly hard", arXiv:1912.12522).
None of the five papers' codes ships one; each space here has a sampler:

* :func:`random_genotype` -- a DARTS cell pair (FedNAS, DP-FNAS; SPIDER through
  :func:`random_mask`): per intermediate node two *distinct* inputs, uniformly among the
  cell inputs and the earlier nodes, each with an op drawn uniformly from the space's ops
  without ``none`` (a discrete cell never keeps the zero op: DARTS' ``derive`` excludes it);
* :func:`random_mask` -- the same cell pair as a SPIDER 0/1 mask over the supernet;
* :func:`random_shuffle_arch` -- a ShuffleNetV2 choice path (DFNAS), one uniform
  candidate per block;
* :func:`random_choice` -- a subnet of any :mod:`jaxfednas.search_spaces.choice` space
  (PerFedRLNAS: DARTS, elastic, hybrid), one uniform choice per dimension;
* :func:`matched` -- rejection sampling of any of these until a cost (parameters,
  multiply-adds) lies within ``rel_tol`` of a target's, so that "searched vs random"
  compares architectures of equal size.

Every sampler is a function of a JAX key alone (drawn on the host through
:func:`jaxfednas.rng.host_generator`): the same key gives the same architecture.
:func:`jaxfednas.rng.random_arch_key` names the keys of an experiment's random controls.
"""
from __future__ import annotations

from typing import Any, TypeVar
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxfednas.rng import host_generator
from jaxfednas.search_spaces.choice import check_choice, Dimension, num_choices
from jaxfednas.search_spaces.darts.genotypes import Genotype
from jaxfednas.search_spaces.darts.masks import mask_from_genotype
from jaxfednas.search_spaces.darts.operations import PRIMITIVES
from jaxfednas.search_spaces.shufflenet.arch import ShuffleArch
from jaxfednas.search_spaces.shufflenet.network import get_space

A = TypeVar("A")


def _cell(rng: np.random.Generator, ops: Sequence[str], steps: int) -> list[tuple[str, int]]:
    pairs = []
    for node in range(steps):
        inputs = np.sort(rng.choice(2 + node, size=2, replace=False))  # two distinct of c_{k-2}, c_{k-1}, nodes < i
        pairs += [(ops[int(rng.integers(len(ops)))], int(j)) for j in inputs]
    return pairs


def random_genotype(key: jax.Array, primitives: Sequence[str] = PRIMITIVES, steps: int = 4,
                    multiplier: int | None = None) -> Genotype:
    """A uniformly random DARTS cell pair: the normal cell, then the reduction cell, drawn
    independently. The output concatenates the last ``multiplier`` nodes (default: all)."""
    ops = [p for p in primitives if p != "none"]
    if not ops:
        raise ValueError(f"primitives {tuple(primitives)} hold no op but 'none': nothing to sample")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    multiplier = steps if multiplier is None else multiplier
    if not 1 <= multiplier <= steps:
        raise ValueError(f"multiplier must be in [1, steps={steps}], got {multiplier}")
    rng = host_generator(key)
    normal, reduce = _cell(rng, ops, steps), _cell(rng, ops, steps)
    concat = list(range(2 + steps - multiplier, 2 + steps))
    return Genotype(normal=normal, normal_concat=concat, reduce=reduce, reduce_concat=concat)


def random_mask(key: jax.Array, primitives: Sequence[str], steps: int) -> dict[str, np.ndarray]:
    """A SPIDER architecture drawn at random: the 0/1 mask over the supernet of
    :func:`random_genotype` (two kept incoming edges per node, one op on each)."""
    return mask_from_genotype(random_genotype(key, primitives, steps), primitives, steps)


def random_shuffle_arch(key: jax.Array, space: str) -> ShuffleArch:
    """A uniformly random path through a ShuffleNetV2 choice-block space."""
    sp = get_space(space)
    rng = host_generator(key)
    return ShuffleArch(space, tuple(int(c) for c in rng.integers(sp.num_candidates, size=sp.num_blocks)))


def random_choice(key: jax.Array, dims: Sequence[Dimension] | Any) -> np.ndarray:
    """A uniformly random subnet (int32 ``[D]``) of a choice space, given its ``dims`` or
    the space itself."""
    dims = getattr(dims, "dims", dims)
    k = num_choices(dims)
    rng = host_generator(key)
    return check_choice(dims, rng.integers(0, k).astype(np.int32))


def matched(key: jax.Array, sample: Callable[[jax.Array], A], cost: Callable[[A], float], target: float, *,
            rel_tol: float = 0.1, max_tries: int = 10_000) -> tuple[A, int]:
    """``(architecture, tries)``: the first of ``sample(k_1), sample(k_2), ...`` (keys split
    from ``key``) whose ``cost`` is within ``rel_tol`` of ``target``
    (``|cost - target| <= rel_tol * target``), and how many draws it took. Conditioning on the cost this way gives
    a uniform draw among the space's architectures of that size. ``ValueError`` when
    ``max_tries`` draws miss (the target is outside what the space reaches, or rare)."""
    if not target > 0:
        raise ValueError(f"target cost must be > 0, got {target}")
    if not rel_tol >= 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    costs = []
    for i in range(max_tries):
        arch = sample(jax.random.fold_in(key, i))
        c = float(cost(arch))
        if abs(c - target) <= rel_tol * target:
            return arch, i + 1
        costs.append(c)
    raise ValueError(f"no sample within {rel_tol:.0%} of cost {target:g} in {max_tries} draws "
                     f"(drawn costs ranged {min(costs):g}..{max(costs):g}): raise rel_tol or max_tries")
