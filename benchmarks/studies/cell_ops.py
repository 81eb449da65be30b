"""Which operations make a DARTS cell good on a task: op counts against stand-alone accuracy.

Reads the run directory of ``examples/fednas.py --seeds ...`` (``--out``): for every
``seed_<s>/`` the searched cell (``train/``) and the random cells (``random_<k>/``), each
stage's genotype from its ``config.json`` and its evaluation-stage global test accuracy
from its ``summary.json``. No training. Prints (and writes to ``--md``) one row per
operation: how often it appears per cell (normal and reduce cells apart) in the searched
and in the random cells, and Kendall's τ-b / Spearman's ρ over the random cells, pooled
over seeds, between a cell's count of that operation and its accuracy (the random cells are
uniform draws, so a τ away from 0 says the task itself rewards or punishes the operation).
A search that wins by picking the rewarded operations shows both: a high τ and a searched
count above the random one.

    PYTHONPATH=. python benchmarks/studies/cell_ops.py /tmp/ev4/cluttered_fednas
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxfednas.search_spaces.darts import PRIMITIVE_SETS
from jaxfednas.seeds import kendall_tau, mean_std, spearman_rho


def _cell(stage: Path) -> dict | None:
    """``{"genotype", "acc"}`` of one finished evaluation stage, or None if it has not finished."""
    if not (stage / "summary.json").exists():
        return None
    cfg = json.loads((stage / "config.json").read_text())
    acc = json.loads((stage / "summary.json").read_text())["final"]["global_test_acc"]
    return {"genotype": json.loads(cfg["algo"]["genotype"]), "acc": float(acc)}


def collect(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The searched and the random cells of every seed under ``run_dir`` (each with its seed)."""
    searched, random = [], []
    seed_dirs = sorted(run_dir.glob("seed_*"), key=lambda p: int(p.name.split("_")[1]))
    if not seed_dirs:
        raise SystemExit(f"cell_ops: no seed_<s>/ under {run_dir} (give the --out of examples/fednas.py)")
    for sd in seed_dirs:
        seed = int(sd.name.split("_")[1])
        if (c := _cell(sd / "train")) is not None:
            searched.append({**c, "seed": seed})
        for rd in sorted(sd.glob("random_*"), key=lambda p: int(p.name.split("_")[1])):
            if (c := _cell(rd)) is not None:
                random.append({**c, "seed": seed})
    return searched, random


GROUPS = {"pooling (max + avg)": ("max_pool_3x3", "avg_pool_3x3"),
          "convolution (sep + dil)": ("sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5")}


def op_count(genotype: dict, cell: str, ops: tuple[str, ...]) -> int:
    """How many of ``cell``'s (``normal`` or ``reduce``) chosen edges are one of ``ops``."""
    return sum(name in ops for name, _ in genotype[cell])


def table(searched: list[dict], random: list[dict], ops: list[str]) -> str:
    rows = ["| cell | operation | searched: per cell (mean ± std) | random: per cell | τ (count vs acc, random cells) | ρ |",
            "|---|---|---|---|---|---|"]
    acc = [c["acc"] for c in random]
    for cell in ("normal", "reduce"):
        for op, members in [*((op, (op,)) for op in ops), *GROUPS.items()]:
            s = [op_count(c["genotype"], cell, members) for c in searched]
            r = [op_count(c["genotype"], cell, members) for c in random]
            (sm, ss), (rm, rs) = mean_std(s), mean_std(r)
            rows.append(f"| {cell} | {op} | {sm:.2f} ± {ss:.2f} | {rm:.2f} ± {rs:.2f} | "
                        f"{kendall_tau(r, acc):+.3f} | {spearman_rho(r, acc):+.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the --out of examples/fednas.py --seeds ...")
    p.add_argument("--primitives", choices=tuple(PRIMITIVE_SETS), default="darts")
    p.add_argument("--md", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    searched, random = collect(args.run_dir)
    if len(random) < 3:
        raise SystemExit(f"cell_ops: {len(random)} finished random cells under {args.run_dir}; need at least 3")
    ops = [op for op in PRIMITIVE_SETS[args.primitives] if op != "none"]
    seeds = sorted({c["seed"] for c in searched + random})
    text = (f"{len(searched)} searched and {len(random)} random cells over seeds "
            f"{','.join(map(str, seeds))} of `{args.run_dir}`; τ and ρ pooled over the random cells "
            f"of every seed (evaluation-stage global test accuracy).\n\n" + table(searched, random, ops) + "\n")
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
