"""The SPIDER example end to end on a tiny setting (C=4, one cell, one node, the tiny op
set, t_s=0 and τ=1 so every client's search ends after round 2, 3 rounds; FedNAS-global
searches 1 round; gain fine-tuning 1 epoch): every method's row, the finished search,
personal_genotypes.json, the gain heatmap, identical local test splits across runs, and
resume of the finished runs. One call of main does all runs (every program compiles once).

Both are opt-in ``slow`` tests (the suite's 10-minute budget): SPIDER with one baseline
(Ditto: the other split, the table, the gain, resume; ~60 s cold on 2 cores) and every
method together (seven runs, ~165 s). SPIDER itself runs through the runner to final
genotypes in the default suite (tests/integration/algorithms/test_spider.py)."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxfednas.algorithms import spider as sp
from jaxfednas.algorithms.spider import personalization_gain
from conftest import assert_accuracy, load_example
from jaxfednas.config import ConfigError
from jaxfednas.evidence import Control, searched_vs_random
from jaxfednas.registry import make_config
from jaxfednas.rng import random_arch_key
from jaxfednas.search_spaces.darts import PRIMITIVE_SETS
from jaxfednas.search_spaces.darts.masks import CELLS, genotype_from_mask
from jaxfednas.search_spaces.sampling import random_mask
from jaxfednas.stages import load_run

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--rounds", "3", "--fednas-rounds", "1", "--gain-epochs", "1",
        "--set", "algo.C=4", "--set", "algo.layers=1", "--set", "algo.nodes=1", "--set", "algo.primitives=tiny",
        "--set", "algo.warmup_rounds=0", "--set", "algo.recovery_rounds=1"]
RUNS = ["spider", "local_nas", "fednas/search", "fednas/train", "ditto", "perfedavg", "local_adaptation"]


def _example():
    return load_example("spider")


def _manifest(out: Path, run: str) -> list[dict]:
    return json.loads((out / run / "partition" / "manifest.json").read_text())["clients"]


@pytest.mark.slow
def test_spider_example_spider_against_ditto(tmp_path, capsys):
    ex, out = _example(), tmp_path / "s"
    assert ex.main(TINY + ["--only", "spider,ditto", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["spider", "ditto"] and result["same_test_splits"]
    n_test = [len(c["test"]) for c in _manifest(out, "spider")]
    for r in rows.values():
        acc = np.asarray(r["client_test_acc"])
        assert acc.shape == (8,) and r["min"] <= r["mean"] <= r["max"]
        for a, n in zip(acc, n_test):
            assert_accuracy(a, n)  # whole local test examples
        assert r["mean"] == pytest.approx(acc.mean(), abs=1e-5) and r["params"] > 0
    assert rows["spider"]["final_clients"] == 8 and rows["spider"]["edges_decided"] == 1.0
    archs = json.loads((out / "spider" / "personal_genotypes.json").read_text())
    assert all(a["final"] and a["genotype"] == result["genotypes"][k] for k, a in archs.items())
    g = result["gain"]
    np.testing.assert_allclose(g["gain"], personalization_gain(np.asarray(g["matrix"])), atol=1e-5)
    for row, n in zip(g["matrix"], n_test):  # p[i, j]: client i's local test accuracy
        for a in row:
            assert_accuracy(a, n)
    assert (out / "plots" / "gain_matrix.png").stat().st_size > 0
    ref, other = _manifest(out, "spider"), _manifest(out, "ditto")
    assert [c["test"] for c in other] == [c["test"] for c in ref]
    assert [sorted(c["train"]) for c in other] == [sorted(c["train"] + c["val"]) for c in ref]
    assert "| SPIDER (λ=0.01) [search final: 8/8] |" in (out / "results.md").read_text()
    # the random control (default --random 3): the same fine-tuning, in the gain's call
    r, v = g["random"], result["versus"]
    assert r["draws"] == 3 and np.asarray(r["acc"]).shape == (8, 3) and np.asarray(r["params"]).shape == (8, 3)
    for row, n in zip(r["acc"], n_test):
        for a in row:
            assert_accuracy(a, n)
    assert [c["searched"] for c in v["clients"]] == pytest.approx(np.diag(g["matrix"]).tolist(), abs=1e-6)
    assert v["mean"]["random_mean"] == pytest.approx(np.mean(r["acc"]), abs=1e-6)
    # the diagnostics' inputs: the searched masks again with 2 other training seeds, every mask inherited
    assert np.asarray(r["repeats"]).shape == (2, 8) and np.asarray(r["inherited"]).shape == (8, 4)
    for row, n in zip(np.concatenate([np.asarray(r["repeats"]).T, r["inherited"]], axis=1), n_test):
        for a in row:
            assert_accuracy(a, n)
    assert not np.array_equal(r["repeats"][0], np.diag(g["matrix"]))  # other minibatches
    assert v["diagnostics"]["train_seeds"] == 3 and v["diagnostics"]["n"] == 4
    assert (out / "plots" / "searched_vs_random.png").stat().st_size > 0
    assert "## Searched vs random architectures (3 random masks per client" in (out / "results.md").read_text()
    capsys.readouterr()
    assert ex.main(TINY + ["--only", "spider,ditto", "--out", str(out), "--resume"]) == 0
    assert "round 1/3" not in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["gain"] == g
    # every mask's inherited accuracy: BN recalibrated under it (sp.inherited_accuracy), first candidate
    # each client's searched mask
    assert r["inherited_bn"] == "recalibrated"
    state = load_run(out / "spider").state
    for c in ("normal", "reduce"):
        np.testing.assert_array_equal(np.asarray(r["masks"][c])[:, 0], np.asarray(state.arch_masks[c]))
    # a gain.json of the earlier recipe (one epoch at learning rate 0, masks not kept): --resume
    # measures the inherited accuracies again, from the same draws, and nothing else
    stale = json.loads((out / "gain.json").read_text())
    del stale["random"]["inherited_bn"], stale["random"]["masks"]
    stale["random"]["inherited"] = [[0.0] * 4] * 8
    (out / "gain.json").write_text(json.dumps(stale))
    assert ex.main(TINY + ["--only", "spider,ditto", "--out", str(out), "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())["gain"]
    assert again["random"]["inherited"] == r["inherited"] and again["random"]["masks"] == r["masks"]
    assert {k: v for k, v in again.items() if k != "random"} == {k: v for k, v in g.items() if k != "random"}


@pytest.mark.slow
def test_spider_example_compares_methods_on_identical_splits_and_resumes(tmp_path, capsys):
    ex, out = _example(), tmp_path / "s"
    assert ex.main(TINY + ["--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == list(ex.METHODS) and result["same_test_splits"]
    n_test = [len(c["test"]) for c in _manifest(out, "spider")]
    for r in rows.values():
        acc = np.asarray(r["client_test_acc"])
        assert acc.shape == (8,)
        for a, n in zip(acc, n_test):
            assert_accuracy(a, n)  # whole local test examples
        assert r["min"] <= r["mean"] <= r["max"] and r["mean"] == pytest.approx(acc.mean(), abs=1e-5)
        assert r["std"] == pytest.approx(acc.std(), abs=1e-5) and r["params"] > 0 and r["wall_s"] > 0
    # the search finished for every client; local-only NAS is SPIDER with λ = 0
    for m, lam in (("spider", 0.01), ("local_nas", 0.0)):
        assert rows[m]["final_clients"] == 8 and rows[m]["edges_decided"] == 1.0 and rows[m]["prox_lambda"] == lam
    metrics = [json.loads(line) for line in (out / "spider" / "metrics.jsonl").read_text().splitlines()]
    assert [r["final_clients"] for r in metrics] == [0, 8, 8]  # round 3 is phase 3

    # personal_genotypes.json: one final genotype per client over the tiny ops, rendered
    archs = json.loads((out / "spider" / "personal_genotypes.json").read_text())
    assert sorted(archs, key=int) == [str(k) for k in range(8)]
    for k, a in archs.items():
        assert a["final"] and a["genotype"] == result["genotypes"][k]
        for cell in ("normal", "reduce"):
            pairs = a["genotype"][cell]
            assert len(pairs) == 2 and {i for _, i in pairs} == {0, 1}  # one node, both inputs
            assert all(op in PRIMITIVE_SETS["tiny"] for op, _ in pairs)
            assert (out / "spider" / "plots" / f"client_{k}_{cell}.png").stat().st_size > 0

    # FedNAS-global trained the genotype its search derived
    search = json.loads((out / "fednas" / "search" / "summary.json").read_text())["architecture"]
    train_cfg = json.loads((out / "fednas" / "train" / "config.json").read_text())
    assert json.loads(train_cfg["algo"]["genotype"]) == search == rows["fednas"]["genotype"]

    # personalization gain (Eq. 6) and its heatmap
    g = result["gain"]
    p = np.asarray(g["matrix"])
    assert p.shape == (8, 8) and g["epochs"] == 1
    for row, n in zip(p, n_test):  # p[i, j]: client i's local test accuracy
        for a in row:
            assert_accuracy(a, n)
    np.testing.assert_allclose(g["gain"], personalization_gain(p), atol=1e-5)
    assert g["mean_gain"] == pytest.approx(np.mean(g["gain"]), abs=1e-5)
    assert (out / "plots" / "gain_matrix.png").stat().st_size > 0

    # identical local test splits; the 80/20 methods train on SPIDER's train + validation rows
    ref = _manifest(out, "spider")
    for run in RUNS[1:]:
        clients = _manifest(out, run)
        assert [c["test"] for c in clients] == [c["test"] for c in ref], run
        if run not in ("local_nas", "fednas/search"):
            assert [sorted(c["train"]) for c in clients] == [sorted(c["train"] + c["val"]) for c in ref], run

    md = (out / "results.md").read_text()
    assert "| SPIDER (λ=0.01) [search final: 8/8] |" in md and "mean personalization gain" in md
    assert "| local adaptation |" in md and "| 7 |" in md

    # finished runs: without --resume the example refuses to overwrite; with it nothing trains again
    # and the gain, wall times and accuracies are kept
    assert ex.main(TINY + ["--out", str(out)]) == 2
    capsys.readouterr()
    assert ex.main(TINY + ["--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "round 1/3" not in printed and "== personalization gain" not in printed
    again = json.loads((out / "results.json").read_text())
    assert again["gain"] == g
    for a, b in zip(again["rows"], result["rows"]):
        assert (a["method"], a["client_test_acc"], a["wall_s"]) == (b["method"], b["client_test_acc"], b["wall_s"])


def test_unknown_method_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        _example().main(["--only", "spider,nope"])
    assert e.value.code == 2


def test_random_masks_are_the_spaces_draws_one_per_client_and_draw():
    """Draw i of client k is sampling.random_mask under fold_in(random_arch_key(seed, i), k):
    a valid cell pair of the space (two inputs per node, one op each), the same for the same
    seed, different across clients, draws and seeds."""
    cfg = make_config("spider", overrides={"algo.nodes": 3}).algo
    prims = PRIMITIVE_SETS[cfg.primitives]
    m = sp.random_masks(cfg, 5, 3, 2)
    assert {c: a.shape for c, a in m.items()} == {c: (3, 2, 9, len(prims)) for c in CELLS}
    for k in range(3):
        for i in range(2):
            want = random_mask(jax.random.fold_in(random_arch_key(5, i), k), prims, cfg.nodes)
            mask = {c: m[c][k, i] for c in CELLS}
            for c in CELLS:
                np.testing.assert_array_equal(mask[c], want[c])
                assert mask[c].sum() == 2 * cfg.nodes and mask[c].sum(1).max() == 1
            genotype_from_mask(mask, prims, cfg.nodes)  # a whole genotype: two inputs per node
    flat = {m["normal"][k, i].tobytes() + m["reduce"][k, i].tobytes() for k in range(3) for i in range(2)}
    assert len(flat) == 6  # every client and draw its own architecture
    again, other = sp.random_masks(cfg, 5, 3, 2), sp.random_masks(cfg, 6, 3, 2)
    assert all(np.array_equal(m[c], again[c]) for c in CELLS)
    assert not all(np.array_equal(m[c], other[c]) for c in CELLS)


@pytest.mark.slow
def test_size_matched_random_masks_are_within_ten_percent_of_each_clients_target():
    """--match-size: each client's draws are rejection-sampled to its own target (here a
    stand-in cost: 1 + the number of sep_conv ops kept); an unreachable one is a one-line error."""
    cfg = make_config("spider", overrides={"algo.nodes": 3}).algo
    sep = PRIMITIVE_SETS[cfg.primitives].index("sep_conv_3x3")

    def size(m):
        return 1 + sum(float(m[c][:, sep].sum()) for c in CELLS)

    targets = [7, 10, 3]
    m = sp.random_masks(cfg, 5, 3, 4, size=size, targets=targets)
    for k, t in enumerate(targets):
        for i in range(4):
            assert abs(size({c: m[c][k, i] for c in CELLS}) - t) <= 0.1 * t, (k, i)
    assert len({m["normal"][1, i].tobytes() + m["reduce"][1, i].tobytes() for i in range(4)}) == 4
    with pytest.raises(ConfigError, match="--match-size, client 0"):
        sp.random_masks(cfg, 5, 1, 1, size=size, targets=[40])


def _gain():
    """A gain.json of 3 clients and 2 random draws with hand-checkable numbers."""
    p = np.array([[0.8, 0.1, 0.1], [0.2, 0.5, 0.3], [0.4, 0.4, 0.6]])
    return {"epochs": 3, "spider_rounds": 30, "matrix": p.tolist(), "gain": personalization_gain(p).tolist(),
            "mean_gain": float(personalization_gain(p).mean()), "wall_s": 1.0,
            "random": {"draws": 2, "seed": 0, "acc": [[0.7, 0.9], [0.5, 0.4], [0.1, 0.2]],
                       "params": [[10, 20], [30, 40], [50, 60]], "searched_params": [12, 24, 36]}}


def _evidence(g: dict):
    """A gain.json's control as searched_vs_random reads it (sp.control's evaluate, without the run)."""
    control = Control(None, evaluate=lambda randoms, train_seeds: sp.client_means(g))
    return searched_vs_random(control, ".", seed=0, random=g["random"]["draws"],
                              train_seeds=1 + len(g["random"].get("repeats", [])))


def test_versus_compares_each_clients_searched_mask_with_its_own_random_masks():
    ex, g = _example(), _gain()
    v = sp.searched_versus_random(_evidence(g))
    c = v["clients"]
    assert [x["searched"] for x in c] == pytest.approx([0.8, 0.5, 0.6])  # p[k, k]
    assert [x["random_mean"] for x in c] == pytest.approx([0.8, 0.45, 0.15])
    assert [(x["beats"], x["ties"]) for x in c] == [(1, 0), (1, 1), (2, 0)]
    # over clients: the searched mean against each draw's mean over clients
    assert v["mean"]["searched"] == pytest.approx(1.9 / 3)
    assert v["mean"]["random_mean"] == pytest.approx((1.3 / 3 + 1.5 / 3) / 2)
    assert v["mean"]["beats"] == 2 and (v["pairs_beaten"], v["pairs"]) == (4, 6)
    assert v["points"]["searched"] == pytest.approx((24, 1.9 / 3))
    assert np.allclose(v["points"]["random"], [(30, 1.3 / 3), (40, 1.5 / 3)])
    result = {"partition": "dirichlet(0.2)", "rounds": 30, "rows": [], "gain": g, "versus": v}
    md = ex.report(result, make_config("spider"), None)[1]
    assert "| 1 | 24 | 0.5000 | 35 | 0.4500 ± 0.0707 | +0.0500 | 1 of 2 (1) |" in md
    assert "| mean over clients | 24 | 0.6333 | 35 | 0.4667 ± 0.0471 | +0.1667 | 2 of 2 draws (0) |" in md
    assert "beats its random mask in 4 of 6 client × draw pairs" in md


def test_versus_diagnostics_on_client_means_by_hand():
    """Searched masks fine-tuned (client means) 0.6333, then 0.6 and 0.7 with two other
    training seeds; the draws' client means 0.4333 and 0.5. Inherited client means 0.3
    (searched), 0.6, 0.1 rank 2 3 1 against fine-tuned 3 1 2: τ = -1/3, ρ = -0.5."""
    ex, g = _example(), _gain()
    g["random"].update(train_seeds=3, repeats=[[0.7, 0.5, 0.6], [0.8, 0.6, 0.7]], inherited=[[0.3, 0.6, 0.1]] * 3)
    d = sp.searched_versus_random(_evidence(g))["diagnostics"]
    seed_std = np.std([1.9 / 3, 0.6, 0.7], ddof=1)
    assert d["train_seeds"] == 3 and d["seed_std"] == pytest.approx(seed_std)
    assert d["signal_to_noise"] == pytest.approx(np.std([1.3 / 3, 1.5 / 3], ddof=1) / seed_std)
    assert d["kendall_tau"] == pytest.approx(-1 / 3) and d["spearman"] == pytest.approx(-0.5) and d["n"] == 3
    result = {"partition": "dirichlet(0.2)", "rounds": 30, "rows": [], "gain": g,
              "versus": sp.searched_versus_random(_evidence(g))}
    assert "supernet ranking Kendall's τ -0.333" in ex.report(result, make_config("spider"), None)[1]
    assert "diagnostics" not in sp.searched_versus_random(_evidence(_gain()))  # a gain.json without the repeats


def test_seeds_run_the_comparison_per_seed_and_table_mean_and_std(tmp_path, monkeypatch):
    """--seeds: each seed's comparison runs with its run.seed into seed_<s>/ (the other
    settings unchanged); results.md holds mean ± std over seeds and the plot."""
    ex, calls = _example(), []

    def one_seed(args, overrides, out):
        calls.append((overrides, out))
        s = overrides["run.seed"]
        return {"numbers": {"searched − random": 0.1 * s, "spider": 0.9},
                "points": {"searched": (100, 0.9), "random": [(120, 0.8 - 0.1 * s)]}}

    monkeypatch.setattr(ex, "one_seed", one_seed)
    assert ex.main(["--seeds", "0-2", "--rounds", "7", "--only", "spider", "--out", str(tmp_path)]) == 0
    assert [(o["run.seed"], o["run.rounds"], out) for o, out in calls] == \
        [(s, 7, tmp_path / f"seed_{s}") for s in (0, 1, 2)]
    text = (tmp_path / "results.md").read_text()
    assert "| searched − random | 0.1000 ± 0.1000 | 0.0000 | 0.1000 | 0.2000 |" in text
    assert "| spider | 0.9000 ± 0.0000 |" in text and (tmp_path / "plots" / "searched_vs_random.png").exists()
    for bad in (["--seeds", "0,0"], ["--seeds", "x"], ["--seeds", "0,1", "--set", "run.seed=3"], ["--random", "-1"]):
        with pytest.raises(SystemExit) as e:  # argparse's one-line usage error
            ex.main(bad + ["--out", str(tmp_path / "x")])
        assert e.value.code == 2, bad
    assert not (tmp_path / "x").exists()
