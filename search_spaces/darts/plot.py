"""Cell diagrams of a :class:`Genotype` drawn with matplotlib (no graphviz needed).

Inputs ``c_{k-2}`` and ``c_{k-1}`` on the left, intermediate nodes ``0..n-1`` in the
middle, the output ``c_{k}`` (channel concat) on the right; each edge is labelled with
its op. The PNG bytes are deterministic for a given matplotlib version (no
timestamp or software tag in the metadata).
"""
from __future__ import annotations

import os

from .genotypes import Genotype

_KINDS = ("normal", "reduce")
_COLORS = {"input": "#a6cee3", "node": "#fdbf6f", "output": "#b2df8a"}


def _layout(steps: int) -> dict[int | str, tuple[float, float]]:
    """Inputs on the left, intermediate nodes in a column (0 at the top), output on the right."""
    top = steps - 1.0
    pos: dict[int | str, tuple[float, float]] = {0: (0.0, top / 2 + 0.8), 1: (0.0, -top / 2 - 0.8)}
    for i in range(steps):
        pos[2 + i] = (3.2, top - 2.0 * i)
    pos["out"] = (6.0, 0.0)
    return pos


def plot_cell(genotype: Genotype, kind: str = "normal", path: str | os.PathLike = "cell.png", *,
              title: str | None = None, dpi: int = 100) -> str:
    """Render the ``kind`` ("normal" or "reduce") cell of ``genotype`` to a PNG at ``path``.

    Edges from the cell inputs are straight; edges between intermediate nodes bend to
    the right of the node column. Each op label sits on its edge, rotated along it.
    """
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    gene = genotype.normal if kind == "normal" else genotype.reduce
    concat = genotype.normal_concat if kind == "normal" else genotype.reduce_concat
    steps = len(gene) // 2
    pos = _layout(steps)
    labels = {0: "c_{k-2}", 1: "c_{k-1}", "out": "c_{k}"}
    labels.update({2 + i: str(i) for i in range(steps)})

    half_h = max(steps - 1.0, 1.0) + 1.0
    fig = Figure(figsize=(8.0, 1.2 + 1.1 * half_h))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.9))
    ax.set_xlim(-0.8, 6.8)
    ax.set_ylim(-half_h, half_h)
    ax.axis("off")
    ax.set_title(title if title is not None else f"{kind} cell", fontsize=12)

    def arrow(a, b, rad, color="#444444", lw=1.2):
        ax.add_patch(FancyArrowPatch(pos[a], pos[b], connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=12, shrinkA=16, shrinkB=16, color=color, lw=lw, zorder=1))

    def label(a, b, rad, text, t):
        # Point at parameter t on the arc3 curve (a quadratic Bezier built in display space),
        # with the label rotated along the tangent there.
        p0, p2 = ax.transData.transform([pos[a], pos[b]])
        c = (p0 + p2) / 2 + rad * (p2 - p0)[::-1] * (1, -1)
        pt = (1 - t) ** 2 * p0 + 2 * (1 - t) * t * c + t ** 2 * p2
        tan = 2 * (1 - t) * (c - p0) + 2 * t * (p2 - c)
        angle = math.degrees(math.atan2(tan[1], tan[0]))
        if angle > 90:
            angle -= 180
        elif angle < -90:
            angle += 180
        x, y = ax.transData.inverted().transform(pt)
        ax.text(x, y, text, fontsize=7.5, ha="center", va="center", rotation=angle, rotation_mode="anchor",
                zorder=3, bbox=dict(boxstyle="round,pad=0.12", fc="white", ec="none", alpha=0.9))

    for k, (op, src) in enumerate(gene):
        dst = 2 + k // 2
        if src < 2:
            arrow(src, dst, 0.0)
            label(src, dst, 0.0, op, 0.42 if src == 0 else 0.58)
        else:
            rad = -0.55  # bend right of the column; the bulge grows with the span, so arcs nest
            arrow(src, dst, rad)
            label(src, dst, rad, op, 0.5)
    for n in concat:
        arrow(n, "out", 0.0, color="#999999", lw=0.9)

    for key, (x, y) in pos.items():
        role = "input" if key in (0, 1) else "output" if key == "out" else "node"
        ax.text(x, y, labels[key], fontsize=10, ha="center", va="center", zorder=4,
                bbox=dict(boxstyle="round,pad=0.35", fc=_COLORS[role], ec="#333333"))

    from jaxfednas.files import save_figure  # noqa: PLC0415

    path = os.fspath(path)
    save_figure(fig, path, dpi=dpi)
    return path


def plot_genotype(genotype: Genotype, path_prefix: str | os.PathLike) -> tuple[str, str]:
    """Write ``<prefix>_normal.png`` and ``<prefix>_reduce.png``; returns both paths."""
    prefix = os.fspath(path_prefix)
    return tuple(plot_cell(genotype, kind, f"{prefix}_{kind}.png") for kind in _KINDS)
