"""SPIDER (Mushtaq, He, Ding, Avestimehr, "Distributed Architecture Search Over
Heterogeneous Distributions", TMLR; earlier version arXiv:2112.13939): personalized
architectures per client, against local-only NAS, a global federated NAS and
personalized baselines on the same clients (the paper's §5.1, Table 1, App. D.1, D.2).

    python examples/spider.py                               # digits, 8 Dir(0.2) clients (CPU, a few minutes)
    python examples/spider.py --only spider,ditto           # a subset of the methods
    python examples/spider.py --preset paper --data-dir DIR # CIFAR-100, the paper's settings (a GPU)
    python examples/spider.py --out runs/spider --resume    # continue an interrupted run
    python examples/spider.py --only spider --seeds 0,1,2   # searched vs random masks over 3 seeds

Methods, each a run directory of its own under ``--out`` (default ``runs/spider``):

  * ``spider/``     — SPIDER (Algorithms 1-2, λ = 0.01): a FedAvg'd supernet and a personal
    subnet per client pulled toward it (Eq. 4), pruned by perturbation on the client's own
    validation split; phase 3 trains the final architecture on train + validation;
  * ``local_nas/``  — local-only NAS (App. D.2): the same run with ``algo.prox_lambda=0``, so no
    personal model learns from the others (the global supernet is still trained and
    averaged, and its time is in the wall time, but it never reaches v_k);
  * ``fednas/search``, ``fednas/train`` — FedNAS-global (App. D.1 analogue): one global
    cell searched with FedNAS (MiLeNAS, Eq. 4 of He et al.) on the same DARTS space
    (``s2`` ops, same C / cells / nodes) and the clients' 60/20 train / validation
    splits, then the derived genotype trained with FedAvg (``fednas_train``) on train +
    validation; its accuracy is the shared model's on every client's local test split.
    The paper's D.1 searches with perturbation at the server instead of MiLeNAS;
  * ``ditto/``, ``perfedavg/``, ``local_adaptation/`` — personalized baselines with their
    default digits network (a small CNN; ResNet18 with ``--preset paper``).

Every method is tested on IDENTICAL local test splits: SPIDER and the FedNAS search split
each client's data 60/20/20 (train / validation / test, §5.1); the other methods 80/20,
as the paper does ("for a fair comparison"). The split shuffles each client's indices
once and cuts the test part off the end, so both give the same test indices; the script
checks this on every run's ``partition/manifest.json`` and stops if any differs.

Reported (``results.md``, ``results.json``, printed): mean ± std (unweighted over clients)
of local test accuracy, min and max over clients, parameters, wall time; SPIDER's
per-client genotypes (cell diagrams in ``spider/plots/client_<k>_normal.png`` /
``_reduce.png``); the personalization-gain matrix P of §5.2.2 (``p[i, j]``: client i's
local test accuracy of client j's architecture fine-tuned on client i's train +
validation data from the global supernet's weights, ``--gain-epochs`` epochs; the paper:
30 and the best epoch, here the last) with g_i and their mean (Eq. 6), as
``plots/gain_matrix.png``.

The random control (``--random N``, default 3; needs ``spider`` in ``--only``): for each
of N draws every client k gets a mask drawn uniformly from the same space
(``jaxfednas.search_spaces.sampling.random_mask``, key ``fold_in(rng.random_arch_key(seed, i), k)``),
fine-tuned with exactly the gain matrix's recipe (same epochs, same minibatches, from the
global supernet's weights; ``jaxfednas.algorithms.spider.fine_tuned_accuracy``), so each client's
searched mask (``p[k, k]``) is compared with random masks trained the same way: per
client and mean over clients, searched − random and how many random masks the searched
one beats (``results.md``), and ``plots/searched_vs_random.png`` (x: kept parameters).
``--match-size`` rejection-samples each client's random masks to within ±10 % of its
searched mask's parameters (``sampling.matched``).
Every client's searched mask is fine-tuned again with ``--train-seeds`` - 1 other training
seeds (other minibatches; 3 seeds in all by default) and every mask is scored with the
global supernet's weights (BatchNorm statistics recalibrated under the mask on the client's
train + validation data, no weight moved: ``sp.inherited_accuracy``), for the two
diagnostics on client means: the architecture signal-to-noise ratio (std over the random
draws / std of the searched masks over training seeds) and the supernet's ranking
(Kendall's τ and Spearman's ρ between inherited and fine-tuned accuracy over the searched
masks and the draws).
``--seeds 0,1,2`` runs the whole comparison once per seed (``run.seed``, which also draws
the partition) into ``seed_<s>/`` and writes mean ± std over seeds of every number.

Digits settings (the embedded data set is ~40x smaller than CIFAR-100 and 8x8 pixels):
a supernet with C=8, 3 cells and 3 intermediate nodes (9 edges per cell: 9 op choices
plus 2 topology projections, 10 searcher triggers), t_s = 4 and τ = 2 (the paper's 30 and
20 for 1000 rounds), 30 rounds: every client's search ends after round 23, then 7 rounds
of phase 3. SPIDER's learning rates 0.03 (the paper's grid {0.01, 0.03}). FedNAS searches
15 rounds (arch lr 1e-2 as examples/fednas.py), then trains 30 rounds; every other method
trains 30 rounds, batch 32, one local epoch. ``--set`` changes SPIDER's settings
(``algo.*``: SPIDER and local NAS; ``data.*`` / ``run.*``: every method, which all take
data, rounds, seed and placement from SPIDER's configuration).

``--preset paper``: CIFAR-100, 8 clients Dir(0.2), 1000 rounds, batch 32, s2 space C=16
with 8 cells and 4 nodes, t_s = 30, τ = 20, λ = 0.01, lr 0.01; FedNAS 50 search rounds
(the FedNAS paper) then 1000 training rounds; baselines ResNet18, lr 0.01 (the paper
tunes each method's rate over a grid; these are untuned). ``--resume`` continues
whichever run was interrupted; a finished run is not trained again.

The default run took 7-8.5 minutes on 2 (shared) CPU cores with an empty compilation
cache, about half of it compiling; SPIDER's round compiles once per λ.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxfednas.algorithms import spider as sp
from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.config import ConfigError, ExperimentConfig
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.files import save_figure
from jaxfednas.example_args import ExampleParser
from jaxfednas.process import exit_process, run_script
from jaxfednas.stages import load_run, StageRunner
from jaxfednas.registry import make_config
from jaxfednas.plots import plot_searched_vs_random
from jaxfednas.rng import random_arch_key
from jaxfednas.seeds import over_seeds, parse_seeds, repeat_seed, signal_to_noise, supernet_ranking, versus_random
from jaxfednas.search_spaces.darts import PRIMITIVE_SETS
from jaxfednas.search_spaces.darts.masks import CELLS
from jaxfednas.search_spaces.sampling import matched, random_mask

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
SHORT_OPS = {"skip_connect": "skip", "sep_conv_3x3": "sep3", "sep_conv_5x5": "sep5", "dil_conv_3x3": "dil3",
             "dil_conv_5x5": "dil5", "avg_pool_3x3": "avg3", "max_pool_3x3": "max3"}


def _describe(row: dict) -> str:
    parts = [f"{k} {row[k]:.4f}" for k in ("train_loss", "train_acc", "personal_train_acc",
                                           "client_test_acc_mean_unweighted") if k in row]
    if "edges_decided" in row:
        parts.append(f"edges decided {row['edges_decided']:.2f}, final clients {int(row['final_clients'])}")
    return ", ".join(parts)


def configs(args, overrides: dict) -> tuple[dict[str, ExperimentConfig], dict]:
    """Every run's configuration by run directory, and the overrides of FedNAS-global's
    training run (its genotype comes from the search). Data, rounds, seed and placement
    of every method are SPIDER's."""
    mode = "paper" if args.preset else "digits"
    base = {} if args.preset else {**DIGITS, **SPIDER_DIGITS}
    spider = make_config("spider", preset=args.preset, overrides={**base, **overrides})
    d, r, a = spider.data, spider.run, spider.algo
    shared = {
        "data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": d.num_clients,
        "data.partition": d.partition, "data.alpha": d.alpha, "data.classes_per_client": d.classes_per_client,
        "data.min_size": d.min_size, "data.partition_seed": d.partition_seed, "run.seed": r.seed,
        "run.rounds": r.rounds, "run.clients_per_round": r.clients_per_round, "run.eval_every": r.eval_every,
        "run.placement": r.placement, "run.client_chunk_size": r.client_chunk_size,
        "algo.batch_size": a.batch_size, "algo.local_epochs": a.local_epochs,
    }
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


def _client_acc(run_dir: Path) -> np.ndarray:
    with open(run_dir / "clients.csv") as f:
        return np.array([float(r["test_acc"]) for r in csv.DictReader(f)])


def _model_params(cfg: ExperimentConfig, info: DataInfo, image_shape) -> int:
    """Weights of a fixed network (the baselines', FedNAS-global's), from shapes only."""
    from jaxfednas.algorithms.fednas_train import make_network  # noqa: PLC0415
    from jaxfednas.cost import count_params  # noqa: PLC0415
    from jaxfednas.search_spaces.models import init_variables, make_model  # noqa: PLC0415

    model = make_network(cfg.algo, info) if cfg.algorithm == "fednas_train" else \
        make_model(cfg.algo.model, info.num_classes, cfg.data.dataset)
    v = jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), image_shape))
    return count_params(v["params"])


def _row(method: str, runs: list[str], acc: np.ndarray, wall: float, params: float, final: dict, **extra) -> dict:
    return {"method": method, "label": LABELS[method], "runs": runs, "client_test_acc": acc.round(6).tolist(),
            "mean": float(np.nanmean(acc)), "std": float(np.nanstd(acc)), "min": float(np.nanmin(acc)),
            "max": float(np.nanmax(acc)), "shared_model_acc": final.get("client_test_acc_global_mean_unweighted"),
            "params": params, "wall_s": round(wall, 1), **extra}


def run(args) -> None:
    """The comparison once (into ``--out``), or once per seed of ``--seeds`` (into
    ``--out/seed_<s>``) with the table of mean ± std over seeds in ``--out/results.md``."""
    overrides = args.overrides
    if args.seeds is None:
        one_seed(args, overrides, Path(args.out))
        return
    over_seeds(parse_seeds(args.seeds), lambda seed, out: one_seed(args, {**overrides, "run.seed": seed}, out),
               args.out, title=f"SPIDER ({', '.join(args.only)}): searched vs random personal architectures",
               metric="client test acc after fine-tuning (mean over clients)",
               note=("Each seed: its own partition, runs, personalization gain and random control "
                     f"(`seed_<s>/results.md`): every client's searched mask and {args.random} random masks of the "
                     f"same space per client{' (size-matched ±10 %)' if args.match_size else ''}, each fine-tuned with the gain "
                     "matrix's recipe (same epochs, same "
                     "minibatches, from the global supernet's weights) and tested on the client's local test "
                     "split. Plot: `plots/searched_vs_random.png` (means over clients; x: kept parameters)."))


def one_seed(args, overrides: dict, out: Path) -> dict:
    """One seed: every method of ``--only``, the gain matrix and the random control;
    results.md / results.json in ``out``; returns the numbers for the table over seeds."""
    t_call = time.perf_counter()
    mode = "paper" if args.preset else "digits"
    cfgs, train_over = configs(args, overrides)
    spider_cfg = cfgs["spider"]
    ds = load_dataset(spider_cfg.data.dataset, spider_cfg.data.data_dir)
    info = DataInfo.of(ds, spider_cfg.data.num_clients)
    runner = StageRunner(out, resume=args.resume, describe=_describe)
    rows = []
    for method in args.only:
        if method in ("spider", "local_nas"):
            s, wall = runner.stage(method, cfgs[method])
            f = s["final"]
            rows.append(_row(method, [method], _client_acc(out / method), wall, f["personal_params_mean"], f,
                             prox_lambda=cfgs[method].algo.prox_lambda, final_clients=int(f["final_clients"]),
                             edges_decided=f["edges_decided"]))
        elif method == "fednas":
            s, w_search = runner.stage("fednas/search", cfgs["fednas/search"])
            train_cfg = make_config("fednas_train", overrides={
                **train_over, "algo.genotype": json.dumps(s["architecture"], sort_keys=True)})
            t, w_train = runner.stage("fednas/train", train_cfg)
            rows.append(_row(method, ["fednas/search", "fednas/train"], _client_acc(out / "fednas" / "train"),
                             w_search + w_train, _model_params(train_cfg, info, ds.image_shape), {},
                             genotype=s["architecture"], search_wall_s=round(w_search, 1)))
        else:
            s, wall = runner.stage(method, cfgs[method])
            rows.append(_row(method, [method], _client_acc(out / method), wall,
                             _model_params(cfgs[method], info, ds.image_shape), s["final"]))

    result = {"dataset": spider_cfg.data.dataset, "clients": spider_cfg.data.num_clients,
              "partition": f"{spider_cfg.data.partition}({spider_cfg.data.alpha})", "rounds": spider_cfg.run.rounds,
              "same_test_splits": True, "rows": rows}
    genotypes = None
    if "spider" in args.only:
        archs = sp.PersonalGenotypes.from_json((out / "spider" / sp.PersonalGenotypes.FILENAME).read_text())
        genotypes = archs.genotypes()
        result["genotypes"] = {str(k): g.to_dict() for k, g in genotypes.items()}
        epochs = args.gain_epochs or GAIN_EPOCHS[mode]
        result["gain"] = gain(out, epochs, args.resume, args.random, args.match_size, args.train_seeds) \
            if len(genotypes) == spider_cfg.data.num_clients else None
        if result["gain"] is None:
            print(f"note: {spider_cfg.data.num_clients - len(genotypes)} clients have not finished their search; "
                  "no personalization gain and no random control (run more rounds or shorten "
                  "algo.warmup_rounds / algo.recovery_rounds)")
        elif args.random:
            result["versus"] = versus(result["gain"])
            plot_searched_vs_random({spider_cfg.run.seed: result["versus"]["points"]},
                                    out / "plots" / "searched_vs_random.png",
                                    metric="client test acc after fine-tuning (mean over clients)",
                                    title=f"SPIDER ({spider_cfg.data.dataset}, seed {spider_cfg.run.seed}): searched "
                                    f"vs random masks, {epochs} fine-tuning epochs")
    result["this_call_s"] = round(time.perf_counter() - t_call, 1)
    text = report(result, spider_cfg, genotypes)
    atomic_write_text(out / "results.md", text)
    atomic_write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
    print("\n" + text)
    print(f"results: {out / 'results.md'}; cell diagrams: {out / 'spider' / 'plots'}/client_<k>_normal.png, "
          f"_reduce.png; this call {result['this_call_s']:.0f} s")
    numbers = {f"{r['method']}: client test acc (mean over clients)": r["mean"] for r in rows}
    if result.get("gain"):
        numbers["mean personalization gain"] = result["gain"]["mean_gain"]
    if result.get("versus"):
        v = result["versus"]["mean"]
        numbers.update({"searched masks fine-tuned (mean over clients)": v["searched"],
                        "random masks fine-tuned (mean over clients and draws)": v["random_mean"],
                        "searched − random": v["searched_minus_random"],
                        "client × draw pairs where searched beats random (fraction)":
                            result["versus"]["pairs_beaten"] / result["versus"]["pairs"],
                        "searched masks: parameters (mean over clients)": result["versus"]["points"]["searched"][0],
                        "random masks: parameters (mean)": float(np.mean(result["gain"]["random"]["params"]))})
        d = result["versus"].get("diagnostics")
        if d:
            numbers.update({f"searched masks: std over {d['train_seeds']} training seeds (mean over clients)":
                            d["seed_std"], "architecture signal-to-noise": d["signal_to_noise"],
                            "supernet ranking: Kendall τ": d["kendall_tau"],
                            "supernet ranking: Spearman ρ": d["spearman"]})
    return {"numbers": numbers, "points": result["versus"]["points"] if result.get("versus") else None}


def random_masks(cfg: sp.SpiderConfig, seed: int, num_clients: int, draws: int, *,
                 size: Callable[[dict], float] | None = None, targets=None) -> dict:
    """The random control's architectures: draw i gives client k the SPIDER mask of a DARTS
    cell pair drawn uniformly from the space (``sampling.random_mask``, key
    ``fold_in(random_arch_key(seed, i), k)``), as ``{"normal": [K, draws, E, |O|], ...}``.
    With ``size`` (a mask's parameters) and ``targets`` (one per client), each draw is
    rejection-sampled (``sampling.matched``) to within ±10 % of its client's target."""
    prims = PRIMITIVE_SETS[cfg.primitives]

    def draw(i: int, k: int) -> dict:
        key = jax.random.fold_in(random_arch_key(seed, i), k)
        if size is None:
            return random_mask(key, prims, cfg.nodes)
        try:
            return matched(key, lambda kk: random_mask(kk, prims, cfg.nodes), size, targets[k], max_tries=20_000)[0]
        except ValueError as e:
            raise ConfigError(f"--match-size, client {k}: {e}; run without --match-size") from None

    m = [[draw(i, k) for i in range(draws)] for k in range(num_clients)]
    return {c: np.asarray([[d[c] for d in row] for row in m], np.float32).reshape(
        (num_clients, draws) + sp.initial_mask(prims, cfg.nodes)[c].shape) for c in CELLS}


def gain(out: Path, epochs: int, resume: bool, draws: int = 0, match_size: bool = False, train_seeds: int = 1) -> dict:
    """The personalization-gain matrix of SPIDER's final state (§5.2.2, Eq. 6) and, with
    ``draws``, the random control: every client's ``draws`` random masks fine-tuned with
    the same recipe (``sp.fine_tuned_accuracy``: the gain's epochs, minibatches and
    starting weights) in the same call. Reused on ``--resume`` when it was computed for the
    same rounds, epochs and draws (and ``match_size``: random masks within ±10 % of each
    client's searched mask's parameters). With ``draws`` and ``train_seeds`` > 1, also the two
    diagnostics' inputs: every client's searched mask fine-tuned again with ``train_seeds`` - 1
    other training seeds (``repeats``) and every mask's inherited accuracy (``inherited``:
    the global supernet's weights under the mask, BatchNorm statistics recalibrated exactly
    on the client's data under it, no weight moved: ``sp.inherited_accuracy``). A result
    whose inherited accuracies were measured the earlier way (one epoch at learning rate 0,
    running statistics) gets them measured again on ``--resume``, nothing else."""
    path = out / "gain.json"
    rounds = json.loads((out / "spider" / "summary.json").read_text())["rounds"]
    if resume and path.exists():
        g = json.loads(path.read_text())
        if g["epochs"] == epochs and g["spider_rounds"] == rounds and g.get("random", {}).get("draws", 0) == draws \
                and g.get("random", {}).get("match_size", False) == match_size \
                and g.get("random", {}).get("train_seeds", 1) == (train_seeds if draws else 1):
            if "inherited" in g["random"] and g["random"].get("inherited_bn") != INHERITED_BN:
                g["random"].update(_inherited(load_run(out / "spider"), g))
                atomic_write_text(path, json.dumps(g, indent=1) + "\n")
            return g
    print(f"== personalization gain: every client's architecture fine-tuned {epochs} epochs on every client"
          + (f", and {draws} random masks per client" if draws else ""), flush=True)
    t0 = time.perf_counter()
    run = load_run(out / "spider")
    cfg, info, state = run.config.algo, run.data.info, run.state
    k = info.num_clients
    arch = {c: np.asarray(a) for c, a in state.arch_masks.items()}
    params = state.variables["params"]
    size = (lambda m: sp.kept_parameters(cfg, params, m)) if match_size else None  # noqa: E731
    searched = [sp.kept_parameters(cfg, params, {c: arch[c][i] for c in CELLS}) for i in range(k)]
    rand = random_masks(cfg, run.config.run.seed, k, draws, size=size, targets=searched)
    # row i: A_1 .. A_K (sp.gain_matrix's candidates), then client i's random masks
    masks = {c: np.concatenate([np.broadcast_to(arch[c][None], (k,) + arch[c].shape), rand[c]], axis=1)
             for c in CELLS}
    acc = sp.fine_tuned_accuracy(cfg, info, state.variables, masks, run.data, epochs=epochs,
                                 placement=run.options.placement)
    p, g = acc[:, :k], sp.personalization_gain(acc[:, :k])
    diagnostics = {}
    if draws and train_seeds > 1:
        place = run.options.placement
        own = {c: arch[c][:, None] for c in CELLS}  # [K, 1, E, |O|]: each client's searched mask
        repeats = [sp.fine_tuned_accuracy(cfg, info, state.variables, own, run.data, epochs=epochs, placement=place,
                                          training_seed=repeat_seed(run.config.run.seed, j))[:, 0]
                   for j in range(1, train_seeds)]
        diagnostics = {"train_seeds": train_seeds, "repeats": [r.round(6).tolist() for r in repeats],
                       **_inherited(run, {"random": {"masks": _masks_json(own, rand)}})}
    result = {"epochs": epochs, "spider_rounds": run.rounds, "matrix": p.round(6).tolist(), "gain": g.round(6).tolist(),
              "mean_gain": float(g.mean()), "wall_s": round(time.perf_counter() - t0, 1),
              "random": {"draws": draws, "match_size": match_size, "seed": run.config.run.seed,
                         "acc": acc[:, k:].round(6).tolist(),
                         "params": [[sp.kept_parameters(cfg, params, {c: rand[c][i, j] for c in CELLS})
                                     for j in range(draws)] for i in range(k)],
                         "searched_params": searched, **diagnostics}}
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    plot_gain(p, g, out / "plots" / "gain_matrix.png", epochs)
    return result


INHERITED_BN = "recalibrated"  # gain.json's inherited accuracies: BN statistics measured exactly under each mask


def _masks_json(own: dict, rand: dict) -> dict:
    """Each client's candidates for the ranking (its searched mask, then its random draws) as
    lists: what :func:`_inherited` scores, kept in gain.json so a later call can score them again."""
    return {c: np.concatenate([own[c], rand[c]], axis=1).astype(np.int8).tolist() for c in CELLS}


def _inherited(run, g: dict) -> dict:
    """``{"inherited": acc[i, j], "inherited_bn", "masks"}``: client i's candidate j (its
    searched mask, then its random draws: ``g["random"]["masks"]``, rebuilt from the run's
    masks and the draws' keys when an older gain.json lacks them) with the global supernet's
    weights, BN statistics recalibrated under it (``sp.inherited_accuracy``)."""
    cfg, info, state = run.config.algo, run.data.info, run.state
    masks = g["random"].get("masks")
    if masks is None:  # written before the masks were kept: the same draws again from their keys
        params = state.variables["params"]
        arch = {c: np.asarray(a) for c, a in state.arch_masks.items()}
        k, draws = info.num_clients, g["random"]["draws"]
        searched = [sp.kept_parameters(cfg, params, {c: arch[c][i] for c in CELLS}) for i in range(k)]
        size = (lambda m: sp.kept_parameters(cfg, params, m)) if g["random"].get("match_size") else None  # noqa: E731
        rand = random_masks(cfg, run.config.run.seed, k, draws, size=size, targets=searched)
        masks = _masks_json({c: arch[c][:, None] for c in CELLS}, rand)
    acc = sp.inherited_accuracy(cfg, info, state.variables, {c: np.asarray(m, np.float32) for c, m in masks.items()},
                                run.data, placement=run.options.placement)
    return {"inherited": acc.round(6).tolist(), "inherited_bn": INHERITED_BN, "masks": masks}


def versus(g: dict) -> dict:
    """Searched vs random from :func:`gain`'s result: per client, its searched mask
    (``p[k, k]``) against its random masks; over clients, the mean of the searched against
    each draw's mean; the plot's points (kept parameters, accuracy), means over clients."""
    searched = np.diag(np.asarray(g["matrix"]))
    rand, params = np.asarray(g["random"]["acc"]), np.asarray(g["random"]["params"], float)
    s_params = np.asarray(g["random"]["searched_params"], float)
    out = {"clients": [versus_random(searched[k], rand[k].tolist()) for k in range(len(searched))],
           "mean": versus_random(searched.mean(), rand.mean(0).tolist()),
           "pairs_beaten": int((searched[:, None] > rand).sum()), "pairs": int(rand.size),
           "points": {"searched": (float(s_params.mean()), float(searched.mean())),
                      "random": [(float(x), float(y)) for x, y in zip(params.mean(0), rand.mean(0))]}}
    if "repeats" in g["random"]:  # the two diagnostics, on client means
        repeats = [searched.mean()] + [float(np.mean(r)) for r in g["random"]["repeats"]]
        snr = signal_to_noise(rand.mean(0).tolist(), repeats)
        inherited = np.asarray(g["random"]["inherited"]).mean(0)  # searched, then each draw
        ranking = supernet_ranking(inherited.tolist(), [float(searched.mean())] + rand.mean(0).tolist())
        out["diagnostics"] = {"train_seeds": len(repeats), "seed_std": snr["seed_std"],
                              "signal_to_noise": snr["ratio"], "inherited": inherited.tolist(), **ranking}
    return out


def plot_gain(p: np.ndarray, g: np.ndarray, path: Path, epochs: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    k = p.shape[0]
    fig = Figure(figsize=(0.75 * k + 2.5, 0.65 * k + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{p[i, j]:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if p[i, j] > 0.6 else "white", fontweight="bold" if i == j else "normal")
    ax.set_xticks(range(k))
    ax.set_yticks(range(k), [f"{i} (g={g[i]:+.2f})" for i in range(k)])
    ax.set_xlabel("architecture of client j")
    ax.set_ylabel("data of client i")
    ax.set_title(f"SPIDER p[i, j] after {epochs} fine-tuning epochs; mean gain {g.mean():+.3f}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def _cell(pairs) -> str:
    """``op(input)+op(input)`` per node, nodes separated by ``/``."""
    ops = [f"{SHORT_OPS.get(op, op)}({i})" for op, i in pairs]
    return " / ".join("+".join(ops[n:n + 2]) for n in range(0, len(ops), 2))


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def report(result: dict, spider_cfg: ExperimentConfig, genotypes: dict | None) -> str:
    a, d = spider_cfg.algo, spider_cfg.data
    lines = [f"# SPIDER vs baselines ({d.dataset}, {d.num_clients} clients, {result['partition']})", "",
             f"{result['rounds']} rounds; SPIDER: C={a.C}, {a.layers} cells, {a.nodes} nodes, {a.primitives} ops, "
             f"t_s={a.warmup_rounds}, τ={a.recovery_rounds}, λ={a.prox_lambda}, lr {a.lr}, split {tuple(d.split)} "
             f"(other methods {d.split[0] + d.split[1]:.2g}/{d.split[2]:.2g}); identical local test splits in every "
             "run (checked on the partition manifests).", "",
             "| method | params | local test acc (mean ± std over clients) | min | max | shared model on local tests "
             "| wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        label = f"{r['label']} (λ={r['prox_lambda']})" if r["method"] == "spider" else r["label"]
        if "final_clients" in r:
            label += f" [search final: {r['final_clients']}/{d.num_clients}]"
        lines.append(f"| {label} | {r['params']:,.0f} | {r['mean']:.4f} ± {r['std']:.4f} | {r['min']:.4f} | "
                     f"{r['max']:.4f} | {_f(r['shared_model_acc'])} | {r['wall_s']:.0f} |")
    lines += ["", "params: SPIDER / local NAS: the personal subnets' weights, mean over clients; shared model: the "
              "global supernet (SPIDER) or the global model before personalization (baselines), mean over clients."]
    if genotypes:
        lines += ["", "## SPIDER's per-client architectures", "",
                  "Per node `op(input)+op(input)`; inputs 0 and 1 are the two previous cells, 2+ earlier nodes. "
                  "Diagrams: `spider/plots/client_<k>_normal.png`, `_reduce.png`.", "",
                  "| client | normal cell | reduce cell |", "|---|---|---|"]
        lines += [f"| {k} | {_cell(g.normal)} | {_cell(g.reduce)} |" for k, g in sorted(genotypes.items())]
    g = result.get("gain")
    if g:
        p, k = np.asarray(g["matrix"]), len(g["gain"])
        lines += ["", f"## Personalization gain (§5.2.2, Eq. 6; {g['epochs']} fine-tuning epochs, last epoch)", "",
                  "p[i, j]: client i's local test accuracy of client j's architecture fine-tuned on client i's train + "
                  "validation data from the global supernet's weights; g_i = Σ_j≠i (p_ii − p_ij) / (c − 1). "
                  "Heatmap: `plots/gain_matrix.png`.", "",
                  "| data \\ arch | " + " | ".join(map(str, range(k))) + " | g_i |", "|---" * (k + 2) + "|"]
        lines += [f"| {i} | " + " | ".join(f"{x:.3f}" for x in p[i]) + f" | {g['gain'][i]:+.4f} |" for i in range(k)]
        lines += ["", f"mean personalization gain: {g['mean_gain']:+.4f} ({g['wall_s']:.0f} s)"]
    v = result.get("versus")
    if v:
        r, n = g["random"], g["random"]["draws"]
        m = v["mean"]
        matched_text = ", size-matched ±10 %" if r.get("match_size") else ""
        lines += ["", f"## Searched vs random architectures ({n} random masks per client{matched_text}, same "
                  "fine-tuning)", "",
                  f"Every client's searched mask (p[k, k] above) against {n} masks drawn uniformly from the same space "
                  + ("among those with parameters within ±10 % of the searched mask's " if r.get("match_size") else "")
                  + "for that client (`sampling.random_mask`, keys `fold_in(random_arch_key(seed, i), k)`), each "
                  f"fine-tuned as the gain matrix's entries: {g['epochs']} epochs on the client's train + validation "
                  "data from the global supernet's weights, the same minibatches; local test accuracy. params: the "
                  "supernet weights the mask keeps. Plot: `plots/searched_vs_random.png`.", "",
                  "| client | searched params | searched acc | random params (mean) | random acc (mean ± std) | "
                  "searched − random | random beaten (ties) |", "|---|---|---|---|---|---|---|"]
        for k, c in enumerate(v["clients"]):
            lines.append(f"| {k} | {r['searched_params'][k]:,} | {c['searched']:.4f} | {np.mean(r['params'][k]):,.0f} "
                         f"| {c['random_mean']:.4f} ± {c['random_std']:.4f} | {c['searched_minus_random']:+.4f} | "
                         f"{c['beats']} of {n} ({c['ties']}) |")
        lines.append(f"| mean over clients | {v['points']['searched'][0]:,.0f} | {m['searched']:.4f} | "
                     f"{np.mean(r['params']):,.0f} | {m['random_mean']:.4f} ± {m['random_std']:.4f} | "
                     f"{m['searched_minus_random']:+.4f} | {m['beats']} of {n} draws ({m['ties']}) |")
        lines += ["", f"Mean over clients: searched {m['searched']:.4f} vs random {m['random_mean']:.4f} "
                  f"({m['searched_minus_random']:+.4f}; std over draws of the clients' mean); the searched mask beats "
                  f"its random mask in {v['pairs_beaten']} of {v['pairs']} client × draw pairs."]
        d = v.get("diagnostics")
        if d:
            lines += ["", f"Diagnostics (client means): the searched masks fine-tuned with {d['train_seeds']} training "
                      f"seeds (other minibatches) spread by {d['seed_std']:.4f} (std), the random draws by "
                      f"{m['random_std']:.4f}: architecture signal-to-noise {d['signal_to_noise']:.2f}. With the "
                      "global supernet's weights under each mask (BatchNorm statistics recalibrated under it on the "
                      "client's train + validation data, no weight moved) the masks reach "
                      f"{', '.join(f'{x:.4f}' for x in d['inherited'])} "
                      f"(searched first): supernet ranking Kendall's τ {d['kendall_tau']:+.3f}, Spearman's ρ "
                      f"{d['spearman']:+.3f} over {d['n']} architectures."]
    return "\n".join(lines) + "\n"


def _methods(text: str) -> tuple[str, ...]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    return tuple(m for m in METHODS if m in names)


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_preset(("paper",), help="the paper's CIFAR-100 settings (a GPU; needs --data-dir)")
    p.add_data("prepared CIFAR-100 (tfds data_dir) for --preset paper")
    p.add_rounds("rounds of SPIDER and of every other method's training (default 30 on digits, 1000 with "
                 "--preset paper)")
    p.add_argument("--fednas-rounds", type=int, help="FedNAS-global's search rounds (default 15 on digits, 50 paper)")
    p.add_argument("--gain-epochs", type=int, help="fine-tuning epochs per entry of the personalization-gain "
                   "matrix (default 3 on digits, 30 with --preset paper)")
    p.add_argument("--only", type=_methods, default=METHODS, metavar="METHOD[,METHOD]",
                   help=f"run a subset of {', '.join(METHODS)}")
    p.add_control(random=3, random_help="the control: N random masks of the space per client, fine-tuned with the "
                  "gain matrix's recipe beside each client's searched mask (needs spider in --only; default 3, 0: none)",
                  min_train_seeds=2, train_seeds_help="the control: fine-tune every client's searched mask with N "
                  "training seeds in all (their std is the noise of the architecture signal-to-noise ratio; default 3, "
                  "at least 2)", match_size_help="draw each client's random masks with parameters within ±10 %% of "
                  "its searched mask's")
    p.add_seeds("the whole comparison once per seed (e.g. 0,1,2), each into --out/seed_<s>; results.md gives "
                "mean ± std over seeds")
    p.add_run_dir("runs/spider", set_help="override a SPIDER setting (see `jaxfednas run spider --help`); "
                  "data./run. fields apply to every method")
    args = p.parse(argv)
    return run_script("examples/spider.py", lambda: run(args))


if __name__ == "__main__":
    exit_process(main())
