"""Running an experiment into a run directory, resumably.

Layout of ``out_dir``::

    config.json                 the full ExperimentConfig
    partition/manifest.json     client -> example indices (+ sha256)
    partition/label_counts.txt  per-client label counts
    partition/label_heatmap.png
    metrics.jsonl               one line per round (train metrics; eval metrics on eval rounds)
    layout.json                 the clients' layout that ran: placement, clients in flight per device
                                (the chunk the memory fit picked), devices
    checkpoint.msgpack          whole algorithm state after the last saved round (atomic, sha256 header)
    checkpoint.<round>.msgpack  the previous saved round, kept to fall back on (see jaxfednas.checkpoint)
    clients.csv                 final per-client accuracies
    plots/curves.png, plots/client_accuracy.png
    architecture.json           (NAS algorithms) the exported architecture (SPIDER: personal_genotypes.json);
                                cell diagrams in plots/
    summary.json                final metrics, wall time, device info, layout

Everything except ``layout.json`` and the ``timing``, ``device`` and ``layout``
entries of ``summary.json`` (what machine ran it, and how) is a function of the
configuration alone: equal seeds give equal bytes, and a
resumed run ends with the bytes of an uninterrupted one. A resume restores the
newest checkpoint that verifies and that ``metrics.jsonl`` covers (a damaged one
is skipped with a one-line warning) and cuts ``metrics.jsonl`` back to its round.

This module holds the training loop; the run directory and its lock are
:mod:`jaxfednas.rundir`, resuming :mod:`jaxfednas.resume`, the files a run writes
:mod:`jaxfednas.reports`, fitting clients to memory :mod:`jaxfednas.memory_fit`, the
process around a run :mod:`jaxfednas.process`, and the examples' stages
:mod:`jaxfednas.stages`.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfednas.files import write_error, WriteError
from jaxfednas.checkpoint import atomic_write_text, checkpoint_config_hash, save_checkpoint, shape_template
from jaxfednas.config import ConfigError, ExperimentConfig, setting_warnings
from jaxfednas.data.datasets import Dataset, load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.distributed import broadcast, is_main, on_main, put_like, to_host
from jaxfednas.memory_fit import LAYOUT, fit_memory_budget, layout_changes, run_layout
from jaxfednas.progress import Progress
from jaxfednas.rng import init_key, round_key
from jaxfednas.registry import build_algorithm
from jaxfednas.reports import device_info, _metrics_bytes, _report, _scalars, write_partition_report, _write_metrics
from jaxfednas.resume import _brief, _check_directory, config_hash, _nonfinite_leaves, _read_resumed
from jaxfednas.rundir import CHECKPOINT, _ERRORS, RunDirectoryError, _RunLock
from jaxfednas.runtime import (CLIENT_AXIS, client_mesh, drop_compiled, Placement,
                               release_memory_after_compiles)


class NonFiniteError(RuntimeError):
    """A round produced a NaN/inf loss or state; the run stopped before saving it."""


def make_partition(cfg: ExperimentConfig, dataset: Dataset) -> dict:
    """The partition manifest (client -> train/val/test indices) for ``cfg.data``."""
    d = cfg.data
    seed = cfg.run.seed if d.partition_seed is None else d.partition_seed
    try:
        parts = part.partition(
            dataset.y_train, d.partition, d.num_clients, seed=seed, alpha=d.alpha,
            classes_per_client=d.classes_per_client, min_size=d.min_size,
        )
        splits = part.split_client_indices(parts, d.split, seed=seed, method=d.split_method)
    except ValueError as e:  # name the config section in partition errors
        raise ConfigError(f"data: {e}") from None
    params = {"alpha": d.alpha, "classes_per_client": d.classes_per_client, "min_size": d.min_size, "split": list(d.split)}
    if d.split_method != "shuffle":  # (absent before the option existed: old manifests keep their hash)
        params["split_method"] = d.split_method
    return part.build_manifest(dataset=dataset.name, method=d.partition, params=params, seed=seed, splits=splits)


@dataclasses.dataclass
class _Prepared:
    dataset: Dataset
    manifest: dict
    table: str
    data: Any
    algo: Any
    state: Any
    start: int
    rows: list
    layout: dict  # the clients' layout that runs (layout.json)


def _data_sharding(cfg: ExperimentConfig, num_clients: int, log: Callable[[str], None]):
    """Where the clients' examples live: split along the ``clients`` mesh when rounds run
    under ``shard_map`` and the clients divide evenly over the devices (each process then
    holds only its own devices' clients), else None (whole, on the default device)."""
    placement = Placement.from_run(cfg.run)
    if placement.resolved() != "shard_map":
        if jax.process_count() > 1:
            raise ConfigError(f"run.placement={cfg.run.placement!r} runs every client in every process; a "
                              "multi-process run needs run.placement=auto or shard_map")
        return None
    n = jax.device_count()
    if num_clients % n:
        if jax.process_count() > 1:
            log(f"warning: {num_clients} clients do not divide over {n} devices: every process holds every "
                f"client's examples (choose data.num_clients as a multiple of {n} to split them)")
        return None
    return NamedSharding(client_mesh(), PartitionSpec(CLIENT_AXIS))


def _quiet(message: str) -> None:
    pass


def _prepare(cfg: ExperimentConfig, out: Path, resume: bool, lock: _RunLock, log: Callable[[str], None]) -> _Prepared:
    """The run directory's rules (one place; see :func:`_check_directory` and
    :func:`_read_resumed`). Everything is checked, the algorithm built and a resumed state
    read before anything is written; then config.json, the partition report and (resumed)
    metrics.jsonl cut back to the checkpoint's round. Returns the data, algorithm and
    (restored) state. In a multi-process run, process 0 alone reads and writes the
    directory and hands its verdict and the restored state to the others."""
    accepted = tuple(on_main(lambda: _check_directory(cfg, out, resume, lock, log), errors=_ERRORS))
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    manifest = make_partition(cfg, dataset)  # (every process: it is a function of the config)
    splits = part.manifest_splits(manifest)
    _warn_about_splits(cfg, splits, log)
    _warn_about_inert_settings(cfg, log)
    data = make_federated_data(dataset, splits, sharding=_data_sharding(cfg, len(splits["train"]), log))

    fitted = fit_memory_budget(cfg, data, log)
    layout = run_layout(cfg, fitted, data.info.num_clients)  # what runs, recorded in the run directory
    algo = build_algorithm(fitted, data.info)
    state = algo.init(init_key(cfg.run.seed))
    drop_compiled(algo.init)  # it runs once: its program need not stay resident while the rounds run
    start, rows, restored = 0, [], None
    if resume:
        shapes = shape_template(state)

        def read() -> int:
            nonlocal rows, restored
            restored, start, rows = _read_resumed(cfg, out, manifest, shapes, accepted, log)
            return start

        start = on_main(read, errors=_ERRORS)
        if start:
            zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
            state = put_like(broadcast(restored if is_main() else zeros), state)

    def write() -> str:
        mpath = out / "metrics.jsonl"
        # cut back to the restored round now, so the directory is consistent even if this
        # run stops before its next save
        if mpath.exists() and mpath.read_bytes() != _metrics_bytes(rows):
            _write_metrics(mpath, rows)
        if start and checkpoint_config_hash(out / CHECKPOINT) != config_hash(cfg):
            # restored from a checkpoint of an older hash (accepted above, e.g. of another layout):
            # the same state saved again under today's, which matches the config.json written next,
            # so that a run stopped before its next save still resumes
            save_checkpoint(out / CHECKPOINT, restored, round=start, config_sha256=config_hash(cfg))
        atomic_write_text(out / "config.json", cfg.to_json())
        _write_layout(out, layout, start, log)
        return write_partition_report(manifest, dataset, out / "partition")

    table = on_main(write, errors=_ERRORS)
    return _Prepared(dataset, manifest, table, data, algo, state, start, rows, layout)


def _write_layout(out: Path, layout: dict, start: int, log: Callable[[str], None]) -> None:
    """``layout.json``: the clients' layout of the rounds from ``start`` on; a resumed run
    whose layout differs from the one its earlier rounds ran with says so (config.json
    records the settings; a chunk picked by the memory fit or by ``placement=auto`` shows
    only here)."""
    path = out / LAYOUT
    if start and path.is_file():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            before = None
        moved = layout_changes(before, layout) if isinstance(before, dict) else []
        if moved:
            log(f"note: the clients' layout that runs changed ({', '.join(moved)}); the rounds from here agree with "
                "an uninterrupted run's up to floating-point rounding, not bit for bit")
    atomic_write_text(path, json.dumps(layout, indent=2, sort_keys=True) + "\n")


_NO_DATA_DIR = ("digits", "cluttered_digits", "synthetic")  # bundled or generated: data.data_dir is not read


def _warn_about_inert_settings(cfg: ExperimentConfig, log: Callable[[str], None]) -> None:
    """One line for each setting given a value that the chosen configuration never reads
    (a trim fraction without the trimmed mean, a server learning rate without a server
    optimizer, a data directory for a bundled dataset): the run goes on, as configured."""
    run = cfg.run
    default = lambda name: type(run).__dataclass_fields__[name].default  # noqa: E731
    inert = []
    if run.trim_fraction != default("trim_fraction") and run.aggregator != "trimmed_mean":
        inert.append(f"run.trim_fraction={run.trim_fraction:g} (read only with run.aggregator=trimmed_mean)")
    if run.server_lr != default("server_lr") and run.server_optimizer == "none":
        inert.append(f"run.server_lr={run.server_lr:g} (read only with a run.server_optimizer)")
    if run.arch_server_lr != default("arch_server_lr") and run.arch_server_optimizer == "none":
        inert.append(f"run.arch_server_lr={run.arch_server_lr:g} (read only with a run.arch_server_optimizer)")
    if cfg.data.data_dir is not None and cfg.data.dataset in _NO_DATA_DIR:
        inert.append(f"data.data_dir={cfg.data.data_dir} (data.dataset={cfg.data.dataset} is bundled or generated)")
    for what in inert:
        log(f"warning: {what} has no effect in this configuration")


def _warn_about_splits(cfg: ExperimentConfig, splits: dict, log: Callable[[str], None]) -> None:
    """One line for clients left without training or test examples, whose updates would
    be empty or whose client test metrics NaN without a word otherwise (a note only when
    ``data.split`` keeps no client test set on purpose, as the paper presets do)."""
    for name, what in (("train", "train nothing"), ("test", "report NaN client test metrics")):
        empty = [k for k, idx in enumerate(splits[name]) if len(idx) == 0]
        if name == "test" and cfg.data.split[2] == 0 and len(empty) == len(splits[name]):
            log(f"note: data.split={','.join(f'{x:g}' for x in cfg.data.split)} keeps no client test examples: "
                "client_test_acc* are NaN (global_test_acc uses the dataset's test set)")
        elif empty:
            log(f"warning: {len(empty)} of {len(splits[name])} clients have no {name} examples and {what} "
                f"(clients {_brief(empty)}); check data.split and data.num_clients against the dataset's size")


def _suspects(cfg: ExperimentConfig, names: list[str]) -> str:
    """The settings most likely at fault for non-finite ``names`` (metrics or state paths)."""
    run, algo = cfg.run, cfg.algo
    settings = []
    if any("arch" in n or "alpha" in n or "policy" in n for n in names):
        settings += [f"algo.{f}={getattr(algo, f)}" for f in ("arch_lr", "arch_server_lr", "policy_lr")
                     if hasattr(algo, f)]
    if run.server_optimizer != "none":
        settings.append(f"run.server_lr={run.server_lr:g} (run.server_optimizer={run.server_optimizer})")
    if run.arch_server_optimizer != "none":
        settings.append(f"run.arch_server_lr={run.arch_server_lr:g}")
    for lr in ("lr", "server_lr"):  # (DP-FNAS has no client optimizer: its server's)
        if hasattr(algo, lr):
            settings.append(f"algo.{lr}={getattr(algo, lr)}")
    for clip in ("grad_clip", "server_grad_clip"):
        if hasattr(algo, clip):
            settings.append(f"algo.{clip}={getattr(algo, clip)} (> 0 clips)")
    return ("Likely at fault: " + ", ".join(settings) + ": try smaller steps") if settings else \
        "Try smaller learning rates."


def _train(cfg: ExperimentConfig, out: Path, run: _Prepared, *, progress, on_round_end, log):
    """Rounds ``run.start .. cfg.run.rounds`` with evaluation, checkpoints, Ctrl-C and
    non-finite handling. Returns ``(state, rows, final metrics, rounds completed,
    (first round's seconds, later rounds' seconds))``."""
    algo, data, state, rows = run.algo, run.data, run.state, run.rows
    ckpt_path, chash = out / CHECKPOINT, config_hash(cfg)
    total = cfg.run.rounds
    bar = Progress(total, run.start, enabled=progress if is_main() else False)
    saved_round = completed = run.start
    final: dict = {}
    t_first, t_rest = None, []  # seconds of the first round (with compilation) and of the later ones

    def last_good() -> str:
        return f"the last good checkpoint (round {saved_round}, {ckpt_path}) is kept" if saved_round else \
            "no checkpoint was written yet"

    def save(r):
        nonlocal saved_round
        host = to_host(state)  # (every process: sharded leaves are gathered by a collective)
        bad = _nonfinite_leaves(host)
        if bad:  # a diverged model is never saved as good
            raise NonFiniteError(f"round {r}: the state holds NaN/inf in {_brief(bad)}; stopped without saving "
                                 f"it: {last_good()}. {_suspects(cfg, bad)}")
        if is_main():
            try:
                # metrics first: rows past the checkpoint are cut on resume, missing ones could not be
                _write_metrics(out / "metrics.jsonl", rows)
                save_checkpoint(ckpt_path, host, round=r, config_sha256=chash)
            except (OSError, WriteError) as e:  # a full disk, a lost mount: the previous checkpoint is intact
                w = write_error(ckpt_path, e)
                raise RunDirectoryError(f"could not save round {r}: writing {w.path} failed: {w.reason}; "
                                        f"{last_good()}; {w.advice}, then continue with --resume") from None
        saved_round = r

    def host_metrics(s, metrics):
        metrics = to_host(metrics)
        return metrics if algo.host_metrics is None else algo.with_host_metrics(to_host(s), data, metrics)

    try:
        for r in range(run.start, total):
            t0 = time.perf_counter()
            new_state, metrics = algo.round(state, data, round_key(cfg.run.seed, r))
            metrics = host_metrics(new_state, metrics)
            row = {"round": r + 1, **_scalars(metrics)}
            if row.get("clients_reported", 1) == 0:
                log(f"warning: round {r + 1}: no sampled client reported (run.dropout_rate="
                    f"{cfg.run.dropout_rate:g}); the model is unchanged")
            evaluate = (r + 1) % cfg.run.eval_every == 0 or r + 1 == total
            if evaluate:
                evaluated = host_metrics(new_state, algo.evaluate(new_state, data))
                row.update(_scalars(evaluated))
            # training metrics, and evaluation losses (a client without test examples has a NaN accuracy)
            bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)
                   and (k in metrics or "loss" in k)]
            if bad:
                raise NonFiniteError(
                    f"round {r + 1}: {', '.join(f'{k}={row[k]}' for k in bad)}; stopped without saving this round: "
                    f"{last_good()}. {_suspects(cfg, bad)}"
                )
            state = new_state
            completed = r + 1
            if evaluate:
                final = evaluated
                if algo.export is not None:  # NAS: the architecture derived at this round
                    row["architecture"] = json.loads(algo.export(to_host(state)).to_json())
            rows.append(row)
            if t_first is None:
                t_first = time.perf_counter() - t0
            else:
                t_rest.append(time.perf_counter() - t0)
            if completed % cfg.run.checkpoint_every == 0 or completed == total:
                save(completed)
            bar.update(completed, row)
            if on_round_end is not None:
                on_round_end(completed, row)
    except KeyboardInterrupt:
        bar.close()
        if completed > saved_round:
            save(completed)
        if saved_round:
            log(f"interrupted: checkpoint of round {saved_round} saved in {ckpt_path}; continue with --resume")
        else:  # (no round finished: no checkpoint exists, and --resume starts at round 0)
            log("interrupted before the first round finished: no checkpoint was written; --resume starts the run "
                "again from round 0")
        raise
    finally:
        bar.close()
    if not final:  # nothing ran (already finished): evaluate the restored state
        final = host_metrics(state, algo.evaluate(state, data))
    return state, rows, final, completed, (t_first, t_rest)


def run_experiment(
    cfg: ExperimentConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool | None = None,
    on_round_end: Callable[[int, dict], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run ``cfg`` into ``out_dir`` (resuming from its checkpoint if ``resume``).

    ``on_round_end(round, metrics)`` is called after each completed round (a
    hook for tests and notebooks). Ctrl-C saves a checkpoint of the last
    completed round and re-raises ``KeyboardInterrupt``. A non-finite training
    metric or evaluation loss, or a state holding NaN/inf when it is due to be saved,
    raises :class:`NonFiniteError` without overwriting the checkpoint. The process
    holds ``out_dir``'s lock for the whole run (:class:`~jaxfednas.rundir.RunInUseError`
    if another has it); a failed write is a :class:`~jaxfednas.files.WriteError` or
    :class:`RunDirectoryError` with one line of advice. Returns the summary dict (also
    written to ``summary.json``).
    """
    if not isinstance(cfg, ExperimentConfig):
        raise TypeError(f"run_experiment(): cfg must be an ExperimentConfig (jaxfednas.registry.make_config or "
                        f"config_from_dict), got {type(cfg).__name__}")
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise TypeError(f"run_experiment(): out_dir must be a directory path (str or Path), got {out_dir!r:.60}")
    out = Path(out_dir)
    t_start = time.perf_counter()
    release_memory_after_compiles()  # the compiler's freed temporaries do not stay resident
    if not is_main():  # one writer, one voice: process 0 (a multi-process run)
        log = _quiet
    for warning in setting_warnings(cfg):
        log(f"warning: {warning}")
    lock = _RunLock(out, log)
    try:
        run = _prepare(cfg, out, resume, lock, log)  # the run directory
        state, rows, final, completed, (t_first, t_rest) = _train(cfg, out, run, progress=progress,
                                                                  on_round_end=on_round_end, log=log)  # the loop
        timing = {"wall_time_s": round(time.perf_counter() - t_start, 3),
                  "first_round_s_incl_compile": None if t_first is None else round(t_first, 3),
                  "later_rounds_s_mean": round(sum(t_rest) / len(t_rest), 4) if t_rest else None,
                  "processes": jax.process_count()}
        host_state = to_host(state)  # (every process: gathering rows split over processes is a collective)
        if not is_main():
            return {"algorithm": cfg.algorithm, "dataset": cfg.data.dataset, "rounds": completed,
                    "final": _scalars(final), "timing": timing, "device": device_info()}
        try:
            return _report(cfg, out, run, host_state, rows, final, completed, timing)  # the report
        except (OSError, WriteError) as e:
            w = write_error(out, e)
            raise RunDirectoryError(f"could not write the report {w.path}: {w.reason}; the checkpoint of round "
                                    f"{completed} is saved: {w.advice}, then run again with --resume (it writes "
                                    "the report without training)") from None
    finally:
        lock.release()


# The public names that lived here until 0.2 (one release of compatibility): reading one
# from this module imports it from its new home, with a DeprecationWarning naming it. (Names
# this module imports for its own use, such as CHECKPOINT, resolve without the warning.)
_MOVED = {
    **dict.fromkeys(("CHECKPOINT", "RUN_LOCK", "RunDirectoryError", "RunExistsError", "RunInUseError",
                     "check_run_directory", "holds_run"), "jaxfednas.rundir"),
    **dict.fromkeys(("enable_compilation_cache", "Terminated", "stop_on_sigterm", "out_of_memory",
                     "environment_error", "INTERRUPTED_CODES", "exit_process", "run_script"), "jaxfednas.process"),
    **dict.fromkeys(("CADENCE_FIELDS", "LAYOUT_FIELDS", "config_hash", "resume_config"), "jaxfednas.resume"),
    **dict.fromkeys(("round_memory_gib", "AUTO_MEMORY_FRACTION", "auto_memory_budget_gib", "fit_memory_budget"),
                    "jaxfednas.memory_fit"),
    **dict.fromkeys(("write_partition_report", "device_info", "client_table"), "jaxfednas.reports"),
    **dict.fromkeys(("run_stage", "StageRunner", "FinishedRun", "load_run", "inherited_accuracies"),
                    "jaxfednas.stages"),
}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"jaxfednas.experiment.{name} has moved to {module}.{name}; import it from {module} "
                  "(jaxfednas.experiment stops providing it in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
