"""DP-FNAS (Singh et al., arXiv:2006.10559): Table 1 and Table 2 analogues.

    python examples/dp_fnas.py                    # digits, Table 1: vanilla NAS / FNAS / DP-FNAS, 1-8 parties
    python examples/dp_fnas.py --sweep-noise      # digits, Table 2: DP-FNAS with 4 parties, noise 0.5 ... 10
    python examples/dp_fnas.py --preset paper --data-dir DIR   # CIFAR-10 with the paper's settings (a GPU)
    python examples/dp_fnas.py --out runs/dp_fnas --resume     # continue an interrupted run
    python examples/dp_fnas.py --seeds 0,1,2      # the private search's cell vs random cells, three seeds
    python examples/dp_fnas.py --seeds 0,1,2 --noise 0   # the same without noise or clipping: what privacy costs

Table 1 (every row is a run directory under ``--out``):
  1. search — Algorithm 1 on K IID parties, each with a search-train / search-val /
     local-test split (50/25/25 %): vanilla NAS (K=1, no noise, no clipping), FNAS
     (K = 2, 4, 8, no noise, no clipping) and DP-FNAS (K = 2, 4, 8, per-example
     clipping R^G = R^H = 1, noise multiplier 1 on both mechanisms);
  2. augmentation — the derived genotype's DARTS network trained from scratch on the
     whole training pool (one party, non-private, as the paper's augmentation stage,
     ``algorithms/fednas_train.py``) and tested on the held-out test set; one run per
     distinct genotype;
  3. the control (``--random N``, default 3): N cells drawn uniformly from the searched
     space (``random-<i>/``), each through the same augmentation stage;
  4. ``results.md`` / ``results.json`` — accuracy of the searched supernet and of the
     augmented network, and per DP row μ (CLT, the paper's Theorem 3.1) and ε (PLD,
     the guarantee) at δ = 1e-5 for the two mechanisms; each row's augmented accuracy
     against the random cells' (mean ± std, how many it beats).

Table 2 (``--sweep-noise``): DP-FNAS with 4 parties and noise multipliers 0.5, 1, 2, 5,
8, 10 on both mechanisms; the supernet's accuracy on the parties' search-val splits (the
paper reports validation error) and ε per row.

``--seeds 0,1,2`` asks only the control's question, once per seed (``run.seed``, which also
draws the parties' split and the random cells) into ``seed_<s>/``: one DP-FNAS row (K =
``--parties``, default 4, noise ``--noise`` on both mechanisms), its cell through the
augmentation stage and ``--random`` random cells through the same stage. The other Table 1
rows (vanilla NAS, FNAS, the other party counts) are not run there; ``--noise 0`` makes the
row its non-private counterpart (FNAS: the same search, space and budget without noise or
clipping, ``fnas-<K>p/``), the reference line of what privacy costs. The searched cell is
augmented again with ``--train-seeds`` - 1 other training seeds (``augment-seed_<j>/``,
default 3 seeds in all), and every cell's accuracy with the weights it inherits from the
private supernet is measured (``inherited.json``; post-processing, no privacy spent), for
the two diagnostics: the architecture signal-to-noise ratio (std over the random cells /
std of the searched cell over training seeds) and the supernet's ranking (Kendall's τ and
Spearman's ρ between inherited and augmented accuracy over the seed's cells). ``results.md``
gives mean ± std over seeds of the supernet's accuracy, ε (PLD, the guarantee, at the
search's δ), the searched and random cells' augmented accuracy, searched − random mean, the
fraction of random cells beaten and the diagnostics; ``plots/searched_vs_random.png`` plots
them by parameters of the augmentation network.

Digits settings differ from the paper's CIFAR-10 ones so that the default run takes
minutes on 2 CPU cores (measured: 8.5 min on a 2-core machine shared with other jobs,
load ~3; most of it XLA compilation of the seven searches and of one augmentation
network per distinct genotype): a tiny supernet (C=4, 2 cells, 2
nodes, ops skip / avg pool / sep conv 3x3), 100 iterations with an expected batch of
16 per party, an augmentation network of C=8 and 2 cells trained for 6 epochs, and the
first-order architecture gradient (``h_i = ∇_A ℓ_i(W', A)``, Algorithm 1 as printed,
for which Theorem 3.1's accounting is exact). The second-order gradient of Eq. 5
(``--arch-gradient second_fd``) costs one training-batch pass per validation example
per iteration (per-example clipping needs each h_i): about 20x slower here. The server
*averages* the parties' gradients (``aggregation=mean``): Algorithm 1's sum is the same
with step sizes multiplied by K, which would change the step size from row to row.
The ε of a row holds for every party's examples (each party's p = 16 / N_k is the same
in a row); the augmentation stage is not private.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.config import apply_overrides
from jaxfednas.data.datasets import load_dataset
from jaxfednas.example_args import ExampleParser
from jaxfednas.experiment import make_partition
from jaxfednas.process import exit_process, run_script
from jaxfednas.evidence import Control, Labels, Names, random_architectures, searched_vs_random, stage_trainer, write_page
from jaxfednas.stages import StageRunner
from jaxfednas.registry import make_config
from jaxfednas.seeds import (mean_std, over_seeds, parse_seeds, versus_random)
from jaxfednas.search_spaces.darts import Genotype, network_params, PRIMITIVE_SETS
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


def _describe(row: dict) -> str:
    acc = f", supernet test acc {row['global_test_acc']:.4f}" if "global_test_acc" in row else ""
    eps = f", ε (PLD) {row['epsilon_pld']:.3f}" if "epsilon_pld" in row else ""
    return f"train loss {row['train_loss']:.4f}{acc}{eps}"


def _stage(runner: StageRunner, name: str, cfg) -> dict:
    """Stage ``name`` (a run directory under the runner's ``--out``) run, resumed or found
    finished: its summary (wall times kept across ``--resume`` in ``wall_times.json``)."""
    return runner.stage(name, cfg)[0]


def _runner(out: Path, args) -> StageRunner:
    # the Table 1 rows differ in parties, so in partition, on purpose: no same-test-rows check
    return StageRunner(out, resume=args.resume, describe=_describe, same_test_rows=False)


def _search_config(preset, parties: int, noise: float, overrides: dict, dataset_cache: dict):
    """The row's search config: K parties, noise on both mechanisms (0: FNAS, no clipping),
    p = B / N_k so that every party's expected batch is B."""
    base = {} if preset else dict(DIGITS_SEARCH)
    row = {"data.num_clients": parties, "algo.noise_multiplier": noise}
    if noise == 0:
        row.update({"algo.clip_norm": 0.0, "algo.arch_clip_norm": 0.0})
    cfg = make_config("dp_fnas", preset=preset, overrides={**base, **row, **overrides})
    if "algo.sampling_prob" not in overrides:
        key = (cfg.data.dataset, cfg.data.data_dir)
        if key not in dataset_cache:
            dataset_cache[key] = load_dataset(cfg.data.dataset, cfg.data.data_dir)
        manifest = make_partition(cfg, dataset_cache[key])
        n_tr = [len(c["train"]) for c in manifest["clients"]]
        n_val = [len(c["val"]) for c in manifest["clients"]]
        b = EXPECTED_BATCH["paper" if preset == "paper" else "digits"]
        cfg = make_config("dp_fnas", preset=preset, overrides={
            **base, **row, **overrides, "algo.sampling_prob": min(1.0, b * len(n_tr) / sum(n_tr)),
            "algo.val_sampling_prob": min(1.0, b * len(n_val) / sum(n_val))})
    return cfg


def _augment(runner: StageRunner, search_cfg, genotype: dict, args, overrides: dict, name: str | None = None,
             seed: int | None = None) -> dict:
    """Train the genotype from scratch on the whole training pool (one party, no DP), into
    ``out/name`` (default: ``augment-<hash of the genotype>``); ``seed``: another training
    seed than the search's."""
    text = json.dumps(genotype, sort_keys=True)
    cfg = _augment_config(search_cfg, text, args, overrides)
    if seed is not None:
        cfg = apply_overrides(cfg, {"run.seed": seed})
    tag = hashlib.sha256(text.encode()).hexdigest()[:10]
    return _stage(runner, name or f"augment-{tag}", cfg)


def _augment_config(search_cfg, text: str, args, overrides: dict):
    """The augmentation stage's config for the genotype's JSON ``text``."""
    d = search_cfg.data
    over = {"data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": 1, "data.partition": "iid",
            "data.split": (1.0, 0.0, 0.0), "run.seed": search_cfg.run.seed, "algo.genotype": text}
    if args.preset is None:
        over.update(DIGITS_AUGMENT)
    if args.train_rounds:
        over["run.rounds"] = args.train_rounds
    over.update({k: v for k, v in overrides.items() if k.startswith("augment.")})
    return make_config("fednas_train", preset=args.preset, overrides={
        k.replace("augment.", "algo.", 1): v for k, v in over.items()})


def _row_name(method: str, parties: int, noise: float) -> str:
    return f"{method.lower().replace(' ', '-')}-{parties}p" + (f"-noise{noise:g}" if noise else "")


def _eps(final: dict) -> tuple[str, str]:
    if "epsilon_pld" not in final:
        return "∞ (no noise)", "–"
    return f"{final['epsilon_pld']:.2f}", f"{final['mu_train']:.3f} / {final['mu_val']:.3f}"


def table1(args, overrides: dict) -> None:
    out = Path(args.out)
    runner = _runner(out, args)
    search_over = {k: v for k, v in overrides.items() if not k.startswith("augment.")}
    cache: dict = {}
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
        s = _stage(runner, name, cfg)
        a = _augment(runner, cfg, s["architecture"], args, overrides)
        eps, mu = _eps(s["final"])
        normal = " ".join(f"{op}<-{i}" for op, i in s["architecture"]["normal"])
        lines.append(f"| {method} | {parties} | {cfg.algo.sampling_prob:.3f} / {cfg.algo.p_val:.3f} "
                     f"| {s['final']['global_test_acc']:.4f} | {a['final']['global_test_acc']:.4f} | {eps} | {mu} "
                     f"| {normal} | {runner.times[name]:.0f} |")
        results.append({"method": method, "parties": parties, "noise_multiplier": cfg.algo.noise_multiplier,
                        "sampling_prob": cfg.algo.sampling_prob, "iterations": int(s["final"]["iterations"]),
                        "supernet_test_acc": s["final"]["global_test_acc"],
                        "augmented_test_acc": a["final"]["global_test_acc"],
                        "epsilon_pld": s["final"].get("epsilon_pld"), "mu_train": s["final"].get("mu_train"),
                        "mu_val": s["final"].get("mu_val"), "architecture": s["architecture"],
                        "search_wall_s": runner.times[name]})
    table = "\n".join(lines) + "\n" + _random_control(runner, cfg, results, args, overrides)
    atomic_write_text(out / "results.md", f"# DP-FNAS Table 1 analogue ({cfg.data.dataset}, "
                      f"{results[0]['iterations']} iterations)\n\n{table}")
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, sort_keys=True) + "\n")
    print("\n" + table)
    print(f"results: {out / 'results.md'}; cell diagrams in each search run's plots/")


def _random_control(runner: StageRunner, search_cfg, results: list[dict], args, overrides: dict) -> str:
    """``args.random`` cells drawn uniformly from the searched space (keys
    ``rng.random_arch_key(seed, i)``), each through the same augmentation stage into
    ``random-<i>/``; every searched row's augmented accuracy against theirs."""
    if not args.random:
        return ""
    accs = [r["final"]["global_test_acc"] for _, r in _random_cells(runner, search_cfg, args, overrides)]
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


def _random_cells(runner: StageRunner, search_cfg, args, overrides: dict) -> list[tuple[Genotype, dict]]:
    """``args.random`` cells drawn uniformly from the searched space
    (:func:`jaxfednas.evidence.random_architectures`), each through the augmentation stage
    into ``random-<i>/``."""
    control = _control(runner, search_cfg, None, None, args, overrides, {})
    return [(g, _augment(runner, search_cfg, g.to_dict(), args, overrides, name=f"random-{i}"))
            for i, g in enumerate(random_architectures(control, search_cfg.run.seed, args.random))]


def _augmented_params(search_cfg, genotype: Genotype, args, overrides: dict, dataset_cache: dict) -> int:
    """Weights of the genotype's augmentation network (without the auxiliary head), from shapes."""
    cfg = _augment_config(search_cfg, genotype.to_json(), args, overrides)
    key = (cfg.data.dataset, cfg.data.data_dir)
    if key not in dataset_cache:
        dataset_cache[key] = load_dataset(*key)
    ds = dataset_cache[key]
    return network_params(genotype, cfg.algo.C, ds.num_classes, cfg.algo.layers, tuple(ds.image_shape))


def _seed_parties(args) -> int:
    return args.parties[0] if args.parties else 4


def over_seeds_control(args, overrides: dict) -> None:
    """``--seeds``: :func:`private_vs_random` once per seed, then the table over seeds."""
    parties = _seed_parties(args)
    if args.noise > 0:
        title = f"DP-FNAS ({parties} parties, noise {args.noise:g}): the private search's cell vs random cells"
        search = (f"a DP-FNAS search ({parties} parties, noise multiplier {args.noise:g} on both mechanisms, "
                  "per-example clipping)")
        eps = "ε: PLD accountant (the guarantee), at the search's δ, for either mechanism. "
    else:
        title = f"FNAS ({parties} parties, no noise): the non-private search's cell vs random cells"
        search = (f"the same search without noise or clipping (FNAS, {parties} parties: DP-FNAS's non-private "
                  "counterpart)")
        eps = ""
    over_seeds(parse_seeds(args.seeds),
               lambda seed, out: private_vs_random(args, {**overrides, "run.seed": seed}, out), args.out,
               title=title,
               metric=METRIC,
               note=(f"Each seed (`seed_<s>/results.md`): its own split of the parties, {search}, "
                     f"the derived cell and {args.random} random cells of the same space each through "
                     f"the same augmentation stage (non-private). {eps}The other Table 1 rows are not run here. "
                     f"The searched cell is augmented with {args.train_seeds} training seeds: its std over them is "
                     "the noise of the architecture signal-to-noise ratio (std over the random cells / that std). "
                     "The supernet ranking is Kendall's τ (Spearman's ρ) over the seed's cells between their "
                     "accuracy with the weights inherited from the supernet and their augmented accuracy. "
                     "Plot: `plots/searched_vs_random.png`."))


def private_vs_random(args, overrides: dict, out: Path) -> dict:
    """One seed of ``--seeds``: the DP-FNAS row with ``--parties`` (default 4) parties and
    ``--noise``, its cell's augmentation and ``args.random`` random cells' augmentations into
    ``out`` (:func:`jaxfednas.evidence.searched_vs_random`); writes results.md / results.json
    there, returns ``{"numbers", "points"}``."""
    from jaxfednas.algorithms.dp_fnas import make_inherited_accuracy  # noqa: PLC0415

    parties = _seed_parties(args)
    cache: dict = {}
    cfg = _search_config(args.preset, parties, args.noise,
                         {k: v for k, v in overrides.items() if not k.startswith("augment.")}, cache)
    private = args.noise > 0  # --noise 0: FNAS, the same search without noise or clipping (the reference line)
    name = _row_name("DP-FNAS" if private else "FNAS", parties, 0)
    runner = _runner(out, args)
    s = _stage(runner, name, cfg)  # the private search (Algorithm 1)
    searched = Genotype.from_dict(s["architecture"])

    def config_for(g, training_seed):  # the augmentation stage: non-private, from scratch, the whole pool
        text = json.dumps(s["architecture"] if g is searched else g.to_dict(), sort_keys=True)
        c = _augment_config(cfg, text, args, overrides)
        return c if training_seed is None else apply_overrides(c, {"run.seed": training_seed})

    control = _control(runner, cfg, searched, config_for, args, overrides, cache)
    control = dataclasses.replace(control, inherited=(out / name, lambda run: make_inherited_accuracy(
        run.config.algo, run.data.info)))  # a post-processing of the released supernet: no privacy spent
    tag = hashlib.sha256(json.dumps(s["architecture"], sort_keys=True).encode()).hexdigest()[:10]
    ev = searched_vs_random(control, out, seed=cfg.run.seed, random=args.random, train_seeds=args.train_seeds,
                            names=Names(searched=f"augment-{tag}", repeat="augment-seed_{j}", random="random-{i}"))
    head = {"supernet test acc (private search)": s["final"]["global_test_acc"],
            f"ε (PLD, δ={cfg.algo.delta:g})": s["final"]["epsilon_pld"]} if private else \
        {"supernet test acc (non-private search)": s["final"]["global_test_acc"]}
    page = write_page(out, ev, title=f"{'DP-FNAS' if private else 'FNAS'} ({cfg.data.dataset}, {parties} parties, "
                      f"noise {cfg.algo.noise_multiplier:g}, seed {cfg.run.seed}): searched vs random cells",
                      labels=LABELS, head=[(k, f"{v:.4f}") for k, v in head.items()] + [
                          ("derived normal cell", " ".join(f"{op}<-{i}" for op, i in searched.normal))],
                      metric=METRIC, describe=lambda g: " ".join(f"{op}<-{i}" for op, i in g.normal),
                      size_name="augmentation network parameters")
    return {"numbers": head | page["numbers"], "points": page["points"]}


def _control(runner: StageRunner, search_cfg, searched: Genotype, config_for, args, overrides: dict,
             cache: dict) -> Control:
    """The searched cell's control: random cells drawn uniformly from the searched space, each
    through the augmentation stage (``config_for``)."""
    prims = PRIMITIVE_SETS[search_cfg.algo.primitives]
    return Control(searched=searched, sample=lambda k: random_genotype(k, prims, search_cfg.algo.nodes),
                   train=stage_trainer(runner, config_for),
                   size=lambda g: _augmented_params(search_cfg, g, args, overrides, cache), key=lambda g: g.to_json())


def sweep_noise(args, overrides: dict) -> None:
    out = Path(args.out)
    runner = _runner(out, args)
    overrides = {k: v for k, v in overrides.items() if not k.startswith("augment.")}
    cache: dict = {}
    lines = ["| noise multiplier | search-val acc (supernet) | supernet test acc | ε (PLD, δ=1e-5) "
             "| μ-GDP train (CLT) | wall (s) |", "|---|---|---|---|---|---|"]
    results = []
    parties = args.parties[0] if args.parties else 4
    for noise in NOISES:
        cfg = _search_config(args.preset, parties, noise, overrides, cache)
        name = _row_name("DP-FNAS", parties, noise)
        s = _stage(runner, name, cfg)
        f = s["final"]
        lines.append(f"| {noise:g} | {f['client_val_acc_mean_weighted']:.4f} | {f['global_test_acc']:.4f} "
                     f"| {f['epsilon_pld']:.3f} | {f['mu_train']:.3f} | {runner.times[name]:.0f} |")
        results.append({"noise_multiplier": noise, "val_acc": f["client_val_acc_mean_weighted"],
                        "test_acc": f["global_test_acc"], "epsilon_pld": f["epsilon_pld"], "mu_train": f["mu_train"]})
    table = "\n".join(lines) + "\n"
    atomic_write_text(out / "results.md", f"# DP-FNAS Table 2 analogue ({cfg.data.dataset}, {parties} parties)\n\n"
                      + table)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, sort_keys=True) + "\n")
    print("\n" + table)


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
            p.error("--seeds compares one private search with random cells: it needs --random >= 1, --noise >= 0 "
                    "(0: the non-private counterpart), "
                    "at most one --parties, and no --seed or --sweep-noise")
    args.out = args.out or ("runs/dp_fnas-noise" if args.sweep_noise else "runs/dp_fnas")
    overrides = args.overrides
    if args.arch_gradient is not None:
        overrides["algo.arch_gradient"] = args.arch_gradient
    mode = over_seeds_control if args.seeds is not None else sweep_noise if args.sweep_noise else table1
    return run_script("examples/dp_fnas.py", lambda: mode(args, overrides))


if __name__ == "__main__":
    exit_process(main())
