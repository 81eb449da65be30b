"""DP-FNAS (Singh et al., arXiv:2006.10559): Table 1 and Table 2 analogues, and the control.

    python examples/dp_fnas.py                    # digits, Table 1: vanilla NAS / FNAS / DP-FNAS, 1-8 parties
    python examples/dp_fnas.py --sweep-noise      # digits, Table 2: DP-FNAS with 4 parties, noise 0.5 ... 10
    python examples/dp_fnas.py --preset paper --data-dir DIR   # CIFAR-10 with the paper's settings (a GPU)
    python examples/dp_fnas.py --out runs/dp_fnas --resume     # continue an interrupted run
    python examples/dp_fnas.py --seeds 0,1,2      # the private search's cell vs random cells, three seeds
    python examples/dp_fnas.py --seeds 0,1,2 --noise 0   # the same without noise or clipping: what privacy costs

Table 1: a search (Algorithm 1) per row on K IID parties -- vanilla NAS (K=1), FNAS (K = 2, 4,
8, no noise), DP-FNAS (K = 2, 4, 8, clipping 1, ``--noise`` on both mechanisms) -- each cell
through the non-private augmentation stage beside ``--random`` random cells; accuracies, μ
(CLT, Theorem 3.1) and ε (PLD) at δ = 1e-5; minutes on 2 CPU cores. Table 2
(``--sweep-noise``): 4 parties, noise 0.5 ... 10. ``--seeds``: one DP-FNAS row (``--parties``;
``--noise 0``: FNAS) and :func:`jaxfednas.evidence.searched_vs_random` per seed. The digits
settings, what ε covers and the results: docs/papers/dp_fnas.md.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jaxfednas.algorithms.dp_fnas import make_inherited_accuracy, sampling_probs
from jaxfednas.config import apply_overrides
from jaxfednas.data.datasets import load_dataset
from jaxfednas.example_args import ExampleParser
from jaxfednas.experiment import make_partition
from jaxfednas.process import exit_process, run_script
from jaxfednas.evidence import (Control, diagnostics_note, Labels, Names, random_architectures, searched_vs_random,
                                stage_trainer, write_page, write_results)
from jaxfednas.stages import StageRunner
from jaxfednas.registry import make_config
from jaxfednas.seeds import mean_std, once_or_over_seeds, versus_random
from jaxfednas.search_spaces.darts import Genotype, network_params, PRIMITIVE_SETS
from jaxfednas.search_spaces.darts.genotypes import edges_text
from jaxfednas.search_spaces.sampling import random_genotype

EXPECTED_BATCH = {"digits": 16, "paper": 256}
DIGITS_SEARCH = {
    "data.dataset": "digits", "run.rounds": 4, "algo.iterations_per_round": 25, "algo.C": 4, "algo.layers": 2,
    "algo.nodes": 2, "algo.primitives": "tiny", "algo.arch_gradient": "first", "algo.aggregation": "mean",
    "algo.server_lr": 0.05, "algo.server_lr_decay_iterations": 100, "algo.arch_server_lr": 1e-2,
    "algo.clip_norm": 1.0, "algo.arch_clip_norm": 1.0,
}
DIGITS_AUGMENT = {"run.rounds": 6, "algo.C": 8, "algo.layers": 2, "algo.local_epochs": 1, "algo.batch_size": 32,
                  "algo.lr": 0.05, "algo.weight_decay": 3e-4}
TABLE1 = [("Vanilla NAS", 1, 0.0), ("FNAS", 2, 0.0), ("FNAS", 4, 0.0), ("FNAS", 8, 0.0),
          ("DP-FNAS", 2, 1.0), ("DP-FNAS", 4, 1.0), ("DP-FNAS", 8, 1.0)]
NOISES = (0.5, 1.0, 2.0, 5.0, 8.0, 10.0)
LABELS = Labels(searched="searched cell: augmented test acc")
METRIC = "augmented test accuracy (non-private training from scratch)"


def _runner(out: Path, args) -> StageRunner:
    # the Table 1 rows differ in parties, so in partition, on purpose: no same-test-rows check
    return StageRunner(out, resume=args.resume, same_test_rows=False)


def _search_config(preset, parties: int, noise: float, overrides: dict, dataset_cache: dict):
    """The row's search config: K parties, noise on both mechanisms (0: FNAS, no clipping),
    p = B / N_k so that every party's expected batch is B."""
    base = {} if preset else dict(DIGITS_SEARCH)
    row = {"data.num_clients": parties, "algo.noise_multiplier": noise,
           **({"algo.clip_norm": 0.0, "algo.arch_clip_norm": 0.0} if noise == 0 else {})}
    cfg = make_config("dp_fnas", preset=preset, overrides={**base, **row, **overrides})
    if "algo.sampling_prob" not in overrides:
        key = (cfg.data.dataset, cfg.data.data_dir)
        manifest = make_partition(cfg, dataset_cache.get(key) or dataset_cache.setdefault(key, load_dataset(*key)))
        p, p_val = sampling_probs(manifest, EXPECTED_BATCH["paper" if preset == "paper" else "digits"])
        cfg = make_config("dp_fnas", preset=preset, overrides={**base, **row, **overrides, "algo.sampling_prob": p,
                                                               "algo.val_sampling_prob": p_val})
    return cfg


def _augment(runner: StageRunner, search_cfg, genotype: dict, args, overrides: dict, name: str | None = None) -> dict:
    """Train the genotype from scratch on the whole training pool (one party, no DP), into
    ``out/name`` (default: ``augment-<hash of the genotype>``)."""
    tag = hashlib.sha256(json.dumps(genotype, sort_keys=True).encode()).hexdigest()[:10]
    return runner.stage(name or f"augment-{tag}", _augment_config(search_cfg, genotype, args, overrides))[0]


def _augment_config(search_cfg, genotype: dict, args, overrides: dict, seed: int | None = None):
    """The augmentation stage's config for the genotype (``seed``: another training seed)."""
    d = search_cfg.data
    over = {"data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": 1, "data.partition": "iid",
            "data.split": (1.0, 0.0, 0.0), "run.seed": search_cfg.run.seed,
            "algo.genotype": json.dumps(genotype, sort_keys=True), **({} if args.preset else DIGITS_AUGMENT),
            **({"run.rounds": args.train_rounds} if args.train_rounds else {}),
            **{k: v for k, v in overrides.items() if k.startswith("augment.")}}
    cfg = make_config("fednas_train", preset=args.preset, overrides={
        k.replace("augment.", "algo.", 1): v for k, v in over.items()})
    return cfg if seed is None else apply_overrides(cfg, {"run.seed": seed})


def _row_name(method: str, parties: int, noise: float) -> str:
    return f"{method.lower().replace(' ', '-')}-{parties}p" + (f"-noise{noise:g}" if noise else "")


def table1(args, overrides: dict) -> None:
    out, runner, cache = Path(args.out), _runner(Path(args.out), args), {}
    search_over = {k: v for k, v in overrides.items() if not k.startswith("augment.")}
    lines = ["| method | parties | p (train / val) | supernet test acc | augmented test acc | ε (PLD, δ=1e-5) "
             "| μ-GDP train / val (CLT) | derived normal cell | search wall (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    results = []
    for method, parties, noise in TABLE1:
        if args.parties and parties not in args.parties:
            continue
        cfg = _search_config(args.preset, parties, noise if noise == 0 else args.noise, search_over, cache)
        name = _row_name(method, parties, 0)
        print(f"== {method}, {parties} parties, noise {cfg.algo.noise_multiplier:g}, p = "
              f"{cfg.algo.sampling_prob:.4f}", flush=True)
        s = runner.stage(name, cfg)[0]
        a = _augment(runner, cfg, s["architecture"], args, overrides)
        f = s["final"]
        eps, mu = ("∞ (no noise)", "–") if "epsilon_pld" not in f else \
            (f"{f['epsilon_pld']:.2f}", f"{f['mu_train']:.3f} / {f['mu_val']:.3f}")
        lines.append(f"| {method} | {parties} | {cfg.algo.sampling_prob:.3f} / {cfg.algo.p_val:.3f} "
                     f"| {s['final']['global_test_acc']:.4f} | {a['final']['global_test_acc']:.4f} | {eps} | {mu} "
                     f"| {edges_text(Genotype.from_dict(s['architecture']).normal)} | {runner.times[name]:.0f} |")
        results.append({"method": method, "parties": parties, "noise_multiplier": cfg.algo.noise_multiplier,
                        "sampling_prob": cfg.algo.sampling_prob, "iterations": int(s["final"]["iterations"]),
                        "supernet_test_acc": s["final"]["global_test_acc"],
                        "augmented_test_acc": a["final"]["global_test_acc"],
                        "epsilon_pld": s["final"].get("epsilon_pld"), "mu_train": s["final"].get("mu_train"),
                        "mu_val": s["final"].get("mu_val"), "architecture": s["architecture"],
                        "search_wall_s": runner.times[name]})
    table = "\n".join(lines) + "\n" + _random_control(runner, cfg, results, args, overrides)
    write_results(out, f"DP-FNAS Table 1 analogue ({cfg.data.dataset}, {results[0]['iterations']} iterations)", table,
                  results, sort_keys=True)
    print(f"results: {out / 'results.md'}; cell diagrams in each search run's plots/")


def _random_control(runner: StageRunner, search_cfg, results: list[dict], args, overrides: dict) -> str:
    """``args.random`` cells drawn uniformly from the searched space
    (:func:`jaxfednas.evidence.random_architectures`), each through the same augmentation
    stage into ``random-<i>/``; every searched row's augmented accuracy against theirs."""
    if not args.random:
        return ""
    cells = random_architectures(_control(runner, search_cfg, None, None, args, overrides), search_cfg.run.seed,
                                 args.random)
    accs = [_augment(runner, search_cfg, g.to_dict(), args, overrides, name=f"random-{i}")["final"]["global_test_acc"]
            for i, g in enumerate(cells)]
    lines = [f"\nSearched vs random cells, trained alike (the augmentation stage): {args.random} random cells of the "
             f"same space reach {mean_std(accs)[0]:.4f} ± {mean_std(accs)[1]:.4f} "
             f"({', '.join(f'{a:.4f}' for a in accs)}).\n",
             "| method | parties | ε (PLD) | augmented test acc | − random mean | random cells beaten (ties) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        vs = versus_random(r["augmented_test_acc"], accs)
        r["versus_random"] = vs
        eps = "∞" if r["epsilon_pld"] is None else f"{r['epsilon_pld']:.2f}"
        lines.append(f"| {r['method']} | {r['parties']} | {eps} | {vs['searched']:.4f} | "
                     f"{vs['searched_minus_random']:+.4f} | {vs['beats']} of {len(accs)} ({vs['ties']}) |")
    results.append({"method": "random cells", "augmented_test_acc": accs})
    return "\n".join(lines) + "\n"


def over_seeds_control(args, overrides: dict) -> None:
    """``--seeds``: :func:`private_vs_random` once per seed, then the table over seeds."""
    k, noise = (args.parties or [4])[0], args.noise
    title, search, eps = (
        (f"DP-FNAS ({k} parties, noise {noise:g}): the private search's cell vs random cells",
         f"a DP-FNAS search ({k} parties, noise multiplier {noise:g} on both mechanisms, per-example clipping)",
         "ε: PLD accountant (the guarantee), at the search's δ, for either mechanism. ") if noise > 0 else
        (f"FNAS ({k} parties, no noise): the non-private search's cell vs random cells",
         f"the same search without noise or clipping (FNAS, {k} parties: DP-FNAS's non-private counterpart)", ""))
    once_or_over_seeds(args, lambda over, out: private_vs_random(args, over, out), overrides, title=title, metric=METRIC,
                       note=(f"Each seed (`seed_<s>/results.md`): its own split of the parties, {search}, the derived cell and "
                             f"{args.random} random cells of the same space each through the same augmentation stage "
                             f"(non-private). {eps}The other Table 1 rows are not run here. "
                             + diagnostics_note("cell", "augmented", args.train_seeds)))


def private_vs_random(args, overrides: dict, out: Path) -> dict:
    """One seed of ``--seeds``: the DP-FNAS row with ``--parties`` (default 4) parties and
    ``--noise``, its cell's augmentation and ``args.random`` random cells' augmentations into
    ``out`` (:func:`jaxfednas.evidence.searched_vs_random`); writes results.md / results.json
    there, returns ``{"numbers", "points"}``."""
    parties = (args.parties or [4])[0]
    cfg = _search_config(args.preset, parties, args.noise,
                         {k: v for k, v in overrides.items() if not k.startswith("augment.")}, {})
    private = args.noise > 0  # --noise 0: FNAS, the same search without noise or clipping (the reference line)
    name = _row_name("DP-FNAS" if private else "FNAS", parties, 0)
    runner = _runner(out, args)
    s = runner.stage(name, cfg)[0]  # the private search (Algorithm 1)
    searched = Genotype.from_dict(s["architecture"])

    def config_for(g, training_seed):  # the augmentation stage: non-private, from scratch, the whole pool
        return _augment_config(cfg, s["architecture"] if g is searched else g.to_dict(), args, overrides,
                               training_seed)

    control = _control(runner, cfg, searched, config_for, args, overrides, inherited=(out / name, lambda run: (
        make_inherited_accuracy(run.config.algo, run.data.info))))  # post-processing the released supernet: no privacy
    tag = hashlib.sha256(json.dumps(s["architecture"], sort_keys=True).encode()).hexdigest()[:10]
    ev = searched_vs_random(control, out, seed=cfg.run.seed, random=args.random, train_seeds=args.train_seeds,
                            names=Names(searched=f"augment-{tag}", repeat="augment-seed_{j}", random="random-{i}"))
    head = {"supernet test acc (private search)": s["final"]["global_test_acc"],
            f"ε (PLD, δ={cfg.algo.delta:g})": s["final"]["epsilon_pld"]} if private else \
        {"supernet test acc (non-private search)": s["final"]["global_test_acc"]}
    page = write_page(out, ev, title=f"{'DP-FNAS' if private else 'FNAS'} ({cfg.data.dataset}, {parties} parties, "
                      f"noise {cfg.algo.noise_multiplier:g}, seed {cfg.run.seed}): searched vs random cells",
                      labels=LABELS, head=[(k, f"{v:.4f}") for k, v in head.items()] + [
                          ("derived normal cell", edges_text(searched.normal))], metric=METRIC,
                      describe=lambda g: edges_text(g.normal),
                      size_name="augmentation network parameters")
    return {"numbers": head | page["numbers"], "points": page["points"]}


def _control(runner: StageRunner, search_cfg, searched: Genotype | None, config_for, args, overrides: dict,
             inherited=None) -> Control:
    """The searched cell's control: random cells drawn uniformly from the searched space, each
    through the augmentation stage (``config_for``), sized by their augmentation network's
    weights (without the auxiliary head)."""
    prims, ds = PRIMITIVE_SETS[search_cfg.algo.primitives], load_dataset(search_cfg.data.dataset,
                                                                          search_cfg.data.data_dir)

    def size(g):
        c = _augment_config(search_cfg, g.to_dict(), args, overrides).algo
        return network_params(g, c.C, ds.num_classes, c.layers, tuple(ds.image_shape))

    return Control(searched=searched, sample=lambda k: random_genotype(k, prims, search_cfg.algo.nodes),
                   train=stage_trainer(runner, config_for), size=size, key=lambda g: g.to_json(), inherited=inherited)


def sweep_noise(args, overrides: dict) -> None:
    out, runner, cache = Path(args.out), _runner(Path(args.out), args), {}
    overrides = {k: v for k, v in overrides.items() if not k.startswith("augment.")}
    lines = ["| noise multiplier | search-val acc (supernet) | supernet test acc | ε (PLD, δ=1e-5) "
             "| μ-GDP train (CLT) | wall (s) |", "|---|---|---|---|---|---|"]
    results = []
    parties = (args.parties or [4])[0]
    for noise in NOISES:
        cfg = _search_config(args.preset, parties, noise, overrides, cache)
        name = _row_name("DP-FNAS", parties, noise)
        f = runner.stage(name, cfg)[0]["final"]
        lines.append(f"| {noise:g} | {f['client_val_acc_mean_weighted']:.4f} | {f['global_test_acc']:.4f} "
                     f"| {f['epsilon_pld']:.3f} | {f['mu_train']:.3f} | {runner.times[name]:.0f} |")
        results.append({"noise_multiplier": noise, "val_acc": f["client_val_acc_mean_weighted"],
                        "test_acc": f["global_test_acc"], "epsilon_pld": f["epsilon_pld"], "mu_train": f["mu_train"]})
    write_results(out, f"DP-FNAS Table 2 analogue ({cfg.data.dataset}, {parties} parties)", "\n".join(lines) + "\n",
                  results, sort_keys=True)


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_argument("--sweep-noise", action="store_true", help="Table 2 analogue: noise 0.5 ... 10, 4 parties")
    p.add_preset(("smoke", "paper"), help="named preset of every stage (default: digits)")
    p.add_data("prepared data directory (CIFAR-10 for --preset paper)")
    p.add_rounds("search rounds (iterations = rounds x algo.iterations_per_round)")
    p.add_argument("--train-rounds", type=int, help="augmentation rounds")
    p.add_argument("--parties", type=int, action="append", help="only the Table 1 rows with these party counts")
    p.add_argument("--noise", type=float, default=1.0, help="noise multiplier of the DP-FNAS rows of Table 1 and of "
                   "--seeds (with --seeds, 0 runs the non-private counterpart, FNAS)")
    p.add_argument("--arch-gradient", choices=("first", "second_fd", "second_hvp"),
                   help="architecture gradient (digits default: first)")
    p.add_control(random=3, random_help="Table 1: also augment N random cells of the searched space, the control "
                  "(default 3; 0: none)", min_train_seeds=2, train_seeds_help="--seeds: augment the searched cell "
                  "with N training seeds (its std over them is the noise of the architecture signal-to-noise ratio; "
                  "default 3, at least 2)")
    p.add_seed()
    p.add_seeds("only the control, once per seed (e.g. 0,1,2 or 0-4): the DP-FNAS row with --parties (default 4) vs "
                "--random random cells, each seed into --out/seed_<s>; results.md gives mean ± std over seeds")
    p.add_run_dir(None, out_help="output directory (default runs/dp_fnas[-noise])",
                  set_help="override a search setting (augment.FIELD for the augmentation stage)")
    args = p.parse(argv)
    if args.seeds is not None:
        if args.sweep_noise or args.seed is not None or args.random == 0 or args.noise < 0 or \
                (args.parties and len(args.parties) > 1):
            p.error("--seeds compares one private search with random cells: it needs --random >= 1, --noise >= 0 (0: the "
                    "non-private counterpart), at most one --parties, and no --seed or --sweep-noise")
    args.out = args.out or ("runs/dp_fnas-noise" if args.sweep_noise else "runs/dp_fnas")
    overrides = args.overrides | ({} if args.arch_gradient is None else {"algo.arch_gradient": args.arch_gradient})
    mode = over_seeds_control if args.seeds is not None else sweep_noise if args.sweep_noise else table1
    return run_script("examples/dp_fnas.py", lambda: mode(args, overrides))


if __name__ == "__main__":
    exit_process(main())
