"""Run management: exact resume, determinism, interruption, NaN stop, CLI errors."""
import json

import jax
import jax.numpy as jnp
import pytest

from jaxfednas import cli
from jaxfednas.config import ConfigError
from jaxfednas.experiment import NonFiniteError, run_experiment
from jaxfednas.registry import make_config
from jaxfednas.rundir import RunExistsError
from conftest import assert_summary_consistent, poison_algorithms

SMALL = {
    "data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2,
    "run.placement": "vmap", "algo.batch_size": 32,
}


def _cfg(rounds, **extra):
    return make_config("fedavg", overrides={**SMALL, "run.rounds": rounds, **extra})


def _files(d):
    return {name: (d / name).read_bytes() for name in
            ("metrics.jsonl", "checkpoint.msgpack", "partition/manifest.json", "clients.csv",
             "partition/label_heatmap.png", "plots/curves.png")}


def test_interrupt_then_resume_equals_uninterrupted(tmp_path):
    straight = tmp_path / "straight"
    run_experiment(_cfg(4), straight, progress=False, log=lambda s: None)

    resumed = tmp_path / "resumed"

    def interrupt(r, metrics):
        if r == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(4), resumed, progress=False, on_round_end=interrupt, log=lambda s: None)
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(RunExistsError):
        run_experiment(_cfg(4), resumed, progress=False)
    run_experiment(_cfg(4), resumed, resume=True, progress=False, log=lambda s: None)

    a, b = _files(straight), _files(resumed)
    for name in a:
        assert a[name] == b[name], name
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["rounds"] == 4
    assert_summary_consistent(straight)


def test_extend_finished_run_and_reject_changed_config(tmp_path):
    d = tmp_path / "run"
    run_experiment(_cfg(2), d, progress=False)
    with pytest.raises(ConfigError, match="configuration differs"):
        run_experiment(_cfg(3, **{"algo.lr": 0.5}), d, resume=True, progress=False)
    run_experiment(_cfg(3), d, resume=True, progress=False, log=lambda s: None)
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_run_resumes_on_another_layout_and_from_a_checkpoint_of_the_former_hash(tmp_path):
    """The clients' layout (run.placement, client_chunk_size, memory_budget_gib) may change on
    resume -- a run moved to another machine -- with a note; a checkpoint written before the
    layout left the config hash (it carries the older hash) still resumes."""
    import flax.serialization

    from jaxfednas.checkpoint import checkpoint_config_hash, save_checkpoint
    from jaxfednas.resume import config_hash, _dict_hash_v1

    straight = tmp_path / "straight"
    run_experiment(_cfg(4), straight, progress=False, log=lambda s: None)
    moved, notes = tmp_path / "moved", []
    run_experiment(_cfg(2), moved, progress=False, log=lambda s: None)
    run_experiment(_cfg(4, **{"run.placement": "map"}), moved, resume=True, progress=False, log=notes.append)
    assert any("the clients' layout changed (run.placement: vmap -> map)" in n for n in notes), notes
    # layout.json records what ran: the first rounds' layout, then the resumed rounds'
    assert json.loads((straight / "layout.json").read_text())["placement"] == "vmap"
    assert json.loads((moved / "layout.json").read_text())["placement"] == "map"
    assert json.loads((moved / "summary.json").read_text())["layout"]["placement"] == "map"
    assert any("the clients' layout that runs changed (placement: vmap -> map" in n for n in notes), notes
    a, b = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, moved))
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):  # the same trajectory, up to rounding (vmap and map sum in other orders)
        for k in ("train_loss", "global_test_loss"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-4), (k, ra["round"])
    # a checkpoint of the former hash (layout included), as runs before this change wrote it
    old = tmp_path / "old"
    run_experiment(_cfg(2), old, progress=False, log=lambda s: None)
    _header, payload = (old / "checkpoint.msgpack").read_bytes().split(b"\n", 1)
    raw = flax.serialization.msgpack_restore(payload)
    former = _dict_hash_v1(json.loads((old / "config.json").read_text()))
    assert raw["config_sha256"] != former
    save_checkpoint(old / "checkpoint.msgpack", raw["state"], round=raw["round"], config_sha256=former)
    # resumed on another layout and stopped before its next save (here: no round left to run),
    # then resumed on a third: the checkpoint was saved again under today's hash, so it still resumes
    run_experiment(_cfg(2, **{"run.placement": "map"}), old, resume=True, progress=False, log=lambda s: None)
    assert checkpoint_config_hash(old / "checkpoint.msgpack") == config_hash(_cfg(2))
    run_experiment(_cfg(4, **{"run.placement": "map", "run.client_chunk_size": 2}), old, resume=True,
                   progress=False, log=lambda s: None)
    a = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in b] == [1, 2, 3, 4] and b[:2] == a[:2]
    for ra, rb in zip(a[2:], b[2:]):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-4)
    with pytest.raises(ConfigError, match="the clients' layout"):  # anything else still refused, the message says what may change
        run_experiment(_cfg(5, **{"algo.lr": 0.5}), old, resume=True, progress=False)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    def round_fn(state, m):
        return state, {**m, "train_loss": jnp.where(state.round >= 3, jnp.nan, m["train_loss"])}

    poison_algorithms(monkeypatch, round_fn=round_fn)
    d = tmp_path / "nan"
    with pytest.raises(NonFiniteError, match="round 3: train_loss=nan.*round 2"):
        run_experiment(_cfg(5), d, progress=False)
    header, payload = (d / "checkpoint.msgpack").read_bytes().split(b"\n", 1)  # sha256 header line, msgpack
    import flax.serialization

    assert header.startswith(b"jaxfednas-checkpoint-v2 ")
    assert flax.serialization.msgpack_restore(payload)["round"] == 2
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("seeds", [None, "0,1"])
def test_cli_divergence_is_one_line_and_exit_3_with_and_without_seeds(seeds, tmp_path, monkeypatch, capsys):
    def round_fn(state, m):
        return state, {**m, "train_loss": jnp.where(state.round >= 1, jnp.nan, m["train_loss"])}

    poison_algorithms(monkeypatch, round_fn=round_fn)
    argv = ["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--rounds", "2", "--out", str(tmp_path / "d"),
            "--no-progress", *(["--seeds", seeds] if seeds else [])]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    assert "round 1: train_loss=nan" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_cli_run_and_partition(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--rounds", "1", "--seed", "1",
                   "--out", str(out), "--set", "algo.batch_size=64", "--set", "run.placement=vmap"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "global_test_acc" in text and "per-client test accuracy" in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algo"]["batch_size"] == 64 and cfg["run"]["seed"] == 1
    assert (out / "plots" / "client_accuracy.png").stat().st_size > 0

    rc = cli.main(["partition", "--dataset", "digits", "--method", "dirichlet", "--clients", "16",
                   "--alpha", "0.5", "--seed", "0", "--out", str(tmp_path / "part")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "total" in text and "sha256" in text
    assert (tmp_path / "part" / "label_heatmap.png").exists()
    # a run's own partition folder (or the run directory itself) is not written over
    manifest = (out / "partition" / "manifest.json").read_bytes()
    for target in (out / "partition", out):
        rc = cli.main(["partition", "--dataset", "digits", "--clients", "16", "--out", str(target)])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "lies in the run directory" in err, err
    assert (out / "partition" / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "run.rounds=0 is out of range"),
    (["--set", "algo.learning_rate=1"], "unknown setting algo.learning_rate"),
    (["--set", "algo.batch_size=abc"], "algo.batch_size='abc': expected int"),
    (["--clients-per-round", "9", "--clients", "4"], "run.clients_per_round=9 is out of range: must be in \\[1, 4\\]"),
    (["--set", "data.split=0.5,0.1,0.1"], "data.split"),
    (["--set", "data.split=a,b"], "data.split='a,b': expected comma-separated float values, e.g. 0.75,0,0.25"),
    (["--set", "data.alpha=0"], "data.alpha=0.0 is out of range"),
    (["--set", "algo.lr=nan"], "algo.lr=nan must be a finite number"),  # NaN fails no comparison
    (["--set", "run.server_lr=nan"], "run.server_lr=nan must be a finite number"),
    (["--set", "data.alpha=inf"], "data.alpha=inf must be a finite number"),  # no upper bound to catch it
    (["--set", "data.split=0.5,nan,0.5"], "data.split=.* must be a finite number"),
    (["--dataset", "cifar10"], "jaxfednas\\[tfds\\]"),
    (["--set", "nope"], "SECTION.FIELD=VALUE"),
    (["--resume"], "--resume"),
    (["--set", "algo.model=shufflenetv2_small:0,1"], "algo.model='shufflenetv2_small:0,1': .*needs 7 indices"),
    (["--set", "algo.model=vgg"], "algo.model='vgg': model must be one of"),
])
def test_cli_bad_arguments(tmp_path, capsys, argv, message):
    rc = cli.main(["run", "fedavg", "--out", str(tmp_path / "bad"), *argv])
    assert rc == 2
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "bad" / "config.json").exists()


@pytest.mark.parametrize("text", ["0.75,0,0.25", "[0.75, 0.0, 0.25]", "(0.75,0,0.25)"])
def test_tuple_settings_read_with_or_without_brackets(text):
    assert make_config("fedavg", overrides={"data.split": text}).data.split == (0.75, 0.0, 0.25)


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    for key in ("data.alpha", "run.clients_per_round", "algo.lr", "algo.server_lr", "--resume", "--preset"):
        assert key in text


def test_cli_privacy_table(capsys):
    rc = cli.main(["privacy", "--sampling-prob", "0.01", "--noise-multiplier", "1", "--steps", "100", "--delta", "1e-5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "PLD" in out and "CLT" in out
    assert cli.main(["privacy", "--sampling-prob", "1.5", "--noise-multiplier", "1", "--steps", "10",
                     "--delta", "1e-5"]) == 2
    assert "sampling_prob" in capsys.readouterr().err


def test_load_run_rebuilds_a_finished_run(tmp_path):
    from jaxfednas.stages import load_run

    d = tmp_path / "run"
    summary = run_experiment(_cfg(2), d, progress=False, log=lambda s: None)
    run = load_run(d)
    assert run.config == _cfg(2) and run.rounds == 2 and run.algorithm.name == "fedavg"
    assert run.manifest == json.loads((d / "partition" / "manifest.json").read_text())
    # the restored state is the one the run ended with: its evaluation reproduces the summary
    final = jax.device_get(run.algorithm.evaluate(run.state, run.data))
    assert float(final["global_test_acc"]) == summary["final"]["global_test_acc"]
    with pytest.raises(FileNotFoundError, match="holds no finished run"):
        load_run(tmp_path / "nothing")


def test_stage_runner_keeps_wall_times_and_checks_test_splits(tmp_path, capsys):
    from jaxfednas.stages import StageRunner

    describe = lambda row: f"loss {row['train_loss']:.3f}"  # noqa: E731
    runner = StageRunner(tmp_path, resume=False, describe=describe)
    _, wall_a = runner.stage("a", _cfg(1))
    _, wall_b = runner.stage("b", _cfg(1, **{"algo.lr": 0.5}))  # same partition: same test rows
    assert "== a: fedavg, synthetic, 4 clients, 1 rounds" in capsys.readouterr().out
    times = json.loads((tmp_path / StageRunner.WALL_TIMES).read_text())
    assert times == {"a": wall_a, "b": wall_b} and wall_a > 0
    with pytest.raises(RuntimeError, match="c: local test splits differ from a's"):
        runner.stage("c", _cfg(1, **{"data.partition_seed": 7}))
    capsys.readouterr()
    # --resume: a finished stage keeps the time it took (the call that finds it adds nothing)
    again = StageRunner(tmp_path, resume=True, describe=describe)
    assert again.stage("a", _cfg(1))[1] == wall_a
    assert "round 1/1" not in capsys.readouterr().out


def test_stage_runner_names_a_damaged_file_and_its_advice_works(tmp_path, capsys):
    """A damaged wall_times.json, stage summary.json or inherited.json of an example's --out is
    one line naming the file (RunDirectoryError, which the examples print as such), and the
    advice it gives (remove the file) lets --resume go on."""
    from jaxfednas.rundir import RunDirectoryError
    from jaxfednas.stages import inherited_accuracies, StageRunner

    describe = lambda row: f"loss {row['train_loss']:.3f}"  # noqa: E731
    first = StageRunner(tmp_path, resume=False, describe=describe).stage("a", _cfg(1))[0]
    for name, damage in ((StageRunner.WALL_TIMES, "{"), ("a/summary.json", "[" * 100_000), ("a/summary.json", "[]")):
        (tmp_path / name).write_text(damage)
        with pytest.raises(RunDirectoryError, match=f"{tmp_path / name} (is damaged|holds a JSON list).*remove it"):
            StageRunner(tmp_path, resume=True, describe=describe).stage("a", _cfg(1))
        (tmp_path / name).unlink()  # the advice
        s, _ = StageRunner(tmp_path, resume=True, describe=describe).stage("a", _cfg(1))
        assert s["final"] == json.loads(json.dumps(first["final"])) and s["rounds"] == 1
    (tmp_path / "inherited.json").write_text("not json")
    with pytest.raises(RunDirectoryError, match="inherited.json is damaged.*measured again"):
        inherited_accuracies(tmp_path, tmp_path / "a", [1], lambda run: lambda v, a, d: 0.5)
    (tmp_path / "inherited.json").unlink()
    assert inherited_accuracies(tmp_path, tmp_path / "a", [1], lambda run: lambda v, a, d: 0.5) == [0.5]
    capsys.readouterr()


def test_stage_runner_reads_a_finished_stage_from_its_text_files(tmp_path, capsys, monkeypatch):
    """--resume on a finished stage reads its summary.json (no checkpoint needed); a stage whose
    partition or configuration no longer matches goes to run_stage, which says why."""
    from jaxfednas.checkpoint import checkpoint_files
    from jaxfednas.rundir import CHECKPOINT
    from jaxfednas.stages import StageRunner

    describe = lambda row: f"loss {row['train_loss']:.3f}"  # noqa: E731
    first = StageRunner(tmp_path, resume=False, describe=describe).stage("a", _cfg(1))[0]
    for f in checkpoint_files(tmp_path / "a" / CHECKPOINT):
        f.unlink()
    capsys.readouterr()
    again = StageRunner(tmp_path, resume=True, describe=describe)
    s, _ = again.stage("a", _cfg(1))
    assert "[a] finished: its summary.json" in capsys.readouterr().out
    assert s["final"] == json.loads(json.dumps(first["final"])) and s["rounds"] == 1
    # a partition that differs from the recorded one (the partitioner changed) is not finished
    import jaxfednas.experiment as exp
    import jaxfednas.stages as stages

    real = exp.make_partition
    for where in (stages, exp):  # StageRunner's check, then the resumed run's
        monkeypatch.setattr(where, "make_partition", lambda cfg, ds: {**real(cfg, ds), "sha256": "0" * 64})
    with pytest.raises(ValueError, match="partition recomputed now differs"):
        again.stage("a", _cfg(1))
    for where in (stages, exp):
        monkeypatch.setattr(where, "make_partition", real)
    with pytest.raises(ConfigError, match="configuration differs"):
        again.stage("a", _cfg(1, **{"algo.lr": 0.5}))


@pytest.mark.parametrize("under", [False, True])
def test_cli_out_naming_a_file_is_one_line(tmp_path, capsys, under):
    f = tmp_path / "afile"
    f.write_text("not a run")
    out = f / "run" if under else f
    rc = cli.main(["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--rounds", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out {out} ") and "not a directory" in err and "choose another --out" in err
    assert f.read_text() == "not a run"


def test_disk_full_during_a_checkpoint_is_one_line_and_resume_finishes_the_run(tmp_path, capsys, monkeypatch):
    """A write that fails during round 2's save (ENOSPC at fsync, as a full disk gives) stops
    the run with one line naming the checkpoint, the last good round and --resume; the files
    on disk are round 1's, and --resume then ends where an uninterrupted run ends."""
    import errno

    import jaxfednas.checkpoint as ck

    argv = ["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--clients-per-round", "2", "--rounds", "3",
            "--no-progress", "--set", "run.placement=vmap", "--set", "algo.batch_size=32"]
    assert cli.main([*argv, "--out", str(tmp_path / "straight")]) == 0
    real_fsync, full = ck.os.fsync, {"now": False}

    def fsync(fd):
        if full["now"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    import jaxfednas.experiment as exp

    real_train = exp._train

    def train(*args, on_round_end=None, **kw):  # the disk fills up once round 1 is saved
        return real_train(*args, on_round_end=lambda r, row: full.update(now=r >= 1), **kw)

    monkeypatch.setattr(ck.os, "fsync", fsync)
    monkeypatch.setattr(exp, "_train", train)
    d = tmp_path / "full"
    capsys.readouterr()
    assert cli.main([*argv, "--out", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"could not save round 2: writing {d / 'metrics.jsonl'} failed: no space left on the device" in err
    assert f"the last good checkpoint (round 1, {d / 'checkpoint.msgpack'}) is kept" in err and "--resume" in err
    import flax.serialization

    payload = (d / "checkpoint.msgpack").read_bytes().split(b"\n", 1)[1]
    assert flax.serialization.msgpack_restore(payload)["round"] == 1
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 1
    assert not list(d.glob(".checkpoint.msgpack.*")), "the torn temporary file is removed"
    monkeypatch.setattr(exp, "_train", real_train)
    full["now"] = False
    assert cli.main(["run", "fedavg", "--out", str(d), "--resume", "--no-progress"]) == 0
    for name in ("metrics.jsonl", "checkpoint.msgpack", "clients.csv"):
        assert (d / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


def test_parse_seeds_and_the_seed_table():
    from jaxfednas.seeds import mean_std, parse_seeds, seed_table

    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("0-2,7") == [0, 1, 2, 7] and parse_seeds("5") == [5]
    for bad in ("a", "3-1", "0,0", "-1", ""):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)
    assert mean_std([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, ((16 / 9 + 1 / 9 + 25 / 9) / 2) ** 0.5))
    assert mean_std([3.0]) == (3.0, 0.0)
    table = seed_table({0: {"acc": 0.5, "loss": 1.0}, 3: {"acc": 0.75}}, ["acc", "loss"])
    assert "| acc | 0.6250 ± 0.1768 | 0.5000 | 0.7500 |" in table
    assert "| loss | 1.0000 ± 0.0000 | 1.0000 | — |" in table


def test_versus_random_by_hand_with_ties_and_missing_values():
    """The searched-vs-random record: mean and sample std of the random architectures, the
    difference, strict wins and ties counted apart (a tie is not a win); a NaN random value
    (a failed architecture) is left out of the mean but still counted as trained."""
    from jaxfednas.seeds import versus_random

    r = versus_random(0.9, [0.8, 0.9, 0.95, 0.9])
    assert r["random_mean"] == pytest.approx(0.8875)
    assert r["random_std"] == pytest.approx((((0.0875 ** 2) + 2 * 0.0125 ** 2 + 0.0625 ** 2) / 3) ** 0.5)
    assert r["searched_minus_random"] == pytest.approx(0.0125)
    assert (r["beats"], r["ties"], r["random_n"]) == (1, 2, 4)
    nan = versus_random(0.5, [0.25, float("nan"), 0.75])
    assert nan["random_mean"] == pytest.approx(0.5) and (nan["beats"], nan["ties"], nan["random_n"]) == (1, 0, 3)


@pytest.mark.slow
def test_cli_seeds_runs_each_seed_in_its_directory_and_tables_them(tmp_path, capsys):
    argv = ["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--rounds", "1", "--no-progress",
            "--set", "run.placement=vmap", "--set", "algo.batch_size=64", "--out", str(tmp_path)]
    assert cli.main([*argv, "--seeds", "0,1"]) == 0
    finals = {s: json.loads((tmp_path / f"seed_{s}" / "summary.json").read_text())["final"] for s in (0, 1)}
    assert [json.loads((tmp_path / f"seed_{s}" / "config.json").read_text())["run"]["seed"] for s in (0, 1)] == [0, 1]
    assert finals[0]["global_test_acc"] != finals[1]["global_test_acc"]
    a = [finals[s]["global_test_acc"] for s in (0, 1)]
    mean, std = sum(a) / 2, abs(a[0] - a[1]) / 2 ** 0.5
    assert f"| global_test_acc | {mean:.4f} ± {std:.4f} | {a[0]:.4f} | {a[1]:.4f} |" in (tmp_path / "results.md").read_text()
    # --resume with a longer list: finished seeds are found done, seed 2 runs
    capsys.readouterr()
    assert cli.main(["run", "fedavg", "--out", str(tmp_path), "--resume", "--seeds", "0-2", "--no-progress"]) == 0
    assert json.loads((tmp_path / "results.json").read_text()).keys() == {"0", "1", "2"}
    assert cli.main([*argv, "--seeds", "0", "--seed", "1"]) == 2
    assert "give --seed (or run.seed) or --seeds, not both" in capsys.readouterr().err
    assert cli.main([*argv, "--seeds", "0", "--set", "run.seed=1"]) == 2  # run.seed would be ignored
    assert "give --seed (or run.seed) or --seeds, not both" in capsys.readouterr().err


def test_a_former_field_name_is_accepted_with_a_warning_and_never_beside_the_new_one():
    import dataclasses
    import warnings

    from jaxfednas.config import ConfigError, Validated, param, replace_fields

    @dataclasses.dataclass(frozen=True)
    class Cfg(Validated):
        SECTION = "algo"
        RENAMED = {"w_lr": "lr"}
        lr: float = param(0.1, "learning rate", range=(0.0, 1.0))

    with pytest.warns(FutureWarning, match=r"algo\.w_lr is now algo\.lr"):
        assert replace_fields(Cfg(), "algo", {"w_lr": "0.5"}).lr == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a run directory's config.json: read silently
        assert replace_fields(Cfg(), "algo", {"w_lr": 0.25}, warn_renamed=False).lr == 0.25
    with pytest.raises(ConfigError, match="both given"):
        replace_fields(Cfg(), "algo", {"w_lr": 0.5, "lr": 0.5})
    with pytest.raises(ConfigError, match="out of range"):  # the old name is validated as the new one
        replace_fields(Cfg(), "algo", {"w_lr": 2.0}, warn_renamed=False)


def test_constructing_a_config_with_a_former_name_warns_and_maps():
    from jaxfednas.algorithms import DittoConfig, FedNASConfig, SpiderConfig

    with pytest.warns(FutureWarning, match=r"algo\.w_lr is now algo\.lr"):
        assert FedNASConfig(w_lr=0.2).lr == 0.2
    with pytest.warns(FutureWarning, match=r"algo\.lam is now algo\.milenas_lambda"):
        assert make_config("fednas", overrides={"algo.lam": 2.0}).algo.milenas_lambda == 2.0
    with pytest.warns(FutureWarning):  # the proximal λ has one name in SPIDER and Ditto
        assert SpiderConfig(lam=0.5).prox_lambda == DittoConfig(lam=0.5).prox_lambda == 0.5
    with pytest.raises(ConfigError, match="both given"):
        DittoConfig(client_lr=0.1, lr=0.1)
    from jaxfednas.algorithms import DPFNASConfig  # its settings are the server's: server_*

    with pytest.warns(FutureWarning, match=r"algo\.lr is now algo\.server_lr"):
        assert DPFNASConfig(lr=0.2).server_lr == 0.2
    with pytest.warns(FutureWarning, match=r"algo\.w_lr is now algo\.server_lr"):
        assert DPFNASConfig(w_lr=0.3).server_lr == 0.3
    with pytest.warns(FutureWarning, match=r"algo\.arch_optimizer is now algo\.arch_server_optimizer"):
        cfg = make_config("dp_fnas", overrides={"algo.arch_optimizer": "sgd", "algo.arch_lr": 0.5})
    assert (cfg.algo.arch_server_optimizer, cfg.algo.arch_server_lr) == ("sgd", 0.5)


def test_a_run_directory_written_with_former_names_resumes_to_the_same_end(tmp_path):
    """A run whose config.json and checkpoint predate the renames (``algo.client_lr``)
    resumes, and ends exactly where a run under today's names ends."""
    import flax.serialization

    from jaxfednas.resume import _dict_hash

    straight = tmp_path / "straight"
    run_experiment(_cfg(3), straight, progress=False, log=lambda s: None)
    old = tmp_path / "old"
    run_experiment(_cfg(2), old, progress=False, log=lambda s: None)
    stored = json.loads((old / "config.json").read_text())
    stored["algo"] = {("client_lr" if k == "lr" else k): v for k, v in stored["algo"].items()}
    (old / "config.json").write_text(json.dumps(stored, indent=2))
    ckpt = old / "checkpoint.msgpack"
    raw = flax.serialization.msgpack_restore(ckpt.read_bytes().split(b"\n", 1)[1])
    raw["config_sha256"] = _dict_hash(stored)  # as the library wrote it then
    ckpt.write_bytes(flax.serialization.msgpack_serialize(raw))  # a checkpoint from before checksums

    run_experiment(_cfg(3), old, resume=True, progress=False, log=lambda s: None)
    rows = lambda d: [{k: v for k, v in json.loads(line).items() if "time" not in k and "wall" not in k}  # noqa: E731
                      for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert rows(old) == rows(straight)
    assert json.loads((old / "config.json").read_text())["algo"]["lr"] == stored["algo"]["client_lr"]


def test_a_former_class_name_resolves_with_a_warning():
    import jaxfednas.algorithms.perfedrlnas as pf
    import jaxfednas.algorithms.spider as sp

    with pytest.warns(FutureWarning, match=r"spider\.PersonalArchitectures is now .*spider\.PersonalGenotypes"):
        assert sp.PersonalArchitectures is sp.PersonalGenotypes
    with pytest.warns(FutureWarning, match=r"PersonalArchitectures is now .*perfedrlnas\.PersonalSubnets"):
        assert pf.PersonalArchitectures is pf.PersonalSubnets
    with pytest.raises(AttributeError):
        sp.PersonalArchitecture  # noqa: B018 -- not a former name


def test_the_run_directory_records_the_chunk_the_memory_fit_picked(tmp_path):
    """run.memory_budget_gib picks the clients in flight at run time; config.json keeps the
    settings (no chunk) and layout.json the chunk that ran (here every client of the round's
    two: the budget is roomy)."""
    d = tmp_path / "fit"
    logged = []
    run_experiment(_cfg(1, **{"run.placement": "map", "run.memory_budget_gib": 100.0}), d, progress=False,
                   log=logged.append)
    assert json.loads((d / "config.json").read_text())["run"]["client_chunk_size"] is None
    layout = json.loads((d / "layout.json").read_text())
    assert any("using client_chunk_size=" in s for s in logged), logged
    chosen = int(next(s for s in logged if "using client_chunk_size=" in s).rsplit("=", 1)[1])
    assert layout["client_chunk_size"] == chosen and layout["placement"] == "map"
    assert layout["configured"] == {"placement": "map", "client_chunk_size": None, "memory_budget_gib": 100.0}
