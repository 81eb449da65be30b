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


def _figure(figsize):
    """A bare Agg ``Figure`` (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def plot_gain_matrix(p: np.ndarray, gain: np.ndarray, path, *, title: str = "") -> None:
    """Heatmap of a personalization-gain matrix (SPIDER §5.2.2): ``p[i, j]`` is client i's
    local test accuracy of client j's architecture, written in each cell (the diagonal
    bold); each row is labelled with its client's gain ``gain[i]`` (Eq. 6)."""
    from jaxfednas.files import save_figure  # noqa: PLC0415

    k = p.shape[0]
    fig = _figure((0.75 * k + 2.5, 0.65 * k + 1.8))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{p[i, j]:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if p[i, j] > 0.6 else "white", fontweight="bold" if i == j else "normal")
    ax.set_xticks(range(k))
    ax.set_yticks(range(k), [f"{i} (g={gain[i]:+.2f})" for i in range(k)])
    ax.set_xlabel("architecture of client j")
    ax.set_ylabel("data of client i")
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def plot_memory_vs_budget(runs: Mapping[str, Mapping[str, Mapping]], path) -> None:
    """Each client's training memory (bars; green: within its budget, red: over) against its
    memory budget (black ticks), one panel per run (PerFedRLNAS Fig. 4): ``runs`` maps a
    panel's label to its clients ``{"0": {"memory_bytes", "memory_budget_bytes", "fits"},
    ...}`` (``PersonalSubnets.clients``)."""
    from jaxfednas.files import save_figure  # noqa: PLC0415

    k = len(next(iter(runs.values())))
    fig = _figure((max(6.0, 0.35 * k + 2), 2.8 * len(runs) + 0.4))
    for i, (label, clients) in enumerate(runs.items()):
        c = [clients[str(j)] for j in range(k)]
        mem = np.array([a["memory_bytes"] for a in c]) / 2**20
        budget = np.array([a["memory_budget_bytes"] for a in c]) / 2**20
        fits = np.array([a["fits"] for a in c])
        ax = fig.add_subplot(len(runs), 1, i + 1)
        ax.bar(np.arange(k), mem, 0.7, color=np.where(fits, "tab:green", "tab:red"))
        ax.bar([0], [0], color="tab:green", label="argmax subnet, fits")
        ax.bar([0], [0], color="tab:red", label="argmax subnet, over budget")
        ax.scatter(np.arange(k), budget, marker="_", s=300, color="black", linewidths=2, label="budget", zorder=3)
        ax.set_ylabel("training memory (MiB)")
        ax.set_xticks(np.arange(k))
        ax.set_xlim(-0.6, k - 0.4)
        ax.set_title(f"{label}: {fits.sum()}/{k} clients within budget", fontsize=9, loc="right")
        if i == 0:
            ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.12), ncol=3, frameon=False)
    ax.set_xlabel("client")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def plot_methods_by_client(acc: Mapping[str, np.ndarray], path) -> None:
    """Each method's local test accuracy per client, side by side (``acc``: method -> one
    value per client, all of the same clients)."""
    from jaxfednas.files import save_figure  # noqa: PLC0415

    k = len(next(iter(acc.values())))
    fig = _figure((max(6.0, 0.7 * k + 2), 3.6))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(acc)
    for j, (name, a) in enumerate(acc.items()):
        ax.bar(np.arange(k) + (j - (len(acc) - 1) / 2) * width, a, width, label=name)
    ax.set_xlabel("client")
    ax.set_ylabel("local test accuracy")
    ax.set_xticks(np.arange(k))
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
