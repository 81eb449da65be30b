"""PerFedRLNAS (Yao & Li, "Personalized Federated Neural Architecture Search via
Reinforcement Learning", AAAI 2024): one supernet, a REINFORCE policy per client, against
FedAvg + fine-tuning, local-only training and personalized FedNAS on the same clients and
the same local test splits (the paper's Tables 2-3 and Fig. 4, scaled down).

    python examples/perfedrlnas.py                                # digits, 20 Dir(0.3) clients, 5 per round (CPU)
    python examples/perfedrlnas.py --only perfedrlnas,local_only  # a subset of the methods
    python examples/perfedrlnas.py --only perfedrlnas,perfedrlnas_nobudget  # Eq. 9 vs Eq. 8 (Fig. 4 with both)
    python examples/perfedrlnas.py --set algo.space=elastic       # another space (elastic, hybrid; no FedNAS then)
    python examples/perfedrlnas.py --preset paper --data-dir DIR  # CIFAR-10, 100 clients, 1500 rounds (a GPU)
    python examples/perfedrlnas.py --out runs/perfedrlnas --resume  # continue an interrupted run
    python examples/perfedrlnas.py --seeds 0,1,2 --random 5       # learned vs random subnets over 3 seeds

Methods (``--only``), each a run directory under ``--out`` (default ``runs/perfedrlnas``),
all tested on identical local test splits: ``perfedrlnas/`` (Algorithm 1, memory-budget
reward Eq. 9), ``perfedrlnas_nobudget/`` (Eq. 8; not by default), ``local_adaptation/``
(FedAvg + fine-tuning), ``local_only/``, ``fednas/`` (personalized FedNAS, He et al. §2.5).
Writes ``results.md`` / ``results.json`` (accuracy, parameters, simulated round time, wall
time; the learned-vs-random control: ``--random``, ``--train-seeds``) and
``plots/memory_vs_budget.png`` (Fig. 4); ``--seeds``: once per seed into ``seed_<s>/``
(only ``perfedrlnas`` unless ``--only`` says more), with mean ± std over seeds. ``--set``:
PerFedRLNAS's settings (``data.*`` / ``run.*``: every method's). Each method, number and
setting: docs/papers/perfedrlnas.md ("The example"). The default run takes 6.8 minutes on 2 CPU
cores (``perfedrlnas_nobudget`` adds about 1.5).
"""
from __future__ import annotations

import time
from pathlib import Path


from jaxfednas.algorithms import perfedrlnas as pf
from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.config import ExperimentConfig
from jaxfednas.cost import model_params
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.evidence import searched_vs_random, write_results
from jaxfednas.example_args import ExampleParser
from jaxfednas.plots import plot_memory_vs_budget, plot_searched_vs_random
from jaxfednas.process import exit_process, run_script
from jaxfednas.registry import make_config
from jaxfednas.runtime import resolve_clients_per_round
from jaxfednas.seeds import once_or_over_seeds, parse_seeds, wins_over_seeds
from jaxfednas.stages import cached_json, method_row, personalized_accuracy, shared_settings, stage_row, StageRunner

METHODS = ("perfedrlnas", "perfedrlnas_nobudget", "local_adaptation", "local_only", "fednas")
DEFAULT_METHODS = ("perfedrlnas", "local_adaptation", "local_only", "fednas")  # + perfedrlnas_nobudget: ~1.5 min more
SEEDS_METHODS = ("perfedrlnas",)  # --seeds: the comparison with random subnets needs only this run
PERFEDRLNAS = ("perfedrlnas", "perfedrlnas_nobudget")
LABELS = {"perfedrlnas": "PerFedRLNAS, memory budget (Eq. 9)", "perfedrlnas_nobudget": "PerFedRLNAS, no budget (Eq. 8)",
          "local_adaptation": "FedAvg + fine-tuning", "local_only": "local-only",
          "fednas": "FedNAS personalized (search + local adaptation)"}

DIGITS = {"data.dataset": "digits", "data.num_clients": 20, "data.partition": "dirichlet", "data.alpha": 0.3,
          "run.clients_per_round": 5}
PFR = {
    "digits": {"run.rounds": 40, "run.eval_every": 10, "algo.C": 8, "algo.layers": 3, "algo.nodes": 2,
               "algo.local_epochs": 5, "algo.lr": 0.1, "algo.lr_min": 0.01, "algo.memory_budget": True},
    "paper": {"algo.memory_budget": True},
}
SEARCH_ROUNDS = {"digits": 10, "paper": 50}  # FedNAS's search
FEDNAS = {"digits": {"algo.arch_lr": 1e-2, "algo.lr": 0.1, "algo.lr_min": 0.01, "algo.personalize_epochs": 5},
          "paper": {"algo.personalize_epochs": 5}}
BASELINES = {
    "digits": {"local_adaptation": {"algo.lr": 0.05, "algo.finetune_epochs": 10},
               "local_only": {"algo.lr": 0.05}},
    "paper": {"local_adaptation": {"algo.model": "resnet18", "algo.lr": 0.01, "algo.finetune_epochs": 10},
              "local_only": {"algo.model": "resnet18", "algo.lr": 0.01}},
}
PLOT = Path("plots") / "memory_vs_budget.png"
LOCAL_PLOT = Path("plots") / "searched_vs_random_local_epochs.png"


def configs(args, overrides: dict) -> dict[str, ExperimentConfig]:
    """Every run's configuration by run directory. Data, rounds, clients per round, seed
    and placement of every method are PerFedRLNAS's."""
    mode = "paper" if args.preset else "digits"
    base = {**PFR[mode]} if args.preset else {**DIGITS, **PFR[mode]}
    pfr = make_config("perfedrlnas", preset=args.preset, overrides={**base, **overrides})
    d, a, shared = pfr.data, pfr.algo, shared_settings(pfr, algo=("batch_size",))
    train = d.split[0] + d.split[1]  # PerFedRLNAS's training rows (a validation split, if any, included)
    out = {"perfedrlnas": pfr,
           "perfedrlnas_nobudget": make_config("perfedrlnas", preset=args.preset, overrides={
               **base, **overrides, "algo.memory_budget": False})}
    for name, extra in BASELINES[mode].items():
        out[name] = make_config(name, overrides={**shared, "data.split": (train, 0.0, d.split[2]),
                                                 "algo.local_epochs": a.local_epochs, **extra})
    out["fednas"] = make_config("fednas", overrides={
        **shared, "algo.local_epochs": a.local_epochs, **FEDNAS[mode],
        "data.split": (0.75 * train, 0.25 * train, d.split[2]),
        "run.rounds": args.fednas_rounds or SEARCH_ROUNDS[mode], "algo.primitives": a.primitives,
        "algo.C": a.C, "algo.layers": a.layers, "algo.nodes": a.nodes})
    return out


def run(args) -> None:
    """One seed into ``--out`` or, with ``--seeds``, each into ``--out/seed_<s>`` and the table over seeds."""
    if args.seeds is None:
        return run_one(args, args.overrides, Path(args.out))
    seeds, out = parse_seeds(args.seeds), Path(args.out)
    per_seed = once_or_over_seeds(args, lambda over, d: run_one(args, over, d),
                                  title="PerFedRLNAS: learned argmax subnets vs random subnets",
                                  metric="client-mean test accuracy (supernet weights)",
                                  plot_title="PerFedRLNAS: learned argmax subnets (stars) vs random subnets (dots), "
                                             "supernet weights",
                                  note=seeds_note(args, seeds))
    local = {s: r["points_local_epochs"] for s, r in per_seed.items() if r.get("points_local_epochs")}
    if local:
        plot_searched_vs_random(local, out / LOCAL_PLOT, metric="client-mean test accuracy (+ E local epochs)",
                                title="PerFedRLNAS: learned argmax subnets (stars) vs random subnets (dots), "
                                      "after E local epochs")
    verdict = wins_over_seeds({s: r["numbers"] for s, r in per_seed.items()}, ": learned − random",
                              winner="the learned subnets", loser="the random ones",
                              title="Learned vs random, seed by seed:")
    if verdict:
        text = (out / "results.md").read_text() + "\n" + verdict
        atomic_write_text(out / "results.md", text)
        print(verdict)


def seeds_note(args, seeds) -> str:
    return (f"Each seed (`run.seed`; also the partition, the simulated devices and the random subnets' keys): the "
            f"methods {', '.join(args.only)} in `seed_<s>/` (its own `results.md`), and {args.random} draws of one "
            "random subnet per client (within the client's memory budget when the run has one), tested by the same "
            "code as the learned policy's argmax subnets. \"supernet weights\": each client's subnet with the final "
            "supernet weights; \"+ E local epochs\": the same subnet after its client's local training. \"fraction "
            "of draws beaten\": the share of the random draws whose client mean the learned subnets' client mean "
            "exceeds; \"clients beating random\": the share of clients whose learned subnet beats their random "
            "subnets' mean. Plots (x: parameters, mean over clients; y: client-mean accuracy; star: learned, dots: "
            "random draws, one colour per seed): `plots/searched_vs_random.png` (supernet weights), "
            "`plots/searched_vs_random_local_epochs.png` (+ E local epochs).\n")


def seed_numbers(rows: list[dict]) -> dict:
    """One seed's result for :func:`jaxfednas.seeds.over_seeds`: ``numbers`` (every run's
    control, :func:`pf.control_numbers`, every other method's mean client accuracy) and the
    first controlled run's ``points`` and ``points_local_epochs``."""
    numbers, result = {}, {}
    for r in rows:
        m, c = r["method"], r.get("random_control")
        if not c:
            numbers[f"{m}: mean client acc"] = r["mean"]
            if "local_training" in r:
                numbers[f"{m}: + local epochs, mean client acc"] = r["local_training"]["mean"]
            continue
        n, points = pf.control_numbers(m, r["params"], c)
        numbers.update(n)
        result = {**points, **result}  # the first run's points
    return {"numbers": numbers, **result}


def run_one(args, overrides: dict, out: Path) -> dict:
    """Every method of ``args.only`` on one seed into ``out``; returns :func:`seed_numbers` of its rows."""
    t_call = time.perf_counter()
    cfgs = configs(args, overrides)
    pfr_cfg = cfgs["perfedrlnas"]
    if pfr_cfg.algo.space != "darts" and "fednas" in args.only:
        print(f"note: FedNAS searches the DARTS space; left out with algo.space={pfr_cfg.algo.space}")
        args.only = tuple(m for m in args.only if m != "fednas")
    ds = load_dataset(pfr_cfg.data.dataset, pfr_cfg.data.data_dir)
    info = DataInfo.of(ds, pfr_cfg.data.num_clients)
    runner = StageRunner(out, resume=args.resume)
    rows = []
    for method in args.only:
        if method in PERFEDRLNAS:
            s, row = stage_row(runner, method, cfgs[method], LABELS[method], lambda s: s["final"]["personal_params_mean"])
            local = cached_json(out / f"{method}_local_training.json", {"rounds": s["rounds"]}, args.resume,
                                lambda m=method: pf.local_train_argmax(out / m))
            per_round = resolve_clients_per_round(cfgs[method].run.clients_per_round, info.num_clients)
            row |= {"memory_budget": cfgs[method].algo.memory_budget, "local_training": local,
                    **pf.training_summary(out / method, s["final"], per_round)}
            if args.random:  # every client's random subnets drawn and tested in one batch
                control = pf.control(out / method, out / f"{method}_random_subnets.json", s["rounds"],
                                     row["client_test_acc"], local["client_test_acc"], row["params"], resume=args.resume)
                ev = searched_vs_random(control, out, seed=cfgs[method].run.seed, random=args.random,
                                        train_seeds=args.train_seeds)
                row["random_control"] = pf.control_summary(ev)
            rows.append(row)
        elif method == "fednas":
            s, w_search = runner.stage("fednas", cfgs["fednas"])
            pers = cached_json(out / "fednas_personalized.json", {"rounds": s["rounds"]}, args.resume,
                               lambda: personalized_accuracy(out / "fednas", lambda run, m: {  # He et al. §2.5
                                   "global_mean": float(m["client_test_acc_global_mean_unweighted"]),
                                   "epochs": run.config.algo.personalize_epochs}))
            rows.append(method_row(method, LABELS[method], ["fednas"], pers["client_test_acc"],
                                   w_search + pers["wall_s"], model_params(cfgs["fednas"], info),
                                   search_wall_s=round(w_search, 1), global_supernet_acc=pers["global_mean"],
                                   genotype=s["architecture"]))
        else:
            s, row = stage_row(runner, method, cfgs[method], LABELS[method], model_params(cfgs[method], info))
            rows.append(row | {"global_model_acc": s["final"].get("client_test_acc_global_mean_unweighted")})

    d = pfr_cfg.data
    result = {"dataset": d.dataset, "clients": d.num_clients, "clients_per_round": pfr_cfg.run.clients_per_round,
              "partition": f"{d.partition}({d.alpha})", "rounds": pfr_cfg.run.rounds,
              "fednas_search_rounds": cfgs["fednas"].run.rounds, "same_test_splits": True, "rows": rows}
    memory = {LABELS[m]: pf.PersonalSubnets.from_json((out / m / pf.PersonalSubnets.FILENAME).read_text()).clients
              for m in PERFEDRLNAS if m in args.only}
    if memory:
        plot_memory_vs_budget(memory, out / PLOT)
        result["memory_plot"] = str(PLOT)
    result["this_call_s"] = round(time.perf_counter() - t_call, 1)
    write_results(out, *report(result, pfr_cfg), result)
    print(f"results: {out / 'results.md'}" + (f"; memory vs budget: {out / PLOT}" if memory else "")
          + f"; this call {result['this_call_s']:.0f} s")
    return seed_numbers(rows)


def report(result: dict, cfg: ExperimentConfig) -> tuple[str, str]:
    """The page's title and Markdown body."""
    a, d = cfg.algo, cfg.data
    space = f"DARTS C={a.C}, {a.layers} cells, {a.nodes} nodes, {a.primitives} ops" if a.space == "darts" else \
        f"{a.space} ({a.space_preset})"
    title = (f"PerFedRLNAS vs baselines ({d.dataset}, {d.num_clients} clients, {result['partition']}, "
             f"{result['clients_per_round']} per round)")
    lines = [f"{result['rounds']} rounds of {a.local_epochs} local epochs; PerFedRLNAS: {space}, lr {a.lr} → "
             f"{a.lr_min}, policy Adam lr {a.policy_lr}, λ_time {a.lambda_time} ({a.time_term}), φ {a.phi}; FedNAS: "
             f"{result['fednas_search_rounds']} search rounds. Identical local test splits "
             f"({d.split[2]:.2g} of each client's data) in every run (checked on the partition manifests).", "",
             "| method | params | local test acc (mean ± std over clients) | min | max | sim. round time (s) "
             "| wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rt = "-" if r.get("round_time_s") is None else f"{r['round_time_s']:.3f}"
        lines.append(f"| {r['label']} | {r['params']:,.0f} | {r['mean']:.4f} ± {r['std']:.4f} | {r['min']:.4f} | "
                     f"{r['max']:.4f} | {rt} | {r['wall_s']:.0f} |")
        if "local_training" in r:
            t = r["local_training"]
            lines.append(f"| ↳ + {t['epochs']} local epochs (lr {t['lr']}) | | {t['mean']:.4f} ± {t['std']:.4f} | "
                         f"{t['min']:.4f} | {t['max']:.4f} | | {t['wall_s']:.0f} |")
    lines += ["", "PerFedRLNAS: each client's argmax subnet of its policy with the final supernet weights; ↳ the same "
              "subnet after its client's local training (as in a round). params: mean over clients of the argmax "
              "subnets' weights (FedNAS: the supernet, every client's adapted copy). sim. round time: mean over "
              "rounds of the slowest sampled client's simulated compute + transfer."]
    pfr = [r for r in result["rows"] if r["method"] in PERFEDRLNAS]
    lines += pf.training_report(pfr, result["clients"])
    lines += pf.control_report([r for r in pfr if "random_control" in r])
    other = [r for r in result["rows"] if r.get("global_model_acc") is not None or "global_supernet_acc" in r]
    if other:
        lines += ["", "Shared model before personalization, mean over clients: " + "; ".join(
            f"{r['label']}: {r.get('global_model_acc', r.get('global_supernet_acc')):.4f}" for r in other) + "."]
    if "memory_plot" in result:
        lines += ["", f"Memory vs budget (Fig. 4 analogue): `{result['memory_plot']}`."]
    return title, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_preset(("paper",), help="the paper's CIFAR-10 settings (a GPU; needs --data-dir)")
    p.add_data("prepared CIFAR-10 / CIFAR-100 (tfds data_dir) for --preset paper")
    p.add_rounds("rounds of PerFedRLNAS and of the baselines (default 40 on digits, 1500 with --preset paper)")
    p.add_argument("--fednas-rounds", type=int, help="FedNAS's search rounds (default 10 on digits, 50 paper)")
    p.add_methods(METHODS, default=None, help=f"the methods to run, of {', '.join(METHODS)} (default: all but "
                  "perfedrlnas_nobudget; with --seeds: perfedrlnas)")
    p.add_seeds("the whole job once per seed (e.g. 0,1,2 or 0-4), each into --out/seed_<s>; results.md gives "
                "mean ± std over seeds of learned vs random subnets")
    p.add_control(random=3, random_help="the control: N draws of a random subnet per client (within its memory "
                  "budget), tested like the learned argmax subnets (default 3; 0: none)", min_train_seeds=2,
                  train_seeds_help="the control: the learned subnets' local epochs again with N training seeds in all "
                  "(their std is the noise of the architecture signal-to-noise ratio; default 3, at least 2)")
    p.add_run_dir("runs/perfedrlnas", set_help="override a PerFedRLNAS setting (see `jaxfednas run perfedrlnas "
                  "--help`); data./run. fields apply to every method")
    args = p.parse(argv)
    if args.only is None:
        args.only = SEEDS_METHODS if args.seeds is not None else DEFAULT_METHODS
    return run_script("examples/perfedrlnas.py", lambda: run(args))


if __name__ == "__main__":
    exit_process(main())
