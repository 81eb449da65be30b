"""SPIDER (Mushtaq, He, Ding, Avestimehr, "Distributed Architecture Search Over
Heterogeneous Distributions", TMLR; earlier version arXiv:2112.13939): personalized
architectures per client, against local-only NAS, a global federated NAS and
personalized baselines on the same clients (the paper's §5.1, Table 1, App. D.1, D.2).

    python examples/spider.py                               # digits, 8 Dir(0.2) clients (CPU, a few minutes)
    python examples/spider.py --only spider,ditto           # a subset of the methods
    python examples/spider.py --preset paper --data-dir DIR # CIFAR-100, the paper's settings (a GPU)
    python examples/spider.py --out runs/spider --resume    # continue an interrupted run
    python examples/spider.py --only spider --seeds 0,1,2   # searched vs random masks over 3 seeds

Methods (``--only``), each a run directory under ``--out`` (default ``runs/spider``):
``spider/`` (SPIDER, Algorithms 1-2, λ = 0.01), ``local_nas/`` (λ = 0, App. D.2),
``fednas/search`` + ``fednas/train`` (FedNAS-global, App. D.1 analogue), ``ditto/``,
``perfedavg/``, ``local_adaptation/``, all tested on identical local test splits. Writes
``results.md`` / ``results.json``: each method's local test accuracy, SPIDER's genotypes,
the personalization-gain matrix of §5.2.2 (``--gain-epochs``; ``plots/gain_matrix.png``)
and, with ``spider`` in ``--only``, the random control (``--random``, ``--match-size``,
``--train-seeds``; ``plots/searched_vs_random.png``); ``--seeds`` repeats it all per seed
into ``seed_<s>/``. ``--set``: SPIDER's settings (``data.*`` / ``run.*``: every method's). The
default run takes 7-8.5 minutes on 2 CPU cores, about half of it compiling. What each method,
number and setting is: docs/papers/spider.md ("The example").
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from jaxfednas.algorithms import spider as sp
from jaxfednas.config import ExperimentConfig
from jaxfednas.cost import model_params
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.evidence import searched_vs_random, write_results
from jaxfednas.example_args import ExampleParser
from jaxfednas.plots import plot_searched_vs_random
from jaxfednas.process import exit_process, run_script
from jaxfednas.registry import make_config
from jaxfednas.seeds import once_or_over_seeds
from jaxfednas.reports import read_client_test_acc
from jaxfednas.search_spaces.darts.genotypes import cell_text
from jaxfednas.stages import method_row, shared_settings, stage_row, StageRunner

METHODS = ("spider", "local_nas", "fednas", "ditto", "perfedavg", "local_adaptation")
LABELS = {"spider": "SPIDER", "local_nas": "local-only NAS (SPIDER λ=0, App. D.2)",
          "fednas": "FedNAS-global: search + FedAvg (App. D.1)", "ditto": "Ditto", "perfedavg": "perFedAvg",
          "local_adaptation": "local adaptation"}

DIGITS = {"data.dataset": "digits", "data.num_clients": 8, "data.partition": "dirichlet", "data.alpha": 0.2}
SPIDER_DIGITS = {"run.rounds": 30, "run.eval_every": 5, "algo.C": 8, "algo.layers": 3, "algo.nodes": 3,
                 "algo.warmup_rounds": 4, "algo.recovery_rounds": 2, "algo.lr": 0.03, "algo.personal_lr": 0.03}
SEARCH_ROUNDS = {"digits": 15, "paper": 50}  # FedNAS-global's search; its training runs SPIDER's rounds
FEDNAS_SEARCH = {"digits": {"algo.arch_lr": 1e-2}, "paper": {}}
FEDNAS_TRAIN = {"digits": {"algo.lr": 0.05, "algo.weight_decay": 3e-4},
                "paper": {"algo.lr": 0.01, "algo.weight_decay": 3e-4}}
BASELINES = {
    "digits": {  # examples/fednas.py's digits settings, the default network (a small CNN)
        "ditto": {"algo.lr": 0.05, "algo.prox_lambda": 0.1},
        "perfedavg": {"algo.lr": 0.01, "algo.inner_lr_multiple": 5},
        "local_adaptation": {"algo.lr": 0.05, "algo.finetune_epochs": 5},
    },
    "paper": {  # Table 1's ResNet18, lr 0.01 from the paper's grid (untuned)
        "ditto": {"algo.model": "resnet18", "algo.lr": 0.01, "algo.prox_lambda": 0.1},
        "perfedavg": {"algo.model": "resnet18", "algo.lr": 0.01, "algo.inner_lr_multiple": 3,
                      "algo.momentum": 0.0},
        "local_adaptation": {"algo.model": "resnet18", "algo.lr": 0.01, "algo.finetune_epochs": 5},
    },
}
GAIN_EPOCHS = {"digits": 3, "paper": 30}


def configs(args, overrides: dict) -> tuple[dict[str, ExperimentConfig], dict]:
    """Every run's configuration by run directory, and the overrides of FedNAS-global's
    training run (its genotype comes from the search). Data, rounds, seed and placement
    of every method are SPIDER's."""
    mode = "paper" if args.preset else "digits"
    base = {} if args.preset else {**DIGITS, **SPIDER_DIGITS}
    spider = make_config("spider", preset=args.preset, overrides={**base, **overrides})
    d, a = spider.data, spider.algo
    shared = shared_settings(spider, algo=("batch_size", "local_epochs"))
    # train on SPIDER's train + validation rows (the paper's 80 %), test on the same 20 %
    merged = {**shared, "data.split": (d.split[0] + d.split[1], 0.0, d.split[2])}
    out = {
        "spider": spider,
        "local_nas": make_config("spider", preset=args.preset, overrides={**base, **overrides, "algo.prox_lambda": 0.0}),
        "fednas/search": make_config("fednas", overrides={
            **shared, **FEDNAS_SEARCH[mode], "data.split": d.split, "run.rounds": args.fednas_rounds or SEARCH_ROUNDS[mode],
            "algo.primitives": a.primitives, "algo.C": a.C, "algo.layers": a.layers, "algo.nodes": a.nodes}),
    }
    train = {**merged, **FEDNAS_TRAIN[mode], "algo.C": a.C, "algo.layers": a.layers}
    make_config("fednas_train", overrides=train)  # bad settings fail now, not after the search
    for name, extra in BASELINES[mode].items():
        out[name] = make_config(name, overrides={**merged, **extra})
    return out, train


def run(args) -> None:
    """The comparison into ``--out``, or into ``--out/seed_<s>`` per seed with the table over seeds."""
    once_or_over_seeds(args, lambda over, out: one_seed(args, over, out),
                       title=f"SPIDER ({', '.join(args.only)}): searched vs random personal architectures",
               metric="client test acc after fine-tuning (mean over clients)",
               note=("Each seed: its own partition, runs, personalization gain and random control (`seed_<s>/"
                     f"results.md`): every client's searched mask and {args.random} random masks of the same space "
                     f"per client{' (size-matched ±10 %)' if args.match_size else ''}, each fine-tuned with the gain "
                     "matrix's recipe (same epochs, same minibatches, from the global supernet's weights) and tested "
                     "on the client's local test split. Plot: `plots/searched_vs_random.png` (means over clients; "
                     "x: kept parameters)."))


def one_seed(args, overrides: dict, out: Path) -> dict:
    """One seed: every method of ``--only``, the gain matrix and the random control;
    results.md / results.json in ``out``; returns the numbers for the table over seeds."""
    t_call = time.perf_counter()
    mode = "paper" if args.preset else "digits"
    cfgs, train_over = configs(args, overrides)
    spider_cfg = cfgs["spider"]
    ds = load_dataset(spider_cfg.data.dataset, spider_cfg.data.data_dir)
    info = DataInfo.of(ds, spider_cfg.data.num_clients)
    runner = StageRunner(out, resume=args.resume)
    rows = []
    for method in args.only:
        if method == "fednas":
            s, w_search = runner.stage("fednas/search", cfgs["fednas/search"])
            train_cfg = make_config("fednas_train", overrides={
                **train_over, "algo.genotype": json.dumps(s["architecture"], sort_keys=True)})
            t, w_train = runner.stage("fednas/train", train_cfg)
            rows.append(method_row(method, LABELS[method], ["fednas/search", "fednas/train"],
                                   read_client_test_acc(out / "fednas" / "train"), w_search + w_train,
                                   model_params(train_cfg, info), shared_model_acc=None, genotype=s["architecture"],
                                   search_wall_s=round(w_search, 1)))
            continue
        nas = method in ("spider", "local_nas")
        s, row = stage_row(runner, method, cfgs[method], LABELS[method], (lambda s: s["final"]["personal_params_mean"])
                           if nas else model_params(cfgs[method], info))
        f = s["final"]
        rows.append(row | {"shared_model_acc": f.get("client_test_acc_global_mean_unweighted")} | (
            {"prox_lambda": cfgs[method].algo.prox_lambda, "final_clients": int(f["final_clients"]),
             "edges_decided": f["edges_decided"]} if nas else {}))

    result = {"dataset": spider_cfg.data.dataset, "clients": spider_cfg.data.num_clients,
              "partition": f"{spider_cfg.data.partition}({spider_cfg.data.alpha})", "rounds": spider_cfg.run.rounds,
              "same_test_splits": True, "rows": rows}
    genotypes = ev = None
    if "spider" in args.only:
        genotypes = sp.PersonalGenotypes.from_json((out / "spider" / sp.PersonalGenotypes.FILENAME).read_text()).genotypes()
        result["genotypes"] = {str(k): g.to_dict() for k, g in genotypes.items()}
        epochs = args.gain_epochs or GAIN_EPOCHS[mode]
        result["gain"] = None
        if len(genotypes) == spider_cfg.data.num_clients:  # the gain matrix and the random masks: one batch
            control = sp.control(genotypes, out / "spider", out / "gain.json", epochs, resume=args.resume,
                                 match_size=args.match_size, plot=out / "plots" / "gain_matrix.png")
            ev = searched_vs_random(control, out, seed=spider_cfg.run.seed, random=args.random,
                                    train_seeds=args.train_seeds if args.random else 1)
            result["gain"] = ev.details["gain"]
        else:
            print(f"note: {spider_cfg.data.num_clients - len(genotypes)} clients have not finished their search; "
                  "no personalization gain and no random control (run more rounds or shorten "
                  "algo.warmup_rounds / algo.recovery_rounds)")
        if ev is not None and args.random:
            result["versus"] = sp.searched_versus_random(ev)
            plot_searched_vs_random({spider_cfg.run.seed: ev.points()}, out / "plots" / "searched_vs_random.png",
                                    metric="client test acc after fine-tuning (mean over clients)",
                                    title=f"SPIDER ({spider_cfg.data.dataset}, seed {spider_cfg.run.seed}): searched "
                                    f"vs random masks, {epochs} fine-tuning epochs")
    result["this_call_s"] = round(time.perf_counter() - t_call, 1)
    title, body = report(result, spider_cfg, genotypes)
    write_results(out, title, body, result)
    print(f"results: {out / 'results.md'}; cell diagrams: {out / 'spider' / 'plots'}/client_<k>_normal.png, "
          f"_reduce.png; this call {result['this_call_s']:.0f} s")
    numbers = {f"{r['method']}: client test acc (mean over clients)": r["mean"] for r in rows}
    if result.get("gain"):
        numbers["mean personalization gain"] = result["gain"]["mean_gain"]
    if result.get("versus"):
        numbers.update(sp.control_numbers(ev, result["versus"]))
    return {"numbers": numbers, "points": result["versus"]["points"] if result.get("versus") else None}


def report(result: dict, spider_cfg: ExperimentConfig, genotypes: dict | None) -> tuple[str, str]:
    """The page's title and Markdown body."""
    a, d = spider_cfg.algo, spider_cfg.data
    lines = [f"{result['rounds']} rounds; SPIDER: C={a.C}, {a.layers} cells, {a.nodes} nodes, {a.primitives} ops, "
             f"t_s={a.warmup_rounds}, τ={a.recovery_rounds}, λ={a.prox_lambda}, lr {a.lr}, split {tuple(d.split)} "
             f"(other methods {d.split[0] + d.split[1]:.2g}/{d.split[2]:.2g}); identical local test splits in every "
             "run (checked on the partition manifests).", "",
             "| method | params | local test acc (mean ± std over clients) | min | max | shared model on local tests "
             "| wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        label = f"{r['label']} (λ={r['prox_lambda']})" if r["method"] == "spider" else r["label"]
        if "final_clients" in r:
            label += f" [search final: {r['final_clients']}/{d.num_clients}]"
        shared = "-" if r["shared_model_acc"] is None else f"{r['shared_model_acc']:.4f}"
        lines.append(f"| {label} | {r['params']:,.0f} | {r['mean']:.4f} ± {r['std']:.4f} | {r['min']:.4f} | "
                     f"{r['max']:.4f} | {shared} | {r['wall_s']:.0f} |")
    lines += ["", "params: SPIDER / local NAS: the personal subnets' weights, mean over clients; shared model: the "
              "global supernet (SPIDER) or the global model before personalization (baselines), mean over clients."]
    if genotypes:
        lines += ["", "## SPIDER's per-client architectures", "",
                  "Per node `op(input)+op(input)`; inputs 0 and 1 are the two previous cells, 2+ earlier nodes. "
                  "Diagrams: `spider/plots/client_<k>_normal.png`, `_reduce.png`.", "",
                  "| client | normal cell | reduce cell |", "|---|---|---|"]
        lines += [f"| {k} | {cell_text(g.normal)} | {cell_text(g.reduce)} |" for k, g in sorted(genotypes.items())]
    lines += sp.gain_report(result["gain"]) if result.get("gain") else []
    lines += sp.control_report(result["gain"], result["versus"]) if result.get("versus") else []
    return f"SPIDER vs baselines ({d.dataset}, {d.num_clients} clients, {result['partition']})", "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_preset(("paper",), help="the paper's CIFAR-100 settings (a GPU; needs --data-dir)")
    p.add_data("prepared CIFAR-100 (tfds data_dir) for --preset paper")
    p.add_rounds("rounds of SPIDER and of every other method's training (default 30 on digits, 1000 with "
                 "--preset paper)")
    p.add_argument("--fednas-rounds", type=int, help="FedNAS-global's search rounds (default 15 on digits, 50 paper)")
    p.add_argument("--gain-epochs", type=int, help="fine-tuning epochs per entry of the personalization-gain "
                   "matrix (default 3 on digits, 30 with --preset paper)")
    p.add_methods(METHODS, default=METHODS, help=f"run a subset of {', '.join(METHODS)}")
    p.add_seeds("the whole comparison once per seed (e.g. 0,1,2), each into --out/seed_<s>; results.md gives "
                "mean ± std over seeds")
    p.add_control(random=3, random_help="the control: N random masks of the space per client, fine-tuned with the "
                  "gain matrix's recipe beside each client's searched mask (needs spider in --only; default 3, 0: none)",
                  min_train_seeds=2, train_seeds_help="the control: fine-tune every client's searched mask with N "
                  "training seeds in all (their std is the noise of the architecture signal-to-noise ratio; default 3, "
                  "at least 2)", match_size_help="draw each client's random masks with parameters within ±10 %% of "
                  "its searched mask's")
    p.add_run_dir("runs/spider", set_help="override a SPIDER setting (see `jaxfednas run spider --help`); "
                  "data./run. fields apply to every method")
    args = p.parse(argv)
    return run_script("examples/spider.py", lambda: run(args))


if __name__ == "__main__":
    exit_process(main())
