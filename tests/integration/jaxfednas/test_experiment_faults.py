"""Bad input and faults: a diverged state never saved, one process per run directory, every
write a one-line error, resume edge cases and the warnings for legal but suspect settings."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import pytest

from jaxfednas import cli
from jaxfednas.checkpoint import CheckpointError
from jaxfednas.experiment import NonFiniteError, run_experiment
from jaxfednas.files import WriteError, write_bytes, write_error, write_text
from jaxfednas.registry import make_config
from jaxfednas.rundir import RunInUseError
from conftest import poison_algorithms

SMALL = {"data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2,
         "run.placement": "vmap", "algo.batch_size": 32}
CLI = ["run", "fedavg", "--dataset", "synthetic", "--clients", "4", "--no-progress",
       "--set", "run.placement=vmap", "--set", "algo.batch_size=32"]


def _cfg(rounds, **extra):
    return make_config("fedavg", overrides={**SMALL, "run.rounds": rounds, **extra})


def _checkpoint_round(d):
    import flax.serialization

    return flax.serialization.msgpack_restore((d / "checkpoint.msgpack").read_bytes().split(b"\n", 1)[1])["round"]


# --- the divergence guard watches the state and the evaluation ----------------------------


def _poison(monkeypatch, from_round, what):
    """Algorithms whose round ``from_round`` on puts NaN into the state's parameters
    (``what="state"``: the training loss stays finite; ``"entry"``: into one entry of one
    leaf only) or the evaluation loss."""
    def round_fn(state, m):
        v = state.variables
        on = state.round >= from_round
        if what == "entry":
            first = jax.tree.leaves(v["params"])[0]
            one = jnp.zeros(first.size, bool).at[first.size // 2].set(True).reshape(first.shape)
            bad = jax.tree.map(lambda x: jnp.where(on & one, jnp.nan, x) if x is first else x, v["params"])
        else:
            bad = jax.tree.map(lambda x: jnp.where(on, jnp.nan, x), v["params"])
        return state.replace(variables={**v, "params": bad}), m

    def evaluate(state, m):
        return {**m, "global_test_loss": jnp.where(state.round >= from_round, jnp.nan, m["global_test_loss"])}

    poison_algorithms(monkeypatch, **({"round_fn": round_fn} if what != "eval" else {"evaluate": evaluate}))


def test_a_nan_state_with_a_finite_loss_is_never_saved(tmp_path, monkeypatch):
    _poison(monkeypatch, 3, "state")
    d = tmp_path / "nan_state"
    # no evaluation in round 3: only the state check can see it, when round 3 is due to be saved
    with pytest.raises(NonFiniteError) as e:
        run_experiment(_cfg(4, **{"run.eval_every": 4}), d, progress=False, log=lambda s: None)
    msg = str(e.value)
    assert "round 3: the state holds NaN/inf in .variables['params']" in msg, msg
    assert f"the last good checkpoint (round 2, {d / 'checkpoint.msgpack'}) is kept" in msg
    assert "algo.lr=" in msg and "\n" not in msg
    assert _checkpoint_round(d) == 2


def test_a_single_nan_entry_in_the_state_is_never_saved(tmp_path, monkeypatch):
    _poison(monkeypatch, 2, "entry")
    d = tmp_path / "nan_entry"
    with pytest.raises(NonFiniteError, match=r"round 2: the state holds NaN/inf in \.variables\['params'\]"):
        run_experiment(_cfg(3, **{"run.eval_every": 3}), d, progress=False, log=lambda s: None)
    assert _checkpoint_round(d) == 1


def test_a_checkpoint_holding_nan_is_refused_on_resume_in_one_line(tmp_path):
    import flax.serialization
    import numpy as np

    from jaxfednas.checkpoint import save_checkpoint

    d = tmp_path / "nan_ckpt"
    run_experiment(_cfg(2), d, progress=False, log=lambda s: None)
    path = d / "checkpoint.msgpack"
    payload = flax.serialization.msgpack_restore(path.read_bytes().split(b"\n", 1)[1])
    state = payload["state"]
    parent = state["variables"]
    key = "params"
    while isinstance(parent[key], dict):  # down to the first parameter array
        parent, key = parent[key], sorted(parent[key])[0]
    bad = np.array(parent[key], copy=True)
    bad.reshape(-1)[0] = np.nan  # one entry, and a valid checksum: a file written by hand
    parent[key] = bad
    save_checkpoint(path, state, round=payload["round"], config_sha256=payload["config_sha256"])
    with pytest.raises(CheckpointError, match=r"--resume: .*checkpoint\.msgpack \(round 2\) holds NaN/inf in "
                                              r"\.variables\['params'\].*start afresh") as e:
        run_experiment(_cfg(3), d, resume=True, progress=False, log=lambda s: None)
    assert "\n" not in str(e.value)
    from jaxfednas.stages import load_run  # the Python API refuses it as --resume does

    with pytest.raises(NonFiniteError, match=r"checkpoint\.msgpack holds non-finite values \(\.variables\['params'\]"):
        load_run(d)


def test_a_nan_evaluation_loss_stops_and_says_when_no_checkpoint_exists(tmp_path, monkeypatch):
    _poison(monkeypatch, 1, "eval")
    d = tmp_path / "nan_eval"
    with pytest.raises(NonFiniteError, match="round 1: global_test_loss=nan; stopped without saving this "
                                             "round: no checkpoint was written yet"):
        run_experiment(_cfg(2, **{"run.server_optimizer": "adam", "run.server_lr": 0.5}), d, progress=False,
                       log=lambda s: None)
    assert not (d / "checkpoint.msgpack").exists()
    assert "run.server_lr=0.5 (run.server_optimizer=adam)" in _last_error(d, monkeypatch)


def _last_error(d, monkeypatch):
    """The one-line message the CLI prints for the poisoned run (resumed into a new directory)."""
    import io
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main([*CLI, "--rounds", "2", "--set", "run.server_optimizer=adam", "--set", "run.server_lr=0.5",
                       "--out", str(d.parent / "cli")])
    assert rc == 3 and err.getvalue().count("\n") == 1, err.getvalue()
    return err.getvalue()


# --- one process per run directory ---------------------------------------------------------


def test_a_second_process_is_refused_while_the_first_holds_the_directory(tmp_path, capsys):
    d = tmp_path / "locked"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from jaxfednas.rundir import _RunLock
        lock = _RunLock(Path({str(d)!r}), print)
        lock.acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunInUseError, match=f"{d} is in use by another run \\(PID {holder.pid} on "):
            run_experiment(_cfg(1), d, progress=False, log=lambda s: None)
        assert not (d / "config.json").exists()  # nothing written by the refused process
        capsys.readouterr()
        assert cli.main([*CLI, "--rounds", "1", "--out", str(d)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"PID {holder.pid}" in err, err
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops a killed holder's lock
        holder.wait()
    run_experiment(_cfg(1), d, progress=False, log=lambda s: None)
    assert _checkpoint_round(d) == 1


# --- every write one line --------------------------------------------------------------------


@pytest.mark.parametrize("err, cause, advice", [
    (errno.EACCES, "permission denied", "fix its permissions"),
    (errno.ENOSPC, "no space left on the device", "free space"),
    (errno.EROFS, "read-only file system", "writable file system"),
    (errno.EISDIR, "is a directory", "path of a file"),
])
def test_write_errors_name_the_path_the_cause_and_the_advice(tmp_path, err, cause, advice):
    e = write_error(tmp_path / "x", OSError(err, os.strerror(err)))
    assert str(e).startswith(f"could not write {tmp_path / 'x'}: {cause}; ") and advice in str(e)
    assert "\n" not in str(e)


def test_the_writer_refuses_a_directory_and_a_file_in_the_way(tmp_path):
    with pytest.raises(WriteError, match="is a directory"):
        write_text(tmp_path, "x")
    (tmp_path / "f").write_text("a file")
    with pytest.raises(WriteError, match="a file is in the way"):
        write_bytes(tmp_path / "f" / "g.txt", b"x")


def test_a_failed_write_is_one_line_in_every_command(tmp_path, capsys, monkeypatch):
    import jaxfednas.files as files

    real_replace = files.os.replace

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(dst))

    capsys.readouterr()
    monkeypatch.setattr(files.os, "replace", denied)
    assert cli.main(["partition", "--out", str(tmp_path / "part")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not write" in err and "permission denied" in err, err
    assert cli.main([*CLI, "--rounds", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "permission denied" in err, err
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert cli.main(["plan", "fedavg", "--no-round", "--json", str(tmp_path)]) == 2  # before any work
    assert "is a directory: give a file path" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["partition", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_a_checkpoint_without_permission_advises_permissions_not_space(tmp_path, capsys, monkeypatch):
    import jaxfednas.checkpoint as ck

    real = ck.write_bytes

    def denied(path, data, **kw):
        if path.name == "checkpoint.msgpack":
            raise write_error(path, PermissionError(errno.EACCES, "Permission denied"))
        return real(path, data, **kw)

    monkeypatch.setattr(ck, "write_bytes", denied)
    capsys.readouterr()
    assert cli.main([*CLI, "--rounds", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "permission denied" in err and "free space" not in err, err
    assert "no checkpoint was written yet" in err


# --- resume ------------------------------------------------------------------------------------


def test_resume_edge_cases_stop_in_one_line_and_write_nothing(tmp_path, capsys):
    d = tmp_path / "run"
    run_experiment(_cfg(3), d, progress=False, log=lambda s: None)
    config = (d / "config.json").read_bytes()
    # fewer rounds than done: refused, config.json untouched
    capsys.readouterr()
    assert cli.main(["run", "fedavg", "--out", str(d), "--resume", "--rounds", "2", "--no-progress"]) == 2
    assert "run.rounds=2 is below the 3 rounds" in capsys.readouterr().err
    assert (d / "config.json").read_bytes() == config
    # every checkpoint gone, metrics left: stop, do not start again from round 0
    for p in d.glob("checkpoint*.msgpack"):
        p.unlink()
    metrics = (d / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="has 3 rounds in metrics.jsonl but no checkpoint"):
        run_experiment(_cfg(4), d, resume=True, progress=False, log=lambda s: None)
    assert (d / "metrics.jsonl").read_bytes() == metrics
    # stopped between the first save's metrics and its checkpoint (the rows of one checkpoint
    # interval, no checkpoint): starts again at round 0 and ends as an uninterrupted run
    (d / "metrics.jsonl").write_text(metrics.decode().splitlines()[0] + "\n")
    logged = []
    run_experiment(_cfg(3), d, resume=True, progress=False, log=logged.append)
    assert any("stopped while saving its first checkpoint" in s and "starting again at round 0" in s
               for s in logged), logged
    assert (d / "metrics.jsonl").read_bytes() == metrics
    for p in d.glob("checkpoint*.msgpack"):
        p.unlink()
    # stopped before its first round (config.json, no metrics, no checkpoint): starts at 0
    (d / "metrics.jsonl").unlink()
    logged = []
    run_experiment(_cfg(1), d, resume=True, progress=False, log=logged.append)
    assert any("no round was completed before it stopped; starting at round 0" in s for s in logged), logged
    assert _checkpoint_round(d) == 1


def test_a_configuration_refused_at_build_time_leaves_nothing_behind(tmp_path, capsys):
    d = tmp_path / "run"
    argv = ["run", "dp_fnas", "--preset", "smoke", "--rounds", "1", "--no-progress", "--out", str(d)]
    assert cli.main([*argv, "--set", "data.split=1,0,0"]) == 2  # DP-FNAS needs a validation split
    assert "needs a validation split" in capsys.readouterr().err
    assert not (d / "config.json").exists() and not (d / "partition").exists()
    # the same --out takes the corrected run
    cfg = make_config("fedavg", overrides={**SMALL, "run.rounds": 1})
    run_experiment(cfg, d, progress=False, log=lambda s: None)


# --- silent acceptances ----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0-99999999"], "at least 100000000 seeds, each a whole run; at most 1000"),
    (["--out", ""], "--out is empty"),
    (["--out", " "], "--out is empty"),
    (["--set", "algo.lrr=0.1"], "unknown setting algo.lrr; did you mean algo.lr\\?"),
    (["--set", "run.sever_lr=0.1"], "did you mean run.server_lr\\?"),
])
def test_refused_in_one_line(tmp_path, capsys, argv, message):
    import re

    capsys.readouterr()
    full = ["run", "fedavg", "--rounds", "1", *(["--out", str(tmp_path / "r")] if "--out" not in argv else []), *argv]
    t0 = time.perf_counter()
    assert cli.main(full) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert time.perf_counter() - t0 < 30  # (refused at once: no hundred million seeds listed)


def test_legal_but_suspect_settings_warn(tmp_path):
    logged = []
    run_experiment(_cfg(1, **{"algo.lr": 0.0, "data.num_clients": 6, "data.split": (0.9, 0.0, 0.1),
                              "run.clients_per_round": 4, "run.dropout_rate": 0.999}),
                   tmp_path / "r", progress=False, log=logged.append)
    warnings = [s for s in logged if s.startswith("warning: ")]
    assert any("algo.lr=0: this learning rate takes no step" in s for s in warnings), logged
    assert any("round 1: no sampled client reported (run.dropout_rate=0.999)" in s for s in warnings), logged
    logged = []
    run_experiment(_cfg(1, **{"data.split": (1.0, 0.0, 0.0)}), tmp_path / "s", progress=False, log=logged.append)
    assert any(s.startswith("note: data.split=1,0,0 keeps no client test examples") for s in logged), logged
    assert not any(s.startswith("warning: ") for s in logged), logged


def test_clients_without_test_examples_are_named(tmp_path):
    import numpy as np
    from jaxfednas.experiment import _warn_about_splits

    logged = []
    splits = {"train": [np.arange(3)] * 3, "val": [np.arange(0)] * 3,
              "test": [np.arange(1), np.arange(0), np.arange(0)]}
    _warn_about_splits(_cfg(1), splits, logged.append)
    assert logged == ["warning: 2 of 3 clients have no test examples and report NaN client test metrics "
                      "(clients 1, 2); check data.split and data.num_clients against the dataset's size"]


def test_sigterm_checkpoints_and_prints_one_line(tmp_path):
    d = tmp_path / "term"
    env = {**os.environ, "JAXFEDNAS_CACHE": "off"}
    p = subprocess.Popen([sys.executable, "-m", "jaxfednas.cli", *CLI, "--rounds", "500", "--out", str(d)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        while not ((d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.time() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated (SIGTERM)", err
    done = len((d / "metrics.jsonl").read_text().splitlines())
    assert f"interrupted: checkpoint of round {done} saved" in out + err
    assert _checkpoint_round(d) == done
    assert json.loads((d / "config.json").read_text())["run"]["rounds"] == 500


def test_an_interrupt_before_the_first_round_claims_no_checkpoint_and_its_advice_works(tmp_path, monkeypatch,
                                                                                       capsys):
    """Interrupted during the first round: no checkpoint exists, the message says so, and its
    advice (--resume) runs the whole run from round 0."""
    def stop(state, m):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        poison_algorithms(m, round_fn=stop)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(_cfg(2), tmp_path / "early", progress=False)
    out = capsys.readouterr()
    assert "no checkpoint was written; --resume starts the run again from round 0" in out.out + out.err
    assert "checkpoint of round" not in out.out + out.err and not (tmp_path / "early" / "checkpoint.msgpack").exists()
    run_experiment(_cfg(2), tmp_path / "early", resume=True, progress=False)
    assert _checkpoint_round(tmp_path / "early") == 2


def test_settings_the_configuration_never_reads_warn_in_one_line_each(tmp_path):
    lines = []
    run_experiment(_cfg(1, **{"run.trim_fraction": 0.2, "run.server_lr": 0.5, "data.data_dir": str(tmp_path)}),
                   tmp_path / "inert", progress=False, log=lines.append)
    warned = [s for s in lines if s.endswith("has no effect in this configuration")]
    assert [w.split()[1] for w in warned] == ["run.trim_fraction=0.2", "run.server_lr=0.5", f"data.data_dir={tmp_path}"]
    lines.clear()  # where they are read: no warning
    run_experiment(_cfg(1, **{"run.aggregator": "trimmed_mean", "run.trim_fraction": 0.2,
                              "run.server_optimizer": "adam", "run.server_lr": 0.5}),
                   tmp_path / "read", progress=False, log=lines.append)
    assert not [s for s in lines if "has no effect" in s]


def test_a_fresh_run_refuses_a_directory_holding_files_no_run_wrote(tmp_path, capsys):
    d = tmp_path / "shared"
    d.mkdir()
    (d / "summary.json").write_text('{"mine": 1}')
    (d / "notes").mkdir()
    assert cli.main([*CLI, "--rounds", "1", "--out", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files that no run wrote (notes/, summary.json)" in err, err
    assert (d / "summary.json").read_text() == '{"mine": 1}' and not (d / "config.json").exists()
    # hidden names (the lock, an interrupted atomic write's temporary file) are a run's own
    e = tmp_path / "interrupted"
    e.mkdir()
    (e / ".config.json.abc123").write_text("{")
    assert cli.main([*CLI, "--rounds", "1", "--out", str(e)]) == 0
    assert (e / "summary.json").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").write_text("{not json"), "config.json is not a run's configuration"),
    (lambda d: (d / "config.json").write_text("[]"), "config.json is not a run's configuration"),
    (lambda d: (d / "config.json").write_text("{}"), "config.json is not a run's configuration"),
    (lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()), "config.json is not a file"),
    (lambda d: ((d / "metrics.jsonl").unlink(), (d / "metrics.jsonl").mkdir()), "metrics.jsonl is not a file"),
    (lambda d: (d / "partition" / "manifest.json").write_text("{"), "is not a partition manifest"),
])
def test_a_damaged_run_directory_is_one_line_on_resume(tmp_path, capsys, damage, message):
    d = tmp_path / "run"
    assert cli.main([*CLI, "--rounds", "1", "--out", str(d)]) == 0
    damage(d)
    capsys.readouterr()
    assert cli.main([*CLI, "--rounds", "2", "--out", str(d), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_a_checkpoint_without_its_state_is_skipped_as_damaged(tmp_path):
    import hashlib

    import flax.serialization

    from jaxfednas.checkpoint import HEADER, read_checkpoint, save_checkpoint

    path = tmp_path / "checkpoint.msgpack"
    save_checkpoint(path, {"w": jnp.ones(3)}, round=1, config_sha256="c")
    raw = flax.serialization.msgpack_restore(path.read_bytes().split(b"\n", 1)[1])
    del raw["state"]  # a valid header and checksum around a payload missing a key
    payload = flax.serialization.msgpack_serialize(raw)
    path.write_bytes(f"{HEADER} bytes={len(payload)} sha256={hashlib.sha256(payload).hexdigest()}\n".encode()
                     + payload)
    with pytest.raises(CheckpointError, match="checkpoint.msgpack: no 'state'"):
        read_checkpoint(path, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_compilation_exits_cleanly(tmp_path, sig, code):
    """The first round's program is compiling when the signal arrives (config.json is written
    just before it): the run ends with 143/130 and its one line, not a segmentation fault (139)."""
    d = tmp_path / "run"
    env = {**os.environ, "JAXFEDNAS_CACHE": "off"}
    p = subprocess.Popen([sys.executable, "-m", "jaxfednas.cli", "run", "fednas", "--preset", "smoke", "--no-progress",
                          "--out", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        while not (d / "config.json").exists():
            assert time.time() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert not (d / "metrics.jsonl").exists(), "the signal came after the first round: compile took < 50 ms?"
    assert p.returncode == code, (p.returncode, err[-2000:])
    assert "Traceback" not in err, err


def test_out_of_memory_is_one_line_with_advice(capsys, monkeypatch):
    from jaxfednas.process import run_script

    def job():  # a real XLA allocation failure: 1 TiB on the host
        jax.jit(lambda: jnp.ones((2 ** 38,), jnp.float32))().block_until_ready()

    assert run_script("examples/x.py", job) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory (RESOURCE_EXHAUSTED" in err and "algo.batch_size" in err, err
    monkeypatch.setattr(cli, "_list", job)  # the command line too
    assert cli.main(["list"]) == 2
    assert "ran out of memory" in capsys.readouterr().err

    def other():
        raise RuntimeError("not memory")

    with pytest.raises(RuntimeError, match="not memory"):  # anything else propagates
        run_script("examples/x.py", other)


def test_a_file_system_fault_is_one_line_naming_the_path(tmp_path, capsys):
    from jaxfednas.process import run_script

    long_out = tmp_path / ("r" * 300)  # longer than a file name may be (255 bytes on Linux)
    assert cli.main(["run", "fedavg", "--preset", "smoke", "--out", str(long_out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "File name too long; use a shorter --out" in err, err
    assert "(" + str(len(str(long_out))) + " characters)" in err, err

    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))

    assert run_script("examples/x.py", full) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'metrics.jsonl'}: No space left on device; use free space on its disk, " \
                  "or another --out\n", err

    def unnamed():
        raise OSError(errno.ENOSPC, "no space")  # no file named: not something a user can act on here

    with pytest.raises(OSError, match="no space"):
        run_script("examples/x.py", unnamed)


def test_no_command_writes_over_files_it_did_not_write(tmp_path, capsys):
    """`partition --out DIR` and a table over seeds refuse, in one line, a directory holding
    files of the names they write that no such command wrote; their own earlier output is
    rewritten (a partition again, a resumed table over seeds)."""
    from jaxfednas import cli
    from jaxfednas.rundir import RunDirectoryError
    from jaxfednas.seeds import over_seeds

    mine = tmp_path / "part"
    mine.mkdir()
    (mine / "label_counts.txt").write_text("my notes\n")
    capsys.readouterr()
    assert cli.main(["partition", "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds label_counts.txt, which no earlier `jaxfednas partition`" in err, err
    assert (mine / "label_counts.txt").read_text() == "my notes\n"
    (mine / "label_counts.txt").unlink()
    assert cli.main(["partition", "--out", str(mine)]) == 0  # then again: its own output, rewritten
    assert cli.main(["partition", "--out", str(mine), "--clients", "4"]) == 0
    capsys.readouterr()

    table = tmp_path / "seeds"
    table.mkdir()
    (table / "results.md").write_text("# my results\n")
    with pytest.raises(RunDirectoryError, match="holds results.md, which no run over seeds wrote"):
        over_seeds([0], lambda seed, d: {"numbers": {"x": 1.0}}, table, title="t")
    assert (table / "results.md").read_text() == "# my results\n"
    (table / "seed_0").mkdir()  # an earlier call's seed directory: its table is rewritten
    over_seeds([0], lambda seed, d: {"numbers": {"x": 1.0}}, table, title="t")
    assert (table / "results.md").read_text().startswith("# t (seeds 0)")


def test_a_users_config_or_checkpoint_in_out_gets_advice_that_works(tmp_path, capsys):
    """--out holding a user's own config.json or checkpoint files: the advice used to be
    'pass --resume', which then failed ('holds no run'). Now one line that says what is there
    and to choose another --out -- and that advice works."""
    from jaxfednas import cli

    for name, text in (("config.json", '{"mine": 1}'), ("checkpoint.msgpack", "x"), ("checkpoint.7.msgpack", "x")):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_text(text)
        capsys.readouterr()
        assert cli.main([*CLI, "--rounds", "1", "--out", str(d)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--resume" not in err and "choose an empty or new --out" in err, err
        assert (d / name).read_text() == text
    assert cli.main([*CLI, "--rounds", "1", "--out", str(tmp_path / "new")]) == 0  # the advice


@pytest.mark.parametrize("over, message", [
    ({"run.server_momentum": 0.5}, "run.server_momentum=0.5 has no effect with run.server_optimizer=none, "
                                   "run.arch_server_optimizer=none (it acts only with run.server_optimizer=avgm)"),
    ({"run.availability_period": 4}, "run.availability_period=4 has no effect with run.sampler=uniform"),
    ({"run.availability_pattern": "markov"}, "run.availability_pattern=markov has no effect with run.sampler=uniform"),
    ({"data.partition": "iid", "data.alpha": 0.1}, "data.alpha=0.1 has no effect with data.partition=iid"),
    ({"run.trim_fraction": 0.2}, "run.trim_fraction=0.2 has no effect with run.aggregator=mean"),
    ({"run.server_lr": 0.5}, "run.server_lr=0.5 has no effect with run.server_optimizer=none"),
    ({"run.placement": "vmap", "run.client_chunk_size": 2}, "run.client_chunk_size=2 has no effect with "
                                                            "run.placement=vmap"),
    ({"run.placement": "vmap", "run.memory_budget_gib": 4.0}, "run.memory_budget_gib=4.0 has no effect with "
                                                              "run.placement=vmap"),
])
def test_a_setting_without_effect_in_the_chosen_configuration_warns(over, message):
    from jaxfednas.config import setting_warnings

    assert any(message in w for w in setting_warnings(_cfg(1, **over))), setting_warnings(_cfg(1, **over))
    assert not setting_warnings(_cfg(1))


def test_a_setting_under_its_mode_does_not_warn():
    from jaxfednas.config import setting_warnings

    for over in ({"run.server_optimizer": "avgm", "run.server_momentum": 0.5},
                 {"run.sampler": "available", "run.availability_period": 4, "run.availability_on": 2},
                 {"data.partition": "dirichlet", "data.alpha": 0.1},
                 {"run.arch_server_optimizer": "adam", "run.server_b1": 0.5},
                 {"run.placement": "auto", "run.client_chunk_size": 2},
                 {"run.placement": "map", "run.memory_budget_gib": 4.0}):
        assert not setting_warnings(_cfg(1, **over)), over


def test_ctrl_c_while_the_command_starts_is_one_line(monkeypatch, capsys):
    """Ctrl-C while modules import or the arguments parse (before the command's own handling):
    'interrupted' and status 130, no traceback."""
    from jaxfednas import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_import_first", interrupted)
    assert cli.main(["list"]) == cli.EXIT_INTERRUPT == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_manifest_of_another_partition_or_nested_deep_is_one_line_on_resume(tmp_path, capsys):
    """--resume where partition/manifest.json is a valid manifest of another partition (another
    seed), or JSON nested 100,000 deep: one line naming the file, no traceback."""
    import shutil

    from jaxfednas import cli

    d = tmp_path / "run"
    assert cli.main([*CLI, "--rounds", "1", "--out", str(d)]) == 0
    assert cli.main(["partition", "--dataset", "synthetic", "--clients", "4", "--seed", "7",
                     "--out", str(tmp_path / "other")]) == 0
    shutil.copy(tmp_path / "other" / "manifest.json", d / "partition" / "manifest.json")
    capsys.readouterr()
    assert cli.main([*CLI, "--rounds", "2", "--out", str(d), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the partition recomputed now differs from" in err and "another --out" in err, err
    (d / "partition" / "manifest.json").write_text("[" * 100_000)
    assert cli.main([*CLI, "--rounds", "2", "--out", str(d), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a partition manifest (RecursionError)" in err, err


def test_a_resume_that_would_re_anneal_a_cosine_rate_is_refused(tmp_path):
    """A cosine rate anneals over run.rounds: resumed with more rounds, the rounds done would have
    followed another schedule. Refused in one line with what to do; a constant rate extends."""
    from jaxfednas.config import ConfigError

    cosine = {"algo.lr_schedule": "cosine"}
    run_experiment(_cfg(1, **cosine), tmp_path / "c", progress=False, log=lambda s: None)
    with pytest.raises(ConfigError, match="run.rounds 1 -> 2: fedavg's learning rate anneals over run.rounds .* keep "
                                          "run.rounds=1, or run 2 rounds afresh in another --out"):
        run_experiment(_cfg(2, **cosine), tmp_path / "c", resume=True, progress=False, log=lambda s: None)
    run_experiment(_cfg(1, **cosine), tmp_path / "c", resume=True, progress=False, log=lambda s: None)  # the advice
    run_experiment(_cfg(1), tmp_path / "k", progress=False, log=lambda s: None)
    assert run_experiment(_cfg(2), tmp_path / "k", resume=True, progress=False, log=lambda s: None)["rounds"] == 2


def test_a_preset_on_resume_that_would_change_the_run_is_refused(tmp_path, capsys):
    """`--preset paper --resume` of a smoke run continued the smoke run without a word; a preset that
    would change the run is one line that says what it would change; the run's own preset passes."""
    from jaxfednas import cli

    out = str(tmp_path / "run")
    assert cli.main([*CLI, "--preset", "smoke", "--rounds", "1", "--out", out]) == 0
    capsys.readouterr()
    assert cli.main([*CLI, "--preset", "paper", "--rounds", "2", "--resume", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--preset paper with --resume" in err and "algo.model='auto' -> " \
        "'resnet18'" in err and "leave --preset out" in err, err
    assert cli.main([*CLI, "--rounds", "2", "--resume", "--out", out]) == 0  # the advice
    assert cli.main([*CLI, "--preset", "smoke", "--rounds", "3", "--resume", "--out", out]) == 0
