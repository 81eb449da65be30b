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
    the rows (default: every metric of the first seed). An infinite value (a ratio over a
    zero spread) stays in its seed's cell and is left out of the mean ± std, which says so.

    >>> print(seed_table({0: {"ratio": 2.0}, 1: {"ratio": float("inf")}, 2: {"ratio": 4.0}}, digits=2))
    | metric | mean ± std over seeds | seed 0 | seed 1 | seed 2 |
    |---|---|---|---|---|
    | ratio | 3.00 ± 1.41 (1 seed inf: left out) | 2.00 | inf | 4.00 |
    <BLANKLINE>
    """
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
        infinite = sum(v is not None and math.isinf(float(v)) for v in vals)
        mean, std = mean_std([v for v in vals if v is not None and not math.isinf(float(v))])
        left_out = f" ({infinite} seed{'s' * (infinite > 1)} inf: left out)" if infinite else ""
        cells = ["—" if v is None else fmt.format(float(v)) for v in vals]
        lines.append(f"| {m} | {fmt.format(mean)} ± {fmt.format(std)}{left_out} | " + " | ".join(cells) + " |\n")
    return head + "".join(lines)


def versus_random(searched: float, random: Sequence[float]) -> dict:
    """How a searched architecture's number compares with random architectures' (trained the
    same way): their mean and sample std, the difference, and how many of them it beats
    (strictly) or ties."""
    mean, std = mean_std(random)
    return {"searched": float(searched), "random_mean": mean, "random_std": std, "random_n": len(random),
            "searched_minus_random": float(searched) - mean,
            "beats": sum(float(searched) > r for r in random), "ties": sum(float(searched) == r for r in random)}


def signal_to_noise(random: Sequence[float], repeats: Sequence[float]) -> dict:
    """Whether a task can tell architectures apart: the sample std of stand-alone accuracy
    over random architectures (each trained once) over the sample std of one architecture's
    accuracy over training seeds (the same architecture, partition and recipe; ``repeats``,
    at least 2). A ratio below ~1 means a search's margin over random is seed noise there.

    >>> r = signal_to_noise([0.80, 0.90, 0.85], [0.86, 0.87, 0.85])
    >>> round(r["ratio"], 6), r["random_n"], r["repeats_n"]
    (5.0, 3, 3)
    """
    arch_std, seed_std = mean_std(random)[1], mean_std(repeats)[1]
    if len(random) < 2 or len(repeats) < 2:  # (one value has no spread to compare)
        arch_std, seed_std = (arch_std if len(random) > 1 else math.nan), (seed_std if len(repeats) > 1 else math.nan)
    if math.isnan(arch_std) or math.isnan(seed_std):
        ratio = math.nan
    else:
        ratio = arch_std / seed_std if seed_std > 0 else math.inf if arch_std > 0 else math.nan
    return {"arch_std": arch_std, "seed_std": seed_std, "ratio": ratio,
            "random_n": len(random), "repeats_n": len(repeats)}


def repeat_seed(seed: int, j: int) -> int:
    """The ``j``-th training seed of a job of seed ``seed`` (``j = 0``: ``seed`` itself), for
    training one architecture again on the same partition (``data.partition_seed`` fixed)."""
    return (seed + 7919 * j) % 2**31


def _ranks(v: Sequence[float]) -> list[float]:
    """Average ranks (1-based; ties share the mean of their positions)."""
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's τ-b of two rankings (ties in either counted as neither concordant nor
    discordant, and corrected for): +1 the same order, −1 the reverse, ~0 unrelated; NaN for
    fewer than two pairs' worth of untied values.

    >>> kendall_tau([1, 2, 3, 4], [10, 30, 20, 40])
    0.6666666666666666
    """
    if len(x) != len(y):
        raise ValueError(f"kendall_tau: {len(x)} values against {len(y)}")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n_x, n_y = concordant + discordant + ties_x, concordant + discordant + ties_y
    return (concordant - discordant) / math.sqrt(n_x * n_y) if n_x and n_y else math.nan


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the average ranks (NaN when either is constant).

    >>> spearman_rho([1, 2, 3, 4], [10, 30, 20, 40])
    0.8
    """
    if len(x) != len(y):
        raise ValueError(f"spearman_rho: {len(x)} values against {len(y)}")
    rx, ry = _ranks(list(x)), _ranks(list(y))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def supernet_ranking(inherited: Sequence[float], standalone: Sequence[float]) -> dict:
    """The standard check of weight sharing: do architectures rank the same with the weights
    they inherit from the trained supernet as trained on their own? Kendall's τ-b and
    Spearman's ρ over the architectures (searched and random of one seed) and their count.
    τ near 0: no supernet-based search can beat random on that task."""
    return {"kendall_tau": kendall_tau(inherited, standalone), "spearman": spearman_rho(inherited, standalone),
            "n": len(inherited)}


def wins_over_seeds(rows: Mapping[int, Mapping[str, float]], suffix: str, *, winner: str, loser: str,
                    title: str) -> str:
    """One Markdown line per number of ``rows`` (seed -> name -> value, as :func:`seed_table`
    takes) whose name ends with ``suffix`` (a difference, e.g. ``": learned − random"``): in
    how many seeds it is positive (``winner`` beat ``loser``) and its mean over seeds; under
    ``title``. Empty when no name ends with ``suffix``."""
    lines = []
    for name in next(iter(rows.values())):
        if not name.endswith(suffix):
            continue
        diffs = [r[name] for r in rows.values() if name in r]
        won = sum(d > 0 for d in diffs)
        lines.append(f"- {name[:-len(suffix)]}: {winner} beat {loser} in {won} of {len(diffs)} seeds "
                     f"({suffix.lstrip(': ')} {sum(diffs) / len(diffs):+.4f} on average).")
    return f"{title}\n\n" + "\n".join(lines) + "\n" if lines else ""


def over_seeds(seeds: Sequence[int], one_seed, out, *, title: str, note: str = "", metric: str = "test accuracy",
               plot_title: str = "") -> dict:
    """Run ``one_seed(seed, out / "seed_<s>")`` for every seed and write the table over seeds.

    ``one_seed`` returns ``{"numbers": {name: value}, "points": {...}}`` (``points`` as
    :func:`jaxfednas.plots.plot_searched_vs_random` takes for one seed, or absent). Writes
    ``out/results.md`` (``title``, the mean ± std table, ``note``), ``out/results.json``
    (each seed's numbers) and ``out/plots/searched_vs_random.png``; returns seed -> result.
    Each seed's run is resumable on its own, so a rerun with ``--resume`` skips finished work.
    The one seeds loop of the library: ``jaxfednas run --seeds`` and every example's
    ``--seeds``. Of several processes (``jax.distributed``) only process 0 writes.
    """
    import json
    from pathlib import Path

    from jaxfednas.checkpoint import atomic_write_text
    from jaxfednas.distributed import is_main
    from jaxfednas.plots import plot_searched_vs_random

    out = Path(out)
    mine = any(out.glob("seed_*/"))  # (a table of an earlier call over seeds)
    foreign = [n for n in ("results.md", "results.json") if (out / n).exists()] if not mine else []
    if foreign:
        from jaxfednas.rundir import RunDirectoryError  # noqa: PLC0415

        raise RunDirectoryError(f"--out {out} holds {', '.join(foreign)}, which no run over seeds wrote there (no "
                                "seed_<s>/ beside it) and which the table over seeds would replace: choose another --out")
    per_seed = {}
    for seed in seeds:
        print(f"==== seed {seed}", flush=True)
        per_seed[seed] = one_seed(seed, out / seed_dir_name(seed))
    rows = {seed: r["numbers"] for seed, r in per_seed.items()}
    table = seed_table(rows)
    if not is_main():
        return per_seed
    points = {seed: r["points"] for seed, r in per_seed.items() if r.get("points")}
    if points:
        plot_searched_vs_random(points, out / "plots" / "searched_vs_random.png", metric=metric,
                                title=plot_title or title)
    seeds_text = ",".join(str(s) for s in seeds)
    atomic_write_text(out / "results.md", f"# {title} (seeds {seeds_text})\n\n{table}\n{note}\n")
    atomic_write_text(out / "results.json", json.dumps({str(k): v for k, v in rows.items()}, indent=1) + "\n")
    print("\n" + table)
    return per_seed


def once_or_over_seeds(args, one, overrides: dict | None = None, **table) -> dict:
    """An example's job, ``one(overrides, out)``, once into ``args.out`` with ``overrides``
    (default ``args.overrides``) or, with ``args.seeds``, once per seed (``run.seed``) into
    ``args.out/seed_<s>`` and the table over seeds (:func:`over_seeds`, ``table``: its title,
    note, metric, plot title). Returns seed -> result (seed ``None`` for the single run)."""
    from pathlib import Path

    overrides = dict(args.overrides if overrides is None else overrides)
    if getattr(args, "seeds", None) is None:
        return {None: one(overrides, Path(args.out))}
    return over_seeds(parse_seeds(args.seeds), lambda seed, out: one({**overrides, "run.seed": seed}, out),
                      args.out, **table)
