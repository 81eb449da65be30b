"""Resuming a run: the configuration hash its checkpoints carry (what a resumed run may
change), the run directory's verdict before a run starts or resumes, and the state and
metrics it resumes from."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Callable

import jax
import numpy as np

from jaxfednas.checkpoint import checkpoint_files, CheckpointError, read_checkpoint, sha256_text
from jaxfednas.config import apply_overrides, ConfigError, current_name, ExperimentConfig
from jaxfednas.data import partition as part
from jaxfednas.registry import config_from_dict
from jaxfednas.reports import _read_metrics
from jaxfednas.rundir import (CHECKPOINT, check_run_directory, holds_run, PartitionChangedError, RunDirectoryError,
                              RunExistsError,
                              _read_config_json, _refuse_non_file, _RunLock)

CADENCE_FIELDS = ("rounds", "eval_every", "checkpoint_every")
"""``run`` fields a resumed run may change: how long it runs and how often it evaluates and saves."""

LAYOUT_FIELDS = ("placement", "client_chunk_size", "memory_budget_gib")
"""``run`` fields a resumed run may change too: how the clients are laid on the devices, not what
they compute (a run moved to another machine; its numbers then agree with an uninterrupted run's
up to floating-point rounding, said in a note)."""


def config_hash(cfg: ExperimentConfig) -> str:
    """Hash of everything that determines the trajectory (the run's cadence,
    :data:`CADENCE_FIELDS`, and the clients' layout, :data:`LAYOUT_FIELDS`, excluded, so a
    finished run can be extended and a run can move to other devices)."""
    return _dict_hash(cfg.to_dict())


def _dict_hash(d: dict, excluded: tuple[str, ...] = CADENCE_FIELDS + LAYOUT_FIELDS) -> str:
    d = {**d, "run": {k: v for k, v in d.get("run", {}).items() if k not in excluded}}
    return sha256_text(json.dumps(d, sort_keys=True))


def _dict_hash_v1(d: dict) -> str:
    """The hash checkpoints carried before the layout was excluded (only the cadence)."""
    return _dict_hash(d, CADENCE_FIELDS)


def _accepted_hashes(cfg: ExperimentConfig, stored: dict, log: Callable[[str], None]) -> tuple[str, ...]:
    """The config hashes a run directory's checkpoints may carry when resuming ``cfg``
    (already checked equal to the directory's ``config.json`` read with today's
    defaults): ``cfg``'s own, and the hash of ``config.json`` as written -- which differs
    when the library has gained config fields since (the run resumes with their
    defaults, which keep the earlier behaviour; said in one line)."""
    written = _dict_hash(stored)
    # checkpoints written before the layout left the hash carry the older one, of config.json's
    # layout (the one they ran with) -- or of today's, where config.json was written since
    older = tuple(dict.fromkeys((_dict_hash_v1(stored), _dict_hash_v1(cfg.to_dict()))))
    if written == config_hash(cfg):
        return (written, *older)
    now = cfg.to_dict()
    sections = {"data": type(cfg.data), "run": type(cfg.run), "algo": type(cfg.algo)}
    seen = {s: {current_name(c, k) for k in stored.get(s, {})} for s, c in sections.items()}
    missing = [f"{s}.{k}" for s in sections for k in now.get(s, {}) if k not in seen[s]]
    if missing:
        log(f"note: config.json predates the fields {', '.join(missing)}; resuming with their defaults")
    return config_hash(cfg), written, *older


def resume_config(out_dir: str | os.PathLike, overrides: dict | None = None) -> ExperimentConfig:
    """The configuration of the run in ``out_dir`` with ``overrides`` applied (the CLI's
    ``--resume``); :func:`~jaxfednas.experiment.run_experiment` then checks that only run
    length, evaluation and checkpoint frequency changed."""
    cfg_path = Path(out_dir) / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"--resume: {out_dir} holds no run (no config.json)")
    return apply_overrides(config_from_dict(_read_config_json(cfg_path)), overrides or {})


def _anneals_over_rounds(cfg: ExperimentConfig) -> bool:
    """Whether a learning rate of ``cfg``'s algorithm follows a schedule over ``run.rounds``:
    its module's ``ANNEALS_OVER_ROUNDS(algo config) -> bool``, else a config whose
    ``lr_schedule`` is cosine (FedAvg's and the configs built on it)."""
    from jaxfednas.registry import algorithm_module  # noqa: PLC0415

    anneals = getattr(algorithm_module(cfg.algorithm), "ANNEALS_OVER_ROUNDS", None)
    return bool(anneals(cfg.algo)) if callable(anneals) else getattr(cfg.algo, "lr_schedule", None) == "cosine"


def _check_directory(cfg: ExperimentConfig, out: Path, resume: bool, lock: _RunLock,
                     log: Callable[[str], None]) -> list[str]:
    """(Process 0) the run directory's verdict, nothing written but the lock: a new run
    needs a directory holding no run; a resumed one the same configuration up to run
    length / evaluation / checkpoint frequency; either, no other process writing it
    (``lock`` is taken). Returns the configuration hashes a resumed checkpoint may carry."""
    check_run_directory(out)
    if resume and not (out / "config.json").exists():
        raise FileNotFoundError(f"--resume: {out} holds no run (no config.json)")
    lock.acquire()
    if not resume:
        if holds_run(out):
            try:
                _read_config_json(out / "config.json") if (out / "config.json").exists() else None
            except RunDirectoryError:
                raise RunExistsError(f"--out {out} holds a config.json that no run wrote; a run would overwrite it: "
                                     "choose an empty or new --out") from None
            if not (out / "config.json").exists():  # checkpoints without the configuration they belong to
                raise RunExistsError(f"--out {out} holds checkpoint files but no config.json: nothing there can be "
                                     "resumed and a run would overwrite them: choose an empty or new --out")
            raise RunExistsError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
        # hidden names are the lock and an interrupted atomic write's temporary file (".NAME.xxxx")
        foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not p.name.startswith("."))
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise RunExistsError(f"--out {out} holds files that no run wrote ({shown}); a run writes files of these "
                                 "names and would overwrite them: choose an empty or new --out")
        return [config_hash(cfg)]
    for name in ("config.json", "metrics.jsonl", CHECKPOINT, "summary.json"):
        _refuse_non_file(out / name)
    cfg_path = out / "config.json"
    raw = _read_config_json(cfg_path)
    if config_hash(config_from_dict(raw)) != config_hash(cfg):
        raise ConfigError(
            f"--resume: the configuration differs from the one in {cfg_path}; only run.rounds, "
            "run.eval_every and run.checkpoint_every, and the clients' layout (run.placement, "
            "run.client_chunk_size, run.memory_budget_gib) may change when resuming"
        )
    before, now = config_from_dict(raw).run, cfg.run
    if before.rounds != now.rounds and _anneals_over_rounds(cfg):
        raise ConfigError(f"--resume with run.rounds {before.rounds} -> {now.rounds}: {cfg.algorithm}'s learning rate "
                          "anneals over run.rounds (a cosine), so the rounds done followed another schedule than "
                          f"{now.rounds} rounds would; keep run.rounds={before.rounds}, or run {now.rounds} rounds "
                          "afresh in another --out")
    moved = [f"run.{f}: {getattr(before, f)} -> {getattr(now, f)}" for f in LAYOUT_FIELDS
             if getattr(before, f) != getattr(now, f)]
    if moved:
        log(f"note: the clients' layout changed ({', '.join(moved)}); the rounds from here agree with an "
            "uninterrupted run's up to floating-point rounding, not bit for bit")
    return list(_accepted_hashes(cfg, raw, log))


def _read_resumed(cfg: ExperimentConfig, out: Path, manifest: dict, shapes, accepted: tuple[str, ...],
                  log: Callable[[str], None]) -> tuple[Any, int, list[dict]]:
    """(Process 0, nothing written) ``(state, completed rounds, metrics rows)`` to resume
    from: the newest checkpoint that verifies, was written for this configuration and
    that metrics.jsonl covers, with the rows cut back to its round."""
    ckpt_path, mpath = out / CHECKPOINT, out / "metrics.jsonl"
    manifest_path = out / "partition" / "manifest.json"
    if manifest_path.exists():
        try:
            recorded = part.load_manifest(manifest_path)["sha256"]
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
            raise RunDirectoryError(f"--resume: {manifest_path} is not a partition manifest ({type(e).__name__}); "
                                    "the partition is recomputed from the configuration: remove the file to have "
                                    "it written again") from None
        if recorded != manifest["sha256"]:
            raise PartitionChangedError(f"--resume: the partition recomputed now differs from {manifest_path} (the "
                                        "dataset or the partitioning code changed since the run): continue with the "
                                        "data it used, or start afresh in another --out")
    rows = _read_metrics(mpath)
    if not checkpoint_files(ckpt_path):
        # the first save writes metrics.jsonl, then the checkpoint: a run stopped in between
        # has at most checkpoint_every rows and starts again at round 0 (its state is init(seed));
        # more rows mean that checkpoints were written and are gone: the run stops
        if len(rows) > cfg.run.checkpoint_every:
            raise CheckpointError(f"--resume: {out} has {len(rows)} rounds in metrics.jsonl but no checkpoint "
                                  f"({CHECKPOINT} and its older copies are gone); start afresh in another --out")
        if rows:
            log(f"{out}: stopped while saving its first checkpoint (metrics.jsonl has {len(rows)} round(s), no "
                "checkpoint); starting again at round 0")
        else:
            log(f"{out}: no round was completed before it stopped; starting at round 0")
        return None, 0, []
    try:
        state, start = read_checkpoint(ckpt_path, shapes, config_sha256=accepted, max_round=len(rows),
                                       warn=lambda m: log(f"warning: {m}"))
    except CheckpointError as e:
        raise CheckpointError(f"--resume: {e}; start afresh in another --out") from None
    bad = _nonfinite_leaves(state)
    if bad:  # a run never saves such a state (save() refuses it): the file was written by something else
        raise CheckpointError(f"--resume: {ckpt_path} (round {start}) holds NaN/inf in {_brief(bad)}: a diverged "
                              "state cannot be continued; start afresh in another --out")
    if cfg.run.rounds < start:
        raise ConfigError(f"--resume: run.rounds={cfg.run.rounds} is below the {start} rounds {out} has done; "
                          f"give run.rounds >= {start}")
    log(f"resumed {out} at round {start}")
    return state, start, rows[:start]


def _brief(ks: list[int]) -> str:
    return ", ".join(map(str, ks[:8])) + (", ..." if len(ks) > 8 else "")


def _nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` (NumPy) holding NaN or inf."""
    return [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.isfinite(x).all()]
