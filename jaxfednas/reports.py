"""What a run writes besides its checkpoints: ``metrics.jsonl``, the partition report, the
per-client table, plots, the exported architecture and ``summary.json``."""
from __future__ import annotations

import csv
import io
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxfednas import plots
from jaxfednas.checkpoint import atomic_write_bytes, atomic_write_text
from jaxfednas.config import ExperimentConfig
from jaxfednas.data.datasets import Dataset
from jaxfednas.data import partition as part
from jaxfednas.files import make_dirs


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


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """A run directory's ``metrics.jsonl``: one dict per round, rounds 1, 2, ... (a file cut
    short loses its tail)."""
    return _read_metrics(Path(run_dir) / "metrics.jsonl")


def read_client_test_acc(run_dir: str | os.PathLike) -> np.ndarray:
    """A finished run's per-client local test accuracies, client 0 first: the ``test_acc``
    column of its ``clients.csv`` (:func:`client_table`)."""
    with open(Path(run_dir) / "clients.csv", newline="") as f:
        return np.array([float(r["test_acc"]) for r in csv.DictReader(f)])


def client_acc_summary(acc) -> dict:
    """Per-client accuracies (NaN for a client without test examples) and their summaries
    over clients, unweighted: ``client_test_acc`` (rounded to 6 digits), ``mean``, ``std``,
    ``min``, ``max`` -- an example's row of a method."""
    acc = np.asarray(acc, np.float64)
    return {"client_test_acc": acc.round(6).tolist(), "mean": float(np.nanmean(acc)), "std": float(np.nanstd(acc)),
            "min": float(np.nanmin(acc)), "max": float(np.nanmax(acc))}


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


def _report(cfg: ExperimentConfig, out: Path, run: Any, state, rows: list, final: dict, completed: int,
            timing: dict) -> dict:
    """Plots, ``clients.csv``, the exported architecture and ``summary.json``. ``run`` is the
    prepared run (``jaxfednas.experiment._Prepared``; not imported here, which imports this)."""
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
    summary["layout"] = run.layout  # the clients' layout that ran (also layout.json)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    summary["_partition_table"] = run.table
    if "client_test_acc" in final:
        summary["_client_table"] = printable
    return summary


def compare_clients(out: str | os.PathLike, results: dict) -> str:
    """Methods compared client by client on the same local test splits: ``results`` maps a
    method to ``(per-client accuracies, wall seconds, parameters)``. Writes ``out/clients.csv``
    (a column per method) and ``out/plots/clients.png``; returns the Markdown table (mean ±
    std over clients, min, max, parameters, wall time)."""
    out = Path(out)
    lines = ["| method | params | avg local test acc (mean ± std over clients) | min | max | wall time (s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {n:,} | {acc.mean():.4f} ± {acc.std():.4f} | {acc.min():.4f} | {acc.max():.4f} | {wall:.0f} |"
              for name, (acc, wall, n) in results.items()]
    k = len(next(iter(results.values()))[0])
    atomic_write_text(out / "clients.csv", "client," + ",".join(results) + "\n" + "".join(
        f"{c}," + ",".join(f"{r[0][c]:.6f}" for r in results.values()) + "\n" for c in range(k)))
    plots.plot_methods_by_client({m: r[0] for m, r in results.items()}, out / "plots" / "clients.png")
    return "\n".join(lines) + "\n"
