"""DFNAS (Garg et al., arXiv:2010.06223): one-stage federated search of a ShuffleNetV2
child, against FedAvg on a fixed hand-designed network.

    python examples/dfnas.py                                   # digits: non-IID + IID 2/4/8 clients
    python examples/dfnas.py --preset cross-silo --data-dir DIR   # CIFAR-10, 8 Dir(0.5) clients, 150 rounds (GPU)
    python examples/dfnas.py --preset cross-device --data-dir DIR # CINIC-10, 16 clients, 250 rounds (GPU)
    python examples/dfnas.py --out runs/dfnas --resume             # continue an interrupted run
    python examples/dfnas.py --seeds 0,1,2                         # searched vs random over three seeds

Runs (resumable run directories): ``noniid-8/`` (Table 1: 8 Dirichlet(0.5) clients), ``iid-2/``,
``iid-4/``, ``iid-8/`` (Table 2), each searching and training at once (Algorithm 2 around
Algorithm 1), and ``fedavg-noniid-8/`` (FedAvg of the space's all-3x3 child); about 7 minutes
on 2 CPU cores. Then :func:`jaxfednas.evidence.searched_vs_random` on the first run's child:
random children of matched multiply-adds, all trained from scratch with the baseline's recipe
(``--train-set``, ``--children-bn-recal``); ``--seeds``: only the first run and the control.
What each number means and the results: docs/papers/dfnas.md.
"""
from __future__ import annotations

import time
from pathlib import Path


from jaxfednas.cost import model_params
from jaxfednas.algorithms.dfnas import child_report
from jaxfednas.search_spaces.models import make_model
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.example_args import ExampleParser
from jaxfednas.process import exit_process, run_script
from jaxfednas.evidence import (Control, diagnostics_note, Labels, Names, searched_vs_random, write_page,
                                write_results)
from jaxfednas.stages import StageRunner
from jaxfednas.registry import make_config
from jaxfednas.seeds import once_or_over_seeds
from jaxfednas.search_spaces.models import child_model_name, child_of_model_name
from jaxfednas.search_spaces.sampling import random_shuffle_arch
from jaxfednas.search_spaces.shufflenet import child_cost, macs_table, ShuffleArch, uniform_arch

# Digits scaling (the paper gives no optimiser settings): α lr 0.2 fixes every block by round ~11 and w lr
# 0.05 is the FedAvg baseline's (docs/papers/dfnas.md, "Training settings the paper does not give").
DIGITS = {"data.dataset": "digits", "data.split": (0.75, 0.0, 0.25), "run.rounds": 20, "run.eval_every": 10,
          "algo.space": "small", "algo.batch_size": 32, "algo.local_epochs": 5, "algo.arch_lr": 0.2,
          "algo.lr": 0.05}
NONIID = {"data.partition": "dirichlet", "data.alpha": 0.5, "data.num_clients": 8}
FEDAVG = {"algo.lr": 0.05, "algo.batch_size": 32, "algo.local_epochs": 5}  # + the searched space's k3 child


def _baseline(space: str) -> dict:
    """The FedAvg baseline's network: the all-3x3 child of the space DFNAS searched."""
    return {"algo.model": f"shufflenetv2_{space}"}


def plan(args, overrides: dict) -> list[tuple[str, str, dict]]:
    """``(run name, algorithm, overrides)`` of every run of this invocation."""
    if args.preset:
        from jaxfednas.algorithms.dfnas import PRESETS  # noqa: PLC0415

        p = PRESETS[args.preset]
        data = {k: v for k, v in p.items() if k.startswith("data.") or k.startswith("run.")}
        fedavg = {**data, **_baseline(overrides.get("algo.space", p["algo.space"])),
                  "algo.batch_size": p.get("algo.batch_size", 64)}
        return [(f"dfnas-{args.preset}", "dfnas", {**p, **overrides}),
                (f"fedavg-{args.preset}", "fedavg", {**fedavg, **overrides})]
    runs = [("noniid-8", "dfnas", {**DIGITS, **NONIID})]
    for k in args.iid_clients:
        runs.append((f"iid-{k}", "dfnas", {**DIGITS, "data.partition": "iid", "data.num_clients": k}))
    base = {k: v for k, v in DIGITS.items() if not k.startswith("algo.")}
    runs.append(("fedavg-noniid-8", "fedavg",
                 {**base, **NONIID, **FEDAVG, **_baseline(overrides.get("algo.space", DIGITS["algo.space"]))}))
    return [(name, algo, {**o, **{k: v for k, v in overrides.items() if k.split(".")[0] != "algo" or algo == "dfnas"}})
            for name, algo, o in runs]


def run(args) -> None:
    once_or_over_seeds(args, lambda over, out: one_seed(args, over, out, control_only=args.seeds is not None),
                       title="DFNAS: the searched child vs random children of matched multiply-adds",
                       metric=_control_metric(args),
                       note=(f"Each seed (`seed_<s>/results.md`): its own partition, the first DFNAS run "
                             f"({plan(args, args.overrides)[0][0]}), then its child and {args.random} random children with "
                             "multiply-adds within ±10 % of its, each trained from scratch with the FedAvg baseline's "
                             "recipe on the same clients. IID runs and the hand-designed FedAvg baseline are not run here. "
                             + diagnostics_note("child", "trained alike", args.train_seeds)
                             + " (Inherited weights: the child's single path, BN recalibrated.)"))


def one_seed(args, overrides: dict, out: Path, *, control_only: bool = False) -> dict:
    """Every run of ``plan`` (``control_only``: only the first DFNAS run) and the random
    control, into ``out``; writes results.md / results.json there and returns the numbers
    over which ``--seeds`` tables (``{"numbers", "points"}``, empty without a control)."""
    rows = []
    # the IID runs partition differently on purpose; wall times survive --resume
    runner = StageRunner(out, resume=args.resume, same_test_rows=False)
    runs = plan(args, overrides)
    todo = [next(r for r in runs if r[1] == "dfnas")] if control_only else runs
    for name, algo, over in todo:
        preset = args.preset if algo == "dfnas" and args.preset else None
        rows.append(_stage(runner, name, algo, make_config(algo, preset=preset, overrides=over)))
    if args.random:
        return random_control(args, runner, rows, runs, out)
    write_results(out, f"DFNAS ({', '.join(r['run'] for r in rows)})", results_table(rows) + "\n", rows)
    return {}


def _stage(runner: StageRunner, name: str, algo: str, cfg) -> dict:
    """Run (or resume) one run; its row of the results table."""
    d = cfg.data
    t0 = time.perf_counter()
    s, wall_s = runner.stage(name, cfg)
    row = {"run": name, "algorithm": algo, "clients": d.num_clients, "partition": d.partition,
           "rounds": s["rounds"], "global_test_acc": s["final"].get("global_test_acc"),
           "client_test_acc": s["final"].get("client_test_acc_mean_unweighted"),
           "wall_s": round(wall_s, 1), "this_call_s": round(time.perf_counter() - t0, 1)}
    ds = load_dataset(d.dataset, d.data_dir)
    if algo == "dfnas":  # the deliverable: the final child, as searched
        arch = ShuffleArch(s["architecture"]["space"], tuple(s["architecture"]["choices"]))
        rep = child_report(arch, DataInfo.of(ds, d.num_clients))
        row.update(architecture=rep["architecture"], params=rep["params"], macs=rep["macs"],
                   space=arch.space, choices=list(arch.choices), fixed_blocks=s["final"].get("fixed_blocks"),
                   global_test_acc_bn_recal=s["final"].get("global_test_acc_bn_recal"))
    else:
        space = make_model(cfg.algo.model, ds.num_classes, d.dataset).space.name
        arch = child_of_model_name(cfg.algo.model) if ":" in cfg.algo.model else uniform_arch(space, "k3")  # a child
        label = str(arch) if ":" in cfg.algo.model else f"ShuffleNetV2 (k3 in every block of {space})"
        row.update(architecture=label, params=model_params(cfg, DataInfo.of(ds, d.num_clients)),
                   macs=child_cost(arch, ds.num_classes, ds.image_shape)["macs"])
        if "global_test_acc_bn_recal" in s["final"]:  # (algo.bn_recalibration_batches > 0)
            row["global_test_acc_bn_recal"] = s["final"]["global_test_acc_bn_recal"]
    return row


def _control_metric(args) -> str:
    """What the searched-vs-random control compares."""
    return ("global test accuracy (FedAvg from scratch, BN recalibrated on the clients)" if args.children_bn_recal
            else "global test accuracy (FedAvg from scratch)")


def random_control(args, runner: StageRunner, rows: list[dict], runs: list, out: Path) -> dict:
    """The searched child of the first DFNAS run, and ``args.random`` random children of the
    same space with multiply-adds within ±10 % of its, each trained from scratch with the
    FedAvg baseline's recipe on the same clients (:func:`jaxfednas.evidence.searched_vs_random`).
    Appends their rows, writes the page; returns ``{"numbers", "points"}`` for ``--seeds``."""
    from jaxfednas.algorithms.dfnas import make_inherited_accuracy  # noqa: PLC0415

    first = next(r for r in rows if r["algorithm"] == "dfnas")
    baseline = {**next(over for _, algo, over in runs if algo == "fedavg"), **args.train_overrides}
    if args.children_bn_recal:  # the children compared with BN statistics recalibrated on the clients
        baseline = {**baseline, "algo.bn_recalibration_batches": args.children_bn_recal}
    cfg0 = make_config("fedavg", overrides=baseline)
    ds = load_dataset(cfg0.data.dataset, cfg0.data.data_dir)
    table = macs_table(first["space"], ds.num_classes, tuple(ds.image_shape))
    sizes = {}

    def train(name, arch, training_seed):  # FedAvg of the child from scratch: a row of the runs table
        over = {**baseline, "algo.model": child_model_name(arch)}
        if training_seed is not None:  # the same partition, another training seed
            over |= {"data.partition_seed": cfg0.run.seed if cfg0.data.partition_seed is None
                     else cfg0.data.partition_seed, "run.seed": training_seed}
        rows.append(_stage(runner, name, "fedavg", make_config("fedavg", overrides=over)))
        sizes.setdefault(arch, rows[-1]["params"])
        return rows[-1]["global_test_acc_bn_recal" if args.children_bn_recal else "global_test_acc"]

    control = Control(
        searched=ShuffleArch(first["space"], tuple(first["choices"])),
        sample=lambda k: random_shuffle_arch(k, first["space"]), train=train, size=lambda a: sizes[a],
        match=lambda a: table.of(a.choices),
        inherited=(out / first["run"], lambda run: make_inherited_accuracy(run.config.algo, run.data.info,
                                                                           placement=run.options.placement)))
    ev = searched_vs_random(control, out, seed=cfg0.run.seed, random=args.random, train_seeds=args.train_seeds,
                            names=Names("searched-fedavg", "searched-fedavg-seed_{j}", "random-{i}-fedavg"))
    labels = Labels(searched="searched child, FedAvg from scratch" + (", BN recalibrated" if args.children_bn_recal
                                                                        else "") + ": global test acc",
                    random_mean="random children (matched multiply-adds): mean", random_std="random children: std",
                    beaten="random children beaten (fraction)", seed_std="searched child: std over {n} training seeds")
    page = write_page(out, ev, title=f"DFNAS ({first['run']}): the searched child vs {args.random} random children "
                      "of matched multiply-adds", labels=labels, preface=results_table(rows) + "\n\n",
                      extra={"runs": rows}, metric=_control_metric(args))
    own = first["global_test_acc"] if first.get("global_test_acc_bn_recal") is None else first["global_test_acc_bn_recal"]
    return {"numbers": {"DFNAS child as searched (no retraining, BN recalibrated): global test acc": own,
                        **page["numbers"]}, "points": page["points"]}


def _f(x, fmt="{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def results_table(rows: list[dict]) -> str:
    lines = ["| run | algorithm | clients | rounds | global test acc | global test acc, BN recalibrated | "
             "client test acc (mean) | params | multiply-adds | wall (s) | architecture |", "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['algorithm']} | {r['clients']} ({r['partition']}) | {r['rounds']} | "
            f"{_f(r['global_test_acc'])} | {_f(r.get('global_test_acc_bn_recal'))} | {_f(r['client_test_acc'])} | "
            f"{r['params']:,} | "
            f"{_f(r.get('macs'), '{:,}')} | {r['wall_s']} | {r['architecture']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_preset(("cross-silo", "cross-device"), help="the paper's settings (CIFAR-10 / CINIC-10; needs --data-dir)")
    p.add_data("prepared CIFAR-10 (tfds data_dir) or CINIC-10 root, for the presets")
    p.add_rounds("rounds of every run (default: 20 on digits, the preset's otherwise)")
    p.add_argument("--iid-clients", type=int, nargs="*", default=[2, 4, 8], help="IID runs (digits only)")
    p.add_control(random=3, random_help="the control: the searched child and N random children of matched "
                  "multiply-adds, each trained from scratch with the FedAvg baseline's recipe (default 3; 0: none)",
                  min_train_seeds=2, train_seeds_help="the control: train the searched child with N training seeds "
                  "on the same partition (its std over them is the noise of the architecture signal-to-noise ratio; "
                  "default 3, at least 2)")
    p.add_train_set("fedavg", "the control: override a FedAvg setting of the children's trainings, the searched, its "
                    "repeats and the random children alike (algo.* or run.*, see `jaxfednas run fedavg --help`; e.g. "
                    "algo.lr_schedule=cosine)")
    p.add_argument("--children-bn-recal", type=int, default=0, metavar="N",
                   help="the control: compare the children with BatchNorm statistics recalibrated on up to N batches "
                        "of each client's training examples (FedAvg's algo.bn_recalibration_batches) instead of "
                        "FedAvg's averaged running statistics (default 0: averaged, as FedAvg reports)")
    p.add_seeds("only the searched-vs-random control, once per seed (e.g. 0,1,2 or 0-4), each into --out/seed_<s>; "
                "results.md gives mean ± std over seeds")
    p.add_run_dir("runs/example-dfnas", set_help="override any config field of the DFNAS runs (data./run. fields "
                  "also of FedAvg)")
    args = p.parse(argv)
    if args.children_bn_recal < 0:
        p.error(f"--children-bn-recal must be >= 0, got {args.children_bn_recal}")
    if args.seeds is not None and args.random == 0:
        p.error("--seeds compares with random children: it needs --random >= 1")
    return run_script("examples/dfnas.py", lambda: run(args))


if __name__ == "__main__":
    exit_process(main())
