"""Running an experiment into a run directory, resumably.

Layout of ``out_dir``::

    config.json                 the full ExperimentConfig
    partition/manifest.json     client -> example indices (+ sha256)
    partition/label_counts.txt  per-client label counts
    partition/label_heatmap.png
    metrics.jsonl               one line per round (train metrics; eval metrics on eval rounds)
    checkpoint.msgpack          whole algorithm state after the last saved round (atomic, sha256 header)
    checkpoint.<round>.msgpack  the previous saved round, kept to fall back on (see jaxfednas.checkpoint)
    clients.csv                 final per-client accuracies
    plots/curves.png, plots/client_accuracy.png
    architecture.json           (NAS algorithms) the exported architecture (SPIDER: personal_genotypes.json);
                                cell diagrams in plots/
    summary.json                final metrics, wall time, device info

Everything except the ``timing`` and ``device`` entries of ``summary.json`` is
a function of the configuration alone: equal seeds give equal bytes, and a
resumed run ends with the bytes of an uninterrupted one. A resume restores the
newest checkpoint that verifies and that ``metrics.jsonl`` covers (a damaged one
is skipped with a one-line warning) and cuts ``metrics.jsonl`` back to its round.
"""
from __future__ import annotations

import csv
import dataclasses
import errno
import io
import json
import math
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfednas import plots
from jaxfednas.files import make_dirs, write_error, WriteError
from jaxfednas.checkpoint import (atomic_write_bytes, atomic_write_text, checkpoint_config_hash, checkpoint_files,
                                  CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint, sha256_text,
                                  shape_template)
from jaxfednas.config import apply_overrides, ConfigError, current_name, ExperimentConfig, setting_warnings
from jaxfednas.data.datasets import Dataset, load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.distributed import broadcast, is_main, on_main, put_like, to_host
from jaxfednas.progress import Progress
from jaxfednas.rng import init_key, round_key
from jaxfednas.registry import build_algorithm, config_from_dict
from jaxfednas.runtime import (CLIENT_AXIS, client_mesh, device_memory_limit, drop_compiled, on_accelerator,
                               Placement, release_memory_after_compiles)

CHECKPOINT = "checkpoint.msgpack"


class NonFiniteError(RuntimeError):
    """A round produced a NaN/inf loss or state; the run stopped before saving it."""


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used: ``--out`` names a file (or lies under one), or
    writing into it failed (a full disk, no permission). The message names the path and,
    for a failed checkpoint, the last good one and ``--resume``."""


class RunExistsError(RunDirectoryError):
    """``out_dir`` already holds a run and ``resume`` was not requested."""




def _exists(path: Path) -> bool:
    """``path.exists()`` as before Python 3.14: False where nothing is there, and an
    ``OSError`` the user can act on (a name too long, no permission) raised, not taken for
    "missing" (3.14's ``Path.exists`` returns False for every OS error)."""
    try:
        path.stat()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return False
        raise
    return True


def check_run_directory(out: Path) -> None:
    """Fail with one line when ``out`` cannot be a directory: it, or a folder above it,
    exists and is not a directory."""
    for p in (out, *out.parents):
        if _exists(p):
            if not p.is_dir():
                what = "is a file" if p == out else f"lies under {p}, which is a file"
                raise RunDirectoryError(f"--out {out} {what}, not a directory: choose another --out")
            return


RUN_LOCK = ".lock"
"""Name of the lock file in a run directory, ``flock``-ed by the process writing the run
(process 0 of a multi-process run) for the whole run; the kernel releases it when that
process ends, however it ends. It holds the holder's PID, host and start time."""


class RunInUseError(RunDirectoryError):
    """Another process is writing the run directory (it holds :data:`RUN_LOCK`)."""


class _RunLock:
    """An exclusive ``fcntl.flock`` on ``out/.lock`` (no-op where fcntl does not exist)."""

    def __init__(self, out: Path, log: Callable[[str], None]):
        self.path, self.log, self.file = out / RUN_LOCK, log, None

    def acquire(self) -> None:
        try:
            import fcntl  # noqa: PLC0415
        except ImportError:  # (Windows) no lock; runs are deterministic, so a clash loses no results
            return
        make_dirs(self.path.parent)
        try:
            f = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        except OSError as e:
            raise write_error(self.path, e, "the run's lock file") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not yet written its PID"
            f.close()
            raise RunInUseError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end "
                                "or choose another --out") from None
        except OSError as e:  # a file system without locks: go on, saying so
            self.log(f"warning: could not lock {self.path} ({e.strerror}); nothing stops a second process "
                     "from writing this run directory")
        f.seek(0)
        f.truncate()
        f.write(f"PID {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # (closing the last descriptor releases the flock)
            self.file = None


# errors process 0 may raise while reading the run directory, re-raised as such by the others
_ERRORS = (CheckpointError, RunInUseError, RunDirectoryError, WriteError, ConfigError, FileNotFoundError, ValueError)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for runs from the CLI and examples.

    A DARTS supernet takes tens of seconds to compile on a CPU; with the cache a
    repeated or resumed run reuses the executables. ``path`` defaults to
    ``$JAXFEDNAS_CACHE`` or ``~/.cache/jaxfednas/xla``; ``JAXFEDNAS_CACHE=off``
    disables it. Returns the directory in use (None when disabled). Results do
    not depend on it: a cached executable is the one XLA would compile.
    """
    path = os.environ.get("JAXFEDNAS_CACHE") if path is None else os.fspath(path)
    if path is not None and path.lower() in ("off", "0", "none", ""):
        return None
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "jaxfednas", "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler's stop), handled as Ctrl-C is: the last completed
    round is checkpointed and the run says how to resume."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (the CLI and the example
    scripts call this; a library caller keeps its own handlers)."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    def handler(signum, frame):
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def out_of_memory(e: BaseException) -> str | None:
    """The one-line error for XLA's out-of-memory (``RESOURCE_EXHAUSTED``, e.g. a batch or a
    number of clients in flight that does not fit), or None for any other exception."""
    if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or "RESOURCE_EXHAUSTED" not in str(e):
        return None
    first = str(e).strip().splitlines()[0]
    return (f"the device ran out of memory ({first}); lower algo.batch_size or run.clients_per_round, or set "
            "run.placement=map (one client at a time); `jaxfednas plan ALGO` estimates a configuration's memory")


_OS_ADVICE = {
    errno.ENAMETOOLONG: "a shorter --out (or run name)",
    errno.EACCES: "a directory you may write (--out)",
    errno.EPERM: "a directory you may write (--out)",
    errno.EROFS: "a writable file system for --out",
    errno.ENOSPC: "free space on its disk, or another --out",
    errno.EDQUOT: "free space within your quota, or another --out",
}


def environment_error(e: BaseException) -> str | None:
    """The one-line error for a fault of the machine rather than of the program: XLA's
    out-of-memory (:func:`out_of_memory`) or an ``OSError`` about a named file that the user
    can act on (a name too long, no permission, a read-only or full disk); None for any
    other exception, which propagates with its traceback."""
    oom = out_of_memory(e)
    if oom is not None:
        return oom
    if isinstance(e, OSError) and e.errno in _OS_ADVICE and e.filename is not None:
        name = str(e.filename)
        shown = name if len(name) <= 100 else f"{name[:60]}...{name[-30:]} ({len(name)} characters)"
        return f"{shown}: {e.strerror}; use {_OS_ADVICE[e.errno]}"
    return None


INTERRUPTED_CODES = (130, 143)
"""Exit statuses after Ctrl-C (130) and SIGTERM (143)."""


def exit_process(code: int) -> None:
    """End the process with ``code`` (a script's ``__main__`` calls this with what
    :func:`run_script` or ``jaxfednas.cli.main`` returned). After Ctrl-C or SIGTERM (130,
    143) the interpreter's own shutdown is skipped (the standard streams are flushed, then
    ``os._exit``): a signal that arrives while XLA is compiling leaves its compiler threads
    running, and finalizing the interpreter under them ended in a segmentation fault (exit
    139) after the run had said how to resume. Every file of a run is written atomically and
    closed by then, and the run directory's lock goes with the process."""
    import sys  # noqa: PLC0415

    if code in INTERRUPTED_CODES:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


def run_script(script: str, job: Callable[[], Any]) -> int:
    """Exit status of an example script's ``job()`` (with the compilation cache on): 0 when
    it finishes; 2 and a one-line error for bad input (configuration, missing data, an
    existing or unusable run directory, a failed write, a NaN loss); 130 on Ctrl-C and 143 on
    SIGTERM, with the command that resumes."""
    import sys  # noqa: PLC0415

    from jaxfednas.data.datasets import DatasetUnavailableError  # noqa: PLC0415

    enable_compilation_cache()
    stop_on_sigterm()
    try:
        job()
    except (ConfigError, DatasetUnavailableError, FileNotFoundError, RunDirectoryError, NonFiniteError,
            WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - out of memory or a file-system fault is one line; the rest propagates
        message = environment_error(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        args = " ".join(a for a in sys.argv[1:] if a != "--resume")
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"\n{how}; continue with: python {script} {args} --resume", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    return 0


def run_stage(cfg: ExperimentConfig, out_dir: str | os.PathLike, *, resume: bool,
              describe: Callable[[dict], str]) -> dict:
    """:func:`run_experiment` for one stage of a multi-stage script: resumed only when asked
    *and* the directory already holds a run (so ``--resume`` also starts later stages),
    with one printed line per round, ``describe(row)`` filling in the metrics."""
    out, t0 = Path(out_dir), time.perf_counter()

    def show(r, row):
        print(f"  [{out.name}] round {r}/{cfg.run.rounds}: {describe(row)} ({time.perf_counter() - t0:.0f} s)",
              flush=True)

    return run_experiment(cfg, out, resume=resume and holds_run(out), progress=False,
                          on_round_end=show)


class StageRunner:
    """The stages of a script that compares methods: each a :func:`run_stage` into
    ``out/<name>``, checked to test on the same local test indices as the first stage
    (the comparison means something only on the same test rows; ``same_test_rows=False``
    for scripts whose stages differ in partition on purpose), with its wall time.

    Wall times survive ``--resume`` in ``out/wall_times.json``: a run that was finished
    keeps the time it took; an interrupted one counts the call that finished it; a finished
    run extended to more rounds adds this call's time. With ``--resume`` a finished stage
    (its ``summary.json`` at the configured rounds, ``config.json`` the same configuration,
    the partition recomputed now the one in ``partition/manifest.json``) is read, not
    loaded: a finished job's tables are rewritten in seconds, and a stage's text files alone
    (no checkpoint) are enough to do so::

        runner = StageRunner(out, resume=args.resume, describe=_describe)
        summary, wall_s = runner.stage("spider", cfg)
    """

    WALL_TIMES = "wall_times.json"

    def __init__(self, out: str | os.PathLike, *, resume: bool, describe: Callable[[dict], str],
                 same_test_rows: bool = True):
        self.out, self.resume, self.describe, self.same_test_rows = Path(out), resume, describe, same_test_rows
        path = self.out / self.WALL_TIMES
        self.times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
        self.test_splits: tuple[str, list] | None = None  # (first stage, its clients' test indices)
        self._datasets: dict[tuple, Dataset] = {}  # (dataset, data_dir) -> loaded, for finished stages' checks

    def stage(self, name: str, cfg: ExperimentConfig) -> tuple[dict, float]:
        """Run (or resume, or find finished) stage ``name``: its ``summary.json`` and wall time."""
        d = self.out / name
        print(f"== {name}: {cfg.algorithm}, {cfg.data.dataset}, {cfg.data.num_clients} clients, "
              f"{cfg.run.rounds} rounds -> {d}", flush=True)
        resumed = self.resume and holds_run(d)
        summary = json.loads((d / "summary.json").read_text()) if resumed and (d / "summary.json").exists() else None
        done = summary is not None and summary["rounds"] >= cfg.run.rounds
        s = self._finished(d, cfg, summary) if done else None
        if s is None:
            s = run_stage(cfg, d, resume=self.resume, describe=self.describe)
        else:
            print(f"  [{name}] finished: its summary.json", flush=True)
        if not (done and name in self.times):
            before = self.times.get(name, 0.0) if resumed else 0.0
            self.times[name] = round(before + s["timing"]["wall_time_s"], 3)
            atomic_write_text(self.out / self.WALL_TIMES, json.dumps(self.times, indent=1, sort_keys=True) + "\n")
        if not self.same_test_rows:
            return s, self.times[name]
        tests = [c["test"] for c in part.load_manifest(d / "partition" / "manifest.json")["clients"]]
        if self.test_splits is None:
            self.test_splits = (name, tests)
        elif tests != self.test_splits[1]:
            raise RuntimeError(f"{name}: local test splits differ from {self.test_splits[0]}'s")
        return s, self.times[name]

    def _finished(self, d: Path, cfg: ExperimentConfig, summary: dict) -> dict | None:
        """``summary`` (``d``'s ``summary.json``) if the run in ``d`` is ``cfg``'s run at
        ``cfg``'s rounds on the partition ``cfg`` gives now; None where :func:`run_stage` must
        decide."""
        manifest_path = d / "partition" / "manifest.json"
        if summary["rounds"] != cfg.run.rounds or not manifest_path.exists() or \
                config_hash(config_from_dict(json.loads((d / "config.json").read_text()))) != config_hash(cfg):
            return None
        if part.load_manifest(manifest_path)["sha256"] != make_partition(cfg, self._dataset(cfg))["sha256"]:
            return None  # (run_stage says what differs)
        return summary

    def _dataset(self, cfg: ExperimentConfig) -> Dataset:
        key = (cfg.data.dataset, cfg.data.data_dir)
        if key not in self._datasets:
            self._datasets[key] = load_dataset(*key)
        return self._datasets[key]


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    """What a run directory holds, rebuilt: its configuration, algorithm, data and
    checkpointed state after ``rounds`` completed rounds."""

    config: ExperimentConfig
    algorithm: Any  # FederatedAlgorithm
    data: Any  # FederatedData
    state: Any
    rounds: int
    manifest: dict
    dataset: Dataset


def load_run(out_dir: str | os.PathLike) -> FinishedRun:
    """Rebuild a run directory's algorithm, data and last checkpointed state from its
    own ``config.json`` (for examples and notebooks that continue from a finished stage,
    e.g. personalization after a search). The partition is recomputed and must equal
    the saved manifest."""
    out = Path(out_dir)
    if not (out / "config.json").exists() or not checkpoint_files(out / CHECKPOINT):
        raise FileNotFoundError(f"{out} holds no finished run (config.json and {CHECKPOINT} are needed)")
    stored = json.loads((out / "config.json").read_text())
    cfg = config_from_dict(stored)
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    manifest = make_partition(cfg, dataset)
    saved = out / "partition" / "manifest.json"
    if saved.exists() and part.load_manifest(saved)["sha256"] != manifest["sha256"]:
        raise ValueError(f"the partition recomputed now differs from {saved}")
    data = make_federated_data(dataset, part.manifest_splits(manifest))
    algo = build_algorithm(cfg, data.info)
    state, rounds = load_checkpoint(out / CHECKPOINT, algo.init(init_key(cfg.run.seed)),
                                    config_sha256=_accepted_hashes(cfg, stored, _quiet))
    return FinishedRun(cfg, algo, data, state, rounds, manifest, dataset)


def inherited_accuracies(out: str | os.PathLike, search_dir: str | os.PathLike, architectures: list,
                         make_accuracy: Callable[[FinishedRun], Callable[[Any, Any, Any], float]], *,
                         key: Callable[[Any], str] = str) -> list[float]:
    """Each architecture's accuracy with the weights it inherits from the finished search in
    ``search_dir``: ``make_accuracy(run)`` gives ``accuracy(variables, architecture, data)``
    (an algorithm's ``make_inherited_accuracy``), applied to that run's state and data.
    Kept in ``out/inherited.json`` by ``key(architecture)``, so a resumed job loads the run
    and measures only the architectures it has not measured."""
    path = Path(out) / "inherited.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    missing = [a for a in architectures if key(a) not in known]
    if missing:
        print(f"== inherited-weight accuracy of {len(missing)} architectures ({Path(search_dir).name}'s supernet)",
              flush=True)
        run = load_run(search_dir)
        accuracy = make_accuracy(run)
        for a in missing:
            known[key(a)] = accuracy(run.state.variables, a, run.data)
        atomic_write_text(path, json.dumps(known, indent=1, sort_keys=True) + "\n")
    return [known[key(a)] for a in architectures]


def _quiet(message: str) -> None:
    pass


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


def write_partition_report(manifest: dict, dataset: Dataset, out_dir: Path) -> str:
    """Manifest, label-count table and heatmap under ``out_dir``; returns the table."""
    make_dirs(out_dir)
    part.save_manifest(manifest, out_dir / "manifest.json")
    splits = part.manifest_splits(manifest)
    owned = [np.concatenate([splits[s][k] for s in ("train", "val", "test")]) for k in range(len(splits["train"]))]
    counts = part.label_counts(dataset.y_train, owned, dataset.num_classes)
    table = part.format_label_table(counts)
    atomic_write_text(out_dir / "label_counts.txt", table + "\n")
    part.plot_label_heatmap(
        counts, out_dir / "label_heatmap.png",
        title=f"{dataset.name}: {manifest['method']} partition, {len(owned)} clients",
    )
    return table


def _scalars(metrics: dict) -> dict[str, float | int]:
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if a.ndim == 0:
            out[k] = a.item()
    return out


def _read_metrics(path: Path) -> list[dict]:
    """The rows of rounds 1, 2, ... up to the first missing or unreadable line (a file
    cut short loses its tail, not the run)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or row.get("round") != len(rows) + 1:
            break
        rows.append(row)
    return rows


def _metrics_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def _write_metrics(path: Path, rows: list[dict]) -> None:
    atomic_write_bytes(path, _metrics_bytes(rows))


def device_info() -> dict[str, Any]:
    d = jax.devices()
    return {
        "platform": d[0].platform,
        "device_kind": d[0].device_kind,
        "device_count": len(d),
        "process_count": jax.process_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def client_table(final: dict, manifest: dict) -> tuple[str, str]:
    """(CSV text, printable table) of per-client sizes and test accuracy, plus every other
    per-client array of ``final`` named ``client_*`` (e.g. PerFedRLNAS's memory and budget)."""
    acc = np.asarray(final["client_test_acc"])
    k = len(manifest["clients"])
    extra = sorted(n for n, v in final.items()
                   if n.startswith("client_") and n != "client_test_acc" and np.ndim(v) == 1 and np.shape(v)[0] == k)
    cols = {n: np.asarray(final[n], np.float64) for n in extra}
    rows = []
    for i, c in enumerate(manifest["clients"]):
        rows.append((i, len(c["train"]), len(c["val"]), len(c["test"]), float(acc[i]), *(cols[n][i] for n in extra)))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["client", "n_train", "n_val", "n_test", "test_acc", *extra])
    for r in rows:
        w.writerow([r[0], r[1], r[2], r[3], f"{r[4]:.6f}", *(f"{v:.6g}" for v in r[5:])])
    lines = [f"{'client':>6} {'n_train':>8} {'n_val':>6} {'n_test':>7} {'test_acc':>9}"
             + "".join(f" {n[7:]:>{max(10, len(n) - 7)}}" for n in extra)]
    lines += [f"{r[0]:>6} {r[1]:>8} {r[2]:>6} {r[3]:>7} {r[4]:>9.4f}"
              + "".join(f" {v:>{max(10, len(n) - 7)}.4g}" for n, v in zip(extra, r[5:])) for r in rows]
    return buf.getvalue(), "\n".join(lines)


def resume_config(out_dir: str | os.PathLike, overrides: dict | None = None) -> ExperimentConfig:
    """The configuration of the run in ``out_dir`` with ``overrides`` applied (the CLI's
    ``--resume``); :func:`run_experiment` then checks that only run length, evaluation and
    checkpoint frequency changed."""
    cfg_path = Path(out_dir) / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"--resume: {out_dir} holds no run (no config.json)")
    return apply_overrides(config_from_dict(_read_config_json(cfg_path)), overrides or {})


def holds_run(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` already holds a run (its ``config.json`` or a checkpoint)."""
    return (Path(out_dir) / "config.json").exists() or bool(checkpoint_files(Path(out_dir) / CHECKPOINT))


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
    moved = [f"run.{f}: {getattr(before, f)} -> {getattr(now, f)}" for f in LAYOUT_FIELDS
             if getattr(before, f) != getattr(now, f)]
    if moved:
        log(f"note: the clients' layout changed ({', '.join(moved)}); the rounds from here agree with an "
            "uninterrupted run's up to floating-point rounding, not bit for bit")
    return list(_accepted_hashes(cfg, raw, log))


def _refuse_non_file(path: Path) -> None:
    """A one-line :class:`RunDirectoryError` where something other than a file (a directory)
    sits at ``path``, a name at which a run keeps a file."""
    if path.exists() and not path.is_file():
        raise RunDirectoryError(f"--resume: {path} is not a file (a run keeps a file of that name there): it was "
                                "not written by a run; move it away or start afresh in another --out")


def _read_config_json(cfg_path: Path) -> dict:
    """A run directory's ``config.json`` as a dict, or a one-line :class:`RunDirectoryError`
    when it is not one a run wrote (not a file, not JSON, not a configuration)."""
    _refuse_non_file(cfg_path)
    try:
        raw = json.loads(cfg_path.read_text())
        if not isinstance(raw, dict) or not raw:
            raise ValueError("an empty or non-object JSON value")
        config_from_dict(raw)
    except OSError as e:
        raise RunDirectoryError(f"--resume: cannot read {cfg_path}: {e.strerror or e}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSONDecodeError is a ValueError
        what = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RunDirectoryError(f"--resume: {cfg_path} is not a run's configuration ({what}); it was not written "
                                "by a run: start afresh in another --out") from None
    return raw


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
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise RunDirectoryError(f"--resume: {manifest_path} is not a partition manifest ({type(e).__name__}); "
                                    "the partition is recomputed from the configuration: remove the file to have "
                                    "it written again") from None
        if recorded != manifest["sha256"]:
            raise ValueError(f"--resume: the partition recomputed now differs from {manifest_path}")
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

    algo = build_algorithm(fit_memory_budget(cfg, data, log), data.info)
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
        return write_partition_report(manifest, dataset, out / "partition")

    table = on_main(write, errors=_ERRORS)
    return _Prepared(dataset, manifest, table, data, algo, state, start, rows)


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


def _brief(ks: list[int]) -> str:
    return ", ".join(map(str, ks[:8])) + (", ..." if len(ks) > 8 else "")


def _nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` (NumPy) holding NaN or inf."""
    return [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.isfinite(x).all()]


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
        log(f"interrupted: checkpoint of round {completed} saved in {ckpt_path}; continue with --resume")
        raise
    finally:
        bar.close()
    if not final:  # nothing ran (already finished): evaluate the restored state
        final = host_metrics(state, algo.evaluate(state, data))
    return state, rows, final, completed, (t_first, t_rest)


def _report(cfg: ExperimentConfig, out: Path, run: _Prepared, state, rows: list, final: dict, completed: int,
            timing: dict) -> dict:
    """Plots, ``clients.csv``, the exported architecture and ``summary.json``."""
    algo, manifest = run.algo, run.manifest
    plots.plot_curves(rows, out / "plots" / "curves.png", title=f"{cfg.algorithm} on {cfg.data.dataset}")
    summary: dict[str, Any] = {"algorithm": cfg.algorithm, "dataset": cfg.data.dataset, "rounds": completed}
    summary["final"] = _scalars(final)
    if "global_test_acc" in summary["final"]:
        summary["best_global_test_acc"] = max(r.get("global_test_acc", 0.0) for r in rows)
    if "client_test_acc" in final:
        csv_text, printable = client_table(final, manifest)
        atomic_write_text(out / "clients.csv", csv_text)
        counts = np.array([len(c["test"]) for c in manifest["clients"]])
        plots.plot_client_accuracy(
            np.asarray(final["client_test_acc"]), counts, out / "plots" / "client_accuracy.png",
            title=f"{cfg.algorithm}: per-client test accuracy after round {completed}",
        )
    if algo.export is not None:
        architecture = algo.export(state)
        # an export may name its file (SPIDER: personal_genotypes.json)
        atomic_write_text(out / getattr(architecture, "FILENAME", "architecture.json"), architecture.to_json() + "\n")
        summary["architecture"] = json.loads(architecture.to_json())
        if algo.write_architecture is not None:
            algo.write_architecture(architecture, out / "plots")
    summary["timing"] = timing
    summary["device"] = device_info()
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    summary["_partition_table"] = run.table
    if "client_test_acc" in final:
        summary["_client_table"] = printable
    return summary


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
    holds ``out_dir``'s lock for the whole run (:class:`RunInUseError` if another has
    it); a failed write is a :class:`~jaxfednas.files.WriteError` or
    :class:`RunDirectoryError` with one line of advice. Returns the summary dict (also
    written to ``summary.json``).
    """
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
