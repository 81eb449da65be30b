"""The ShuffleNetV2 choice-block supernet of DSNAS / DFNAS and its child networks.

:class:`ShuffleSpace` fixes the geometry; :data:`SPACES` holds the named ones:

* ``"cross_silo"`` — DFNAS' CIFAR-10 space: 20 choice blocks × 4 candidates (4^20), the
  SPOS/DSNAS stage layout (repeats 4, 4, 8, 4; widths 64, 160, 320, 640; last 1×1 conv
  to 1024). **32×32 geometry (our decision; the paper gives none):** the ImageNet stem
  (3×3 stride 2) and five stride-2 stages would shrink a 32×32 image to 1×1, so the
  stem has stride 1 and the first stage keeps the resolution: 32 → 32 → 16 → 8 → 4
  (the ResNet-on-CIFAR schedule). A child has 2.14M (all k3: the paper's "2.1M") to
  2.86M (all Xception) parameters for 10 classes and 93M–116M multiply-adds per image.
* ``"cross_device"`` — 12 blocks × 3 candidates (3^12) as the paper states; the layout
  is not given anywhere, so: repeats 2, 2, 6, 2 (ShuffleNet's heavy third stage), the
  same widths, candidates k3/k5/k7 (the Xception unit, the slowest on devices, is left
  out).
* ``"imagenet"`` — the DSNAS/SPOS ImageNet supernet itself (224×224, stem stride 2,
  every stage stride 2), for reference: its children span 296M–359M multiply-adds,
  the 290M–360M range SPOS reports for this space.
* ``"small"`` — a narrow 7-block space for 8×8 digits (3 stages: repeats 1, 3, 3; widths
  16, 32, 64; 4^7). Few stage-first blocks on purpose: a stage's first unit replaces
  every channel (no pass-through half), so with a different sampled unit each step the
  features change completely; with stages (2, 2, 2, 2) one client reached 48 % training
  accuracy after 10 local epochs, with (1, 3, 3) 88 %;
  ``"tiny"`` — 3 blocks for tests.

One module, :class:`ShuffleNetwork`, serves both roles: with ``choices=None`` it is the
supernet (every block holds every candidate; α of shape ``(blocks, candidates)`` lives
in the ``arch`` collection, init N(1, 0.01)); with ``choices`` a tuple it is the child
network that holds and runs only the chosen unit of each block.

``scan_blocks=True`` runs every run of consecutive blocks with the same
:class:`BlockSpec` and candidates (:meth:`ShuffleNetwork.block_runs`: in the supernet
each stage's blocks after its first; in a child, equal consecutive choices) as one
``lax.scan``, so its body is traced and compiled once instead of once per block. The
variables do not change: ``init`` builds every block as ``block{l}`` (unrolled), and
``apply`` stacks the run's variables (``jnp.stack``: each block gets its own gradient),
scans a functional :class:`ChoiceBlock` over them with the per-block path index (still a
``lax.switch``: one unit runs) and gate, and writes each block's new BatchNorm statistics
back under ``block{l}``; checkpoints, :func:`~jaxfednas.search_spaces.shufflenet.child_variables`,
the cost tables and DFNAS' masks are the same either way. ``all_paths`` and ``remat``
networks and children scan too. Outputs, statistics and gradients equal the unrolled
network's to float rounding (tests/integration/search_spaces/test_shufflenet.py). Off by default: on the
``cross_silo`` DFNAS local search (2 CPU cores, batch 64, three runs under load ~3) it
halved trace + lowering (38-44 s -> 22-24 s) but XLA's compile barely moved (74-85 s ->
64-82 s), and a step got 15-27 % slower (1.62-1.77 -> 1.92-2.06 s); the cause was not
isolated (a guess: the switch's residuals, one set per candidate, are copied into the
scan's stacked buffers). Unrolled, each block is applied through one jitted function of an
unbound :class:`ChoiceBlock` (``_apply_block``), so equal-shaped blocks still share one
trace: the same local search traces + lowers in 11.5 s (19.7 s calling the block modules
directly; XLA's compile and the step unchanged).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .blocks import BN_EPS, CANDIDATES, Head, make_unit, Stem


class BlockSpec(NamedTuple):
    inp: int  # channels entering the main branch (half the block input for stride-1 units)
    oup: int
    stride: int
    first: bool  # first block of a stage: projection branch instead of a channel split


@dataclasses.dataclass(frozen=True)
class ShuffleSpace:
    """Geometry of a ShuffleNetV2 choice-block space."""

    name: str
    candidates: tuple[str, ...]
    stage_repeats: tuple[int, ...]
    stage_channels: tuple[int, ...]
    stage_strides: tuple[int, ...]
    stem_channels: int = 16
    stem_stride: int = 1
    last_channels: int = 1024

    def __post_init__(self):
        bad = [c for c in self.candidates if c not in CANDIDATES]
        if bad or not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates must be distinct names from {CANDIDATES}, got {self.candidates}")
        n = len(self.stage_repeats)
        if n == 0 or len(self.stage_channels) != n or len(self.stage_strides) != n:
            raise ValueError("stage_repeats, stage_channels and stage_strides need one entry per stage")
        if any(r < 1 for r in self.stage_repeats) or any(s not in (1, 2) for s in self.stage_strides):
            raise ValueError("stage repeats must be >= 1 and stage strides 1 or 2")
        if any(c % 4 for c in self.stage_channels):
            raise ValueError(f"stage channels must be multiples of 4 (channel split, mid = C/2), got {self.stage_channels}")

    @property
    def num_blocks(self) -> int:
        return sum(self.stage_repeats)

    @property
    def num_candidates(self) -> int:
        return len(self.candidates)

    def plan(self) -> tuple[BlockSpec, ...]:
        """Per block: main-branch input channels, output channels, stride, first-of-stage."""
        out, prev = [], self.stem_channels
        for reps, ch, stride in zip(self.stage_repeats, self.stage_channels, self.stage_strides):
            for i in range(reps):
                out.append(BlockSpec(prev, ch, stride, True) if i == 0 else BlockSpec(ch // 2, ch, 1, False))
            prev = ch
        return tuple(out)

    def downsampling(self) -> int:
        f = self.stem_stride
        for s in self.stage_strides:
            f *= s
        return f


SPACES: dict[str, ShuffleSpace] = {
    "cross_silo": ShuffleSpace("cross_silo", CANDIDATES, (4, 4, 8, 4), (64, 160, 320, 640), (1, 2, 2, 2)),
    "cross_device": ShuffleSpace("cross_device", ("k3", "k5", "k7"), (2, 2, 6, 2), (64, 160, 320, 640),
                                 (1, 2, 2, 2)),
    "imagenet": ShuffleSpace("imagenet", CANDIDATES, (4, 4, 8, 4), (64, 160, 320, 640), (2, 2, 2, 2),
                             stem_stride=2),
    "small": ShuffleSpace("small", CANDIDATES, (1, 3, 3), (16, 32, 64), (1, 2, 2), stem_channels=8,
                          last_channels=128),
    "tiny": ShuffleSpace("tiny", CANDIDATES, (1, 2), (8, 16), (1, 2), stem_channels=8, last_channels=32),
}


def get_space(name: str) -> ShuffleSpace:
    if name not in SPACES:
        raise ValueError(f"unknown ShuffleNet space {name!r}; available: {sorted(SPACES)}")
    return SPACES[name]


def init_alpha(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """DSNAS' ``log_alpha`` init: N(mean 1, std 0.01) — softmax ≈ uniform."""
    return 1.0 + 0.01 * jax.random.normal(key, shape, jnp.float32)


class ChoiceBlock(nn.Module):
    """Holds one unit per candidate (``units_0``, ``units_1``, ...); runs only ``index``.

    ``lax.switch`` (through ``nn.switch``) executes only the selected branch when the
    index is a scalar; under ``vmap`` over clients it would become a select over every
    branch, which is why single-path algorithms map clients sequentially (DESIGN
    invariant 3). ``all_paths=True`` runs every candidate and keeps the selected output
    (same values): the cost a vmapped switch would pay, for benchmarks.
    """

    spec: BlockSpec
    candidates: tuple[str, ...]
    dw_impl: str | None = None
    all_paths: bool = False
    remat: bool = False
    bn_eps: float = BN_EPS

    def setup(self):
        s = self.spec
        unit = make_unit
        if self.remat:  # keep only the block input for the backward pass; recompute the unit
            unit = lambda *a: nn.remat(type(make_unit(*a)), static_argnums=(3,))(*a)  # noqa: E731
        self.units = [unit(c, s.inp, s.oup, s.stride, s.first, self.dw_impl, self.bn_eps) for c in self.candidates]

    def __call__(self, x, index, *, train: bool, mask):
        branches = [lambda mdl, h, m, i=i: mdl.units[i](h, m, train) for i in range(len(self.units))]
        if len(branches) == 1:
            return branches[0](self, x, mask)
        if self.is_initializing() or self.all_paths:
            outs = [b(self, x, mask) for b in branches]
            return jnp.stack(outs)[index]
        return nn.switch(index, branches, self, x, mask)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _apply_block(unit: ChoiceBlock, train: bool, update: bool, variables, h, index, mask):
    """``unit`` (unbound, hashable: equal specs hit one trace) on ``h``: ``(output, new
    batch_stats or None)``."""
    out = unit.apply(variables, h, index, train=train, mask=mask, mutable=["batch_stats"] if update else False)
    return (out[0], out[1]["batch_stats"]) if update else (out, None)


class ShuffleNetwork(nn.Module):
    """Supernet (``choices=None``) or child network (``choices`` = one index per block).

    ``__call__(x, path=None, gates=None, *, train, mask)``:
      * ``path``: int array ``[blocks]`` of candidate indices (supernet only; default
        ``argmax(α)``, i.e. the derived child inside the supernet);
      * ``gates``: float array ``[blocks]``; block ``l``'s output is multiplied by
        ``gates[l]`` (DSNAS' "1" indicator: pass ones and differentiate w.r.t. it to get
        each block's credit ∂L/∂1_l);
      * ``mask``: ``[B]`` bool, padded examples excluded from BatchNorm statistics.

    ``scan_blocks``: run identical consecutive blocks as one ``lax.scan`` (same variables
    and numbers; the module docstring has the trade-off).
    """

    space: ShuffleSpace
    num_classes: int
    choices: tuple[int, ...] | None = None
    dw_impl: str | None = None
    all_paths: bool = False
    remat: bool = False
    bn_eps: float = BN_EPS
    scan_blocks: bool = False

    def candidates_of(self, block: int) -> tuple[str, ...]:
        if self.choices is None:
            return self.space.candidates
        return (self.space.candidates[self.choices[block]],)

    def block_runs(self) -> tuple[tuple[int, ...], ...]:
        """Consecutive blocks with the same :class:`BlockSpec` and candidates (identical
        variable shapes): every block of a stage after its first in the supernet; blocks
        with equal consecutive choices in a child."""
        runs: list[list[int]] = []
        plan = self.space.plan()
        for l, spec in enumerate(plan):
            if runs and (plan[runs[-1][0]], self.candidates_of(runs[-1][0])) == (spec, self.candidates_of(l)):
                runs[-1].append(l)
            else:
                runs.append([l])
        return tuple(tuple(r) for r in runs)

    def _scanned(self, h, blocks: tuple[int, ...], path, gates, train: bool, mask):
        """Blocks ``blocks`` (identical shapes) as one ``lax.scan``: traced and compiled
        once. Each block's variables stay under ``block{l}``; they are stacked here
        (``jnp.stack`` is differentiable: every block gets its own gradient), a fresh
        unbound :class:`ChoiceBlock` is applied functionally per step, and the new
        BatchNorm statistics are written back block by block."""
        first = blocks[0]
        unit = ChoiceBlock(self.space.plan()[first], self.candidates_of(first), self.dw_impl, self.all_paths,
                           self.remat, self.bn_eps, parent=None)
        cols = [c for c in ("params", "batch_stats") if c in self.variables]
        xs = {"v": {c: jax.tree.map(lambda *a: jnp.stack(a), *[self.variables[c][f"block{l}"] for l in blocks])
                    for c in cols}}
        sl = slice(first, blocks[-1] + 1)
        if path is not None:
            xs["index"] = path[sl]
        if gates is not None:
            xs["gate"] = gates[sl]
        update = train and "batch_stats" in cols

        def body(h, x):
            out = unit.apply(x["v"], h, x.get("index"), train=train, mask=mask,
                             mutable=["batch_stats"] if update else False)
            y, new = out if update else (out, None)
            if "gate" in x:
                y = y * x["gate"]
            return y, None if new is None else new["batch_stats"]

        h, new = jax.lax.scan(body, h, xs)
        if update:
            for i, l in enumerate(blocks):
                self.put_variable("batch_stats", f"block{l}", jax.tree.map(lambda a: a[i], new))
        return h

    def _traced_block(self, l: int, h, index, train: bool, mask):
        """Block ``l`` applied functionally through :func:`_apply_block` (a jitted
        function of an unbound :class:`ChoiceBlock`, its variables and inputs): the blocks
        of a stage after its first have equal shapes, so they share one trace, its
        linearisation and lowering; XLA inlines the calls (the same program as calling
        the block module). Its new BatchNorm statistics go back under ``block{l}``."""
        unit = ChoiceBlock(self.space.plan()[l], self.candidates_of(l), self.dw_impl, self.all_paths, self.remat,
                           self.bn_eps, parent=None)
        cols = {c: self.variables[c][f"block{l}"] for c in ("params", "batch_stats") if c in self.variables}
        update = train and "batch_stats" in cols and self.is_mutable_collection("batch_stats")
        h, new = _apply_block(unit, train, update, cols, h, index, mask)
        if update:
            self.put_variable("batch_stats", f"block{l}", new)
        return h

    @nn.compact
    def __call__(self, x, path=None, gates=None, *, train: bool = False, mask=None):
        space = self.space
        nb, nc = space.num_blocks, space.num_candidates
        if self.choices is not None:
            if len(self.choices) != nb or any(not 0 <= c < nc for c in self.choices):
                raise ValueError(f"choices must give {nb} candidate indices in [0, {nc}), got {self.choices}")
            if path is not None:
                raise ValueError("a child network has fixed choices; do not pass path")
        elif path is None or self.is_initializing():  # α is only read to default the path
            alpha = self.variable("arch", "alpha", lambda: init_alpha(self.make_rng("params"), (nb, nc))).value
            if path is None:
                path = jnp.argmax(alpha, axis=-1)
        if mask is None:
            mask = jnp.ones((x.shape[0],), bool)
        h = Stem(space.stem_channels, space.stem_stride, self.bn_eps, name="stem")(x, train=train, mask=mask)
        plan = space.plan()
        for run in self.block_runs():
            if self.scan_blocks and len(run) > 1 and not self.is_initializing():
                h = self._scanned(h, run, path, gates, train, mask)
                continue
            for l in run:  # init creates every block here, so the variable layout is the unrolled one
                index = None if path is None else path[l]
                if self.is_initializing():
                    block = ChoiceBlock(plan[l], self.candidates_of(l), self.dw_impl, self.all_paths, self.remat,
                                        self.bn_eps, name=f"block{l}")
                    h = block(h, index, train=train, mask=mask)
                else:
                    h = self._traced_block(l, h, index, train, mask)
                if gates is not None:
                    h = h * gates[l]
        return Head(space.last_channels, self.num_classes, self.bn_eps, name="head")(h, train=train, mask=mask)
