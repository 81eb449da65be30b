"""Every paper example takes ``--dataset NAME`` (one of ``DATASETS``, e.g. the cluttered
digits) into the configuration of every stage it runs; a name that is not a dataset is a
one-line usage error."""
from pathlib import Path

import pytest

from conftest import load_example
from jaxfednas.stages import StageRunner

ROOT = Path(__file__).resolve().parents[3]
# example -> the function main hands its overrides to (replaced here: nothing trains)
ENTRY = {"fednas": "global_search", "dfnas": "one_seed", "spider": "one_seed", "perfedrlnas": "run_one",
         "dp_fnas": "table1"}


def _example(name):
    return load_example(name)


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_dataset_flag_reaches_every_stage(name, tmp_path, monkeypatch, capsys):
    mod, seen = _example(name), []
    monkeypatch.setattr(mod, ENTRY[name], lambda args, overrides, *rest, **kw: seen.append(dict(overrides)) or {})
    assert mod.main(["--dataset", "cluttered_digits", "--out", str(tmp_path / "o")]) in (0, None)
    assert [o["data.dataset"] for o in seen] == ["cluttered_digits"]
    with pytest.raises(SystemExit) as e:
        mod.main(["--dataset", "cluttered", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'cluttered'" in err and "Traceback" not in err


def test_fednas_train_set_reaches_the_evaluation_stage_of_every_cell(tmp_path, monkeypatch, capsys):
    """--train-set changes the evaluation stage (searched, repeated and random cells alike),
    not the search; a wrong name, a wrong value or a data.* key is a one-line usage error."""
    mod, ran = _example("fednas"), {}

    class Stop(Exception):
        pass

    def fake_stage(runner, name, cfg):
        ran[name] = cfg
        if cfg.algorithm == "fednas":
            return {"architecture": {"normal": [["skip_connect", 0]] * 2, "normal_concat": [2],
                                     "reduce": [["skip_connect", 0]] * 2, "reduce_concat": [2]}}
        if name == "random_0":
            raise Stop
        return {"final": {"global_test_acc": 0.5}}

    monkeypatch.setattr(StageRunner, "stage", lambda runner, name, cfg: (fake_stage(runner, name, cfg), 1.0))
    with pytest.raises(Stop):
        mod.main(["--train-set", "algo.lr_schedule=cosine", "--train-set", "run.eval_every=2", "--train-seeds", "2",
                  "--set", "algo.nodes=1", "--out", str(tmp_path / "o")])
    assert sorted(ran) == ["random_0", "search", "train", "train_seed_1"]
    assert ran["search"].algorithm == "fednas" and not hasattr(ran["search"].algo, "lr_schedule")
    for name in ("train", "train_seed_1", "random_0"):
        assert ran[name].algo.lr_schedule == "cosine" and ran[name].run.eval_every == 2, name
    for bad, message in ((["--train-set", "algo.lr_schedul=cosine"], "did you mean algo.lr_schedule"),
                         (["--train-set", "algo.lr_schedule=linear"], "lr_schedule"),
                         (["--train-set", "data.alpha=0.1"], "only algo.* and run.*")):
        with pytest.raises(SystemExit) as e:
            mod.main(bad + ["--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, bad


def test_dfnas_train_set_reaches_every_child_not_the_search(tmp_path, monkeypatch, capsys):
    """DFNAS's --train-set changes the FedAvg trainings of the control's children (searched,
    repeated and random alike), not the search; a FedAvg name that does not exist or a
    data.* key is a one-line usage error."""
    from jaxfednas.search_spaces.shufflenet import uniform_arch

    mod, ran = _example("dfnas"), {}

    class Stop(Exception):
        pass

    def fake_stage(runner, name, algo, cfg):
        ran[name] = cfg
        if algo == "dfnas":
            arch = uniform_arch(cfg.algo.space, "k3")
            return {"run": name, "algorithm": "dfnas", "space": arch.space, "choices": list(arch.choices),
                    "global_test_acc": 0.5}
        if name == "random-0-fedavg":  # (the last of the control's trainings)
            raise Stop
        return {"run": name, "algorithm": algo, "global_test_acc": 0.5, "params": 1}

    monkeypatch.setattr(mod, "_stage", fake_stage)
    with pytest.raises(Stop):
        mod.main(["--seeds", "0", "--random", "1", "--train-set", "algo.lr_schedule=cosine", "--train-set",
                  "run.eval_every=2", "--out", str(tmp_path / "o")])
    assert sorted(ran) == ["noniid-8", "random-0-fedavg", "searched-fedavg", "searched-fedavg-seed_1",
                           "searched-fedavg-seed_2"]
    assert ran["noniid-8"].algorithm == "dfnas" and ran["noniid-8"].run.eval_every != 2
    for name in ("searched-fedavg", "searched-fedavg-seed_1", "searched-fedavg-seed_2", "random-0-fedavg"):
        assert ran[name].algo.lr_schedule == "cosine" and ran[name].run.eval_every == 2, name
    for bad, message in ((["--train-set", "algo.lr_schedul=cosine"], "did you mean algo.lr_schedule"),
                         (["--train-set", "data.alpha=0.1"], "only algo.* and run.*")):
        with pytest.raises(SystemExit) as e:
            mod.main(bad + ["--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, bad


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_every_example_refuses_a_wrong_shared_flag_in_the_same_line(name, tmp_path, monkeypatch, capsys):
    """The shared flags (jaxfednas.example_args.ExampleParser) are checked in one place:
    each wrong value is the same one-line usage error in every paper example."""
    mod = _example(name)
    monkeypatch.setattr(mod, ENTRY[name], lambda *a, **k: pytest.fail("a wrong flag reached the run"))
    minimum = 1 if name == "fednas" else 2
    for argv, message in ((["--random", "-1"], "--random -1: must be >= 0"),
                          (["--train-seeds", str(minimum - 1)], f"--train-seeds {minimum - 1}: must be >= {minimum}"),
                          (["--seeds", "0,x"], "seed"),
                          (["--seeds", "0,1", "--set", "run.seed=3"], "--seeds sets run.seed of every run itself"),
                          (["--set", "algo.lr"], "SECTION.FIELD=VALUE")):
        with pytest.raises(SystemExit) as e:
            mod.main([*argv, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2, argv
        assert ": error: " in err[-1] and message in err[-1] and "Traceback" not in "\n".join(err), (argv, err)


def test_the_shared_flags_become_the_overrides_of_every_stage():
    from jaxfednas.example_args import ExampleParser

    p = ExampleParser("doc")
    p.add_data("data dir")
    p.add_rounds("rounds")
    p.add_seed()
    p.add_run_dir("runs/x", set_help="a setting")
    args = p.parse(["--set", "algo.lr=0.5", "--rounds", "3", "--dataset", "cluttered_digits", "--seed", "7"])
    assert args.overrides == {"algo.lr": "0.5", "run.rounds": 3, "data.dataset": "cluttered_digits", "run.seed": 7}
    assert args.out == "runs/x" and not args.resume
    assert p.parse([]).overrides == {}


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--set", "algo.lr"], "--set 'algo.lr': expected SECTION.FIELD=VALUE"),
    (["--set", "algo.lr=-1"], "algo.lr"),
    (["--preset", "nope"], "nope"),
    (["--out", " "], "--out is empty"),
])
def test_fedavg_example_refuses_bad_input_in_one_line(argv, message, tmp_path):
    import subprocess
    import sys

    argv = argv if "--out" in argv else argv + ["--out", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "fedavg.py"), *argv], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sum("error" in line for line in r.stderr.splitlines()) == 1, r.stderr  # (argparse adds its usage)
    assert not (tmp_path / "run").exists()


def test_fedavg_example_without_cifar_gives_advice_it_can_follow(tmp_path):
    """--preset paper without the data: one line of advice naming only flags and commands that
    exist -- this example's --data-dir, and the CLI command that downloads."""
    import subprocess
    import sys

    empty = tmp_path / "cifar"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "fedavg.py"), "--preset", "paper", "--data-dir",
                        str(empty), "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert str(empty) in r.stderr and f"then pass --data-dir {empty}" in r.stderr, r.stderr  # the flag it has
    command = f"jaxfednas partition --dataset cifar10 --data-dir {empty} --download --out runs/cifar10-partition"
    advised = command.split()[1:]
    assert command in r.stderr, r.stderr
    from jaxfednas.cli import _parser

    assert _parser().parse_args(advised).download  # the advised command parses


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_a_page_in_out_that_no_stages_wrote_is_refused_before_any_stage(name, tmp_path, monkeypatch, capsys):
    """An example's results.md/results.json in a user's --out was replaced when the script ended;
    now it is one line before any stage runs, the user's file kept."""
    mod, ran = _example(name), []
    monkeypatch.setattr(StageRunner, "stage", lambda self, *a, **k: ran.append(a) or (_ for _ in ()).throw(
        AssertionError("a stage ran")))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.md").write_text("# my notes\n")
    assert mod.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds results.md, which no run of stages wrote there" in err, err
    assert (out / "results.md").read_text() == "# my notes\n" and not ran


def test_a_stage_runners_own_page_is_rewritten(tmp_path):
    out = tmp_path / "o"
    (out / "stage").mkdir(parents=True)
    (out / "results.md").write_text("# an earlier page\n")
    (out / "stage" / "config.json").write_text("{}")
    StageRunner(out, resume=True)  # a stage directory beside it: the script's own page
    (out / "stage" / "config.json").unlink()
    (out / "wall_times.json").write_text("{}")
    StageRunner(out, resume=True)
