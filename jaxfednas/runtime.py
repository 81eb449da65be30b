"""The federated runtime: which clients run, where they run, how results combine.

* :func:`round_clients` — the round's sampled clients and their keys, the one
  call every algorithm's round starts with (:func:`sample_clients`: uniform
  sampling without replacement, keyed by the round key so that a resumed run
  samples the same clients; keys from :mod:`jaxfednas.rng`).
* :func:`map_clients` — run a pure per-client function over a leading client
  axis. One call site, three placements: ``vmap`` (all clients batched),
  ``map`` (``lax.map`` in chunks of ``client_chunk_size`` to bound memory;
  chunk 1 runs clients one after another, so single-path methods pay for one
  path) and ``shard_map`` over a mesh axis named ``clients`` spanning every
  visible device (clients padded to a multiple of the device count with copies
  that are dropped before anything is aggregated, and that skip the work where clients
  run one after another within a device; within a device, clients are vmapped or
  chunk-mapped).
* :func:`weighted_mean`, :func:`masked_weighted_mean` — aggregation of pytrees
  over the client axis (BatchNorm statistics included: they are just leaves).
* :func:`gather_rows`, :func:`scatter_rows` — persistent per-client state
  (personal models, policies, masks) stored with a leading client axis.
* :func:`jit` — ``jax.jit`` with the XLA options every jaxfednas program is compiled
  with (:func:`compiler_options`: XLA:CPU's memory-optimised scheduler and LLVM at
  ``-O2``), traced with Python's garbage collector paused (:func:`gc_paused`).
* :func:`release_memory_after_compiles` — hand the compiler's freed temporaries back to
  the operating system before a freshly compiled program runs (lower peak RSS on CPU).
* :func:`step_if`, :func:`output_shapes` — a step that may be skipped, or a zeros carry
  shaped like a function's output, without tracing the function twice.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import math
import os
import platform
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxfednas import rng
from jaxfednas.config import PLACEMENTS
from jaxfednas.nn import target_platform
from jaxfednas.rng import client_keys

CLIENT_AXIS = "clients"

CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
"""XLA options of the ``"memory"`` scheduler on CPU, what every jaxfednas program compiles
with by default. XLA:CPU's default scheduler orders independent work for concurrency, so
a MiLeNAS step (a training and a validation pass that do not depend on each other) keeps
both passes' activations alive at once; the memory-optimised scheduler orders the same
operations to free buffers early. Same operations, bitwise-equal results. A trade, measured
on the 2-core CPU: XLA's temporary buffer of one FedNAS step at C=16, 8 cells, batch 64
11.7 -> 3.0 GiB (``benchmarks/fednas_search.py``); rounds on a quiet machine
(``benchmarks/studies/scheduler_ab.py``): FedNAS C=8, 5 cells 2.9x less temporary memory at 0.90x
the speed, DP-FNAS 1.8x less at 0.93x, DFNAS 1.2x less at 1.11x. Memory first, because at
the paper's size XLA's default needs ~12 GiB per client in flight on CPU;
``JAXFEDNAS_CPU_SCHEDULER=default`` buys the speed back. FedNAS' round asks for XLA's own
scheduler since its two passes run as one loop body and cannot overlap
(:func:`jaxfednas.algorithms.fednas.cpu_scheduler`: 6.2 instead of 3.0 GiB at that size, 13 % faster)."""

SCHEDULERS = ("memory", "default")

CPU_OPT_LEVEL = 2
"""LLVM optimisation level of every jaxfednas program on CPU (XLA's
``xla_backend_optimization_level``; XLA's default is 3). A compile-time trade with no measured
cost in speed: the convolutions and matmuls are library calls whatever the level, and ``-O2``
keeps LLVM's loop and SLP vectorisers for the fused elementwise loops. Measured on a 2-core
CPU (AMD EPYC, 2026-11-24): FedNAS config (b)'s local search (C=16, 8 cells,
``benchmarks/fednas_search.py``), fresh processes alternating the levels, XLA compile 50.0 /
49.4 s at 2 against 56.5 / 53.0 s at 3 (-9 %; 39.7 s at 0, but steps twice as slow); one round
each, compiled in one process (``benchmarks/studies/scheduler_ab.py --compare opt_level``): FedNAS
-7 %, DP-FNAS -18 %, DFNAS -3 %, round times within noise. Results differ from ``-O3``'s by
float rounding. ``JAXFEDNAS_CPU_OPT_LEVEL=0..3`` in the environment overrides it."""


def cpu_opt_level() -> int:
    """:data:`CPU_OPT_LEVEL`, or ``JAXFEDNAS_CPU_OPT_LEVEL`` from the environment (0-3)."""
    raw = os.environ.get("JAXFEDNAS_CPU_OPT_LEVEL")
    if not raw:
        return CPU_OPT_LEVEL
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"JAXFEDNAS_CPU_OPT_LEVEL must be 0, 1, 2 or 3, got {raw!r}")
    return int(raw)


KEEP_CALLS_OPTIONS = {"xla_disable_hlo_passes": "call-inliner"}
"""XLA options of a program that keeps the calls of its nested ``jax.jit`` s (XLA's
``call-inliner`` pass off) instead of inlining them: for programs built from a few large
functions traced once per shape and called many times, such as FedNAS' round over the
grouped DARTS cells (``search_spaces/darts/wide.py``), whose HLO passes then run over far
fewer instructions. Measured on a 2-core CPU (AMD EPYC, 2026-11-26), FedNAS' 8-cell round
(C=16, batch 64, 4 clients; ``benchmarks/studies/compile_phases.py``, fresh processes
alternated): HLO passes 18.5 -> 12.4 s, XLA compile 45.4 -> 39.9 s, trace + lower + compile
52.6 -> 47.3 s; step time and results: ``benchmarks/studies/scheduler_ab.py --compare
keep_calls``. A program asks for it with ``jit(..., keep_calls=True)``;
``JAXFEDNAS_CPU_KEEP_CALLS=0|1`` in the environment overrides every program's choice."""


def keep_calls_choice(keep_calls: bool) -> bool:
    """``keep_calls``, or ``JAXFEDNAS_CPU_KEEP_CALLS`` (``0`` or ``1``) from the environment."""
    raw = os.environ.get("JAXFEDNAS_CPU_KEEP_CALLS")
    if not raw:
        return bool(keep_calls)
    if raw not in ("0", "1"):
        raise ValueError(f"JAXFEDNAS_CPU_KEEP_CALLS must be 0 or 1, got {raw!r}")
    return raw == "1"


CPU_CONV_BACKENDS = {
    "ynn": {},  # XLA:CPU's default in jaxlib 0.12: convolutions fused into YNNPACK calls
    "xla": {"xla_cpu_experimental_ynn_fusion_type": ""},  # XLA's own (Eigen) convolutions
    "onednn": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_experimental_onednn_custom_call": True},
    "ynn+onednn": {"xla_cpu_experimental_onednn_custom_call": True},  # oneDNN for what YNNPACK does not take
}
"""The XLA options of each convolution library on CPU, by name -- YNNPACK (XLA's default, jaxlib
0.12), XLA's own Eigen convolutions, oneDNN's (what PyTorch's CPU convolutions call) as ``__onednn$convolution``
custom calls, or YNNPACK with oneDNN for the convolutions YNNPACK does not take (``ynn+onednn``:
in a DARTS training step, most of the gradient convolutions, which otherwise run on XLA's own).
``JAXFEDNAS_CPU_CONV=ynn|xla|onednn|ynn+onednn`` picks one for every program."""

CPU_CONV_DEFAULT = "ynn+onednn"
"""The convolution library of every jaxfednas program on an x86-64 CPU (:data:`CPU_CONV_BACKENDS`;
elsewhere XLA's default, ``ynn``, as oneDNN's custom calls are built for x86-64). Measured on a 2-core
AMD EPYC CPU, jax 0.12.1, in one process per comparison (``benchmarks/studies/conv_backends.py``):
a DARTS search edge (the 8-op ``MixedOp``, fused separable convolutions) forward + backward 1.29x
as fast as YNNPACK alone at C=16, batch 64 and 1.40x at C=8, batch 32, gradients as close to the
reference formulation as YNNPACK's; oneDNN for every convolution (``onednn``) 1.03x and ~0.7x. The
FedNAS local search step (``benchmarks/fednas_search.py --parts step``, separate processes): 1.16x
at C=8, 5 cells (1.88 vs 2.19 s/step), 1.07x at the paper's C=16, 8 cells (17.97 vs 19.27)."""


def cpu_conv_backend() -> str:
    """The convolution library of CPU programs: ``JAXFEDNAS_CPU_CONV``, else :data:`CPU_CONV_DEFAULT`
    on x86-64 and ``"ynn"`` (XLA's default) elsewhere."""
    raw = os.environ.get("JAXFEDNAS_CPU_CONV")
    if not raw:
        return CPU_CONV_DEFAULT if platform.machine().lower() in ("x86_64", "amd64") else "ynn"
    if raw not in CPU_CONV_BACKENDS:
        raise ValueError(f"JAXFEDNAS_CPU_CONV must be one of {', '.join(CPU_CONV_BACKENDS)}, got {raw!r}")
    return raw


def compiler_options(scheduler: str = "memory", keep_calls: bool = False) -> dict[str, str | int] | None:
    """The ``compiler_options`` of a program compiled with ``scheduler`` on the default
    backend. On CPU: ``xla_backend_optimization_level`` = :func:`cpu_opt_level` (left to JAX
    under ``JAX_DISABLE_MOST_OPTIMIZATIONS``, which compiles at ``-O0``), plus
    :data:`CPU_COMPILER_OPTIONS` for ``"memory"`` (nothing more for ``"default"``, XLA's own
    scheduler), plus :data:`KEEP_CALLS_OPTIONS` where ``keep_calls`` (:func:`keep_calls_choice`),
    plus the convolution library's options (:func:`cpu_conv_backend`); ``None`` on other backends
    or where nothing is set.
    ``JAXFEDNAS_CPU_SCHEDULER=memory|default`` in the environment overrides every program's
    choice (for comparisons). Pass them to your own
    ``jax.jit(..., compiler_options=compiler_options())`` (or use :func:`jit`)."""
    choice = os.environ.get("JAXFEDNAS_CPU_SCHEDULER") or scheduler
    if choice not in SCHEDULERS:
        raise ValueError(f"the CPU scheduler (JAXFEDNAS_CPU_SCHEDULER or scheduler=) must be 'memory' or "
                         f"'default', got {choice!r}")
    if target_platform() != "cpu":
        return None
    options: dict[str, str | int] = {}
    if not jax.config.read("jax_disable_most_optimizations"):  # that switch (the test suite's) sets -O0 itself
        options["xla_backend_optimization_level"] = cpu_opt_level()
    if choice == "memory":
        options.update(CPU_COMPILER_OPTIONS)
    if keep_calls_choice(keep_calls):
        options.update(KEEP_CALLS_OPTIONS)
    options.update(CPU_CONV_BACKENDS[cpu_conv_backend()])
    return options or None


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside the block, back as it was after.

    Tracing a large program allocates hundreds of thousands of long-lived objects (FedNAS'
    8-cell round: ~700,000), so the collector runs its full passes over a heap that only
    grows, for nothing: the trace's objects are alive until it ends. Measured on a 2-core
    CPU (2026-11-26), that round's trace + lowering 7.0 / 6.9 s with the collector on, 4.9 /
    5.1 s paused. Cycles made inside the block are collected after it, as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Jit:
    """``jax.jit(fn)`` twice: with :func:`compiler_options` when called (or lowered) as a
    program of its own, without when called inside another trace (JAX accepts compiler
    options only on the outermost jit; algorithms call each other's ``init`` / ``round``).
    A top-level call (its trace, when it traces), ``lower``, ``trace`` and ``eval_shape``
    run under :func:`gc_paused`."""

    def __init__(self, fn: Callable, options: dict | None, kwargs: dict):
        self.options = dict(options or {})  # what the outermost program compiles with
        self.top = jax.jit(fn, compiler_options=options, **kwargs)
        self.nested = jax.jit(fn, **kwargs) if options else self.top
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "jitted")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs))):
            return self.nested(*args, **kwargs)
        with gc_paused():
            return self.top(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with gc_paused():
            return self.top.lower(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forget the compiled programs (see :func:`drop_compiled`)."""
        self.top.clear_cache()
        if self.nested is not self.top:
            self.nested.clear_cache()

    def eval_shape(self, *args, **kwargs):
        with gc_paused():
            return self.top.eval_shape(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with gc_paused():
            return self.top.trace(*args, **kwargs)


def jit(fn: Callable, *, scheduler: str = "memory", keep_calls: bool = False, **kwargs) -> Callable:
    """``jax.jit(fn, **kwargs)`` compiled with :func:`compiler_options` of ``scheduler`` and
    ``keep_calls`` (only where it is the outermost jit: called inside another jitted function
    it is plain ``jax.jit``)."""
    return _Jit(fn, compiler_options(scheduler, keep_calls), kwargs)


RELEASE_AFTER_COMPILE_S = 1.0
"""Compilations at least this long (seconds) are followed by :func:`release_freed_memory`
once :func:`release_memory_after_compiles` is on."""


def release_freed_memory() -> bool:
    """Hand the memory the C allocator holds free back to the operating system (glibc's
    ``malloc_trim(0)``, every arena). XLA compiling a supernet's step allocates ~1-2 GiB
    of temporaries and frees them when done, but glibc keeps the freed pages, so the
    process stays that much larger while the program then runs: the peak RSS is the
    compiler's garbage plus the step's buffers. Measured on the 2-core CPU (FedNAS config
    (a), C=8, 5 cells, batch 32, ``benchmarks/fednas_search.py``): 2.5 GiB resident after
    compiling the local search, 1.3 GiB after this call (0.05-0.15 s). True where the call
    exists (Linux with glibc); elsewhere nothing happens and it returns False."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True


_RELEASE = {"listener": None}


def _release_listener(min_seconds: float) -> Callable[..., None]:
    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and duration >= min_seconds:
            release_freed_memory()
    return listener


def release_memory_after_compiles(enable: bool = True, min_seconds: float = RELEASE_AFTER_COMPILE_S) -> bool:
    """After every XLA compilation of at least ``min_seconds`` in this process (a JAX
    monitoring listener: it runs when the compiler returns, before the program first runs),
    :func:`release_freed_memory`. On from the moment ``jaxfednas.runtime`` is imported (every
    algorithm imports it), so the plain Python API gets it as ``run_experiment`` does; off
    again with ``enable=False``, or never on with ``JAXFEDNAS_RELEASE_MEMORY=0`` in the
    environment. Returns whether the listener is installed afterwards."""
    if _RELEASE["listener"] is not None:
        jax.monitoring.unregister_event_duration_listener(_RELEASE["listener"])
        _RELEASE["listener"] = None
    if enable and os.environ.get("JAXFEDNAS_RELEASE_MEMORY", "1") != "0":
        _RELEASE["listener"] = _release_listener(min_seconds)
        jax.monitoring.register_event_duration_secs_listener(_RELEASE["listener"])
    return _RELEASE["listener"] is not None


def drop_compiled(fn: Callable) -> None:
    """Forget the programs a jitted ``fn`` compiled (its own in-memory cache; the persistent
    compilation cache on disk keeps them, so a later call reloads rather than recompiles).
    For a program that runs once -- an algorithm's ``init`` in ``run_experiment`` -- whose
    executable would otherwise stay resident while the rounds run (FedNAS config (a)'s
    supernet init: 0.15 GiB). A function that is not jitted is left alone."""
    clear = getattr(fn, "clear_cache", None)
    if clear is not None:
        clear()


def output_shapes(fn: Callable, *args) -> tuple[Callable, Any]:
    """``(traced_fn, shapes)``: ``fn`` under ``jax.jit`` and the shapes of its output at
    ``args``. Calling ``traced_fn`` at the same shapes (in a ``lax.cond`` branch or a
    ``lax.scan`` body of the same trace) reuses this trace: a zeros-like branch or carry
    built from ``jax.eval_shape(fn, ...)`` would trace ``fn`` -- a whole supernet's
    training step -- a second time."""
    traced = jax.jit(fn)
    return traced, jax.eval_shape(traced, *args)


def zeros_of(shapes: Any) -> Any:
    """Zeros of every ``jax.ShapeDtypeStruct`` in ``shapes``."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def step_if(pred: jax.Array, step: Callable[[Any], tuple[Any, Any]], carry: Any) -> tuple[Any, Any]:
    """``step(carry) -> (carry, out)`` where ``pred`` holds, else ``(carry, zeros like out)``
    (a padded local-step slot, an iteration past the budget); ``step`` is traced once."""
    traced, (_, out) = output_shapes(step, carry)
    return jax.lax.cond(pred, traced, lambda c: (c, zeros_of(out)), carry)


def on_accelerator() -> bool:
    """Whether programs are traced for an accelerator (not the CPU): the default backend, or
    :func:`jaxfednas.nn.compile_for`'s platform."""
    return target_platform() != "cpu"


def device_memory_limit() -> int | None:
    """Bytes the first device's allocator may use (``memory_stats()["bytes_limit"]``), or
    None where the backend reports none (the CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 -- a backend without memory statistics raises
        stats = {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


@dataclasses.dataclass(frozen=True)
class Placement:
    """How clients are laid on devices.

    Attributes:
      mode: ``"vmap"``, ``"map"``, ``"shard_map"`` or ``"auto"`` (``shard_map``
        when more than one device is visible; on one device ``vmap``, except on
        CPU where sequential ``map`` is faster; on CPU ``auto`` also maps
        sequentially within each device).
      client_chunk_size: for ``map`` (and inside each device for ``shard_map``
        with ``within="map"``): clients vmapped together per ``lax.map`` step;
        ``None`` means 1 (strictly sequential).
      within: how clients are run inside one device under ``shard_map``:
        ``"vmap"`` or ``"map"``.
    """

    mode: str = "auto"
    client_chunk_size: int | None = None
    within: str = "vmap"

    def __post_init__(self):
        if self.mode not in PLACEMENTS:
            raise ValueError(f"placement mode must be one of {PLACEMENTS}, got {self.mode!r}")
        if self.within not in ("vmap", "map"):
            raise ValueError(f"placement within must be 'vmap' or 'map', got {self.within!r}")
        if self.client_chunk_size is not None and (
            not isinstance(self.client_chunk_size, int) or self.client_chunk_size < 1
        ):
            raise ValueError(
                f"client_chunk_size must be an integer >= 1 or None, got {self.client_chunk_size!r}"
            )

    @classmethod
    def from_run(cls, run: Any) -> Placement:
        """The placement a run's config asks for (``run.placement``, ``run.client_chunk_size``;
        a chunk size runs clients in chunks of that many within each device too)."""
        return cls(run.placement, run.client_chunk_size, "vmap" if run.client_chunk_size is None else "map")

    def single_path(self) -> Placement:
        """For single-path methods (one sampled candidate per block, ``lax.switch``):
        ``auto`` → clients one after another within each device (``lax.map``, chunk 1),
        across devices with ``shard_map``, because ``vmap`` turns a per-client switch
        into a select that computes every candidate. Explicit choices are kept
        (``vmap`` then pays for every candidate: a benchmark's reference)."""
        if self.mode != "auto":
            return self
        mode = "shard_map" if jax.device_count() > 1 else "map"
        return Placement(mode, client_chunk_size=self.client_chunk_size, within="map")

    def state_sharding(self) -> NamedSharding | None:
        """Where the server state lives between rounds: replicated over the ``clients``
        mesh under ``shard_map`` (where a round returns it), else None (the default
        device)."""
        if self.resolved() != "shard_map":
            return None
        return NamedSharding(client_mesh(), P())

    def jit_init(self, init: Callable, rows: tuple[str, ...] = ()) -> Callable:
        """``jit(init)`` with its state placed where rounds return theirs. Otherwise
        round 2, whose inputs carry the mesh sharding round 1 gave them, would compile the
        round a second time (tests/integration/algorithms/test_contract.py counts the traces). ``rows``: the
        state's per-client fields (see :meth:`state_shardings`)."""
        if self.state_sharding() is None:
            return jit(init)
        return jit(init, out_shardings=self.state_shardings(init, rows))

    def jit_round(self, round_fn: Callable, init: Callable, rows: tuple[str, ...]) -> Callable:
        """``jit(round_fn)`` returning the state placed as :meth:`jit_init` places it
        (per-client ``rows`` split along the ``clients`` mesh) and replicated metrics."""
        if self.state_sharding() is None:
            return jit(round_fn)
        return jit(round_fn, out_shardings=(self.state_shardings(init, rows), self.state_sharding()))

    def state_shardings(self, init: Callable, rows: tuple[str, ...]) -> Any:
        """Where each leaf of ``init``'s state lives under ``shard_map``: the leaves of the
        fields named in ``rows`` (persistent per-client rows with a leading client axis:
        personal models, policies, masks) split along the ``clients`` mesh when the clients
        divide evenly over the devices, so a device keeps only its own clients' rows
        between rounds; everything else replicated."""
        shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))
        mesh, n = client_mesh(), jax.device_count()
        split, whole = NamedSharding(mesh, P(CLIENT_AXIS)), NamedSharding(mesh, P())
        every = jax.tree.map(lambda _: whole, shapes)
        return every.replace(**{f: jax.tree.map(lambda x: split if x.shape and x.shape[0] % n == 0 else whole,
                                                getattr(shapes, f)) for f in rows})

    def resolved(self) -> str:
        if self.mode != "auto":
            return self.mode
        if jax.device_count() > 1:
            return "shard_map"
        # XLA:CPU turns vmapped per-client convolutions into slow grouped convolutions:
        # there, clients one after another are faster (benchmarks/RESULTS.md). On one
        # accelerator every client at once, unless a chunk size (given, or picked by
        # run.memory_budget_gib) asks for that many clients in flight at a time: a paper-sized
        # FedNAS round of 16 vmapped clients needs ~220 GiB (jaxfednas plan).
        if target_platform() == "cpu" or self.client_chunk_size is not None:
            return "map"
        return "vmap"

    def clients_per_device(self, clients: int) -> int:
        """How many of ``clients`` one device runs in a round under this placement."""
        return math.ceil(clients / jax.device_count()) if self.resolved() == "shard_map" else clients

    def resolved_within(self) -> str:
        if self.mode == "auto" and target_platform() == "cpu":
            return "map"
        return self.within


def resolve_clients_per_round(value: int | float, num_clients: int) -> int:
    """Clients per round from an integer count in ``[1, num_clients]`` or a float
    fraction in ``(0, 1]`` of ``num_clients`` (rounded, at least 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"clients_per_round must be an int or a float fraction, got {value!r}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"clients_per_round as a fraction must be in (0, 1], got {value}")
        return max(1, int(round(value * num_clients)))
    if not 1 <= value <= num_clients:
        raise ValueError(f"clients_per_round must be in [1, {num_clients}] (num_clients), got {value}")
    return value


def sample_clients(key: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """Sorted indices of ``clients_per_round`` clients drawn uniformly without replacement.
    Every client (full participation): the host constant ``np.arange(num_clients)``, which
    :func:`is_every_client` recognises so that rows are used in place instead of gathered
    (no copy, and no collective when the rows are split over devices)."""
    if clients_per_round == num_clients:
        return np.arange(num_clients, dtype=np.int32)
    idx = jax.random.choice(key, num_clients, (clients_per_round,), replace=False)
    return jnp.sort(idx).astype(jnp.int32)


def reporting_clients(round_key: jax.Array, ids: jax.Array, dropout_rate: float) -> jax.Array:
    """``[m]`` bool: which of the round's clients ``ids`` report their update. Each fails
    independently with probability ``dropout_rate`` (``run.dropout_rate``), drawn from
    ``(seed, round, client)`` (:func:`jaxfednas.rng.dropout_key`), so a resumed run drops
    the same clients. A client that fails does its local work but the server never sees
    it: it is left out of the aggregate and its persistent rows are not updated. Rate 0:
    every client reports (nothing is drawn)."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate == 0.0:
        return jnp.ones(ids.shape, bool)
    key = rng.dropout_key(round_key)
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(ids) >= dropout_rate


def round_clients(round_key: jax.Array, num_clients: int, clients_per_round: int) -> tuple[jax.Array, jax.Array]:
    """``(ids, keys)``: the sorted ids of this round's clients (:func:`sample_clients`
    on :func:`jaxfednas.rng.sample_key`) and one key per sampled client
    (:func:`jaxfednas.rng.client_keys`)."""
    ids = sample_clients(rng.sample_key(round_key), num_clients, clients_per_round)
    return ids, client_keys(round_key, ids)


# --- Placement --------------------------------------------------------------------


def _leading_size(tree: Any) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(tree)}
    if len(sizes) != 1:
        raise ValueError(f"per-client inputs must share one leading client axis, got sizes {sorted(sizes)}")
    return sizes.pop()


def _pad_clients(tree: Any, target: int) -> Any:
    """Pad the client axis to ``target`` rows with copies of row 0 (finite, real data)."""
    def pad(x):
        extra = target - x.shape[0]
        if extra == 0:
            return x
        return jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)], axis=0)

    return jax.tree.map(pad, tree)


def _run_local(fn, per_client, shared, mode: str, chunk: int | None):
    if mode == "vmap":
        return jax.vmap(fn, in_axes=(0, None))(per_client, shared)
    return jax.lax.map(lambda pc: fn(pc, shared), per_client, batch_size=chunk if chunk and chunk > 1 else None)


def _flagged(fn):
    """``fn`` on ``(row, flag)`` rows: a row whose flag is false skips ``fn`` (zeros)."""
    def run(c, sh):
        row, flag = c
        return step_if(flag, lambda args: (args, fn(*args)), (row, sh))[1]

    return run


def client_mesh() -> Mesh:
    """A 1-D mesh named ``clients`` over every visible device."""
    return Mesh(np.array(jax.devices()), (CLIENT_AXIS,))


def map_clients(
    fn: Callable[[Any, Any], Any],
    per_client: Any,
    shared: Any = None,
    *,
    placement: Placement = Placement(),
    active: Any = None,
) -> Any:
    """``[fn(c, shared) for c in per_client]`` stacked on a leading client axis.

    ``per_client`` is a pytree whose leaves share a leading axis (one row per
    client); ``shared`` is broadcast to every client. The result does not depend
    on the placement (up to float reassociation inside batched kernels).

    ``active`` (a bool per client, or one for all): a client whose flag is false skips
    ``fn`` and its row is zeros (per-client flags skip only where clients run in turn -- a
    vmapped branch is a select --; one flag for all skips each device's whole share, vmapped
    or not). Use it, never a ``lax.cond`` around ``map_clients``, to
    skip work on a condition: across several devices the result is gathered by a
    collective, and a collective inside a data-dependent branch deadlocked XLA:CPU's
    devices of one process now and then (SPIDER's search, about one run in three on 2
    cores: each device thread waiting at a different collective). Here the branch is per
    client, inside each device's own work, and the collectives run unconditionally.
    """
    everyone = None  # one flag for all: each device's whole share is one branch
    if active is not None and jnp.ndim(active) == 0:
        everyone = jnp.asarray(active, bool)
        shared = (shared, everyone)
    elif active is not None:
        fn = _flagged(fn)
        per_client = (per_client, jnp.broadcast_to(jnp.asarray(active, bool), (_leading_size(per_client),)))

    def local(f, pc, sh, how):
        if everyone is None:
            return _run_local(f, pc, sh, how, placement.client_chunk_size)
        sh, go = sh
        return step_if(go, lambda a: (a, _run_local(f, a[0], a[1], how, placement.client_chunk_size)), (pc, sh))[1]

    mode = placement.resolved()
    if mode in ("vmap", "map"):
        return local(fn, per_client, shared, mode)
    mesh = client_mesh()
    n_dev = mesh.devices.size
    m = _leading_size(per_client)
    target = math.ceil(m / n_dev) * n_dev
    padded = _pad_clients(per_client, target)
    within = placement.resolved_within()
    skip_padding = target > m and within == "map"

    # a padding row skips the work (its output is dropped below): devices that share
    # processors -- XLA:CPU's simulated devices -- do not pay for clients that do not exist
    run = _flagged(fn) if skip_padding else fn
    if skip_padding:
        padded = (padded, jnp.arange(target) < m)

    def on_device(pc, sh):
        return local(run, pc, sh, within)

    out = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(P(CLIENT_AXIS), P()),
        out_specs=P(CLIENT_AXIS),
        check_vma=False,
    )(padded, shared)
    # Every device gets every client's result (an all-gather), so what follows (the
    # aggregation, metrics) runs in one fixed order whatever the number of devices and
    # processes: the same bits as on one device, not a layout-dependent all-reduce.
    out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P()))
    return jax.tree.map(lambda x: x[:m], out)


# --- Aggregation ------------------------------------------------------------------


def normalized_weights(weights: jax.Array) -> jax.Array:
    w = jnp.asarray(weights, jnp.float32)
    return w / jnp.maximum(w.sum(), jnp.finfo(jnp.float32).tiny)


def weighted_mean(tree: Any, weights: jax.Array, fallback: Any = None) -> Any:
    """``sum_k w_k x_k / sum_k w_k`` over the leading client axis of every leaf.

    When every weight is zero (e.g. every sampled client has an empty training split)
    the mean is undefined: ``fallback`` (the previous server state) is returned if given,
    else zeros. See :func:`nothing_to_aggregate` for the matching metric."""
    w = normalized_weights(weights)
    mean = jax.tree.map(lambda x: jnp.tensordot(w, x.astype(jnp.float32), axes=1).astype(x.dtype), tree)
    if fallback is None:
        return mean
    return jax.tree.map(lambda a, b: jnp.where(nothing_to_aggregate(weights) > 0, b, a), mean, fallback)


def reported_metrics(weights: jax.Array, round_key: jax.Array, ids: jax.Array, dropout_rate: float) -> dict:
    """``clients_reported`` (of the round's sampled clients) and ``server_update_skipped``."""
    return {"clients_reported": reporting_clients(round_key, ids, dropout_rate).sum(),
            "server_update_skipped": nothing_to_aggregate(weights)}


def nothing_to_aggregate(weights: jax.Array) -> jax.Array:
    """1.0 when all aggregation weights are zero (the server kept its state), else 0.0:
    reported by every algorithm as the ``server_update_skipped`` metric."""
    return (jnp.asarray(weights, jnp.float32).sum() <= 0).astype(jnp.float32)


def masked_weighted_mean(tree: Any, masks: Any, weights: jax.Array, fallback: Any) -> Any:
    """Element-wise ``sum_k w_k m_k x_k / sum_k w_k m_k``; ``fallback`` where no client
    covers an element (e.g. a supernet weight no sampled subnet used).

    ``masks`` has the structure of ``tree`` (leaves broadcastable to it, with
    the same leading client axis), values in ``{0, 1}``.
    """
    w = jnp.asarray(weights, jnp.float32)

    def agg(x, m, fb):
        m = jnp.broadcast_to(m, x.shape).astype(jnp.float32)
        wm = m * w.reshape((-1,) + (1,) * (x.ndim - 1))
        num = (wm * x.astype(jnp.float32)).sum(0)
        den = wm.sum(0)
        return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), fb).astype(x.dtype)

    return jax.tree.map(agg, tree, masks, fallback)


# --- Persistent per-client rows ---------------------------------------------------


def is_every_client(idx: Any, num_clients: int) -> bool:
    """Whether ``idx`` is :func:`sample_clients`'s host constant for every client in order."""
    return isinstance(idx, np.ndarray) and idx.shape == (num_clients,) and bool((idx == np.arange(num_clients)).all())


def gather_rows(tree: Any, idx: jax.Array) -> Any:
    """Rows ``idx`` of every leaf (leading axis = all clients); every client: the leaves
    themselves."""
    return jax.tree.map(lambda a: a if is_every_client(idx, a.shape[0]) else a[idx], tree)


def scatter_rows(tree: Any, idx: jax.Array, rows: Any, keep: jax.Array | None = None) -> Any:
    """Write ``rows`` back at ``idx``; all other clients' rows are untouched. With ``keep``
    (``[len(idx)]`` bool, e.g. :func:`reporting_clients`), only the rows where it is True."""
    if keep is not None:
        rows = jax.tree.map(lambda a, r: jnp.where(keep.reshape((-1,) + (1,) * (r.ndim - 1)), r, gather_rows(a, idx)),
                            tree, rows)
    return jax.tree.map(lambda a, r: r.astype(a.dtype) if is_every_client(idx, a.shape[0]) else a.at[idx].set(r),
                        tree, rows)


# On by default: a user's first compiled round should not keep the compiler's freed
# temporaries resident (benchmarks/api_memory.py measures the difference).
release_memory_after_compiles()
