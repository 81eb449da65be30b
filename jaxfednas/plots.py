"""Plots written into a run directory (matplotlib Agg; PNGs without timestamps)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    from jaxfednas.files import save_figure  # noqa: PLC0415

    try:
        save_figure(fig, path, dpi=100)
    finally:
        _plt().close(fig)


def plot_curves(rows: Sequence[Mapping[str, float]], path, *, title: str = "") -> None:
    """Accuracy curves (left) and training loss (right) against rounds."""
    plt = _plt()
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    names = {
        "global_test_acc": "global test acc",
        "client_test_acc_mean_unweighted": "client test acc (mean, unweighted)",
        "client_test_acc_mean_weighted": "client test acc (mean, weighted)",
        "train_acc": "train acc (sampled clients)",
    }
    for key, label in names.items():
        pts = [(r["round"], r[key]) for r in rows if key in r]
        if pts:
            x, y = zip(*pts)
            ax_acc.plot(x, y, marker="." if len(pts) < 30 else None, label=label)
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(fontsize=8)
    pts = [(r["round"], r["train_loss"]) for r in rows if "train_loss" in r]
    if pts:
        x, y = zip(*pts)
        ax_loss.plot(x, y, color="tab:red")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("train loss")
    ax_loss.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)


def plot_client_accuracy(acc: np.ndarray, counts: np.ndarray, path, *, title: str = "") -> None:
    """Bar chart of each client's test accuracy, with its number of test examples."""
    plt = _plt()
    k = len(acc)
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * k + 2), 3.5))
    ax.bar(np.arange(k), acc, color="tab:blue")
    valid = counts > 0
    if valid.any():
        ax.axhline(float(acc[valid].mean()), color="k", ls="--", lw=1, label="mean (unweighted)")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("client")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_xticks(np.arange(k))
    ax.tick_params(axis="x", labelsize=7)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)


def plot_searched_vs_random(points: Mapping, path, *, metric: str = "test accuracy", title: str = "") -> None:
    """The searched architecture among random ones, per seed: ``points`` maps a seed to
    ``{"searched": (params, value), "random": [(params, value), ...]}``; random
    architectures are dots, the searched one a star, one colour per seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (seed, p) in enumerate(points.items()):
        color = f"C{i % 10}"
        if p["random"]:
            x, y = zip(*p["random"])
            ax.scatter(x, y, s=22, color=color, alpha=0.6, label=f"random (seed {seed})")
        ax.scatter(*p["searched"], s=160, marker="*", color=color, edgecolor="black", linewidth=0.6,
                   label=f"searched (seed {seed})", zorder=3)
    ax.set_xlabel("parameters")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)
