"""The PerFedRLNAS example end to end on a tiny setting (6 clients, 3 per round, C=4, one
cell, one node, the tiny op set, 2 rounds of one local epoch; FedNAS searches 1 round):
the rows of results.json, identical local test splits across runs, the memory-vs-budget
plot, personal_architectures.json, the argmax subnets' local training, and resume of the
finished runs. One call of main does all runs.

The default suite runs PerFedRLNAS (memory budget) with local-only training, the cheapest
baseline; every method (two PerFedRLNAS runs, FedAvg + fine-tuning, local-only, FedNAS
search + personalization) is the opt-in ``slow`` test."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_example
from jaxfednas.algorithms import perfedrlnas as pf
from jaxfednas.evidence import Control, searched_vs_random

ROOT = Path(__file__).resolve().parents[3]
K = 6
TINY = ["--rounds", "2", "--fednas-rounds", "1", "--set", f"data.num_clients={K}", "--set", "run.clients_per_round=3",
        "--set", "algo.C=4", "--set", "algo.layers=1", "--set", "algo.nodes=1", "--set", "algo.primitives=tiny",
        "--set", "algo.local_epochs=1", "--random", "1", "--train-seeds", "2"]


def _example():
    return load_example("perfedrlnas")


def _manifest(out: Path, run: str) -> list[dict]:
    return json.loads((out / run / "partition" / "manifest.json").read_text())["clients"]


def _check_rows(out: Path, rows: dict) -> None:
    """Every method's accuracies are whole numbers of each client's local test examples (the
    same rows for every method, from the manifest); its wall time is the stage's recorded one."""
    counts = np.array([len(c["test"]) for c in _manifest(out, "perfedrlnas")])
    times = json.loads((out / "wall_times.json").read_text())
    for method, r in rows.items():
        acc = np.asarray(r["client_test_acc"])
        assert acc.shape == (K,)
        correct = acc * counts
        np.testing.assert_allclose(correct, np.round(correct), atol=1e-4)
        assert ((np.round(correct) >= 0) & (np.round(correct) <= counts)).all()
        assert (r["min"], r["max"], r["mean"]) == pytest.approx((acc.min(), acc.max(), acc.mean()), abs=1e-5)
        assert r["std"] == pytest.approx(acc.std(), abs=1e-5) and r["params"] > 0 and times[method] > 0
        if method == "fednas":  # the search stage, then the personalization's own time
            pers = json.loads((out / "fednas_personalized.json").read_text())
            assert r["search_wall_s"] == round(times[method], 1)
            assert r["wall_s"] == pytest.approx(times[method] + pers["wall_s"], abs=0.051)
        else:
            assert r["wall_s"] == round(times[method], 1)


def _check_perfedrlnas(out: Path, method: str, row: dict, budget: bool) -> None:
    assert row["memory_budget"] is budget and row["round_time_s"] > 0
    assert len(row["over_budget"]) == 2 and row["sampled_subnets"] == 6
    assert budget or sum(row["over_budget"]) == 0
    rounds = [json.loads(line) for line in (out / method / "metrics.jsonl").read_text().splitlines()]
    share = [m["reward_time_share"] for m in rounds if "reward_time_share" in m]
    assert len(share) == 2 and row["reward_time_share"] == pytest.approx(np.mean(share), rel=1e-6)
    local = row["local_training"]
    assert len(local["client_test_acc"]) == K and local["epochs"] == 1
    archs = json.loads((out / method / "personal_architectures.json").read_text())
    assert sorted(archs, key=int) == [str(k) for k in range(K)]
    for a in archs.values():
        # one node: 2 edges in each of the two cell types
        assert a["fits"] == (a["memory_bytes"] <= a["memory_budget_bytes"]) and len(a["choice"]) == 4
    assert row["fits"] == sum(a["fits"] for a in archs.values())
    assert row["params"] == pytest.approx(np.mean([a["params"] for a in archs.values()]), rel=1e-5)
    # the control: one random subnet per client, within its budget when the run has budgets,
    # tested by the same evaluate / personalize as the learned subnets
    (draw,) = json.loads((out / f"{method}_random_subnets.json").read_text())["draws"]
    counts = np.array([len(c["test"]) for c in _manifest(out, method)])
    for k, a in archs.items():
        assert len(draw["choices"][int(k)]) == len(a["choice"])
    control = row["random_control"]
    for key, learned in (("supernet_weights", row["client_test_acc"]), ("local_epochs", local["client_test_acc"])):
        acc = np.asarray(draw[key])
        np.testing.assert_allclose(acc * counts, np.round(acc * counts), atol=1e-4)
        v = control[key]
        assert v["searched"] == pytest.approx(np.mean(learned)) and v["random_mean"] == pytest.approx(acc.mean())
        assert v["clients_beating_random"] == pytest.approx(np.mean(np.asarray(learned) > acc))
    # the learned subnets' local epochs again with a second training seed: other minibatches
    (again,) = json.loads((out / f"{method}_random_subnets.json").read_text())["repeats"]
    assert len(again) == K and again != local["client_test_acc"]
    d = control["diagnostics"]
    assert d["train_seeds"] == 2 and d["n"] == 2
    assert d["seed_std"] == pytest.approx(abs(np.mean(again) - np.mean(local["client_test_acc"])) / 2 ** 0.5)


@pytest.mark.slow  # a whole run (30-100 s cold): CI's slow tier
def test_perfedrlnas_example_against_local_only(tmp_path, capsys):
    ex, out = _example(), tmp_path / "p"
    assert ex.main(TINY + ["--only", "perfedrlnas,local_only", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["perfedrlnas", "local_only"] and result["same_test_splits"]
    _check_rows(out, rows)
    _check_perfedrlnas(out, "perfedrlnas", rows["perfedrlnas"], budget=True)
    assert (out / "plots" / "memory_vs_budget.png").stat().st_size > 0
    ref, other = _manifest(out, "perfedrlnas"), _manifest(out, "local_only")
    assert [c["test"] for c in other] == [c["test"] for c in ref]
    assert [sorted(c["train"]) for c in other] == [sorted(c["train"]) for c in ref]
    md = (out / "results.md").read_text()
    assert "| PerFedRLNAS, memory budget (Eq. 9) |" in md and "| local-only |" in md
    # what --seeds tables for this seed: the learned subnets and the random draw as (params, acc)
    seed = ex.seed_numbers(result["rows"])
    (draw,) = json.loads((out / "perfedrlnas_random_subnets.json").read_text())["draws"]
    for key, points in (("supernet_weights", seed["points"]), ("local_epochs", seed["points_local_epochs"])):
        ((params, acc),) = points["random"]
        assert params == draw["params_mean"] and acc == pytest.approx(np.mean(draw[key]))
    assert seed["points"]["searched"] == (rows["perfedrlnas"]["params"], pytest.approx(rows["perfedrlnas"]["mean"]))
    assert seed["numbers"]["local_only: mean client acc"] == rows["local_only"]["mean"]
    # finished runs: without --resume the example refuses to overwrite; with it nothing trains again
    assert ex.main(TINY + ["--only", "perfedrlnas,local_only", "--out", str(out)]) == 2
    capsys.readouterr()
    assert ex.main(TINY + ["--only", "perfedrlnas,local_only", "--out", str(out), "--resume"]) == 0
    assert "round 1/2" not in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    for a, b in zip(again["rows"], result["rows"]):
        assert (a["client_test_acc"], a["wall_s"], a.get("local_training")) == \
            (b["client_test_acc"], b["wall_s"], b.get("local_training"))


@pytest.mark.slow
def test_perfedrlnas_example_compares_every_method_on_identical_splits(tmp_path, capsys):
    ex, out = _example(), tmp_path / "p"
    every = ["--only", ",".join(ex.METHODS)]
    assert ex.main(TINY + every + ["--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == list(ex.METHODS) and result["same_test_splits"]
    _check_rows(out, rows)
    _check_perfedrlnas(out, "perfedrlnas", rows["perfedrlnas"], budget=True)
    _check_perfedrlnas(out, "perfedrlnas_nobudget", rows["perfedrlnas_nobudget"], budget=False)
    # both runs draw the same simulated devices (the seed), so the same budgets
    budgets = [[a["memory_budget_bytes"] for _, a in sorted(json.loads(
        (out / m / "personal_architectures.json").read_text()).items(), key=lambda kv: int(kv[0]))]
        for m in ("perfedrlnas", "perfedrlnas_nobudget")]
    assert budgets[0] == budgets[1]
    assert (out / "plots" / "memory_vs_budget.png").stat().st_size > 0
    # FedNAS: a search of the same DARTS space, personalized on every client
    cfg = json.loads((out / "fednas" / "config.json").read_text())["algo"]
    assert (cfg["C"], cfg["layers"], cfg["nodes"], cfg["primitives"]) == (4, 1, 1, "tiny")
    assert rows["fednas"]["genotype"] == json.loads((out / "fednas" / "summary.json").read_text())["architecture"]
    final = json.loads((out / "fednas" / "summary.json").read_text())["final"]
    assert rows["fednas"]["global_supernet_acc"] == pytest.approx(final["client_test_acc_mean_unweighted"], abs=1e-6)
    # identical local test splits; FedNAS searches on a 60/20 split of the others' 80 % training rows
    ref = _manifest(out, "perfedrlnas")
    for run in ("perfedrlnas_nobudget", "local_adaptation", "local_only", "fednas"):
        clients = _manifest(out, run)
        assert [c["test"] for c in clients] == [c["test"] for c in ref], run
        assert [sorted(c["train"] + c["val"]) for c in clients] == [sorted(c["train"]) for c in ref], run
    md = (out / "results.md").read_text()
    for label in ex.LABELS.values():
        assert f"| {label} |" in md
    capsys.readouterr()
    assert ex.main(TINY + every + ["--out", str(out), "--resume"]) == 0
    assert "round 1/2" not in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    for a, b in zip(again["rows"], result["rows"]):
        assert (a["method"], a["client_test_acc"], a["wall_s"]) == (b["method"], b["client_test_acc"], b["wall_s"])


def test_unknown_method_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        _example().main(["--only", "perfedrlnas,nope"])
    assert e.value.code == 2


def _row(seed: int) -> dict:
    """A PerFedRLNAS row of results.json with a two-draw control, its numbers set by ``seed``."""
    return {"method": "perfedrlnas", "mean": 0.6 + seed / 100, "params": 1000.0 + seed,
            "local_training": {"mean": 0.8},
            "random_control": {"draws": 2, "params_mean": 950.0, "draw_params": [900.0, 1000.0],
                               "supernet_weights": {"searched": 0.6 + seed / 100, "random_mean": 0.55,
                                                    "random_acc": [0.5, 0.6],
                                                    "searched_minus_random": 0.05 + seed / 100,
                                                    "beats": 1 + (seed > 0), "clients_beating_random": 0.5},
                               "local_epochs": {"searched": 0.8, "random_mean": 0.85, "random_acc": [0.8, 0.9],
                                                "searched_minus_random": -0.05, "beats": 0,
                                                "clients_beating_random": 0.25},
                               "diagnostics": {"train_seeds": 3, "seed_std": 0.02, "signal_to_noise": 2.5 + seed,
                                               "kendall_tau": 0.5, "spearman": 0.6, "n": 3}}}


def test_seed_numbers_reads_learned_vs_random_from_the_rows():
    r = _example().seed_numbers([_row(0), {"method": "local_only", "mean": 0.7, "params": 5.0}])
    n = r["numbers"]
    assert n["local_only: mean client acc"] == 0.7 and "perfedrlnas: mean client acc" not in n
    assert n["perfedrlnas, supernet weights: learned"] == 0.6 and n["perfedrlnas, + local epochs: learned"] == 0.8
    assert n["perfedrlnas, supernet weights: learned − random"] == pytest.approx(0.05)
    assert n["perfedrlnas, supernet weights: fraction of draws beaten"] == 0.5
    assert n["perfedrlnas, + local epochs: random (mean of draws)"] == 0.85
    assert n["perfedrlnas, + local epochs: fraction of draws beaten"] == 0.0
    assert n["perfedrlnas, + local epochs: clients beating random"] == 0.25
    assert n["perfedrlnas: params, random (mean over clients and draws)"] == 950.0
    assert n["perfedrlnas: learned, + local epochs: std over 3 training seeds"] == 0.02
    assert n["perfedrlnas: architecture signal-to-noise (+ local epochs)"] == 2.5
    assert n["perfedrlnas: supernet ranking, Kendall τ (supernet weights vs + local epochs)"] == 0.5
    assert n["perfedrlnas: supernet ranking, Spearman ρ"] == 0.6
    # x = params (mean over clients), y = client-mean accuracy: the learned subnets and each draw
    assert r["points"] == {"searched": (1000.0, 0.6), "random": [(900.0, 0.5), (1000.0, 0.6)]}
    assert r["points_local_epochs"] == {"searched": (1000.0, 0.8), "random": [(900.0, 0.8), (1000.0, 0.9)]}


def test_diagnostics_by_hand_on_client_means():
    """Client means: learned 0.8 after the local epochs, 0.82 and 0.78 with the other training
    seeds (std 0.02); random draws 0.7 and 0.5 (std 0.1414): ratio 7.07. Supernet weights:
    learned 0.3, draws 0.6 and 0.1, ranked 2 3 1 against local 3 2 1: τ = 1/3, ρ = 0.5."""
    rand = {"draws": [{"local_epochs": [0.6, 0.8], "supernet_weights": [0.5, 0.7]},
                      {"local_epochs": [0.5, np.nan], "supernet_weights": [0.1, 0.1]}],
            "repeats": [[0.8, 0.84], [0.76, 0.8]]}
    for d in rand["draws"]:
        d |= {"choices": [[0], [0]], "params_mean": 1.0}
    control = Control(None, evaluate=lambda randoms, t: pf.client_means(np.array([0.2, 0.4]), np.array([0.8, 0.8]),
                                                                         1.0, rand))
    d = pf.control_summary(searched_vs_random(control, ".", seed=0, random=2, train_seeds=3))["diagnostics"]
    assert d["train_seeds"] == 3 and d["n"] == 3 and d["seed_std"] == pytest.approx(0.02)
    assert d["signal_to_noise"] == pytest.approx(0.2 / 2 ** 0.5 / 0.02)
    assert d["kendall_tau"] == pytest.approx(1 / 3) and d["spearman"] == pytest.approx(0.5)


def test_perfedrlnas_example_over_seeds_tables_each_seeds_numbers(tmp_path, monkeypatch):
    """--seeds: each seed's job runs with its run.seed into seed_<s>/ (only PerFedRLNAS unless
    --only says more), and results.md holds mean ± std over seeds of learned vs random."""
    mod = _example()
    calls = []

    def one_seed(args, overrides, out):
        seed = overrides["run.seed"]
        calls.append((seed, out, args.only, overrides.get("algo.C")))
        return mod.seed_numbers([_row(seed)])

    monkeypatch.setattr(mod, "run_one", one_seed)
    assert mod.main(["--seeds", "0-2", "--set", "algo.C=4", "--out", str(tmp_path)]) == 0
    assert calls == [(s, tmp_path / f"seed_{s}", ("perfedrlnas",), "4") for s in (0, 1, 2)]
    text = (tmp_path / "results.md").read_text()
    assert "(seeds 0,1,2)" in text
    assert "| perfedrlnas, supernet weights: learned | 0.6100 ± 0.0100 | 0.6000 | 0.6100 | 0.6200 |" in text
    assert "| perfedrlnas, supernet weights: fraction of draws beaten | 0.8333 ± 0.2887 | 0.5000 | 1.0000 |" in text
    assert "| perfedrlnas, + local epochs: learned − random | -0.0500 ± 0.0000 |" in text
    assert "- perfedrlnas, supernet weights: the learned subnets beat the random ones in 3 of 3 seeds" in text
    assert "- perfedrlnas, + local epochs: the learned subnets beat the random ones in 0 of 3 seeds" in text
    for plot in ("searched_vs_random.png", "searched_vs_random_local_epochs.png"):
        assert (tmp_path / "plots" / plot).stat().st_size > 0
    calls.clear()
    assert mod.main(["--seeds", "3", "--only", "perfedrlnas,local_only", "--out", str(tmp_path / "o")]) == 0
    assert [c[2] for c in calls] == [("perfedrlnas", "local_only")]


@pytest.mark.parametrize("argv", [["--seeds", "0,0"], ["--seeds", "a"], ["--seeds", "2-1"],
                                  ["--seeds", "0,1", "--set", "run.seed=3"]])
def test_bad_seeds_are_a_one_line_usage_error(argv, tmp_path, capsys, monkeypatch):
    mod = _example()
    monkeypatch.setattr(mod, "run_one", lambda *a: pytest.fail("ran a seed"))  # nothing may train
    with pytest.raises(SystemExit) as e:
        mod.main(argv + ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --seeds" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())
