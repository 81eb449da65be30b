"""DP-FNAS' privacy-utility curve on the cluttered digits (the paper's Table 2 on a task that can show it).

Reads the records of one DP-FNAS search run at several privacy levels on the same random cells
(``benchmarks/records/<prefix>`` for the non-private line, ``<prefix>_noise<σ>`` for each noise
multiplier; each holds ``seed_<s>/results.json`` and the search's ``summary.json``, as
``examples/dp_fnas.py --seeds ...`` writes them) and writes, for the seeds each level has:

* a table per level: ε (PLD, δ = 1e-5) and the GDP μ of the validation mechanism (the larger
  one, whose ε the run reports), the private supernet's accuracy, the searched cell's augmented
  accuracy, the random cells', searched − random, the fraction of random cells beaten,
  signal-to-noise and τ, each as mean ± std over the seeds;
* the figure, over the seeds every private level has: the searched cell's accuracy against ε
  (log scale; each seed ± its cell's std over training seeds, the mean a line), the random cells'
  mean ± std as a band, the non-private search's cell as a horizontal line.

    python benchmarks/records/dp_fnas_privacy_utility.py            # docs/results/dp_fnas_privacy_utility.{md,png}
    python benchmarks/records/dp_fnas_privacy_utility.py --no-write # print only

Nothing is trained: the numbers are the records'.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "records"
PREFIX = "dp_fnas_cluttered_digits_budget_probe_darts_5cells"
NOISES = ("0.77", "1.64", "5.04")
COMMAND = ("python examples/dp_fnas.py --dataset cluttered_digits --seeds S --random 5 --noise σ --train-rounds 12 "
           "--rounds 20 --set augment.lr_schedule=cosine --set algo.server_lr_decay_iterations=500 --set algo.C=8 "
           "--set algo.primitives=darts --set augment.layers=5")


def level(directory: Path) -> dict[int, dict]:
    """seed -> the numbers of one level's record (the seeds whose results.json exists)."""
    out = {}
    for seed_dir in sorted(directory.glob("seed_*")):
        page = seed_dir / "results.json"
        if not page.exists():
            continue
        numbers = json.loads(page.read_text())["numbers"]
        search = [d for d in seed_dir.iterdir() if d.is_dir() and d.name.endswith("p") and "-" in d.name
                  and (d / "summary.json").exists() and d.name.split("-")[0] in ("dp", "fnas")]
        final = json.loads((search[0] / "summary.json").read_text())["final"] if search else {}
        supernet = next(v for k, v in numbers.items() if k.startswith("supernet test acc"))
        out[int(seed_dir.name.split("_")[1])] = {
            "epsilon": numbers.get("ε (PLD, δ=1e-05)", float("inf")), "mu": final.get("mu_val", float("inf")),
            "supernet": supernet, "searched": numbers["searched cell: augmented test acc"],
            "searched_std": numbers["searched cell: std over 3 training seeds"],
            "random": numbers["random cells: mean"], "random_std": numbers["random cells: std"],
            "diff": numbers["searched − random mean"], "beaten": numbers["random cells beaten (fraction)"],
            "snr": numbers["architecture signal-to-noise"], "tau": numbers["supernet ranking: Kendall τ"]}
    return out


def mean_std(values: list[float], digits: int = 4) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(levels: dict[str, dict[int, dict]]) -> str:
    head = ["noise σ", "seeds", "ε (PLD, δ=1e-5)", "GDP μ (val)", "supernet", "searched cell", "random cells",
            "searched − random", "beaten", "signal-to-noise", "τ"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for noise, seeds in levels.items():
        if not seeds:
            continue
        v = {k: [s[k] for s in seeds.values()] for k in next(iter(seeds.values()))}
        private = noise != "0"
        rows.append("| " + " | ".join([
            noise if private else "0 (non-private)", ",".join(map(str, seeds)),
            mean_std(v["epsilon"], 2) if private else "∞", mean_std(v["mu"], 3) if private else "∞",
            mean_std(v["supernet"]), mean_std(v["searched"]), mean_std(v["random"]), mean_std(v["diff"]),
            f"{100 * statistics.fmean(v['beaten']):.0f} %", mean_std(v["snr"], 2), mean_std(v["tau"], 2)]) + " |")
    return "\n".join(rows)


def figure(levels: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private = {n: s for n, s in levels.items() if n != "0" and s}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    # the seeds every private level has: the random cells of a seed are the same at every level
    common = sorted(set.intersection(*(set(seeds) for seeds in private.values())))
    cells = {seed: s for seeds in levels.values() for seed, s in seeds.items() if seed in common}
    randoms, spread = [cells[s]["random"] for s in common], [cells[s]["random_std"] for s in common]
    lo, hi = statistics.fmean(randoms) - statistics.fmean(spread), statistics.fmean(randoms) + statistics.fmean(spread)
    eps = sorted(statistics.fmean(s["epsilon"] for s in seeds.values()) for seeds in private.values())
    xs = [min(eps) / 1.5, max(eps) * 1.5]
    ax.fill_between(xs, lo, hi, color="0.85", label="random cells: mean ± std")
    nonprivate = [s["searched"] for seed, s in levels.get("0", {}).items() if seed in common]
    if nonprivate:
        ax.axhline(statistics.fmean(nonprivate), color="tab:green", ls="--", label="non-private search")
    line = sorted((statistics.fmean(s["epsilon"] for s in seeds.values()),
                   statistics.fmean(s["searched"] for s in seeds.values())) for seeds in private.values())
    ax.plot(*zip(*line), color="tab:red", marker="o", label="private search (mean over seeds)")
    for i, seeds in enumerate(private.values()):  # each seed, ± its searched cell's std over training seeds
        ax.errorbar([s["epsilon"] for s in seeds.values()], [s["searched"] for s in seeds.values()],
                    yerr=[s["searched_std"] for s in seeds.values()], fmt="none", ecolor="tab:red", alpha=0.5,
                    capsize=3, label="each seed ± training-seed std" if i == 0 else None)
    ax.set_xscale("log")
    ax.set_xlim(*xs)
    ax.set_xlabel("ε (PLD, δ = 1e-5)")
    ax.set_ylabel("searched cell: augmented test accuracy")
    ax.set_title(f"DP-FNAS, cluttered digits, seeds {','.join(map(str, common))}: privacy vs utility", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    levels = {"0": level(RECORDS / PREFIX), **{n: level(RECORDS / f"{PREFIX}_noise{n}") for n in NOISES}}
    if not any(levels.values()):
        print(f"no records under {RECORDS}/{PREFIX}*", file=sys.stderr)
        return 2
    body = table(levels)
    print(body)
    if args.no_write:
        return 0
    out = ROOT / "docs" / "results"
    figure(levels, out / "dp_fnas_privacy_utility.png")
    seeds = {n: len(s) for n, s in levels.items()}
    (out / "dp_fnas_privacy_utility.md").write_text(f"""# DP-FNAS: privacy vs utility on the cluttered digits

The same DP-FNAS search (probe C's budget: 500 iterations of a C=8, 2-cell, 2-node supernet over
DARTS' eight operations, 4 IID parties, cells augmented in a 5-cell network) without noise and
with noise multipliers 0.77, 1.64 and 5.04 on both mechanisms (ε ≈ 16, 4 and 1 at δ = 1e-5),
each seed's searched cell against the same 5 random cells of that seed:

    {COMMAND}

(`--noise 0` for the non-private line). Seeds per level: {", ".join(f"σ {n}: {k}" for n, k in seeds.items())}
(mean ± std over them where more than one). ε is the PLD accountant's for the validation
mechanism, the larger of the two; μ its Gaussian-DP CLT value (asymptotic, not a bound). Records:
`benchmarks/records/{PREFIX}*/`. Written by `python benchmarks/records/dp_fnas_privacy_utility.py`.

{body}

Figure: `dp_fnas_privacy_utility.png` beside this page (the searched cell's accuracy against ε, the
random cells' band, the non-private search's line).
""")
    print(f"wrote {out / 'dp_fnas_privacy_utility.md'} and its figure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
