"""The example scripts' stages on top of :func:`~jaxfednas.experiment.run_experiment`: a stage
per compared method (resumable, its wall time kept), a finished run rebuilt, and the
accuracies architectures inherit from a finished search."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

from jaxfednas.checkpoint import atomic_write_text, checkpoint_files, load_checkpoint
from jaxfednas.config import ExperimentConfig
from jaxfednas.data.datasets import Dataset, load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.experiment import NonFiniteError, make_partition, run_experiment, _quiet
from jaxfednas.registry import build_algorithm, config_from_dict
from jaxfednas.resume import config_hash, _accepted_hashes, _nonfinite_leaves
from jaxfednas.run_options import RunOptions
from jaxfednas.rng import init_key
from jaxfednas.rundir import CHECKPOINT, holds_run, PartitionChangedError, RunDirectoryError, _read_config_json, read_json


ROUND_METRICS = (("train_loss", "train loss", "{:.4f}"), ("train_acc", "train acc", "{:.4f}"),
                 ("personal_train_acc", "personal train acc", "{:.4f}"), ("reward_acc", "reward acc", "{:.4f}"),
                 ("global_test_acc", "global test acc", "{:.4f}"),
                 ("client_test_acc_mean_unweighted", "client test acc", "{:.4f}"), ("arch_entropy", "α entropy", "{:.4f}"),
                 ("epsilon_pld", "ε (PLD)", "{:.3f}"), ("fixed_blocks", "fixed blocks", "{:.0f}"),
                 ("edges_decided", "edges decided", "{:.2f}"), ("final_clients", "final clients", "{:.0f}"),
                 ("over_budget", "over budget", "{:.0f}"))
"""The round metrics a stage's progress line shows where the algorithm reports them, each as
(key, name, format)."""


def describe_round(row: dict) -> str:
    """A stage's progress line for one round: the :data:`ROUND_METRICS` in ``row``."""
    return ", ".join(f"{name} {fmt.format(row[key])}" for key, name, fmt in ROUND_METRICS if key in row)


def run_stage(cfg: ExperimentConfig, out_dir: str | os.PathLike, *, resume: bool,
              describe: Callable[[dict], str] = describe_round) -> dict:
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

        runner = StageRunner(out, resume=args.resume)  # (progress lines: describe_round)
        summary, wall_s = runner.stage("spider", cfg)
    """

    WALL_TIMES = "wall_times.json"

    def __init__(self, out: str | os.PathLike, *, resume: bool, describe: Callable[[dict], str] = describe_round,
                 same_test_rows: bool = True):
        self.out, self.resume, self.describe, self.same_test_rows = Path(out), resume, describe, same_test_rows
        path = self.out / self.WALL_TIMES
        self._refuse_foreign_pages()
        #: Each stage's wall time in seconds, by name (kept in ``out/wall_times.json``).
        self.times: dict[str, float] = read_json(path, dict, "remove it: the stages' wall times are then counted "
                                                 "from this call on") if path.exists() else {}
        #: The first stage and its clients' test indices, once a stage has run.
        self.test_splits: tuple[str, list] | None = None
        self._datasets: dict[tuple, Dataset] = {}  # (dataset, data_dir) -> loaded, for finished stages' checks

    PAGES = ("results.md", "results.json")  # what a script's page writes into ``out`` (evidence.write_results)

    def _refuse_foreign_pages(self) -> None:
        """A page (``results.md``/``results.json``) in ``out`` that no stages wrote -- no
        ``wall_times.json`` and no stage directory beside it -- would be replaced when the script
        ends: refused before any stage runs, in one line."""
        if not self.out.is_dir() or (self.out / self.WALL_TIMES).exists() or \
                any((d / "config.json").exists() for d in self.out.iterdir() if d.is_dir()):
            return
        foreign = [n for n in self.PAGES if (self.out / n).exists()]
        if foreign:
            raise RunDirectoryError(f"--out {self.out} holds {', '.join(foreign)}, which no run of stages wrote there "
                                    "(no wall_times.json or stage directory beside it) and which this script's page "
                                    "would replace: choose another --out")

    def stage(self, name: str, cfg: ExperimentConfig) -> tuple[dict, float]:
        """Run (or resume, or find finished) stage ``name``: its ``summary.json`` and wall time."""
        d = self.out / name
        print(f"== {name}: {cfg.algorithm}, {cfg.data.dataset}, {cfg.data.num_clients} clients, "
              f"{cfg.run.rounds} rounds -> {d}", flush=True)
        resumed = self.resume and holds_run(d)
        summary = read_json(d / "summary.json", dict, "remove it: --resume then finishes the stage from its checkpoint "
                            "and writes it again") if resumed and (d / "summary.json").exists() else None
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
                config_hash(config_from_dict(_read_config_json(d / "config.json"))) != config_hash(cfg):
            return None
        if part.load_manifest(manifest_path)["sha256"] != make_partition(cfg, self._dataset(cfg))["sha256"]:
            return None  # (run_stage says what differs)
        return summary

    def _dataset(self, cfg: ExperimentConfig) -> Dataset:
        key = (cfg.data.dataset, cfg.data.data_dir)
        if key not in self._datasets:
            self._datasets[key] = load_dataset(*key)
        return self._datasets[key]


def shared_settings(cfg: ExperimentConfig, algo: tuple[str, ...] = ()) -> dict:
    """The settings every method an example compares takes from its main run's ``cfg``, as
    ``--set`` overrides: the data (dataset, clients, partition and its seed), the seed, rounds,
    clients per round, evaluation interval and placement, and the ``algo`` fields named."""
    d, r = cfg.data, cfg.run
    return {
        "data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": d.num_clients,
        "data.partition": d.partition, "data.alpha": d.alpha, "data.classes_per_client": d.classes_per_client,
        "data.min_size": d.min_size, "data.partition_seed": d.partition_seed, "run.seed": r.seed,
        "run.rounds": r.rounds, "run.clients_per_round": r.clients_per_round, "run.eval_every": r.eval_every,
        "run.placement": r.placement, "run.client_chunk_size": r.client_chunk_size,
        **{f"algo.{name}": getattr(cfg.algo, name) for name in algo},
    }


def method_row(method: str, label: str, runs: list[str], acc, wall: float, params: float, **extra) -> dict:
    """One method's row of an example's table: its name, label and run directories, its
    per-client local test accuracies summarised (:func:`jaxfednas.reports.client_acc_summary`),
    parameters, wall time (seconds, one decimal) and ``extra``."""
    from jaxfednas.reports import client_acc_summary  # noqa: PLC0415

    return {"method": method, "label": label, "runs": runs, **client_acc_summary(acc), "params": params,
            "wall_s": round(wall, 1), **extra}


def stage_row(runner: StageRunner, name: str, cfg: ExperimentConfig, label: str,
              params: float | Callable[[dict], float], **extra) -> tuple[dict, dict]:
    """Run (or find finished) the stage of one method (:meth:`StageRunner.stage`) and make its
    :func:`method_row` from its ``clients.csv``; ``params`` is a number or a function of the
    stage's ``summary.json``. Returns the summary and the row."""
    from jaxfednas.reports import read_client_test_acc  # noqa: PLC0415

    s, wall = runner.stage(name, cfg)
    return s, method_row(name, label, [name], read_client_test_acc(runner.out / name), wall,
                         params(s) if callable(params) else params, **extra)


def cached_json(path: str | os.PathLike, key: dict, resume: bool, compute: Callable[[], dict]) -> dict:
    """``{"key": key, **compute()}``, saved to ``path`` (JSON); with ``resume`` the saved one
    is returned instead when it was computed for the same ``key`` (e.g. the rounds of the run
    it reads), so a resumed example does not compute a finished step again."""
    path = Path(path)
    if resume and path.exists():
        saved = read_json(path, dict, "remove it: it is computed again")
        if saved.get("key") == key:
            return saved
    result = {"key": key, **compute()}
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    return result


def personalized_accuracy(run_dir: str | os.PathLike,
                          extra: Callable[[FinishedRun, dict], dict] | None = None) -> dict:
    """A finished run's ``personalize`` (every client adapts the final state on its own data,
    key ``rng.personalize_key(run.seed)``, and is tested on its local test split): its
    ``client_test_acc`` summarised (:func:`jaxfednas.reports.client_acc_summary`), then
    ``extra(run, metrics)`` (what else to keep of the run and ``personalize``'s host-side
    metrics), then ``wall_s``."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxfednas.reports import client_acc_summary  # noqa: PLC0415
    from jaxfednas.rng import personalize_key  # noqa: PLC0415

    t0 = time.perf_counter()
    run = load_run(run_dir)
    _, out = run.algorithm.personalize(run.state, run.data, personalize_key(run.config.run.seed))
    out = jax.device_get(out)
    return {**client_acc_summary(np.asarray(out["client_test_acc"])), **(extra(run, out) if extra else {}),
            "wall_s": round(time.perf_counter() - t0, 1)}


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    """What a run directory holds, rebuilt: its configuration, algorithm, data and
    checkpointed state after ``rounds`` completed rounds, and the run's options
    (:class:`jaxfednas.run_options.RunOptions`, built once: the algorithm was built with
    them, and code that continues from the run -- its placement, its server -- reads them
    here)."""

    config: ExperimentConfig
    algorithm: Any  # FederatedAlgorithm
    data: Any  # FederatedData
    state: Any
    rounds: int
    manifest: dict
    dataset: Dataset
    options: Any = None  # RunOptions


def load_run(out_dir: str | os.PathLike) -> FinishedRun:
    """Rebuild a run directory's algorithm, data and last checkpointed state from its
    own ``config.json`` (for examples and notebooks that continue from a finished stage,
    e.g. personalization after a search). The partition is recomputed and must equal
    the saved manifest."""
    out = Path(out_dir)
    if not (out / "config.json").exists() or not checkpoint_files(out / CHECKPOINT):
        raise FileNotFoundError(f"{out} holds no finished run (config.json and {CHECKPOINT} are needed)")
    stored = _read_config_json(out / "config.json")
    cfg = config_from_dict(stored)
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    manifest = make_partition(cfg, dataset)
    saved = out / "partition" / "manifest.json"
    if saved.exists() and part.load_manifest(saved)["sha256"] != manifest["sha256"]:
        raise PartitionChangedError(f"the partition recomputed now differs from {saved} (the dataset or the "
                                    "partitioning code changed since the run)")
    data = make_federated_data(dataset, part.manifest_splits(manifest))
    options = RunOptions.from_run(cfg.run)
    algo = build_algorithm(cfg, data.info, run=options)
    state, rounds = load_checkpoint(out / CHECKPOINT, algo.init(init_key(cfg.run.seed)),
                                    config_sha256=_accepted_hashes(cfg, stored, _quiet))
    bad = _nonfinite_leaves(state)
    if bad:  # as --resume refuses it
        raise NonFiniteError(f"{out / CHECKPOINT} holds non-finite values ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}): the run diverged before its round {rounds}")
    return FinishedRun(cfg, algo, data, state, rounds, manifest, dataset, options)


def inherited_accuracies(out: str | os.PathLike, search_dir: str | os.PathLike, architectures: list,
                         make_accuracy: Callable[[FinishedRun], Callable[[Any, Any, Any], float]], *,
                         key: Callable[[Any], str] = str) -> list[float]:
    """Each architecture's accuracy with the weights it inherits from the finished search in
    ``search_dir``: ``make_accuracy(run)`` gives ``accuracy(variables, architecture, data)``
    (an algorithm's ``make_inherited_accuracy``), applied to that run's state and data.
    Kept in ``out/inherited.json`` by ``key(architecture)``, so a resumed job loads the run
    and measures only the architectures it has not measured."""
    path = Path(out) / "inherited.json"
    known = read_json(path, dict, "remove it: the accuracies are measured again") if path.exists() else {}
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
