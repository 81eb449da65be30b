"""The FedNAS example end to end on a tiny setting: global search + evaluation stage (the
README's main job), and the personalized comparison (FedNAS personalization vs the three
baselines; opt-in ``slow``: its parts are tested in tests/integration/algorithms/test_fednas.py and
tests/integration/algorithms/test_personalized_baselines.py, and its four compilations cost ~35 s cold)."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_accuracy, assert_summary_consistent, load_example
from jaxfednas.data.datasets import load_dataset
from jaxfednas.rng import random_arch_key
from jaxfednas.seeds import kendall_tau, mean_std, repeat_seed
from jaxfednas.search_spaces.darts import Genotype, PRIMITIVE_SETS
from jaxfednas.search_spaces.sampling import random_genotype

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--preset", "smoke", "--rounds", "1", "--set", "algo.primitives=tiny", "--set", "algo.nodes=1",
        "--set", "algo.layers=1", "--set", "algo.personalize_epochs=1", "--set", "data.num_clients=4"]


def _example(name):
    return load_example(name)


@pytest.mark.slow
def test_fednas_example_global_search_then_evaluation_stage(tmp_path, capsys):
    out = tmp_path / "g"
    assert _example("fednas").main(TINY + ["--train-rounds", "1", "--random", "2", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    train_cfg = json.loads((out / "train" / "config.json").read_text())
    # the table's numbers are the stages' final evaluations, whole numbers of test examples
    search, train = (json.loads((out / d / "summary.json").read_text())["final"] for d in ("search", "train"))
    n_test = load_dataset(train_cfg["data"]["dataset"]).y_test.shape[0]
    assert res["numbers"]["searched cell: evaluation-stage global test acc"] == train["global_test_acc"]
    for key, final, metric in (("supernet global test acc (search, final round)", search, "global_test_acc"),
                               ("same, BN recalibrated on the clients' training examples (pooled n_k/n)", search,
                                "global_test_acc_bn_recal")):
        assert res["head"][key] == f"{final[metric]:.4f}", key
        assert_accuracy(final[metric], n_test)
    assert_accuracy(train["global_test_acc"], n_test)
    assert_summary_consistent(out / "train")
    assert "<-" in res["head"]["derived normal cell"]
    # the control: random cell 0 of seed 0, trained with the evaluation stage's recipe on the same clients
    rand_cfg = json.loads((out / "random_0" / "config.json").read_text())
    prims = PRIMITIVE_SETS[json.loads((out / "search" / "config.json").read_text())["algo"]["primitives"]]
    assert Genotype.from_json(rand_cfg["algo"]["genotype"]) == random_genotype(random_arch_key(0, 0), prims, 1)
    assert {k: v for k, v in rand_cfg["algo"].items() if k != "genotype"} == \
        {k: v for k, v in train_cfg["algo"].items() if k != "genotype"} and rand_cfg["data"] == train_cfg["data"]
    rands = [json.loads((out / f"random_{i}" / "summary.json").read_text())["final"]["global_test_acc"] for i in (0, 1)]
    n = res["numbers"]
    assert (n["random cells: mean"], n["random cells: std"]) == pytest.approx(mean_std(rands))
    assert n["searched − random mean"] == pytest.approx(train["global_test_acc"] - sum(rands) / 2)
    assert n["random cells beaten (fraction)"] == sum(train["global_test_acc"] > r for r in rands) / 2
    assert [a["score"] for a in res["architectures"]] == [train["global_test_acc"], *rands]
    # the diagnostics: the searched cell retrained with other training seeds on the same partition ...
    repeats = [train["global_test_acc"]]
    for j in (1, 2):
        cfg_j = json.loads((out / f"train_seed_{j}" / "config.json").read_text())
        assert cfg_j["run"]["seed"] == repeat_seed(0, j) and cfg_j["algo"] == train_cfg["algo"]
        assert json.loads((out / f"train_seed_{j}" / "partition" / "manifest.json").read_text())["clients"] == \
            json.loads((out / "train" / "partition" / "manifest.json").read_text())["clients"]
        repeats.append(json.loads((out / f"train_seed_{j}" / "summary.json").read_text())["final"]["global_test_acc"])
    assert res["training_seeds"] == repeats
    assert n["architecture signal-to-noise"] == pytest.approx(mean_std(rands)[1] / mean_std(repeats)[1])
    # ... and the supernet's ranking of the three cells against their stand-alone accuracies
    inherited = json.loads((out / "inherited.json").read_text())
    genotypes = [train_cfg["algo"]["genotype"]] + \
        [json.loads((out / f"random_{i}" / "config.json").read_text())["algo"]["genotype"] for i in (0, 1)]
    inh = [inherited[Genotype.from_json(g).to_json()] for g in genotypes]
    assert all(0 <= a <= 1 for a in inh) and len(inherited) == 3
    assert n["supernet ranking: Kendall τ"] == pytest.approx(kendall_tau(inh, [train["global_test_acc"], *rands]))
    assert (out / "plots" / "searched_vs_random.png").stat().st_size > 0
    # the evaluation stage trains exactly the exported genotype, on the same partition
    assert json.loads(train_cfg["algo"]["genotype"]) == json.loads((out / "search" / "architecture.json").read_text())
    m_s = json.loads((out / "search" / "partition" / "manifest.json").read_text())
    m_t = json.loads((out / "train" / "partition" / "manifest.json").read_text())
    for a, b in zip(m_s["clients"], m_t["clients"]):
        assert sorted(a["train"] + a["val"]) == sorted(b["train"]) and a["test"] == b["test"]
    assert (out / "search" / "plots" / "cell_normal.png").exists()
    # a second call without --resume refuses to overwrite; with --resume it finishes at once
    assert _example("fednas").main(TINY + ["--train-rounds", "1", "--random", "2", "--out", str(out)]) != 0
    assert _example("fednas").main(TINY + ["--train-rounds", "1", "--random", "2", "--out", str(out), "--resume"]) == 0
    assert "evaluation-stage global test acc" in capsys.readouterr().out


def test_fednas_example_over_seeds_tables_each_seeds_numbers(tmp_path, monkeypatch):
    """--seeds: each seed's whole job runs with its run.seed into seed_<s>/, and results.md holds
    mean ± std over seeds of every number (the per-seed job is the test above)."""
    mod = _example("fednas")
    calls = []

    def one_seed(args, overrides, out):
        seed = overrides["run.seed"]
        calls.append((seed, out))
        return {"numbers": {"searched": 0.5 + seed / 10, "random": 0.25},
                "points": {"searched": (10, 0.5), "random": [(9, 0.25)]}}

    monkeypatch.setattr(mod, "search_and_evaluate", one_seed)
    assert mod.main(["--seeds", "0-2", "--random", "1", "--out", str(tmp_path)]) == 0
    assert calls == [(s, tmp_path / f"seed_{s}") for s in (0, 1, 2)]
    text = (tmp_path / "results.md").read_text()
    assert "| searched | 0.6000 ± 0.1000 | 0.5000 | 0.6000 | 0.7000 |" in text
    assert "| random | 0.2500 ± 0.0000 |" in text and (tmp_path / "plots" / "searched_vs_random.png").exists()
    with pytest.raises(SystemExit):  # argparse's one-line usage error
        mod.main(["--seeds", "0,0", "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_fednas_example_personalized_table(tmp_path):
    out = tmp_path / "p"
    assert _example("fednas").main(TINY + ["--personalized", "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    for name in ("FedNAS (personalized)", "local_adaptation", "ditto", "perfedavg"):
        assert name in table
    acc = np.loadtxt(out / "clients.csv", delimiter=",", skiprows=1)
    assert acc.shape == (4, 5) and np.all((acc[:, 1:] >= 0) & (acc[:, 1:] <= 1))
    assert len(json.loads((out / "personal_genotypes.json").read_text())) == 4
    sel = json.loads((out / "personal_selection.json").read_text())  # candidates: global model + 1 epoch
    assert np.asarray(sel["test_acc_by_epoch"]).shape == (4, 2) and set(sel["kept_epoch"]) <= {0, 1}
    kept = np.asarray(sel["test_acc_by_epoch"])[np.arange(4), sel["kept_epoch"]]
    np.testing.assert_allclose(acc[:, 1], kept, atol=1e-5)  # the table reports the kept models
    assert "kept epochs" in table
