"""Results over several seeds: a number is read with its spread.

One seed's result cannot tell a 1-point difference from noise. Every example and
``jaxfednas run`` take ``--seeds`` (``0,1,2`` or ``0-4``): each seed is a run of its own
(``run.seed``; the partition follows it unless ``data.partition_seed`` is set) in its own
directory ``seed_<s>``, resumable like any run, and :func:`seed_table` writes one table of
mean ± standard deviation over the seeds with every seed's value beside it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jaxfednas.config import ConfigError


MAX_SEEDS = 1000
"""The most seeds one ``--seeds`` accepts (each is a whole run)."""


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-4"`` (or a mix, ``"0-2,7"``) as a list of distinct seeds, in order;
    at most :data:`MAX_SEEDS`."""
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            lo, hi = map(int, part.split("-", 1) if "-" in part[1:] else (part, part))
        except ValueError:
            lo, hi = 0, -1
        if hi < lo:
            raise ConfigError(f"--seeds {text!r}: expected comma-separated seeds or ranges, e.g. 0,1,2 or 0-4")
        if len(seeds) + hi - lo + 1 > MAX_SEEDS:  # (before building the list)
            raise ConfigError(f"--seeds {text!r}: at least {len(seeds) + hi - lo + 1} seeds, each a whole run; "
                              f"at most {MAX_SEEDS} at once")
        seeds += range(lo, hi + 1)
    if any(s < 0 or s >= 2**31 for s in seeds):
        raise ConfigError(f"--seeds {text!r}: every seed must be in [0, 2^31)")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed is repeated")
    return seeds


def seed_dir_name(seed: int) -> str:
    return f"seed_{seed}"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for one value), NaNs ignored."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        return math.nan, math.nan
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s


def seed_table(rows: Mapping[int, Mapping[str, float]], metrics: Sequence[str] | None = None, *,
               digits: int = 4) -> str:
    """A Markdown table: one row per metric, ``mean ± std`` over the seeds (sample std), then
    each seed's value. ``rows`` maps seed -> {metric: value}; ``metrics`` picks and orders
    the rows (default: every metric of the first seed)."""
    seeds = list(rows)
    if not seeds:
        raise ValueError("seed_table needs at least one seed")
    metrics = list(metrics if metrics is not None else rows[seeds[0]])
    fmt = f"{{:.{digits}f}}"
    head = "| metric | mean ± std over seeds | " + " | ".join(f"seed {s}" for s in seeds) + " |\n"
    head += "|---|---|" + "---|" * len(seeds) + "\n"
    lines = []
    for m in metrics:
        vals = [rows[s].get(m) for s in seeds]
        mean, std = mean_std([v for v in vals if v is not None])
        cells = ["—" if v is None else fmt.format(float(v)) for v in vals]
        lines.append(f"| {m} | {fmt.format(mean)} ± {fmt.format(std)} | " + " | ".join(cells) + " |\n")
    return head + "".join(lines)


def versus_random(searched: float, random: Sequence[float]) -> dict:
    """How a searched architecture's number compares with random architectures' (trained the
    same way): their mean and sample std, the difference, and how many of them it beats
    (strictly) or ties."""
    mean, std = mean_std(random)
    return {"searched": float(searched), "random_mean": mean, "random_std": std, "random_n": len(random),
            "searched_minus_random": float(searched) - mean,
            "beats": sum(float(searched) > r for r in random), "ties": sum(float(searched) == r for r in random)}


def over_seeds(seeds: Sequence[int], one_seed, out, *, title: str, note: str = "", metric: str = "test accuracy",
               plot_title: str = "") -> dict:
    """Run ``one_seed(seed, out / "seed_<s>")`` for every seed and write the table over seeds.

    ``one_seed`` returns ``{"numbers": {name: value}, "points": {...}}`` (``points`` as
    :func:`jaxfednas.plots.plot_searched_vs_random` takes for one seed, or absent). Writes
    ``out/results.md`` (``title``, the mean ± std table, ``note``), ``out/results.json``
    (each seed's numbers) and ``out/plots/searched_vs_random.png``; returns seed -> result.
    Each seed's run is resumable on its own, so a rerun with ``--resume`` skips finished work.
    """
    import json
    from pathlib import Path

    from jaxfednas.checkpoint import atomic_write_text
    from jaxfednas.plots import plot_searched_vs_random

    out = Path(out)
    per_seed = {}
    for seed in seeds:
        print(f"==== seed {seed}", flush=True)
        per_seed[seed] = one_seed(seed, out / seed_dir_name(seed))
    rows = {seed: r["numbers"] for seed, r in per_seed.items()}
    table = seed_table(rows)
    points = {seed: r["points"] for seed, r in per_seed.items() if r.get("points")}
    if points:
        plot_searched_vs_random(points, out / "plots" / "searched_vs_random.png", metric=metric,
                                title=plot_title or title)
    seeds_text = ",".join(str(s) for s in seeds)
    atomic_write_text(out / "results.md", f"# {title} (seeds {seeds_text})\n\n{table}\n{note}\n")
    atomic_write_text(out / "results.json", json.dumps({str(k): v for k, v in rows.items()}, indent=1) + "\n")
    print("\n" + table)
    return per_seed
