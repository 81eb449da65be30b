"""How much of a FedAvg child's test accuracy is its averaged BatchNorm statistics.

Reads finished FedAvg stages of ``examples/dfnas.py --seeds ...`` (``--out``): for each
seed directory given (``seed_<s>/``), the searched child (``searched-fedavg/``), its
extra training seeds (``searched-fedavg-seed_<k>/``) and the random children
(``random-<k>-fedavg/``), each from its final checkpoint (no training). Every child is
evaluated twice on the global test set: with the BatchNorm running statistics FedAvg
averaged over the clients (what the example reports), and with them recalibrated on the
clients' training examples, as the search's child is (every client measures the child's
batch statistics on up to 10 batches of its training data in training mode, the server
pools them n_i/n: ``jaxfednas.algorithms.common.recalibrated_batch_stats``; the weights
are not touched). Then, per seed and both ways: the searched child against the random
children and the architecture signal-to-noise (random children's std over the searched
child's training-seed std). Writes ``--md`` (a table) and ``--json``; a ``.json`` file given
in place of a seed directory (an earlier ``--json``) is read instead of measured, so seeds
measured apart make one table.

    PYTHONPATH=. python benchmarks/studies/bn_recalibration.py runs/dfnas_cd/seed_1 runs/dfnas_cd/seed_2 \\
        --md runs/bn_recal.md --json runs/bn_recal.json

Needs the stages' checkpoints (a record in ``benchmarks/records/`` keeps text files only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from jaxfednas.algorithms.common import recalibrated_batch_stats
from jaxfednas.evaluation import global_accuracy
from jaxfednas.stages import load_run
from jaxfednas.runtime import Placement
from jaxfednas.search_spaces.models import make_model

MAX_BATCHES = 10  # per client, as the DFNAS child's recalibration (bn_recalibration_batches 0 -> 10)
BATCH = 500


def accuracies(stage: Path) -> dict[str, float]:
    """``{"running": acc, "recalibrated": acc}``: global test accuracy of the stage's final
    model with FedAvg's averaged BN statistics, and with them recalibrated on the clients."""
    run = load_run(stage)
    info, data, v = run.data.info, run.data, run.state.variables
    model = make_model(run.config.algo.model, info.num_classes, info.name)

    stats = recalibrated_batch_stats(model, info, v, data, batch_size=BATCH, max_batches=MAX_BATCHES,
                                     placement=Placement())

    def acc(variables):
        logits = lambda x: model.apply(variables, info.normalize(x), train=False)  # noqa: E731
        return float(global_accuracy(logits, data, BATCH)["global_test_acc"])

    return {"running": acc(v), "recalibrated": acc({"params": v["params"], "batch_stats": stats})}


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def seed_summary(seed_dir: Path, log=print) -> dict:
    """Both evaluations of every finished FedAvg stage of one seed, and the comparison."""
    stages = {}
    for stage in sorted(seed_dir.iterdir()):
        if stage.is_dir() and "fedavg" in stage.name and (stage / "summary.json").exists():
            stages[stage.name] = accuracies(stage)
            a = stages[stage.name]
            log(f"  {seed_dir.name}/{stage.name}: running statistics {a['running']:.4f}, "
                f"recalibrated {a['recalibrated']:.4f}")
    out = {"stages": stages}
    for how in ("running", "recalibrated"):
        searched = [a[how] for n, a in stages.items() if n.startswith("searched-fedavg")]
        random = [a[how] for n, a in stages.items() if n.startswith("random-")]
        if not searched or len(random) < 2:
            continue
        first = stages["searched-fedavg"][how] if "searched-fedavg" in stages else searched[0]
        out[how] = {"searched": first, "random_mean": statistics.fmean(random), "random_std": _std(random),
                    "difference": first - statistics.fmean(random),
                    "beaten": sum(first > r for r in random) / len(random),
                    "training_seed_std": _std(searched), "training_seeds": len(searched),
                    "snr": _std(random) / _std(searched) if len(searched) > 1 else float("nan")}
    return out


def table(results: dict[str, dict]) -> str:
    rows = [("searched child (training seed 0)", "searched"), ("random children: mean", "random_mean"),
            ("random children: std", "random_std"), ("searched − random mean", "difference"),
            ("random children beaten (fraction)", "beaten"),
            ("searched child: std over its training seeds", "training_seed_std"),
            ("architecture signal-to-noise", "snr")]
    seeds = list(results)
    lines = ["| metric | evaluation | mean ± std over seeds | " + " | ".join(seeds) + " |",
             "|---|---|---|" + "---|" * len(seeds)]
    for label, key in rows:
        for how, name in (("running", "averaged BN statistics (reported)"), ("recalibrated", "BN recalibrated")):
            vals = [results[s].get(how, {}).get(key) for s in seeds]
            have = [x for x in vals if x is not None and x == x]
            agg = (f"{statistics.fmean(have):.4f} ± {_std(have):.4f}" if len(have) > 1 else
                   f"{have[0]:.4f}" if have else "-")
            cells = " | ".join("-" if x is None else f"{x:.4f}" for x in vals)
            lines.append(f"| {label} | {name} | {agg} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seed_dirs", nargs="+", type=Path,
                   help="seed_<s>/ directories of a DFNAS --seeds job, or earlier --json files")
    p.add_argument("--md", type=Path, help="write the table here")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    for d in args.seed_dirs:
        if not (d.is_dir() or (d.suffix == ".json" and d.is_file())):
            print(f"error: {d} is neither a directory nor a .json file", file=sys.stderr)
            return 2
    results = {}
    for d in args.seed_dirs:
        if d.suffix == ".json" and d.is_file():
            results.update(json.loads(d.read_text()))
        else:
            results[d.name] = seed_summary(d)
        if args.json:  # after every seed: an interrupted study keeps what it measured
            args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = table(results)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
