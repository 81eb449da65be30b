"""FedNAS (He et al., arXiv:2004.08546): global search, evaluation stage, personalization.

    python examples/fednas.py                       # digits: search (8 Dir(0.5) clients), train the cell + 5 random ones
    python examples/fednas.py --seeds 0,1,2         # the same over three seeds: mean ± std
    python examples/fednas.py --dataset cluttered_digits --train-set algo.lr_schedule=cosine  # cells differ more
    python examples/fednas.py --personalized        # Table 1 analogue: FedNAS vs local adaptation / Ditto / perFedAvg
    python examples/fednas.py --preset paper --data-dir DIR   # CIFAR-10, the paper's settings (a GPU)
    python examples/fednas.py --out runs/fednas --resume      # continue an interrupted run

Global mode, each stage a resumable run directory under ``--out``: ``search/`` (Algorithm 1:
MiLeNAS, Eq. 4, on each sampled client; FedAvg of w, BN statistics and α, Eq. 5), ``train/``
(§3.2's evaluation stage: the derived cell trained from scratch with FedAvg on the same
clients), then :func:`jaxfednas.evidence.searched_vs_random` (``train_seed_<j>/``,
``random_<i>/``); about 6-12 minutes a seed on 2 CPU cores. Personalized mode (§2.5, Table
1): label-skew clients, FedNAS with 4 of 8 clients per round, every client adapting w and α
locally, against ``local_adaptation``, ``ditto`` and ``perfedavg`` on the same test splits.
What each stage computes and writes, the digits settings and the results: docs/papers/fednas.md.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxfednas.algorithms.fednas import client_genotypes, make_inherited_accuracy
from jaxfednas.algorithms.fednas_train import resolve_genotype
from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.evidence import Control, diagnostics_note, Labels, Names, searched_vs_random, stage_trainer, write_page
from jaxfednas.cost import model_params
from jaxfednas.reports import compare_clients, read_client_test_acc
from jaxfednas.example_args import ExampleParser
from jaxfednas.process import exit_process, run_script
from jaxfednas.stages import load_run, shared_settings, StageRunner
from jaxfednas.registry import make_config
from jaxfednas.seeds import once_or_over_seeds
from jaxfednas.rng import personalize_key
from jaxfednas.search_spaces.darts import network_params, PRIMITIVE_SETS
from jaxfednas.search_spaces.darts.genotypes import edges_text
from jaxfednas.search_spaces.sampling import random_genotype

DIGITS = {"data.dataset": "digits", "data.num_clients": 8, "data.partition": "dirichlet", "data.alpha": 0.5}
SEARCH = {"run.rounds": 10, "run.eval_every": 5, "algo.C": 8, "algo.layers": 5, "algo.local_epochs": 1,
          "algo.batch_size": 32, "algo.arch_lr": 0.3}
TRAIN = {"run.rounds": 20, "run.eval_every": 5, "algo.local_epochs": 1, "algo.batch_size": 32, "algo.lr": 0.05,
         "algo.weight_decay": 3e-4}
# The paper's Table 1 setting scaled to digits; it fixes batch 32 for every method (as SEARCH does).
PERSONAL_DATA = {"data.partition": "label_skew", "data.classes_per_client": 5, "run.clients_per_round": 4}
BASELINES = {
    "local_adaptation": {"algo.lr": 0.05, "algo.finetune_epochs": 5},
    "ditto": {"algo.lr": 0.05, "algo.prox_lambda": 0.1},
    "perfedavg": {"algo.lr": 0.01, "algo.inner_lr_multiple": 5},
}


def _fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.4f}"


def global_search(args, overrides: dict) -> None:
    """The search + evaluation stage + random cells, once per seed (``--seeds``: each into
    ``seed_<s>/``, then the table over seeds in ``results.md``)."""
    once_or_over_seeds(args, lambda over, out: search_and_evaluate(args, over, out), overrides,
                       title="FedNAS global search: searched vs random cells",
                       metric="evaluation-stage global test accuracy",
                       note=(f"Each seed: its own partition, search, evaluation stage of the derived cell and of "
                             f"{args.random} random cells trained with the same recipe (`seed_<s>/results.md`). "
                             + diagnostics_note("cell", "trained in the evaluation stage", args.train_seeds)
                             + " (Inherited weights: BN recalibrated on the clients.)"))


LABELS = Labels(searched="searched cell: evaluation-stage global test acc",
                seed_std="searched cell: std over training seeds")


def search_and_evaluate(args, overrides: dict, out: Path) -> dict:
    """One seed: search, the derived cell's evaluation stage, ``args.random`` random cells'
    evaluation stages (the same recipe), results.md / results.json; returns the numbers."""
    preset = args.preset
    base = {} if preset else {**DIGITS, **SEARCH}
    search_cfg = make_config("fednas", preset=preset, overrides={**base, **overrides})
    runner = StageRunner(out, resume=args.resume)
    s = runner.stage("search", search_cfg)[0]  # FedNAS, Algorithm 1
    text = json.dumps(s["architecture"], sort_keys=True)
    searched = resolve_genotype(text)

    d = search_cfg.data
    train_over = {
        "data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": d.num_clients,
        "data.partition": d.partition, "data.alpha": d.alpha, "data.classes_per_client": d.classes_per_client,
        "data.min_size": d.min_size, "data.partition_seed": d.partition_seed, "run.seed": search_cfg.run.seed,
        # the clients' search-train + search-val examples; the local test split is the same
        "data.split": (d.split[0] + d.split[1], 0.0, d.split[2]),
        "algo.C": search_cfg.algo.C, "algo.layers": search_cfg.algo.layers, "run.placement": search_cfg.run.placement,
        **({} if preset else TRAIN), **({"run.rounds": args.train_rounds} if args.train_rounds else {}),
        **args.train_overrides}  # e.g. algo.lr_schedule=cosine

    def config_for(g, training_seed):  # the evaluation stage: FedAvg of the cell, on the same clients
        over = {**train_over, "algo.genotype": text if g is searched else g.to_json()}
        if training_seed is not None:  # the same partition, another training seed
            over |= {"data.partition_seed": search_cfg.run.seed if d.partition_seed is None else d.partition_seed,
                     "run.seed": training_seed}
        return make_config("fednas_train", preset=preset, overrides=over)

    ds, train = load_dataset(search_cfg.data.dataset, search_cfg.data.data_dir), config_for(searched, None).algo
    info = DataInfo.of(ds, search_cfg.data.num_clients)

    control = Control(
        searched=searched, sample=lambda k: random_genotype(k, PRIMITIVE_SETS[search_cfg.algo.primitives],
                                                            search_cfg.algo.nodes),
        train=stage_trainer(runner, config_for), size=lambda g: model_params(config_for(g, None), info),
        match=(lambda g: network_params(g, C=train.C, num_classes=ds.num_classes, layers=train.layers,
                                        image_shape=tuple(ds.image_shape))) if args.match_size else None,
        inherited=(out / "search", lambda run: make_inherited_accuracy(run.config.algo, run.data.info,
                                                                         placement=run.options.placement)),
        key=lambda g: g.to_json())
    ev = searched_vs_random(control, out, seed=search_cfg.run.seed, random=args.random, train_seeds=args.train_seeds,
                            names=Names(searched="train", repeat="train_seed_{j}", random="random_{i}"))
    t = json.loads((out / "train" / "summary.json").read_text())
    f = s["final"]
    head = [
        ("supernet global test acc (search, final round)", _fmt(f["global_test_acc"])),
        ("same, BN with test-batch statistics", _fmt(f["global_test_acc_bn_batch"])),
        ("same, BN recalibrated on the clients' training examples (pooled n_k/n)",
         _fmt(f.get("global_test_acc_bn_recal", float("nan")))),
        ("supernet client val acc (mean ± std, unweighted)",
         f"{_fmt(f['client_val_acc_mean_unweighted'])} ± {_fmt(f['client_val_acc_std_unweighted'])}"),
        (f"α entropy (nats; uniform: {np.log(len(PRIMITIVE_SETS[search_cfg.algo.primitives])):.4f})",
         _fmt(f["arch_entropy"])),
        ("derived normal cell", edges_text(searched.normal)), ("derived reduce cell", edges_text(searched.reduce)),
        ("evaluation-stage client test acc (mean ± std, unweighted)",
         f"{_fmt(t['final']['client_test_acc_mean_unweighted'])} ± {_fmt(t['final']['client_test_acc_std_unweighted'])}"),
        ("supernet parameters", f"{model_params(search_cfg, info):,}"),
        ("wall time search / evaluation stage (s)", f"{runner.times['search']:.0f} / {runner.times['train']:.0f}"),
    ]
    page = write_page(out, ev, title=f"FedNAS global search ({search_cfg.data.dataset})", labels=LABELS, head=head,
                      metric="evaluation-stage global test accuracy", describe=lambda g: edges_text(g.normal),
                      plot_title=f"FedNAS ({search_cfg.data.dataset}, seed {search_cfg.run.seed}): searched cell vs "
                      "random cells")
    print(f"cell diagrams: {out / 'search' / 'plots'}/cell_normal.png, cell_reduce.png; results: {out / 'results.md'}")
    return {"numbers": {"supernet global test acc": f["global_test_acc"], "α entropy": f["arch_entropy"],
                        **page["numbers"]}, "points": page["points"]}


def personalized(args, overrides: dict) -> None:
    out = Path(args.out)
    preset = args.preset
    base = {} if preset else {**DIGITS, **SEARCH, **PERSONAL_DATA}
    search_cfg = make_config("fednas", preset=preset, overrides={**base, **overrides})
    if search_cfg.data.partition != "label_skew":
        print(f"note: partition is {search_cfg.data.partition} (the paper's Table 1 uses label_skew)")
    runner = StageRunner(out, resume=args.resume)  # (it checks that every method tests on the same local rows)
    runner.stage("fednas", search_cfg)
    t0 = time.perf_counter()
    run = load_run(out / "fednas")
    algo, data, state, info = run.algorithm, run.data, run.state, run.data.info
    rows, pers = algo.personalize(state, data, personalize_key(search_cfg.run.seed))
    pers = jax.device_get(pers)
    genos = client_genotypes(search_cfg.algo, rows["arch"])
    atomic_write_text(out / "personal_genotypes.json",
                      json.dumps([g.to_dict() for g in genos], indent=1, sort_keys=True) + "\n")
    selection = {  # candidate 0: the global model; e: after e adaptation epochs
        "kept_epoch": np.asarray(pers["personal_epoch"]).tolist(),
        "val_acc_by_epoch": np.round(np.asarray(pers["client_val_acc_by_epoch"], np.float64), 6).tolist(),
        "test_acc_by_epoch": np.round(np.asarray(pers["client_test_acc_by_epoch"], np.float64), 6).tolist(),
    }
    atomic_write_text(out / "personal_selection.json", json.dumps(selection, indent=1) + "\n")
    t_pers = time.perf_counter() - t0 + runner.times["fednas"]
    print(f"  local adaptation of w and α on every client: {time.perf_counter() - t0:.0f} s", flush=True)

    d = search_cfg.data
    shared = {**shared_settings(search_cfg, algo=("batch_size", "local_epochs")), "run.eval_every": search_cfg.run.rounds,
              "data.split": (d.split[0] + d.split[1], 0.0, d.split[2])}  # the examples FedNAS searches on
    results = {"FedNAS (personalized)": (np.asarray(pers["client_test_acc"]), t_pers, model_params(search_cfg, info))}
    for name, extra in BASELINES.items():
        cfg = make_config(name, preset=preset, overrides={**shared, **({} if preset else extra)})
        runner.stage(name, cfg)  # on FedNAS's local test rows, or it stops
        results[name] = (read_client_test_acc(out / name), runner.times[name], model_params(cfg, info))

    table = compare_clients(out, results)  # clients.csv, plots/clients.png
    notes = (
        f"FedNAS: each client keeps the model best on its own validation split among the global model (epoch 0) "
        f"and its {search_cfg.algo.personalize_epochs} adaptation epochs (ties: the later); kept epochs "
        f"{selection['kept_epoch']}. After all epochs instead: "
        f"{pers['client_test_acc_final_mean_unweighted']:.4f} ± {pers['client_test_acc_final_std_unweighted']:.4f}; "
        f"the unadapted global supernet: {pers['client_test_acc_global_mean_unweighted']:.4f} ± "
        f"{pers['client_test_acc_global_std_unweighted']:.4f}.\n"
    )
    atomic_write_text(out / "results.md",
                      f"# Personalized FedNAS vs baselines ({d.dataset}, {d.partition})\n\n{table}\n{notes}")
    print("\n" + table)
    print(notes, end="")
    print(f"per-client accuracies: {out / 'clients.csv'}, {out / 'plots' / 'clients.png'}; "
          f"per-client genotypes: {out / 'personal_genotypes.json'}; kept epochs: {out / 'personal_selection.json'}")


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_argument("--personalized", action="store_true", help="Table 1 analogue: personalized FedNAS vs baselines")
    p.add_preset(("smoke", "paper"))
    p.add_data("prepared data directory (CIFAR-10 for --preset paper)")
    p.add_rounds("search rounds")
    p.add_argument("--train-rounds", type=int, help="evaluation-stage rounds")
    p.add_train_set("fednas_train", "global mode: override a setting of the evaluation stage, the searched and the "
                    "random cells alike (algo.* or run.*, see `jaxfednas run fednas_train --help`; e.g. "
                    "algo.lr_schedule=cosine)")
    p.add_seed()
    p.add_seeds("global mode: the whole job once per seed (e.g. 0,1,2), each into --out/seed_<s>; results.md gives "
                "mean ± std over seeds")
    p.add_control(random=5, random_help="global mode: also train N random cells of the space with the evaluation "
                  "stage's recipe (the control; default 5, 0: none)", min_train_seeds=1,
                  train_seeds_help="global mode: train the searched cell with N training seeds on the same partition "
                  "(train/, train_seed_<j>/) for the architecture signal-to-noise ratio (default 3, >= 1)",
                  match_size_help="draw each random cell with parameters within ±10 %% of the searched cell's")
    p.add_run_dir(None, out_help="output directory (default runs/fednas[-personalized])",
                  set_help="override a search setting (see `jaxfednas run fednas --help`)")
    args = p.parse(argv)
    args.out = args.out or ("runs/fednas-personalized" if args.personalized else "runs/fednas")
    overrides = args.overrides
    if args.seeds is not None and (args.seed is not None or args.personalized):
        p.error("--seeds goes with global mode and without --seed")
    return run_script("examples/fednas.py", lambda: (personalized if args.personalized else global_search)(args, overrides))


if __name__ == "__main__":
    exit_process(main())
