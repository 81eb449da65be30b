"""examples/dp_fnas.py end to end on the smoke preset shrunk to one cell and one node,
one DP-FNAS row (Table 1) and one noise level (Table 2), so that the file stays near
a minute on 2 cores."""
import argparse
import json
from pathlib import Path

import pytest

from conftest import assert_accuracy, load_example
from jaxfednas import privacy, stages
from jaxfednas.stages import StageRunner
from jaxfednas.rng import random_arch_key
from jaxfednas.seeds import repeat_seed
from jaxfednas.search_spaces.darts import Genotype, network_params, PRIMITIVE_SETS
from jaxfednas.search_spaces.sampling import random_genotype

ROOT = Path(__file__).resolve().parents[3]
DIGITS_TEST = 360  # scikit-learn's digits: 1437 training and 360 test images
SMOKE = ["--preset", "smoke", "--rounds", "1", "--train-rounds", "1", "--arch-gradient", "first",
         "--set", "algo.layers=1", "--set", "algo.nodes=1", "--set", "augment.layers=1"]


def _example():
    return load_example("dp_fnas")


@pytest.mark.slow  # a whole run (30-100 s cold): CI's slow tier
def test_table1_row_and_noise_sweep(tmp_path, capsys):
    ex = _example()
    ex.TABLE1 = [("DP-FNAS", 2, 1.0)]
    out = tmp_path / "t1"
    assert ex.main(SMOKE + ["--random", "1", "--out", str(out)]) == 0
    row, rand = json.loads((out / "results.json").read_text())
    assert row["method"] == "DP-FNAS" and row["parties"] == 2 and row["iterations"] == 2
    # both networks are tested on digits' 360 held-out test images (the server's test set),
    # each the final accuracy of its own run
    assert_accuracy(row["supernet_test_acc"], DIGITS_TEST)
    assert_accuracy(row["augmented_test_acc"], DIGITS_TEST)
    (aug_dir,) = [p for p in out.iterdir() if p.name.startswith("augment-")]
    final = {d: json.loads((out / d / "summary.json").read_text())["final"] for d in ("dp-fnas-2p", aug_dir.name)}
    assert row["supernet_test_acc"] == final["dp-fnas-2p"]["global_test_acc"]
    assert row["augmented_test_acc"] == final[aug_dir.name]["global_test_acc"]
    assert row["epsilon_pld"] == final["dp-fnas-2p"]["epsilon_pld"]
    # the reported epsilon is the PLD epsilon of the row's mechanism after its iterations
    cfg = json.loads((out / "dp-fnas-2p" / "config.json").read_text())["algo"]
    want = privacy.pld_epsilon(sampling_prob=max(cfg["sampling_prob"], cfg["val_sampling_prob"]),
                               noise_multiplier=1.0, steps=2, delta=1e-5)
    assert row["epsilon_pld"] == pytest.approx(want, rel=1e-9)
    manifest = json.loads((out / "dp-fnas-2p" / "partition" / "manifest.json").read_text())
    n_tr = [len(c["train"]) for c in manifest["clients"]]
    assert cfg["sampling_prob"] * sum(n_tr) / 2 == pytest.approx(16)  # expected batch 16 per party
    assert "| DP-FNAS | 2 |" in (out / "results.md").read_text()
    # the control: random cell 0 of the space searched, through the same augmentation stage
    rand_cfg = json.loads((out / "random-0" / "config.json").read_text())
    aug_cfg = json.loads((out / aug_dir.name / "config.json").read_text())
    want = random_genotype(random_arch_key(0, 0), PRIMITIVE_SETS[cfg["primitives"]], cfg["nodes"])
    assert Genotype.from_json(rand_cfg["algo"]["genotype"]) == want
    assert {k: v for k, v in rand_cfg["algo"].items() if k != "genotype"} == \
        {k: v for k, v in aug_cfg["algo"].items() if k != "genotype"} and rand_cfg["data"] == aug_cfg["data"]
    r_acc = json.loads((out / "random-0" / "summary.json").read_text())["final"]["global_test_acc"]
    assert rand == {"method": "random cells", "augmented_test_acc": [r_acc]}
    assert row["versus_random"]["searched_minus_random"] == pytest.approx(row["augmented_test_acc"] - r_acc)

    ex.NOISES = (1.0,)
    out2 = tmp_path / "t2"
    assert ex.main(SMOKE + ["--sweep-noise", "--parties", "2", "--out", str(out2)]) == 0
    (r2,) = json.loads((out2 / "results.json").read_text())
    assert r2["noise_multiplier"] == 1.0 and r2["epsilon_pld"] == pytest.approx(row["epsilon_pld"])
    assert_accuracy(r2["test_acc"], DIGITS_TEST)
    # the search-val accuracy weighted by the parties' val sizes: correct predictions over all val examples
    manifest2 = json.loads((out2 / "dp-fnas-2p-noise1" / "partition" / "manifest.json").read_text())
    assert_accuracy(r2["val_acc"], sum(len(c["val"]) for c in manifest2["clients"]))
    assert "DP-FNAS Table 2 analogue" in (out2 / "results.md").read_text()
    assert "ε" in capsys.readouterr().out


def test_dp_fnas_example_over_seeds_tables_each_seeds_numbers(tmp_path, monkeypatch, capsys):
    """--seeds: the private search vs random cells once per seed with its run.seed into
    seed_<s>/, and results.md holds mean ± std over seeds (the per-seed job: the next test)."""
    ex = _example()
    calls = []

    def one_seed(args, overrides, out):
        seed = overrides["run.seed"]
        calls.append((seed, out))
        return {"numbers": {"searched": 0.5 + seed / 10, "ε (PLD, δ=1e-05)": 6.0},
                "points": {"searched": (10, 0.5), "random": [(9, 0.25)]}}

    monkeypatch.setattr(ex, "private_vs_random", one_seed)
    assert ex.main(["--seeds", "1,3", "--random", "1", "--out", str(tmp_path)]) == 0
    assert calls == [(s, tmp_path / f"seed_{s}") for s in (1, 3)]
    text = (tmp_path / "results.md").read_text()
    assert "| searched | 0.7000 ± 0.1414 | 0.6000 | 0.8000 |" in text
    assert "| ε (PLD, δ=1e-05) | 6.0000 ± 0.0000 |" in text and "PLD accountant" in text
    assert (tmp_path / "plots" / "searched_vs_random.png").exists()
    capsys.readouterr()
    for bad in (["--seeds", "0,0"], ["--seeds", "2-1"], ["--seeds", "0,1", "--random", "0"],
                ["--seeds", "0,1", "--noise", "-1"], ["--seeds", "0,1", "--sweep-noise"],
                ["--seeds", "0,1", "--parties", "2", "--parties", "4"], ["--seeds", "0,1", "--set", "run.seed=3"]):
        with pytest.raises(SystemExit) as e:  # argparse's one-line usage error
            ex.main(bad + ["--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "error: --seeds" in err and "Traceback" not in err, bad
    assert len(calls) == 2 and not (tmp_path / "x").exists()
    # --noise 0: the non-private counterpart (FNAS), titled as such, no ε
    assert ex.main(["--seeds", "1", "--random", "1", "--noise", "0", "--out", str(tmp_path / "fnas")]) == 0
    text = (tmp_path / "fnas" / "results.md").read_text()
    assert "FNAS (4 parties, no noise): the non-private search's cell vs random cells" in text
    assert "without noise or clipping" in text and "PLD accountant" not in text


def test_dp_fnas_example_one_seed_is_one_private_row_vs_random_cells(tmp_path, monkeypatch):
    """One seed of --seeds: one DP-FNAS search (K = --parties, the seed's run.seed, noise),
    its cell and the random cells through the same augmentation stage; numbers and points."""
    ex = _example()
    prims = PRIMITIVE_SETS["tiny"]
    searched = random_genotype(random_arch_key(99, 0), prims, 2)
    ran = {}

    def fake_stage(runner, name, cfg):
        ran[name] = cfg
        assert runner.out == tmp_path  # every stage a directory of the seed's --out
        (runner.out / name).mkdir(exist_ok=True)  # (what a stage leaves: its directory and configuration)
        (runner.out / name / "config.json").write_text(cfg.to_json())
        if cfg.algorithm == "dp_fnas":
            return {"final": {"global_test_acc": 0.5, "epsilon_pld": 6.5}, "architecture": searched.to_dict()}
        acc = {"random-0": 0.9, "random-1": 0.7, "augment-seed_1": 0.83, "augment-seed_2": 0.87}.get(name, 0.85)
        return {"final": {"global_test_acc": acc}}

    inherited = {}

    def fake_inherited(out, search_dir, genotypes, make_accuracy, key):
        inherited.update(out=out, search_dir=search_dir, genotypes=genotypes)
        return [0.6, 0.3, 0.1]  # searched, random 0, random 1

    # every stage (the search and each augmentation) goes through the runner; the inherited
    # accuracies through jaxfednas.stages (as jaxfednas.evidence measures them)
    monkeypatch.setattr(StageRunner, "stage", lambda runner, name, cfg: (fake_stage(runner, name, cfg), 1.0))
    monkeypatch.setattr(stages, "inherited_accuracies", fake_inherited)
    args = argparse.Namespace(preset=None, parties=[2], noise=1.5, random=2, resume=False, train_rounds=None,
                             train_seeds=3)
    res = ex.private_vs_random(args, {"run.seed": 7, "algo.nodes": 2, "algo.primitives": "tiny"}, tmp_path)
    search = ran.pop("dp-fnas-2p")
    assert search.algorithm == "dp_fnas" and search.data.num_clients == 2 and search.run.seed == 7
    assert search.algo.noise_multiplier == 1.5 and search.algo.clip_norm > 0
    (aug,) = [n for n in ran if n.startswith("augment-") and "seed" not in n]
    assert sorted(ran) == sorted([aug, "augment-seed_1", "augment-seed_2", "random-0", "random-1"])
    for j in (1, 2):  # the searched cell again, with training seeds repeat_seed(7, j), nothing else changed
        again = ran[f"augment-seed_{j}"]
        assert again.run.seed == repeat_seed(7, j) != 7 and again.algo == ran[aug].algo and again.data == ran[aug].data
    assert inherited["search_dir"] == tmp_path / "dp-fnas-2p"
    assert inherited["genotypes"] == [searched] + [random_genotype(random_arch_key(7, i), prims, 2) for i in (0, 1)]
    assert Genotype.from_json(ran[aug].algo.genotype) == searched
    assert Genotype.from_json(ran["random-1"].algo.genotype) == random_genotype(random_arch_key(7, 1), prims, 2)
    assert {k: v for k, v in vars(ran["random-1"].algo).items() if k != "genotype"} == \
        {k: v for k, v in vars(ran[aug].algo).items() if k != "genotype"}
    n = res["numbers"]
    assert n["ε (PLD, δ=1e-05)"] == 6.5 and n["supernet test acc (private search)"] == 0.5
    assert n["searched cell: augmented test acc"] == 0.85 and n["random cells: mean"] == pytest.approx(0.8)
    assert n["searched − random mean"] == pytest.approx(0.05) and n["random cells beaten (fraction)"] == 0.5
    # the diagnostics by hand: std(0.9, 0.7) / std(0.85, 0.83, 0.87) = 0.1414 / 0.02; inherited ranks 3 2 1
    # against stand-alone 2 3 1: one discordant pair of three (τ = 1/3), Σd² = 2 (ρ = 1 - 12/24)
    assert n["searched cell: std over 3 training seeds"] == pytest.approx(0.02)
    assert n["architecture signal-to-noise"] == pytest.approx(0.2 / 2 ** 0.5 / 0.02)
    assert n["supernet ranking: Kendall τ"] == pytest.approx(1 / 3) and n["supernet ranking: Spearman ρ"] == 0.5
    c = ran[aug].algo
    assert res["points"]["searched"] == (network_params(searched, c.C, 10, c.layers, (8, 8, 1)), 0.85)
    assert [a for _, a in res["points"]["random"]] == [0.9, 0.7]
    assert "| searched − random mean | +0.0500 |" in (tmp_path / "results.md").read_text()

    # --noise 0: the same search without noise or clipping (FNAS), named so, no ε
    ran.clear()
    args.noise = 0.0
    res = ex.private_vs_random(args, {"run.seed": 7, "algo.nodes": 2, "algo.primitives": "tiny"}, tmp_path)
    search = ran.pop("fnas-2p")
    assert search.algo.noise_multiplier == 0 and search.algo.clip_norm == 0 and search.algo.arch_clip_norm == 0
    assert "supernet test acc (non-private search)" in res["numbers"]
    assert not any(k.startswith("ε") for k in res["numbers"])
    assert (tmp_path / "results.md").read_text().startswith("# FNAS (")
