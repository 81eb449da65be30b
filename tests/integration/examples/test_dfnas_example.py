"""The DFNAS example end to end on a tiny setting (3-block space, 1 round): the non-IID
run and the FedAvg ShuffleNetV2 baseline, the all-3x3 child of the same space (IID runs only
change the partition; left out to save a compilation), results table, resume, CLI."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxfednas import stages

from conftest import assert_summary_consistent, load_example
from jaxfednas.seeds import repeat_seed

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--rounds", "1", "--iid-clients", "--set", "algo.space=tiny", "--set", "algo.local_epochs=1",
        "--set", "algo.bn_recalibration_batches=1", "--set", "algo.batch_size=128"]
# --set reaches only the DFNAS runs' algo fields; the FedAvg baseline (5 local epochs of
# batch 32 by default) gets the same few steps here
FEDAVG_TINY = {"algo.local_epochs": 1, "algo.batch_size": 128}


def _example():
    mod = load_example("dfnas")
    mod.FEDAVG = {**mod.FEDAVG, **FEDAVG_TINY}
    return mod


@pytest.mark.slow  # a whole run (30-100 s cold): CI's slow tier
def test_dfnas_example_runs_search_and_fedavg(tmp_path, capsys):
    out = tmp_path / "d"
    assert _example().main(TINY + ["--random", "1", "--train-seeds", "2", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["runs"]
    assert [r["run"] for r in rows] == ["noniid-8", "fedavg-noniid-8", "searched-fedavg", "searched-fedavg-seed_1",
                                        "random-0-fedavg"]
    rows = rows[:3] + rows[4:] + rows[3:4]  # the searched child, the random one, the searched child again
    # the searched child again with another training seed, on the same clients
    again = json.loads((out / "searched-fedavg-seed_1" / "config.json").read_text())
    first = json.loads((out / "searched-fedavg" / "config.json").read_text())
    assert again["algo"] == first["algo"] and again["run"]["seed"] != first["run"]["seed"]
    assert json.loads((out / "searched-fedavg-seed_1" / "partition" / "manifest.json").read_text())["clients"] == \
        json.loads((out / "searched-fedavg" / "partition" / "manifest.json").read_text())["clients"]
    inherited = json.loads((out / "inherited.json").read_text())  # the two children in noniid-8's supernet
    assert sorted(inherited) == sorted({rows[2]["architecture"], rows[3]["architecture"]})
    # the control: the searched child and a random child of matched multiply-adds, trained with FedAvg's recipe
    cfgs = {r["run"]: json.loads((out / r["run"] / "config.json").read_text()) for r in rows[1:]}
    for name in ("searched-fedavg", "random-0-fedavg"):
        assert {k: v for k, v in cfgs[name]["algo"].items() if k != "model"} == \
            {k: v for k, v in cfgs["fedavg-noniid-8"]["algo"].items() if k != "model"}
        assert cfgs[name]["data"] == cfgs["fedavg-noniid-8"]["data"]
    assert cfgs["searched-fedavg"]["algo"]["model"] == "shufflenetv2_tiny:" + ",".join(map(str, rows[0]["choices"]))
    assert abs(rows[3]["macs"] - rows[0]["macs"]) <= 0.1 * rows[0]["macs"]
    assert rows[2]["architecture"] == rows[0]["architecture"] and rows[2]["macs"] == rows[0]["macs"]
    text = (out / "results.md").read_text()
    d = rows[2]["global_test_acc"] - rows[3]["global_test_acc"]
    assert f"| searched child, FedAvg from scratch: global test acc | {rows[2]['global_test_acc']:.4f} |" in text
    assert f"| searched − random mean | {d:+.4f} |" in text and result["numbers"]["searched − random mean"] == d
    for r in rows:  # each row is its run's final evaluation, whole numbers of test examples
        final = json.loads((out / r["run"] / "summary.json").read_text())["final"]
        assert r["global_test_acc"] == final["global_test_acc"] and r["params"] > 0 and r["macs"] > 0
        assert r["client_test_acc"] == final["client_test_acc_mean_unweighted"]
        assert_summary_consistent(out / r["run"])
    search = rows[0]
    assert search["architecture"].startswith("tiny[") and search["clients"] == 8
    arch = json.loads((out / "noniid-8" / "architecture.json").read_text())
    assert len(arch["choices"]) == 3
    # the baseline is the all-3x3 child of the space searched (set here by --set algo.space=tiny)
    assert rows[1]["architecture"].endswith("every block of tiny)")
    assert rows[1]["params"] <= rows[0]["params"]  # k3 is the space's cheapest candidate
    assert (rows[1]["macs"] == rows[0]["macs"]) == all(c == 0 for c in arch["choices"])  # 0: k3
    # FedAvg ran on the same clients as the non-IID search
    m1 = json.loads((out / "noniid-8" / "partition" / "manifest.json").read_text())
    m2 = json.loads((out / "fedavg-noniid-8" / "partition" / "manifest.json").read_text())
    assert m1["clients"] == m2["clients"]
    assert "| noniid-8 | dfnas |" in (out / "results.md").read_text()
    # finished runs: without --resume the example refuses to overwrite, with it it is done at once
    assert _example().main(TINY + ["--random", "1", "--train-seeds", "2", "--out", str(out)]) != 0
    assert _example().main(TINY + ["--random", "1", "--train-seeds", "2", "--out", str(out), "--resume"]) == 0
    assert "global test acc" in capsys.readouterr().out
    # a finished run keeps the wall time it took, not the resumed call's
    again = json.loads((out / "results.json").read_text())["runs"]
    assert [r["wall_s"] for r in again] == [r["wall_s"] for r in result["runs"]] and rows[0]["wall_s"] > 1


def test_cli_runs_dfnas_and_rejects_bad_space(tmp_path):
    cmd = [sys.executable, "-m", "jaxfednas.cli", "run", "dfnas", "--rounds", "1", "--set", "algo.space=nope",
           "--out", str(tmp_path / "c")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "algo.space" in r.stderr and "Traceback" not in r.stderr


def test_dfnas_example_over_seeds_tables_each_seeds_numbers(tmp_path, monkeypatch, capsys):
    """--seeds: only the control runs, once per seed with its run.seed into seed_<s>/, and
    results.md holds mean ± std over seeds (the per-seed job is the test above)."""
    mod = _example()
    calls = []

    def one_seed(args, overrides, out, *, control_only=False):
        seed = overrides["run.seed"]
        calls.append((seed, out, control_only))
        return {"numbers": {"searched": 0.5 + seed / 10, "random": 0.25},
                "points": {"searched": (10, 0.5), "random": [(9, 0.25)]}}

    monkeypatch.setattr(mod, "one_seed", one_seed)
    assert mod.main(["--seeds", "0-2", "--random", "1", "--out", str(tmp_path)]) == 0
    assert calls == [(s, tmp_path / f"seed_{s}", True) for s in (0, 1, 2)]
    text = (tmp_path / "results.md").read_text()
    assert "| searched | 0.6000 ± 0.1000 | 0.5000 | 0.6000 | 0.7000 |" in text
    assert "| random | 0.2500 ± 0.0000 |" in text and (tmp_path / "plots" / "searched_vs_random.png").exists()
    capsys.readouterr()
    for bad in (["--seeds", "0,0"], ["--seeds", "x"], ["--seeds", "0,1", "--random", "0"],
                ["--seeds", "0,1", "--set", "run.seed=3"]):
        with pytest.raises(SystemExit) as e:  # argparse's one-line usage error
            mod.main(bad + ["--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "error: --seeds" in err and "Traceback" not in err
    assert len(calls) == 3 and not (tmp_path / "x").exists()


def test_dfnas_example_control_only_runs_the_first_search_and_its_control(tmp_path, monkeypatch):
    """One seed of --seeds: the non-IID search, no IID run and no hand-designed baseline, then
    the searched and random children; its numbers are the control's."""
    mod = _example()
    ran = []

    def fake_stage(runner, name, algo, cfg):
        ran.append((name, algo, cfg.run.seed))
        acc = {"noniid-8": 0.9, "searched-fedavg": 0.8, "random-0-fedavg": 0.7, "searched-fedavg-seed_1": 0.78,
               "searched-fedavg-seed_2": 0.82}.get(name, 0.6)
        row = {"run": name, "algorithm": algo, "clients": 8, "partition": "dirichlet", "rounds": 1,
               "global_test_acc": acc, "client_test_acc": acc, "params": 100 + len(ran), "macs": 1000,
               "wall_s": 1.0, "architecture": "a"}
        if algo == "dfnas":
            row.update(space="tiny", choices=[0, 1, 2], global_test_acc_bn_recal=0.95)
        return row

    inherited = {}

    def fake_inherited(out, search_dir, children, make_accuracy, key):
        inherited.update(search_dir=search_dir, children=children)
        return [0.2, 0.5, 0.1]  # searched, random 0, random 1

    monkeypatch.setattr(mod, "_stage", fake_stage)
    monkeypatch.setattr(stages, "inherited_accuracies", fake_inherited)  # (as jaxfednas.evidence measures them)
    args = argparse.Namespace(preset=None, iid_clients=[2, 4, 8], random=2, children_bn_recal=0, resume=False, out=str(tmp_path),
                              train_seeds=3, train_overrides={})
    res = mod.one_seed(args, {"run.seed": 5, "algo.space": "tiny"}, tmp_path / "seed_5", control_only=True)
    assert [r[:2] for r in ran] == [("noniid-8", "dfnas"), ("searched-fedavg", "fedavg"),
                                    ("searched-fedavg-seed_1", "fedavg"), ("searched-fedavg-seed_2", "fedavg"),
                                    ("random-0-fedavg", "fedavg"), ("random-1-fedavg", "fedavg")]
    assert [r[2] for r in ran] == [5] * 2 + [repeat_seed(5, 1), repeat_seed(5, 2)] + [5] * 2
    assert inherited["search_dir"] == tmp_path / "seed_5" / "noniid-8"
    assert [str(a) for a in inherited["children"][:1]] == ["tiny[" + " ".join(
        mod.ShuffleArch("tiny", (0, 1, 2)).names) + "]"] and len(inherited["children"]) == 3
    n = res["numbers"]
    assert n["DFNAS child as searched (no retraining, BN recalibrated): global test acc"] == 0.95
    assert n["searched child, FedAvg from scratch: global test acc"] == 0.8
    assert n["random children (matched multiply-adds): mean"] == pytest.approx(0.65)
    assert n["searched − random mean"] == pytest.approx(0.15) and n["random children beaten (fraction)"] == 1.0
    # by hand: std(0.7, 0.6) / std(0.8, 0.78, 0.82) = 0.0707 / 0.02; inherited ranks 2 3 1 against
    # stand-alone 3 2 1: one discordant pair of three (τ = 1/3), Σd² = 2 (ρ = 0.5)
    assert n["searched child: std over 3 training seeds"] == pytest.approx(0.02)
    assert n["architecture signal-to-noise"] == pytest.approx(0.1 / 2 ** 0.5 / 0.02)
    assert n["supernet ranking: Kendall τ"] == pytest.approx(1 / 3) and n["supernet ranking: Spearman ρ"] == 0.5
    assert res["points"] == {"searched": (102, 0.8), "random": [(105, 0.7), (106, 0.6)]}
    assert (tmp_path / "seed_5" / "results.md").exists() and (tmp_path / "seed_5" / "plots" / "searched_vs_random.png").exists()


@pytest.mark.slow  # a whole run: CI's slow tier
def test_dfnas_example_compares_children_with_recalibrated_bn(tmp_path):
    """--children-bn-recal N: the children's FedAvg runs also report the accuracy with BN
    statistics recalibrated on the clients, and the control compares those."""
    out = tmp_path / "d"
    assert _example().main(TINY + ["--random", "1", "--train-seeds", "2", "--children-bn-recal", "2",
                                   "--iid-clients", "--out", str(out)]) == 0
    rows = {r["run"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    for name in ("searched-fedavg", "random-0-fedavg", "searched-fedavg-seed_1"):
        assert json.loads((out / name / "config.json").read_text())["algo"]["bn_recalibration_batches"] == 2
        assert rows[name]["global_test_acc_bn_recal"] is not None
    assert json.loads((out / "fedavg-noniid-8" / "config.json").read_text())["algo"]["bn_recalibration_batches"] == 0
    s, r = rows["searched-fedavg"]["global_test_acc_bn_recal"], rows["random-0-fedavg"]["global_test_acc_bn_recal"]
    text = (out / "results.md").read_text()
    assert f"| searched child, FedAvg from scratch, BN recalibrated: global test acc | {s:.4f} |" in text
    assert f"| searched − random mean | {s - r:+.4f} |" in text
