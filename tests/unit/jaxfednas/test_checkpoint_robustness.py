"""Checkpoints survive damage: the last two are kept with a sha256 header, a truncated,
empty, bit-flipped or missing newest one is skipped for the older one with a one-line
warning, none usable is a one-line error, and a run SIGKILLed in the middle of a save
resumes to the bytes of an uninterrupted run (issue 15, checkpoint reliability)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas import cli
from jaxfednas.checkpoint import (CheckpointError, checkpoint_files, load_checkpoint, read_checkpoint, save_checkpoint,
                                  shape_template)
from jaxfednas.experiment import run_experiment
from jaxfednas.resume import _dict_hash
from jaxfednas.registry import build_algorithm, make_config

ROOT = Path(__file__).resolve().parents[3]
# fedavg's smoke preset on 4 synthetic clients: the cheapest real run
FLAGS = ["--preset", "smoke", "--dataset", "synthetic", "--clients", "4", "--clients-per-round", "2",
         "--placement", "vmap", "--rounds", "4"]
OVERRIDES = {"data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2,
             "run.placement": "vmap", "run.rounds": 4}
COMPARED = ("config.json", "metrics.jsonl", "checkpoint.msgpack", "checkpoint.3.msgpack", "clients.csv",
            "partition/manifest.json")


def _cfg():
    return make_config("fedavg", preset="smoke", overrides=OVERRIDES)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 4-round run: the bytes every resumed run must end with."""
    d = tmp_path_factory.mktemp("straight") / "run"
    summary = run_experiment(_cfg(), d, progress=False, log=lambda s: None)
    return d, summary


def _assert_same_run(d, straight):
    ref, summary = straight
    for name in COMPARED:
        assert (d / name).read_bytes() == (ref / name).read_bytes(), name
    assert json.loads((d / "summary.json").read_text())["final"] == summary["final"]
    assert sorted(p.name for p in d.iterdir() if "checkpoint" in p.name) == ["checkpoint.3.msgpack",
                                                                            "checkpoint.msgpack"]


# --- the files, on a tiny state ---------------------------------------------------------------

STATE = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(0)}


def _state(r):
    return {"w": STATE["w"] + r, "step": jnp.int32(r)}


def _saved(tmp_path, rounds=(1, 2, 3)):
    path = tmp_path / "checkpoint.msgpack"
    for r in rounds:
        save_checkpoint(path, _state(r), round=r, config_sha256="c")
    return path


def test_keeps_the_last_two_with_a_checksum_header(tmp_path):
    path = _saved(tmp_path)
    assert [p.name for p in checkpoint_files(path)] == ["checkpoint.msgpack", "checkpoint.2.msgpack"]
    header, payload = path.read_bytes().split(b"\n", 1)
    digest = hashlib.sha256(payload).hexdigest()
    assert header == f"jaxfednas-checkpoint-v2 bytes={len(payload)} sha256={digest}".encode()
    assert flax.serialization.msgpack_restore(payload)["round"] == 3
    state, r = load_checkpoint(path, STATE, config_sha256="c")
    assert r == 3 and np.array_equal(state["w"], _state(3)["w"])


def _truncate(p):
    p.write_bytes(p.read_bytes()[:-7])


def _empty(p):
    p.write_bytes(b"")


def _flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))


def _remove(p):
    p.unlink()


DAMAGE = {"truncated": (_truncate, "truncated"), "empty": (_empty, "empty file"),
          "bit-flipped": (_flip, "sha256 mismatch"), "missing": (_remove, "missing")}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_falls_back_to_the_older_with_one_warning(tmp_path, damage):
    path = _saved(tmp_path)
    spoil, why = DAMAGE[damage]
    spoil(path)
    warned = []
    state, r = load_checkpoint(path, STATE, config_sha256="c", warn=warned.append)
    assert r == 2 and np.array_equal(state["w"], _state(2)["w"]) and int(state["step"]) == 2
    assert len(warned) == 1 and "\n" not in warned[0]
    assert f"checkpoint.msgpack: {why}" in warned[0] and "using checkpoint.2.msgpack (round 2)" in warned[0]
    # the next save replaces the bad one and keeps the good older one (not the bad one)
    save_checkpoint(path, _state(3), round=3, config_sha256="c")
    assert [p.name for p in checkpoint_files(path)] == ["checkpoint.msgpack", "checkpoint.2.msgpack"]
    assert load_checkpoint(path, STATE, warn=warned.append)[1] == 3 and len(warned) == 1


def test_none_usable_is_one_clear_error(tmp_path):
    path = _saved(tmp_path)
    _truncate(path)
    _flip(tmp_path / "checkpoint.2.msgpack")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, STATE)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)  # how callers catch it
    assert "checkpoint.msgpack: truncated" in str(e.value) and "checkpoint.2.msgpack: sha256 mismatch" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_checkpoint_from_before_checksums_still_loads(tmp_path):
    path = _saved(tmp_path, rounds=(3,))
    path.write_bytes(path.read_bytes().split(b"\n", 1)[1])  # the old format: the msgpack payload alone
    assert load_checkpoint(path, STATE, config_sha256="c")[1] == 3
    _truncate(path)
    with pytest.raises(CheckpointError, match="unreadable msgpack"):
        load_checkpoint(path, STATE)


# --- runs --------------------------------------------------------------------------------------


def test_resume_past_a_truncated_checkpoint_equals_uninterrupted(tmp_path, straight):
    d = tmp_path / "run"

    def interrupt(r, metrics):
        if r == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(), d, progress=False, on_round_end=interrupt, log=lambda s: None)
    _truncate(d / "checkpoint.msgpack")  # round 3 cut short; metrics.jsonl has 3 rows
    logged = []
    run_experiment(_cfg(), d, resume=True, progress=False, log=logged.append)
    warning = [s for s in logged if s.startswith("warning:")]
    assert len(warning) == 1 and "\n" not in warning[0]
    assert warning[0].startswith(f"warning: {d}: skipped checkpoint.msgpack: truncated (")
    assert warning[0].endswith("payload bytes); using checkpoint.2.msgpack (round 2)")
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 4
    assert f"resumed {d} at round 2" in logged
    _assert_same_run(d, straight)


def test_old_single_checkpoint_directory_resumes(tmp_path, straight):
    d = tmp_path / "old"
    shutil.copytree(straight[0], d)
    (d / "checkpoint.msgpack").write_bytes((d / "checkpoint.3.msgpack").read_bytes().split(b"\n", 1)[1])
    (d / "checkpoint.3.msgpack").unlink()  # as a run of the previous version left it (metrics: 4 rows)
    logged = []
    run_experiment(_cfg(), d, resume=True, progress=False, log=logged.append)
    assert logged[0] == f"resumed {d} at round 3"
    for name in ("metrics.jsonl", "checkpoint.msgpack", "clients.csv"):
        assert (d / name).read_bytes() == (straight[0] / name).read_bytes(), name


def test_a_run_from_before_a_new_config_field_resumes_with_its_default(tmp_path, straight):
    """A run directory written before the library gained a config field (here:
    algo.bn_recalibration_batches absent from config.json, checkpoints hashed without it) resumes, says so in one line,
    and ends with the bytes of an uninterrupted run; a foreign checkpoint is still refused."""
    d = tmp_path / "older"
    shutil.copytree(straight[0], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["algo"]["bn_recalibration_batches"]
    (d / "config.json").write_text(json.dumps(cfg))
    state, _ = read_checkpoint(d / "checkpoint.3.msgpack", shape_template(_straight_state()))
    (d / "checkpoint.3.msgpack").unlink()
    save_checkpoint(d / "checkpoint.msgpack", state, round=3, config_sha256=_dict_hash(cfg), keep=1)
    logged = []
    run_experiment(_cfg(), d, resume=True, progress=False, log=logged.append)
    assert "note: config.json predates the fields algo.bn_recalibration_batches; resuming with their defaults" in logged
    assert f"resumed {d} at round 3" in logged
    for name in ("config.json", "metrics.jsonl", "checkpoint.msgpack", "clients.csv"):
        assert (d / name).read_bytes() == (straight[0] / name).read_bytes(), name
    # a checkpoint of any other configuration is still refused
    (d / "config.json").write_text(json.dumps(cfg))
    save_checkpoint(d / "checkpoint.msgpack", state, round=4, config_sha256="0" * 64, keep=1)
    with pytest.raises(CheckpointError, match="written for another configuration"):
        run_experiment(_cfg(), d, resume=True, progress=False, log=lambda s: None)


def test_a_newest_checkpoint_of_another_configuration_is_passed_over_like_a_damaged_one(tmp_path, straight):
    d = tmp_path / "foreign"
    shutil.copytree(straight[0], d)
    state, _ = read_checkpoint(d / "checkpoint.msgpack", shape_template(_straight_state()))
    data = (d / "checkpoint.msgpack").read_bytes()
    save_checkpoint(d / "checkpoint.msgpack", state, round=4, config_sha256="0" * 64, keep=2)  # (round 3 kept)
    assert (d / "checkpoint.msgpack").read_bytes() != data
    logged = []
    run_experiment(_cfg(), d, resume=True, progress=False, log=logged.append)
    assert any(s.startswith("warning: ") and "checkpoint.msgpack: written for another configuration" in s
               and "using checkpoint.3.msgpack (round 3)" in s for s in logged), logged
    assert f"resumed {d} at round 3" in logged
    _assert_same_run(d, straight)


def _straight_state():
    from jaxfednas.data.datasets import load_dataset  # noqa: PLC0415
    from jaxfednas.data.federated import DataInfo  # noqa: PLC0415

    cfg = _cfg()
    ds = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    return jax.eval_shape(build_algorithm(cfg, DataInfo.of(ds, cfg.data.num_clients)).init,
                          jax.random.PRNGKey(0))


def test_metrics_cut_short_resumes_from_the_checkpoint_they_cover(tmp_path, straight):
    d = tmp_path / "cut"
    shutil.copytree(straight[0], d)
    text = (d / "metrics.jsonl").read_text()
    (d / "metrics.jsonl").write_text(text[:len(text) - 20])  # round 4's line cut short
    logged = []
    run_experiment(_cfg(), d, resume=True, progress=False, log=logged.append)
    assert logged[0] == (f"warning: {d}: skipped checkpoint.msgpack: round 4 is past the 3 rounds of "
                         "metrics.jsonl; using checkpoint.3.msgpack (round 3)")
    _assert_same_run(d, straight)


def test_cli_resume_without_a_usable_checkpoint_is_one_line(tmp_path, straight, capsys):
    d = tmp_path / "bad"
    shutil.copytree(straight[0], d)
    _empty(d / "checkpoint.msgpack")
    _truncate(d / "checkpoint.3.msgpack")
    assert cli.main(["run", "fedavg", "--out", str(d), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --resume: no usable checkpoint in {d} ")
    assert "checkpoint.msgpack: empty file; checkpoint.3.msgpack: truncated" in err


@pytest.mark.parametrize("point", ["torn", "rotated", "partial"])
def test_sigkill_during_a_save_then_resume_equals_uninterrupted(tmp_path, straight, point, capsys):
    """The test hook in save_checkpoint kills the process while it saves round 3: with half
    the file written in place (torn), the previous checkpoint renamed aside (rotated), or
    half the temporary file written (partial)."""
    d = tmp_path / "killed"
    env = {**os.environ, "JAXFEDNAS_TEST_KILL_IN_SAVE": f"3:{point}"}
    p = subprocess.run([sys.executable, "-m", "jaxfednas.cli", "run", "fedavg", *FLAGS, "--no-progress",
                        "--out", str(d)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == -9, p.stderr[-2000:]
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 3  # written before the checkpoint
    assert cli.main(["run", "fedavg", "--out", str(d), "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    expected = {"torn": "checkpoint.msgpack: truncated", "rotated": "checkpoint.msgpack: missing", "partial": None}
    if expected[point] is None:
        assert warning == []
    else:
        assert len(warning) == 1 and expected[point] in warning[0] and "checkpoint.2.msgpack (round 2)" in warning[0]
    assert f"resumed {d} at round 2" in out
    _assert_same_run(d, straight)
    assert not [p.name for p in d.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_and_checkpoints_are_created_with_the_umask_mode(tmp_path, umask):
    """A run's files are readable by whom the umask allows (mkstemp alone gives 0600)."""
    import stat

    from jaxfednas.files import write_text

    old = os.umask(umask)
    try:
        write_text(tmp_path / "summary.json", "{}")
        save_checkpoint(tmp_path / "checkpoint.msgpack", {"w": np.zeros(3)}, round=1, config_sha256="x")
    finally:
        os.umask(old)
    for name in ("summary.json", "checkpoint.msgpack"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
