"""Why DFNAS trails FedAvg on the embedded digits: a sensitivity study.

Every variant is the non-IID DFNAS run of ``examples/dfnas.py`` as it was before this
study (digits, 8 clients, Dirichlet(0.5) unless ``--iid``, ``small`` space 4^7, batch 32,
α lr 0.05, w lr 0.1; the example now uses α lr 0.2 and w lr 0.05) with one thing changed,
run in this process through the library's API (``jaxfednas.algorithms.dfnas.dfnas``, the same
data, partition and keys as ``jaxfednas run``). Reported per variant: the final child's
global test accuracy with its BatchNorm statistics recalibrated (the example's number)
and with the search's running statistics, the child's accuracy at rounds ``--curve``,
how many blocks early fixing froze and when, the final α entropy, and wall time.

Variants that isolate causes (not DFNAS options, built here by changing the state):

* ``fixed:k3`` -- every block fixed to the 3x3 unit from round 0: the DFNAS training
  recipe (lr, momentum, label smoothing, BN, α untouched) with the search switched off,
  i.e. FedAvg of the plain ShuffleNetV2 under DFNAS' optimiser.
* ``fixed:found`` -- every block fixed from round 0 to the child the default search
  found (given by ``--found``): is the found architecture bad, or its weights?
* ``arch_lr=0`` -- α never moves: uniform single-path sampling (SPOS' supernet
  training); the child reported is argmax of uniform α = all k3, trained shared.

The BatchNorm recalibration is also evaluated both ways on the default run's final
state: pooled mean and variance (what DFNAS does) vs the per-batch variances averaged
(the earlier form), on the same weights.

    PYTHONPATH=. python benchmarks/studies/dfnas_sensitivity.py                   # all variants (~30 min on 2 cores)
    PYTHONPATH=. python benchmarks/studies/dfnas_sensitivity.py --only default fixed:k3

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.run_options import RunOptions
from jaxfednas.algorithms import common
from jaxfednas.algorithms.dfnas import dfnas
from jaxfednas.data import partition as part
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.experiment import make_partition
from jaxfednas.registry import make_config
from jaxfednas.rng import init_key, round_key
from jaxfednas.search_spaces.shufflenet import CANDIDATES

# examples/dfnas.py's digits settings (DIGITS + NONIID) before this study: α lr 0.05, w lr 0.1
BASE = {"data.dataset": "digits", "data.split": (0.75, 0.0, 0.25), "run.rounds": 20, "algo.space": "small",
        "algo.batch_size": 32, "algo.local_epochs": 5, "algo.arch_lr": 0.05,
        "data.partition": "dirichlet", "data.alpha": 0.5, "data.num_clients": 8}

VARIANTS: dict[str, dict] = {
    "default": {},
    "fixed:k3": {"_fixed": "k3"},
    "fixed:found": {"_fixed": "found"},
    "arch_lr=0": {"algo.arch_lr": 0.0},
    "arch_lr=0.01": {"algo.arch_lr": 0.01},
    "arch_lr=0.2": {"algo.arch_lr": 0.2},
    "fix_threshold=0": {"algo.fix_threshold": 0.0},
    "fix_threshold=0.1": {"algo.fix_threshold": 0.1},
    "local_epochs=1": {"algo.local_epochs": 1},
    "local_epochs=10": {"algo.local_epochs": 10},
    "rounds=40": {"run.rounds": 40},
    "rounds=60": {"run.rounds": 60},
    "lr=0.05": {"algo.lr": 0.05},
    "label_smoothing=0": {"algo.label_smoothing": 0.0},
    "arch_lr=0.2,lr=0.05": {"algo.arch_lr": 0.2, "algo.lr": 0.05},
    "arch_lr=0.2,seed=1": {"algo.arch_lr": 0.2, "run.seed": 1},
    "seed=1": {"run.seed": 1},
    "arch_lr=0.2,lr=0.05,seed=1": {"algo.arch_lr": 0.2, "algo.lr": 0.05, "run.seed": 1},
    "arch_lr=0.2,lr=0.05,iid": {"algo.arch_lr": 0.2, "algo.lr": 0.05, "data.partition": "iid"},
    "iid": {"data.partition": "iid"},
}


def averaged_variance_stats(stats: dict, n) -> dict:
    """The earlier recalibration for the A/B: client statistics averaged n_i/n as they
    are (mean of means, mean of variances) -- leaves out the spread of the client means."""
    w = n / jnp.maximum(n.sum(), 1)
    return jax.tree.map(lambda s: jnp.tensordot(w, s, axes=1), stats)


def run_variant(name: str, over: dict, found: list[str], curve: set[int]) -> dict:
    over = {**BASE, **over}
    fixed_to = over.pop("_fixed", None)
    cfg = make_config("dfnas", overrides={**over, "run.placement": "auto"})
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    data = make_federated_data(dataset, part.manifest_splits(make_partition(cfg, dataset)))
    algo = dfnas(cfg.algo, data.info, run=RunOptions(rounds=cfg.run.rounds))
    state = algo.init(init_key(cfg.run.seed))
    if fixed_to:
        choices = [fixed_to] * len(found) if fixed_to != "found" else found
        nb = state.fixed.shape[0]
        idx = [CANDIDATES.index(c) for c in (choices if len(choices) == nb else [choices[0]] * nb)]
        choice = jnp.asarray(idx, jnp.int32)
        # α of a fixed block is frozen and the child is argmax(α): make it the fixed unit
        alpha = 10.0 * jax.nn.one_hot(choice, len(CANDIDATES))
        variables = {**state.variables, "arch": {"alpha": alpha}}
        state = state.replace(variables=variables, fixed=jnp.ones((nb,), bool), fixed_choice=choice)
    t0 = time.perf_counter()
    acc_curve, fixed_at = {}, {}
    for r in range(cfg.run.rounds):
        state, met = algo.round(state, data, round_key(cfg.run.seed, r))
        nfixed = int(met["fixed_blocks"])
        if nfixed not in fixed_at.values() and nfixed:
            fixed_at[r + 1] = nfixed
        if r + 1 in curve and r + 1 != cfg.run.rounds:
            acc_curve[r + 1] = float(algo.evaluate(state, data)["global_test_acc"])
    final = jax.device_get(algo.evaluate(state, data))
    acc_curve[cfg.run.rounds] = float(final["global_test_acc"])
    arch = str(algo.export(state))
    row = {"variant": name, "rounds": cfg.run.rounds, "global_test_acc": float(final["global_test_acc"]),
           "running_bn": float(final.get("global_test_acc_running_bn", np.nan)),
           "client_test_acc": float(final["client_test_acc_mean_unweighted"]),
           "train_acc_last_round": float(met["train_acc"]), "arch_entropy": float(final["arch_entropy"]),
           "fixed_blocks": int(final["fixed_blocks"]), "fixed_at_round": fixed_at, "curve": acc_curve,
           "child": arch, "wall_s": round(time.perf_counter() - t0, 1)}
    if name == "default":  # the recalibration A/B on the same weights
        orig = common.pool_batch_statistics
        try:  # federated_batch_statistics pools through this module-level name
            common.pool_batch_statistics = averaged_variance_stats
            algo2 = dfnas(cfg.algo, data.info, run=RunOptions(rounds=cfg.run.rounds))
            row["global_test_acc_averaged_variance_bn"] = float(algo2.evaluate(state, data)["global_test_acc"])
        finally:
            common.pool_batch_statistics = orig
    return row


def report(rows: list[dict]) -> str:
    """The Markdown table of ``rows`` (the newest row of each variant, in VARIANTS order)."""
    latest = {r["variant"]: r for r in rows}
    order = [v for v in VARIANTS if v in latest]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    table = []
    for v in order:
        r = latest[v]
        curve = " / ".join(f"{fmt(r['curve'].get(str(t), r['curve'].get(t)))}" for t in (5, 10, 20))
        fixed = ", ".join(f"{n}@{t}" for t, n in r["fixed_at_round"].items()) or "none"
        table.append([f"`{v}`", r["rounds"], fmt(r["global_test_acc"]), fmt(r["running_bn"]), curve,
                      fmt(r["train_acc_last_round"]), fixed, r["child"].split("[")[1].rstrip("]"), r["wall_s"]])
    from benchmarks._bench_util import markdown_table  # noqa: PLC0415

    header = ["variant", "rounds", "child test acc (recalibrated BN)", "running BN", "at round 5 / 10 / 20",
              "train acc, last round", "blocks fixed (count@round)", "child", "wall s"]
    out = markdown_table(header, table)
    if "default" in latest and "global_test_acc_averaged_variance_bn" in latest["default"]:
        out += (f"\n\nBatchNorm recalibration on the `default` run's final weights: pooled variance "
                f"{latest['default']['global_test_acc']:.4f}, averaged variances "
                f"{latest['default']['global_test_acc_averaged_variance_bn']:.4f}.")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, choices=tuple(VARIANTS))
    p.add_argument("--iid", action="store_true", help="IID partition of the 8 clients instead of Dirichlet(0.5)")
    p.add_argument("--found", default="xception k5 xception k5 k3 k7 xception",
                   help="the child of fixed:found (README's non-IID child)")
    p.add_argument("--curve", default="5,10,15,20,40", help="rounds at which the child's accuracy is recorded")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra override for every variant (e.g. data.partition=iid)")
    p.add_argument("--out", default="/tmp/dfnas_sensitivity.jsonl", help="rows are appended here as they finish")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: print the table of the rows already in --out")
    args = p.parse_args(argv)
    from jaxfednas.config import parse_set  # noqa: PLC0415

    out = Path(args.out)
    if not args.report_only:
        extra = parse_set(args.set)
        if args.iid:
            extra["data.partition"] = "iid"
        curve = {int(x) for x in args.curve.split(",")}
        found = args.found.split()
        for name in args.only or VARIANTS:
            row = run_variant(name, {**VARIANTS[name], **extra}, found, curve)
            row["extra"] = {k: v for k, v in extra.items()}
            print(json.dumps(row), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(report([json.loads(line) for line in out.read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main()
