"""The SPIDER example end to end on a tiny setting (C=4, one cell, one node, the tiny op
set, t_s=0 and τ=1 so every client's search ends after round 2, 3 rounds; FedNAS-global
searches 1 round; gain fine-tuning 1 epoch): every method's row, the finished search,
personal_genotypes.json, the gain heatmap, identical local test splits across runs, and
resume of the finished runs. One call of main does all runs (every program compiles once).

Both are opt-in ``slow`` tests (the suite's 10-minute budget): SPIDER with one baseline
(Ditto: the other split, the table, the gain, resume; ~60 s cold on 2 cores) and every
method together (seven runs, ~165 s). SPIDER itself runs through the runner to final
genotypes in the default suite (tests/test_spider.py)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from algorithms.spider import personalization_gain
from conftest import assert_accuracy
from search_spaces.darts import PRIMITIVE_SETS

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--rounds", "3", "--fednas-rounds", "1", "--gain-epochs", "1",
        "--set", "algo.C=4", "--set", "algo.layers=1", "--set", "algo.steps=1", "--set", "algo.primitives=tiny",
        "--set", "algo.warmup_rounds=0", "--set", "algo.recovery_rounds=1"]
RUNS = ["spider", "local_nas", "fednas/search", "fednas/train", "ditto", "perfedavg", "local_adaptation"]


def _example():
    spec = importlib.util.spec_from_file_location("example_spider", ROOT / "examples" / "spider.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    capsys.readouterr()
    assert ex.main(TINY + ["--only", "spider,ditto", "--out", str(out), "--resume"]) == 0
    assert "round 1/3" not in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["gain"] == g


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
        assert rows[m]["final_clients"] == 8 and rows[m]["edges_decided"] == 1.0 and rows[m]["lam"] == lam
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
