"""Architecture signal-to-noise of a dataset under the FedNAS example's evaluation recipe.

Trains ``--random`` random DARTS cells (keys ``rng.random_arch_key(0, i)``) with the
evaluation stage of ``examples/fednas.py`` (its digits partition and ``TRAIN`` recipe, C=8,
5 cells, ``--train-set`` on top) on seed 0's partition, and random cell 0 again with
``--train-seeds`` - 1 other training seeds (``seeds.repeat_seed``, the partition fixed),
then prints :func:`jaxfednas.seeds.signal_to_noise`: the std over the random cells over
the std over the training seeds. No search: the ratio asks only whether the task and the
recipe can tell cells apart. Each stage is a resumable run directory under ``--out``.

    PYTHONPATH=. python benchmarks/studies/cluttered_snr.py --dataset cluttered_digits \\
        --train-set algo.lr_schedule=cosine --out runs/snr-cosine
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from jaxfednas.config import parse_set
from jaxfednas.data.datasets import DATASETS
from jaxfednas.stages import run_stage
from jaxfednas.registry import make_config
from jaxfednas.rng import random_arch_key
from jaxfednas.search_spaces.darts import PRIMITIVE_SETS
from jaxfednas.search_spaces.sampling import random_genotype
from jaxfednas.seeds import repeat_seed, signal_to_noise

ROOT = Path(__file__).resolve().parents[2]


def _fednas_example():
    spec = importlib.util.spec_from_file_location("example_fednas", ROOT / "examples" / "fednas.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="cluttered_digits")
    p.add_argument("--random", type=int, default=5, help="random cells (default 5)")
    p.add_argument("--train-seeds", type=int, default=3, help="training seeds of random cell 0 (default 3)")
    p.add_argument("--train-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a setting of the evaluation recipe, e.g. algo.lr_schedule=cosine")
    p.add_argument("--out", default="runs/snr")
    args = p.parse_args(argv)
    ex = _fednas_example()
    base = {**ex.DIGITS, **ex.TRAIN, "data.dataset": args.dataset, "data.split": (0.75, 0.0, 0.25),
            "algo.C": ex.SEARCH["algo.C"], "algo.layers": ex.SEARCH["algo.layers"], "run.seed": 0,
            **parse_set(args.train_set)}
    cells = [random_genotype(random_arch_key(0, i), PRIMITIVE_SETS["darts"], 4) for i in range(args.random)]
    out, t0, random, repeats = Path(args.out), time.perf_counter(), [], []

    def stage(name, over):
        r = run_stage(make_config("fednas_train", overrides={**base, **over}), out / name, resume=True,
                      describe=lambda row: f"global test acc {row['global_test_acc']:.4f}"
                      if "global_test_acc" in row else "")
        acc = r["final"]["global_test_acc"]
        print(f"{name}: {acc:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        return acc

    for i, g in enumerate(cells):
        random.append(stage(f"random_{i}", {"algo.genotype": g.to_json()}))
    repeats = [random[0]] + [stage(f"seed_{j}", {"algo.genotype": cells[0].to_json(), "data.partition_seed": 0,
                                                "run.seed": repeat_seed(0, j)}) for j in range(1, args.train_seeds)]
    snr = signal_to_noise(random, repeats)
    result = {"dataset": args.dataset, "train_set": args.train_set, "random": random, "repeats": repeats, **snr,
              "wall_s": round(time.perf_counter() - t0)}
    (out / "snr.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
