"""Fitting the clients in flight to a device's memory: the memory of a compiled round and the
largest ``run.client_chunk_size`` whose round fits a budget."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxfednas.config import ExperimentConfig
from jaxfednas.registry import build_algorithm
from jaxfednas.rng import init_key, round_key
from jaxfednas.runtime import device_memory_limit, on_accelerator, Placement


def round_memory_gib(algo, state, data, key) -> float:
    """Per-device memory of one compiled round (arguments + outputs - donated + XLA's
    temporaries, from ``compiled.memory_analysis()``), in GiB. Compiles the round."""
    m = algo.round.lower(state, data, key).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes) / 2**30


AUTO_MEMORY_FRACTION = 0.9
"""Share of an accelerator's memory (its allocator's ``bytes_limit``) that ``placement=auto``
fills with clients in flight when no budget or chunk size is given."""


def auto_memory_budget_gib(cfg: ExperimentConfig) -> float | None:
    """The per-device budget ``placement=auto`` fits the round to by itself: on an
    accelerator, with neither ``run.client_chunk_size`` nor ``run.memory_budget_gib`` given,
    :data:`AUTO_MEMORY_FRACTION` of the device's memory; else None (CPU: clients run one
    after another there, which is faster and needs no fitting)."""
    run = cfg.run
    if run.placement != "auto" or run.client_chunk_size is not None or run.memory_budget_gib is not None:
        return None
    if not on_accelerator():
        return None
    limit = device_memory_limit()
    return None if limit is None else AUTO_MEMORY_FRACTION * limit / 2**30


def _round_gib(cfg: ExperimentConfig, data) -> float:
    algo = build_algorithm(cfg, data.info)
    return round_memory_gib(algo, algo.init(init_key(cfg.run.seed)), data, round_key(cfg.run.seed, 0))


def fit_memory_budget(cfg: ExperimentConfig, data, log: Callable[[str], None] = print) -> ExperimentConfig:
    """``cfg`` with ``run.client_chunk_size`` (clients in flight per device) the largest
    of 1, 2, 4, ... (and every client of a device) whose compiled round fits
    ``run.memory_budget_gib`` per device; 1 with a warning when none fits. Unchanged when
    no budget is set. Each candidate is compiled once (the persistent compilation cache,
    when on, keeps the chosen one).

    With no budget, chunk size or placement given on an accelerator
    (:func:`auto_memory_budget_gib`), the round as configured is compiled first and kept
    when it fits (every client at once, or the one-at-a-time round of single-path
    algorithms); otherwise the largest chunk that fits is chosen as above."""
    budget, auto = cfg.run.memory_budget_gib, False
    if budget is None:
        budget = auto_memory_budget_gib(cfg)
        auto = budget is not None
    if budget is None:
        return cfg
    setting = f"placement=auto ({budget:.3g} GiB: {AUTO_MEMORY_FRACTION:.0%} of the device)" if auto else \
        f"run.memory_budget_gib={budget}"
    if auto:
        whole = _round_gib(cfg, data)
        if whole <= budget:
            log(f"{setting}: the round as configured needs {whole:.3g} GiB per device; keeping it")
            return cfg
    placement = Placement.from_run(cfg.run)
    per_device = placement.clients_per_device(data.info.num_clients)
    candidates = sorted({min(2**i, per_device) for i in range(per_device.bit_length() + 1)})
    chosen, table = None, []
    for c in candidates:
        gib = _round_gib(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, client_chunk_size=c)), data)
        table.append(f"{c}: {gib:.3g} GiB")
        if gib > budget:
            break
        chosen = c
    if chosen is None:
        log(f"warning: {setting}: even one client in flight needs {table[0].split(': ')[1]} "
            "per device; running with client_chunk_size=1")
        chosen = 1
    log(f"{setting}: clients in flight per device -> round memory {', '.join(table)}; "
        f"using client_chunk_size={chosen}")
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, client_chunk_size=chosen))


LAYOUT = "layout.json"
"""The file of a run directory that records the clients' layout that ran (:func:`run_layout`)."""


def run_layout(configured: ExperimentConfig, fitted: ExperimentConfig, num_clients: int) -> dict:
    """The clients' layout a run ran with: the placement resolved on this machine, the
    clients in flight per device (``client_chunk_size``, after :func:`fit_memory_budget`;
    None: the placement's default) and what chose them (the configured settings)."""
    import jax  # noqa: PLC0415

    placement = Placement.from_run(fitted.run)
    return {"placement": placement.resolved(), "within": placement.resolved_within(),
            "client_chunk_size": fitted.run.client_chunk_size, "devices": jax.device_count(),
            "clients_per_device": placement.clients_per_device(num_clients),
            "configured": {f: getattr(configured.run, f) for f in ("placement", "client_chunk_size",
                                                                     "memory_budget_gib")}}


def layout_changes(before: dict, now: dict) -> list[str]:
    """What differs between two :func:`run_layout` records (``"client_chunk_size: 8 -> 4"``)."""
    return [f"{k}: {before.get(k)} -> {now.get(k)}" for k in ("placement", "within", "client_chunk_size", "devices")
            if before.get(k) != now.get(k)]
