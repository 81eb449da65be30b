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

Methods, each a run directory of its own under ``--out`` (default ``runs/perfedrlnas``):

  * ``perfedrlnas/``          — PerFedRLNAS (Algorithm 1) with the memory-budget reward
    (Eq. 9, ``algo.memory_budget=true``): every client has a simulated memory budget, a
    sampled subnet that does not fit scores accuracy 0 and φ = 1, one that fits pays its
    memory utilisation φ = memory / budget;
  * ``perfedrlnas_nobudget/`` — the same without budgets (Eq. 8); not in the default set
    (about 1.5 minutes more), ``--only`` adds it;
  * ``local_adaptation/``     — FedAvg, then every client fine-tunes the global model on its
    own train split before testing (the paper's "FedAvg with post fine-tuning", 10 epochs);
  * ``local_only/``           — every client trains a model of its own, nothing shared;
  * ``fednas/``               — personalized FedNAS (He et al. §2.5, examples/fednas.py
    ``--personalized``): a global FedNAS search (MiLeNAS) on the same DARTS space (same
    ops, C, cells, nodes), then every client adapts w and α on its own data
    (``algo.personalize_epochs``) and is tested with its adapted supernet.

PerFedRLNAS's accuracy is each client's argmax subnet of its policy with the final
supernet weights (its ``evaluate``), as the clients would deploy it without training
again; the table's second PerFedRLNAS line ("+ E local epochs") is the same subnet after
``algo.local_epochs`` epochs of its client's local training (SGD at the schedule's last
learning rate; the algorithm's ``personalize``), which is what a client reports in a round of Algorithm 1 and
what FedAvg + fine-tuning gets. Also
listed: the mean of the latest accuracies the clients reported during training (sampled
subnets, after local training) and of their best-ever ones (the authors' code's logged
number), the simulated round time (mean over rounds of ``round_time_s``: the slowest
sampled client's compute on its simulated device plus weights down and up at 100 Mbit/s)
and the policies' entropy.

The control (``--random N``, default 3): N draws of one random subnet per client, uniform
among the subnets within the client's memory budget when the run has budgets (the filter the
learned subnets face), tested by the same ``evaluate`` and ``personalize`` as the learned
argmax subnets: does the learned policy beat a random subnet trained the same way? The
learned subnets' local epochs run again with ``--train-seeds`` - 1 other training seeds
(other minibatches; 3 seeds in all by default), for the two diagnostics on client means:
the architecture signal-to-noise ratio (std over the random draws after the local epochs /
std of the learned subnets over training seeds) and the supernet's ranking (Kendall's τ and
Spearman's ρ over the learned subnets and the draws between their accuracy with the
supernet's weights and after the local epochs).

``--seeds 0,1,2`` (or ``0-4``) runs the job once per seed (``run.seed``, which also draws
the partition, the clients' simulated devices and budgets, and the random subnets) into
``--out/seed_<s>/``, each a run of its own with its own ``results.md`` and resumable with
``--resume``, then writes ``--out/results.md`` (:func:`jaxfednas.seeds.over_seeds`): mean ±
std over seeds and every seed's value of the learned argmax subnets' client-mean accuracy,
the random subnets' (mean of the draws), learned − random, the fraction of random draws
the learned subnets beat and the share of clients whose learned subnet beats its random
mean, each with the supernet weights and after the local epochs; then one line per test
saying in how many seeds learned beat random. Plots (x: parameters, mean over clients; y:
client-mean accuracy; one colour per seed, star: learned, dots: random draws):
``plots/searched_vs_random.png`` (supernet weights) and
``plots/searched_vs_random_local_epochs.png``. The comparison needs only the PerFedRLNAS
run, so ``--seeds`` runs only ``perfedrlnas`` unless ``--only`` names more (the baselines
add about 2.5 minutes per seed, FedNAS most of it); their client means then join the table.

Every method is tested on IDENTICAL local test splits: PerFedRLNAS, FedAvg + fine-tuning
and local-only split each client's data 80/20 train / test (PerFedRLNAS's default), the
FedNAS search 60/20/20 (its α needs a validation split; train + validation are the same
80 %). The split shuffles each client's indices once and cuts the test part off the end,
so every run gets the same test indices; the script checks every run's
``partition/manifest.json`` and stops if any differs.

Reported (``results.md``, ``results.json``, printed): mean ± std (unweighted over clients)
of local test accuracy, min, max, parameters (PerFedRLNAS: mean over clients of their
argmax subnets; FedNAS: the supernet), simulated round time, wall time; the Fig. 4
analogue ``plots/memory_vs_budget.png``: each client's training memory of its final argmax
subnet (weights, gradients, momentum and one batch's activations) against its budget,
from ``perfedrlnas/personal_architectures.json``.

Digits settings (the embedded data set: 1,797 8x8 images, ~70 training images per
client): a DARTS supernet with C=8, 3 cells and 2 intermediate nodes (5 edges per cell,
10 dimensions of the 8 DARTS ops, 'none' included), 40 rounds of 5 local epochs (each
client is sampled about 10 times), SGD lr 0.1 with a cosine to 0.01 (the code: 0.025 to
0.001 over 1500 rounds), policies as the paper (Adam lr 0.5, β1 0.5). The baselines
(the default digits network, a small CNN) train 40 rounds of 5 local epochs, lr 0.05;
FedAvg's clients fine-tune 10 epochs (the paper). FedNAS searches 10 rounds of 5 local
epochs (w: SGD lr 0.1 with a cosine to 0.01 over each round's epochs; α: Adam lr 1e-2, as
examples/fednas.py) and adapts 5 epochs per client. ``--set`` changes PerFedRLNAS's
settings (``algo.*``: both PerFedRLNAS runs; ``data.*`` / ``run.*``: every method, which
all take data, rounds, clients per round, seed and placement from PerFedRLNAS's
configuration).

``--preset paper``: CIFAR-10, 100 clients Dir(0.3), 5 per round, 1500 rounds of 5 local
epochs, batch 32, DARTS C=16 with 8 cells and 4 nodes, lr 0.025 (the authors' DARTS
configuration); baselines ResNet18 at lr 0.01 (the paper uses MobileNetV3-Large; untuned);
FedNAS 50 search rounds. CIFAR-100 (the paper's Dir(0.1)): add
``--set data.dataset=cifar100 --set data.alpha=0.1``. ``--resume`` continues whichever
run was interrupted; a finished run is not trained again.

Not included: Fig. 5 (new clients): :func:`jaxfednas.algorithms.perfedrlnas.adapt_new_clients`
needs clients whose data the supernet never saw, and every client of the partition
takes part in training here (no hold-out of clients in the sampler).

The default run took 6.8 minutes on 2 (shared) CPU cores with an empty compilation cache
(PerFedRLNAS 152 s and its local training 27 s, FedNAS search + personalization 123 s,
the two CNN baselines 28 s); ``perfedrlnas_nobudget`` adds about 1.5 minutes.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxfednas.algorithms import perfedrlnas as pf
from jaxfednas import rng
from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.config import ExperimentConfig
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import DataInfo
from jaxfednas.files import save_figure
from jaxfednas.example_args import ExampleParser
from jaxfednas.process import exit_process, run_script
from jaxfednas.stages import load_run, StageRunner
from jaxfednas.plots import plot_searched_vs_random
from jaxfednas.registry import make_config
from jaxfednas.runtime import resolve_clients_per_round
from jaxfednas.seeds import over_seeds, parse_seeds, repeat_seed, signal_to_noise, supernet_ranking, versus_random

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


def _describe(row: dict) -> str:
    parts = [f"{k} {row[k]:.4f}" for k in ("train_loss", "train_acc", "reward_acc", "arch_entropy",
                                           "client_test_acc_mean_unweighted") if k in row]
    if "over_budget" in row:
        parts.append(f"over budget {int(row['over_budget'])}")
    return ", ".join(parts)


def configs(args, overrides: dict) -> dict[str, ExperimentConfig]:
    """Every run's configuration by run directory. Data, rounds, clients per round, seed
    and placement of every method are PerFedRLNAS's."""
    mode = "paper" if args.preset else "digits"
    base = {**PFR[mode]} if args.preset else {**DIGITS, **PFR[mode]}
    pfr = make_config("perfedrlnas", preset=args.preset, overrides={**base, **overrides})
    d, r, a = pfr.data, pfr.run, pfr.algo
    shared = {
        "data.dataset": d.dataset, "data.data_dir": d.data_dir, "data.num_clients": d.num_clients,
        "data.partition": d.partition, "data.alpha": d.alpha, "data.classes_per_client": d.classes_per_client,
        "data.min_size": d.min_size, "data.partition_seed": d.partition_seed, "run.seed": r.seed,
        "run.rounds": r.rounds, "run.clients_per_round": r.clients_per_round, "run.eval_every": r.eval_every,
        "run.placement": r.placement, "run.client_chunk_size": r.client_chunk_size,
        "algo.batch_size": a.batch_size,
    }
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


def _client_acc(run_dir: Path) -> np.ndarray:
    with open(run_dir / "clients.csv") as f:
        return np.array([float(r["test_acc"]) for r in csv.DictReader(f)])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _model_params(cfg: ExperimentConfig, info: DataInfo, image_shape) -> int:
    """Weights of a fixed network (the baselines') or of FedNAS's supernet, from shapes only."""
    from jaxfednas.algorithms.fednas import make_supernet  # noqa: PLC0415
    from jaxfednas.cost import count_params  # noqa: PLC0415
    from jaxfednas.search_spaces.models import init_variables, make_model  # noqa: PLC0415

    model = make_supernet(cfg.algo, info) if cfg.algorithm == "fednas" else \
        make_model(cfg.algo.model, info.num_classes, cfg.data.dataset)
    v = jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), image_shape))
    return count_params(v["params"])


def _stats(acc: np.ndarray) -> dict:
    acc = np.asarray(acc, np.float64)
    return {"client_test_acc": acc.round(6).tolist(), "mean": float(np.nanmean(acc)), "std": float(np.nanstd(acc)),
            "min": float(np.nanmin(acc)), "max": float(np.nanmax(acc))}


def _row(method: str, runs: list[str], acc: np.ndarray, wall: float, params: float, **extra) -> dict:
    return {"method": method, "label": LABELS[method], "runs": runs, **_stats(acc), "params": params,
            "wall_s": round(wall, 1), **extra}


def _cached(path: Path, key: dict, resume: bool, compute) -> dict:
    """``compute()`` saved to ``path``; on ``--resume`` reused when it was computed for ``key``."""
    if resume and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
    result = {"key": key, **compute()}
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    return result


def local_train_argmax(run_dir: Path) -> dict:
    """Every client's argmax subnet of a finished PerFedRLNAS run after ``algo.local_epochs``
    epochs of its client's local training from the supernet's weights, tested on the
    client's local test split (the algorithm's ``personalize``)."""
    t0 = time.perf_counter()
    run = load_run(run_dir)
    cfg = run.config
    _, out = run.algorithm.personalize(run.state, run.data, rng.personalize_key(cfg.run.seed))
    acc = np.asarray(jax.device_get(out["client_test_acc"]))
    lr = float(pf.cosine_lr(cfg.algo.lr, cfg.algo.lr_min, cfg.run.rounds)(cfg.run.rounds))
    return {**_stats(acc), "epochs": cfg.algo.local_epochs, "lr": round(lr, 6),
            "wall_s": round(time.perf_counter() - t0, 1)}


def random_control(run_dir: Path, n: int, train_seeds: int = 1) -> dict:
    """The control of a finished PerFedRLNAS run: ``n`` draws of one random subnet per client
    (``pf.random_subnets``, keys ``rng.random_arch_key(seed, i)``; with ``algo.memory_budget``
    only subnets within the client's budget, the filter the learned ones face), tested by the
    same ``evaluate`` (supernet weights) and ``personalize`` (E local epochs) as the learned
    policies' argmax subnets; and the learned subnets' ``personalize`` again with
    ``train_seeds`` - 1 other training seeds (keys ``rng.personalize_key(repeat_seed(seed,
    j))``: other minibatches, the same subnets and weights), the seed noise of the local
    epochs."""
    t0 = time.perf_counter()
    run = load_run(run_dir)
    cfg, algo, state = run.config, run.algorithm, run.state
    space = pf.make_space(cfg.algo, run.data.info)
    budgets = np.asarray(jax.device_get(state.resources.memory_budget)) if cfg.algo.memory_budget else None
    k, width = state.policy_logits.shape[0], state.policy_logits.shape[-1]
    draws = []
    for i in range(n):
        choices = pf.random_subnets(rng.random_arch_key(cfg.run.seed, i), space, budgets, num_clients=k,
                                    batch_size=cfg.algo.batch_size)
        st = state.replace(policy_logits=pf.policies_for(jax.numpy.asarray(choices), width))
        ev = jax.device_get(algo.evaluate(st, run.data))
        _, pers = algo.personalize(st, run.data, rng.personalize_key(cfg.run.seed))
        draws.append({"choices": choices.tolist(),
                      "supernet_weights": np.asarray(ev["client_test_acc"], np.float64).round(6).tolist(),
                      "local_epochs": np.asarray(jax.device_get(pers["client_test_acc"]), np.float64).round(6).tolist(),
                      "params_mean": float(np.mean([space.cost(c).params for c in choices]))})
    repeats = [np.asarray(jax.device_get(algo.personalize(state, run.data, rng.personalize_key(
        repeat_seed(cfg.run.seed, j)))[1]["client_test_acc"]), np.float64).round(6).tolist()
        for j in range(1, train_seeds)]
    return {"draws": draws, "repeats": repeats, "wall_s": round(time.perf_counter() - t0, 1)}


def diagnostics(learned_supernet: np.ndarray, learned_local: np.ndarray, rand: dict) -> dict:
    """The two diagnostics of one run's control, on client means: architecture
    signal-to-noise (std over the random draws after the local epochs / std of the learned
    subnets over training seeds) and the supernet's ranking (Kendall's τ and Spearman's ρ
    over the learned subnets and the draws between their accuracy with the supernet's
    weights and after the local epochs)."""
    local = [float(np.nanmean(d["local_epochs"])) for d in rand["draws"]]
    repeats = [float(np.nanmean(learned_local))] + [float(np.nanmean(r)) for r in rand.get("repeats", [])]
    snr = signal_to_noise(local, repeats)
    ranking = supernet_ranking([float(np.nanmean(learned_supernet))]
                               + [float(np.nanmean(d["supernet_weights"])) for d in rand["draws"]],
                               [float(np.nanmean(learned_local))] + local)
    return {"train_seeds": len(repeats), "seed_std": snr["seed_std"], "signal_to_noise": snr["ratio"],
            "kendall_tau": ranking["kendall_tau"], "spearman": ranking["spearman"], "n": ranking["n"]}


def _versus_random(searched: np.ndarray, draws: list[np.ndarray]) -> dict:
    """Learned argmax subnets vs random ones: the client means of every random draw (mean ±
    std over draws) and the share of clients whose learned subnet beats its random draws' mean."""
    searched, rand = np.asarray(searched, np.float64), np.asarray(draws, np.float64)  # [K], [n, K]
    vs = versus_random(float(np.nanmean(searched)), [float(np.nanmean(r)) for r in rand])
    vs["random_acc"] = [float(np.nanmean(r)) for r in rand]
    vs["clients_beating_random"] = float(np.mean(searched > np.nanmean(rand, 0)))
    return vs


def fednas_personalized(run_dir: Path) -> dict:
    """Personalized FedNAS (§2.5): every client adapts the searched supernet's w and α on its
    own train / validation split, tested on its local test split (examples/fednas.py)."""
    t0 = time.perf_counter()
    run = load_run(run_dir)
    _, out = run.algorithm.personalize(run.state, run.data, rng.personalize_key(run.config.run.seed))
    out = jax.device_get(out)
    return {**_stats(np.asarray(out["client_test_acc"])),
            "global_mean": float(out["client_test_acc_global_mean_unweighted"]),
            "epochs": run.config.algo.personalize_epochs, "wall_s": round(time.perf_counter() - t0, 1)}


def run(args) -> None:
    """One seed into ``--out`` or, with ``--seeds``, one run of every method per seed into
    ``--out/seed_<s>`` and the table over seeds (:func:`jaxfednas.seeds.over_seeds`)."""
    overrides = args.overrides
    if args.seeds is None:
        run_one(args, overrides, Path(args.out))
        return
    seeds, out = parse_seeds(args.seeds), Path(args.out)
    per_seed = over_seeds(seeds, lambda seed, d: run_one(args, {**overrides, "run.seed": seed}, d), out,
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
    verdict = seeds_verdict({s: r["numbers"] for s, r in per_seed.items()})
    if verdict:
        text = (out / "results.md").read_text() + "\n" + verdict
        atomic_write_text(out / "results.md", text)
        print(verdict)


def seeds_verdict(rows: dict) -> str:
    """One line per PerFedRLNAS run and test: in how many seeds the learned argmax subnets'
    client mean beats the random subnets' (and the mean difference over seeds)."""
    lines = []
    first = next(iter(rows.values()))
    for name in first:
        if not name.endswith(": learned − random"):
            continue
        diffs = [r[name] for r in rows.values() if name in r]
        won = sum(d > 0 for d in diffs)
        lines.append(f"- {name[:-len(': learned − random')]}: the learned subnets beat the random ones in {won} of "
                     f"{len(diffs)} seeds (learned − random {float(np.mean(diffs)):+.4f} on average).")
    return ("Learned vs random, seed by seed:\n\n" + "\n".join(lines) + "\n") if lines else ""


def seeds_note(args, seeds) -> str:
    return (f"Each seed (`run.seed`; also the partition, the simulated devices and the random subnets' keys): "
            f"the methods {', '.join(args.only)} in `seed_<s>/` (its own `results.md`), and {args.random} draws "
            f"of one random subnet per client (within the client's memory budget when the run has one), tested "
            f"by the same code as the learned policy's argmax subnets. \"supernet weights\": each client's "
            f"subnet with the final supernet weights; \"+ E local epochs\": the same subnet after its client's "
            f"local training. \"fraction of draws beaten\": the share of the random draws whose client mean the "
            f"learned subnets' client mean exceeds; \"clients beating random\": the share of clients whose "
            f"learned subnet beats their random subnets' mean. Plots (x: parameters, mean over clients; y: "
            f"client-mean accuracy; star: learned, dots: random draws, one colour per seed): "
            f"`plots/searched_vs_random.png` (supernet weights), `plots/searched_vs_random_local_epochs.png` "
            f"(+ E local epochs).\n")


def seed_numbers(rows: list[dict]) -> dict:
    """One seed's result for :func:`jaxfednas.seeds.over_seeds`: ``numbers``, for every
    PerFedRLNAS run with the control, learned vs random (with the supernet weights and
    after the local epochs), and every other method's mean client accuracy; ``points`` (supernet weights)
    and ``points_local_epochs``: the first such run's learned subnets and random draws as
    (params, client-mean accuracy)."""
    numbers, result = {}, {}
    for r in rows:
        m, c = r["method"], r.get("random_control")
        if not c:
            numbers[f"{m}: mean client acc"] = r["mean"]
            if "local_training" in r:
                numbers[f"{m}: + local epochs, mean client acc"] = r["local_training"]["mean"]
            continue
        for tag, key, point in (("supernet weights", "supernet_weights", "points"),
                                ("+ local epochs", "local_epochs", "points_local_epochs")):
            v = c[key]
            numbers[f"{m}, {tag}: learned"] = v["searched"]
            numbers[f"{m}, {tag}: random (mean of draws)"] = v["random_mean"]
            numbers[f"{m}, {tag}: learned − random"] = v["searched_minus_random"]
            numbers[f"{m}, {tag}: fraction of draws beaten"] = v["beats"] / c["draws"]
            numbers[f"{m}, {tag}: clients beating random"] = v["clients_beating_random"]
            result.setdefault(point, {"searched": (r["params"], v["searched"]),
                                      "random": list(zip(c["draw_params"], v["random_acc"]))})
        dg = c["diagnostics"]
        numbers[f"{m}: learned, + local epochs: std over {dg['train_seeds']} training seeds"] = dg["seed_std"]
        numbers[f"{m}: architecture signal-to-noise (+ local epochs)"] = dg["signal_to_noise"]
        numbers[f"{m}: supernet ranking, Kendall τ (supernet weights vs + local epochs)"] = dg["kendall_tau"]
        numbers[f"{m}: supernet ranking, Spearman ρ"] = dg["spearman"]
        numbers[f"{m}: params, learned (mean over clients)"] = r["params"]
        numbers[f"{m}: params, random (mean over clients and draws)"] = c["params_mean"]
    return {"numbers": numbers, **result}


def run_one(args, overrides: dict, out: Path) -> dict:
    """Every method of ``args.only`` on one seed into ``out``: results.md / results.json
    there; returns :func:`seed_numbers` of its rows."""
    t_call = time.perf_counter()
    cfgs = configs(args, overrides)
    pfr_cfg = cfgs["perfedrlnas"]
    if pfr_cfg.algo.space != "darts" and "fednas" in args.only:
        print(f"note: FedNAS searches the DARTS space; left out with algo.space={pfr_cfg.algo.space}")
        args.only = tuple(m for m in args.only if m != "fednas")
    ds = load_dataset(pfr_cfg.data.dataset, pfr_cfg.data.data_dir)
    info = DataInfo.of(ds, pfr_cfg.data.num_clients)
    runner = StageRunner(out, resume=args.resume, describe=_describe)
    rows = []
    for method in args.only:
        if method in PERFEDRLNAS:
            s, wall = runner.stage(method, cfgs[method])
            f, metrics = s["final"], _metrics(out / method)
            rounds = s["rounds"]
            local = _cached(out / f"{method}_local_training.json", {"rounds": rounds}, args.resume,
                            lambda m=method: local_train_argmax(out / m))
            archs = pf.PersonalSubnets.from_json((out / method / pf.PersonalSubnets.FILENAME).read_text())
            control = {}
            if args.random:
                rand = _cached(out / f"{method}_random_subnets.json",
                               {"rounds": rounds, "draws": args.random, "train_seeds": args.train_seeds}, args.resume,
                               lambda m=method: random_control(out / m, args.random, args.train_seeds))
                control = {"random_control": {
                    "draws": args.random, "params_mean": float(np.mean([d["params_mean"] for d in rand["draws"]])),
                    "draw_params": [d["params_mean"] for d in rand["draws"]],
                    "supernet_weights": _versus_random(_client_acc(out / method),
                                                       [d["supernet_weights"] for d in rand["draws"]]),
                    "local_epochs": _versus_random(local["client_test_acc"],
                                                   [d["local_epochs"] for d in rand["draws"]]),
                    "diagnostics": diagnostics(_client_acc(out / method), np.asarray(local["client_test_acc"]), rand)}}
            entropy = [m.get("arch_entropy", m.get("policy_entropy")) for m in metrics]  # (former name)
            rows.append(_row(method, [method], _client_acc(out / method), wall, f["personal_params_mean"],
                             memory_budget=cfgs[method].algo.memory_budget, local_training=local,
                             reported_acc_mean=f["reported_acc_mean"],
                             best_reported_acc_mean=f["best_reported_acc_mean"],
                             round_time_s=float(np.mean([m["round_time_s"] for m in metrics])),
                             reward_time_share=float(np.mean([m["reward_time_share"] for m in metrics])),
                             policy_entropy=[entropy[0], entropy[-1]],
                             over_budget=[int(m["over_budget"]) for m in metrics],
                             sampled_subnets=len(metrics) * resolve_clients_per_round(
                                 cfgs[method].run.clients_per_round, info.num_clients),
                             fits=sum(c["fits"] for c in archs.clients.values()), **control))
        elif method == "fednas":
            s, w_search = runner.stage("fednas", cfgs["fednas"])
            pers = _cached(out / "fednas_personalized.json", {"rounds": s["rounds"]}, args.resume,
                           lambda: fednas_personalized(out / "fednas"))
            rows.append(_row(method, ["fednas"], np.asarray(pers["client_test_acc"]), w_search + pers["wall_s"],
                             _model_params(cfgs["fednas"], info, ds.image_shape), search_wall_s=round(w_search, 1),
                             global_supernet_acc=pers["global_mean"], genotype=s["architecture"]))
        else:
            s, wall = runner.stage(method, cfgs[method])
            rows.append(_row(method, [method], _client_acc(out / method), wall,
                             _model_params(cfgs[method], info, ds.image_shape),
                             global_model_acc=s["final"].get("client_test_acc_global_mean_unweighted")))

    d = pfr_cfg.data
    result = {"dataset": d.dataset, "clients": d.num_clients, "clients_per_round": pfr_cfg.run.clients_per_round,
              "partition": f"{d.partition}({d.alpha})", "rounds": pfr_cfg.run.rounds,
              "fednas_search_rounds": cfgs["fednas"].run.rounds, "same_test_splits": True, "rows": rows}
    memory = {m: pf.PersonalSubnets.from_json((out / m / pf.PersonalSubnets.FILENAME).read_text())
              for m in PERFEDRLNAS if m in args.only}
    if memory:
        plot_memory(memory, out / PLOT)
        result["memory_plot"] = str(PLOT)
    result["this_call_s"] = round(time.perf_counter() - t_call, 1)
    text = report(result, pfr_cfg)
    atomic_write_text(out / "results.md", text)
    atomic_write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
    print("\n" + text)
    print(f"results: {out / 'results.md'}" + (f"; memory vs budget: {out / PLOT}" if memory else "")
          + f"; this call {result['this_call_s']:.0f} s")
    return seed_numbers(rows)


def plot_memory(runs: dict, path: Path) -> None:
    """Fig. 4 analogue: each client's training memory of its argmax subnet (bars; red: over
    budget) and its budget (black ticks), one panel per PerFedRLNAS run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    k = len(next(iter(runs.values())).clients)
    fig = Figure(figsize=(max(6.0, 0.35 * k + 2), 2.8 * len(runs) + 0.4))
    FigureCanvasAgg(fig)
    for i, (method, archs) in enumerate(runs.items()):
        c = [archs.clients[str(j)] for j in range(k)]
        mem = np.array([a["memory_bytes"] for a in c]) / 2**20
        budget = np.array([a["memory_budget_bytes"] for a in c]) / 2**20
        fits = np.array([a["fits"] for a in c])
        ax = fig.add_subplot(len(runs), 1, i + 1)
        ax.bar(np.arange(k), mem, 0.7, color=np.where(fits, "tab:green", "tab:red"))
        ax.bar([0], [0], color="tab:green", label="argmax subnet, fits")
        ax.bar([0], [0], color="tab:red", label="argmax subnet, over budget")
        ax.scatter(np.arange(k), budget, marker="_", s=300, color="black", linewidths=2, label="budget", zorder=3)
        ax.set_ylabel("training memory (MiB)")
        ax.set_xticks(np.arange(k))
        ax.set_xlim(-0.6, k - 0.4)
        ax.set_title(f"{LABELS[method]}: {fits.sum()}/{k} clients within budget", fontsize=9, loc="right")
        if i == 0:
            ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.12), ncol=3, frameon=False)
    ax.set_xlabel("client")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def _f(x, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(result: dict, cfg: ExperimentConfig) -> str:
    a, d = cfg.algo, cfg.data
    space = f"DARTS C={a.C}, {a.layers} cells, {a.nodes} nodes, {a.primitives} ops" if a.space == "darts" else \
        f"{a.space} ({a.space_preset})"
    lines = [f"# PerFedRLNAS vs baselines ({d.dataset}, {d.num_clients} clients, {result['partition']}, "
             f"{result['clients_per_round']} per round)", "",
             f"{result['rounds']} rounds of {a.local_epochs} local epochs; PerFedRLNAS: {space}, lr {a.lr} → "
             f"{a.lr_min}, policy Adam lr {a.policy_lr}, λ_time {a.lambda_time} ({a.time_term}), φ {a.phi}; FedNAS: "
             f"{result['fednas_search_rounds']} search rounds. Identical local test splits "
             f"({d.split[2]:.2g} of each client's data) in every run (checked on the partition manifests).", "",
             "| method | params | local test acc (mean ± std over clients) | min | max | sim. round time (s) "
             "| wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rt = _f(r.get("round_time_s"), 3)
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
    if pfr:
        lines += ["", "| PerFedRLNAS run | reported acc (latest, mean) | best reported (code's number) | "
                  "policy entropy first → last round | time term's share of \\|r\\| (mean over rounds) | sampled "
                  "subnets over budget (all rounds) | argmax subnets within budget |", "|---|---|---|---|---|---|---|"]
        for r in pfr:
            e = r["policy_entropy"]
            lines.append(f"| {r['label']} | {r['reported_acc_mean']:.4f} | {r['best_reported_acc_mean']:.4f} | "
                         f"{e[0]:.3f} → {e[1]:.3f} | {r['reward_time_share']:.3f} | "
                         f"{sum(r['over_budget'])}/{r['sampled_subnets']} | "
                         f"{r['fits']}/{result['clients']} |")
    controlled = [r for r in pfr if "random_control" in r] if pfr else []
    if controlled:
        lines += ["", "Learned vs random subnets (the control: one random subnet per client per draw, within the "
                  "client's memory budget when the run has one, tested by the same code):", "",
                  "| PerFedRLNAS run | tested | learned (argmax) | random (mean ± std over draws) | learned − random | "
                  "draws the learned beat | clients whose learned subnet beats their random mean |",
                  "|---|---|---|---|---|---|---|"]
        for r in controlled:
            c = r["random_control"]
            for label, key in (("supernet weights", "supernet_weights"), ("+ E local epochs", "local_epochs")):
                v = c[key]
                lines.append(f"| {r['label']} | {label} | {v['searched']:.4f} | {v['random_mean']:.4f} ± "
                             f"{v['random_std']:.4f} | {v['searched_minus_random']:+.4f} | {v['beats']} of "
                             f"{c['draws']} | {v['clients_beating_random']:.2f} |")
        lines += [""] + [
            f"Diagnostics ({r['label']}, client means): the learned subnets after the local epochs spread by "
            f"{d['seed_std']:.4f} (std over {d['train_seeds']} training seeds), the random draws by "
            f"{r['random_control']['local_epochs']['random_std']:.4f}: architecture signal-to-noise "
            f"{d['signal_to_noise']:.2f}. Supernet ranking over {d['n']} subnets (learned and draws), supernet weights "
            f"vs after the local epochs: Kendall's τ {d['kendall_tau']:+.3f}, Spearman's ρ {d['spearman']:+.3f}."
            for r in controlled for d in [r["random_control"]["diagnostics"]]]
        lines += ["", "Random subnets' mean parameters: " + "; ".join(
            f"{r['label']}: {r['random_control']['params_mean']:,.0f} (learned {r['params']:,.0f})" for r in controlled)
            + "."]
    other = [r for r in result["rows"] if r.get("global_model_acc") is not None or "global_supernet_acc" in r]
    if other:
        lines += ["", "Shared model before personalization, mean over clients: " + "; ".join(
            f"{r['label']}: {_f(r.get('global_model_acc', r.get('global_supernet_acc')))}" for r in other) + "."]
    if "memory_plot" in result:
        lines += ["", f"Memory vs budget (Fig. 4 analogue): `{result['memory_plot']}`."]
    return "\n".join(lines) + "\n"


def _methods(text: str) -> tuple[str, ...]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    return tuple(m for m in METHODS if m in names)


def main(argv=None) -> int:
    p = ExampleParser(__doc__)
    p.add_preset(("paper",), help="the paper's CIFAR-10 settings (a GPU; needs --data-dir)")
    p.add_data("prepared CIFAR-10 / CIFAR-100 (tfds data_dir) for --preset paper")
    p.add_rounds("rounds of PerFedRLNAS and of the baselines (default 40 on digits, 1500 with --preset paper)")
    p.add_argument("--fednas-rounds", type=int, help="FedNAS's search rounds (default 10 on digits, 50 paper)")
    p.add_argument("--only", type=_methods, metavar="METHOD[,METHOD]",
                   help=f"the methods to run, of {', '.join(METHODS)} (default: all but perfedrlnas_nobudget; "
                        f"with --seeds: perfedrlnas)")
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
