"""Several processes, one run (issue 12): ``jaxfednas run ... --coordinator/--num-processes/
--process-id`` on loopback, CPU collectives (gloo), a few fake devices per process.

The claims: a run over P processes x D devices writes the bytes (metrics.jsonl and the
checkpoint) of one process with P*D devices; a checkpoint written by several processes
resumes in one; a process that dies makes the others stop within the heartbeat timeout.
Every process is a CLI subprocess (the test process itself has 8 fake devices and no
coordinator)."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import EVERY_PARTY, TINY
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.experiment import fit_memory_budget, round_memory_gib
from jaxfednas.registry import ALGORITHMS, algorithm_module, make_config
from jaxfednas.rng import init_key, round_key
from jaxfednas.runtime import CLIENT_AXIS, client_mesh

FEDAVG = ["fedavg", "--clients", "8", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"]
FEDNAS = ["fednas", "--clients", "4", "--set", "algo.C=4", "--set", "algo.layers=1", "--set", "algo.steps=1",
          "--set", "algo.primitives=tiny", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAXFEDNAS_CACHE="off",
               **extra)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _start(args: list[str], out: Path, *, processes: int, devices: int, rounds: int, resume=False, env=None):
    """``processes`` CLI processes of one run (``devices`` fake CPU devices each)."""
    cmd = [sys.executable, "-m", "jaxfednas.cli", "run", *args, "--rounds", str(rounds), "--out", str(out),
           "--no-progress"] + (["--resume"] if resume else [])
    if processes == 1:
        return [subprocess.Popen(cmd, env=_env(devices, **(env or {})), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]
    coord = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen(cmd + ["--coordinator", coord, "--num-processes", str(processes), "--process-id", str(i)],
                             env=_env(devices, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            for i in range(processes)]


def _run(args, out, **kw) -> list[str]:
    procs = _start(args, out, **kw)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-3000:]}"
    return logs


def _same_run(a: Path, b: Path) -> None:
    assert (a / "metrics.jsonl").read_bytes() == (b / "metrics.jsonl").read_bytes()
    assert (a / "checkpoint.msgpack").read_bytes() == (b / "checkpoint.msgpack").read_bytes()


def test_fedavg_two_processes_equal_one_and_resume_in_one(tmp_path):
    # 1 process x 4 devices, 3 rounds: the reference
    _run(FEDAVG, tmp_path / "one", processes=1, devices=4, rounds=3)
    # 2 processes x 2 devices, 2 rounds; then the same directory resumed by 1 process x 4 devices
    logs = _run(FEDAVG, tmp_path / "two", processes=2, devices=2, rounds=2)
    assert "run directory:" in logs[0] and "run directory:" not in logs[1]  # process 0 reports, alone
    assert not list(tmp_path.glob("two/**/.*"))  # no temporary file left by a second writer
    _run(FEDAVG, tmp_path / "two", processes=1, devices=4, rounds=3, resume=True)
    _same_run(tmp_path / "one", tmp_path / "two")


def test_fednas_two_processes_equal_one_device_count(tmp_path):
    # the tiny DARTS space: 2 processes x 1 device == 1 process x 2 devices, bitwise
    # (same global device count: the same per-device program; across device counts the
    # per-client search may differ by float reassociation, ~1e-10 on α)
    _run(FEDNAS, tmp_path / "one", processes=1, devices=2, rounds=2)
    _run(FEDNAS, tmp_path / "two", processes=2, devices=1, rounds=2)
    _same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_four_processes_fedavg_and_fednas(tmp_path):
    # opt-in (about 2 min on 2 cores): 4 processes x 1 device vs 1 process x 4 devices,
    # each run started in 1 process (1 round) and resumed in 4
    for name, args, rounds in (("fedavg", FEDAVG, 3), ("fednas", FEDNAS, 2)):
        _run(args, tmp_path / f"{name}-one", processes=1, devices=4, rounds=rounds)
        _run(args, tmp_path / f"{name}-four", processes=1, devices=4, rounds=1)
        _run(args, tmp_path / f"{name}-four", processes=4, devices=1, rounds=rounds, resume=True)
        _same_run(tmp_path / f"{name}-one", tmp_path / f"{name}-four")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_two_processes(tmp_path, name):
    # opt-in (about 6 min on 2 cores): every registered algorithm, tiny settings (those of
    # test_contract.py), 2 processes x 1 device vs 1 process x 2 devices, bitwise
    args = [name, "--dataset", "synthetic", "--clients", "4"]
    args += ["--clients-per-round", "2"] * (name not in EVERY_PARTY)
    args += [a for k, v in TINY.get(name, {}).items() for a in ("--set", f"{k}={v}")]
    _run(args, tmp_path / "one", processes=1, devices=2, rounds=2)
    _run(args, tmp_path / "two", processes=2, devices=1, rounds=2)
    _same_run(tmp_path / "one", tmp_path / "two")


def test_a_dead_process_stops_the_others(tmp_path):
    out = tmp_path / "run"
    procs = _start(FEDAVG, out, processes=2, devices=1, rounds=500, env={"JAXFEDNAS_HEARTBEAT_S": "5"})
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists():  # the run is under way (round 1 saved)
        assert time.monotonic() < deadline and procs[0].poll() is None, "the run did not start"
        time.sleep(0.5)
    procs[1].kill()
    t0 = time.monotonic()
    log = procs[0].communicate(timeout=90)[0]
    waited = time.monotonic() - t0
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert "stopped sending heartbeats" in log or "another task died" in log, log[-2000:]
    assert waited < 60, f"process 0 took {waited:.0f} s to stop"
    assert (out / "checkpoint.msgpack").exists()  # the last saved round stays resumable


def test_sharded_federated_data_equals_whole():
    # each device holds only its clients' rows, and the values are those of the whole arrays
    ds = load_dataset("digits")
    splits = part.split_client_indices(part.partition(ds.y_train, "dirichlet", 8, seed=0, alpha=0.5), (0.7, 0.1, 0.2),
                                       seed=0)
    whole = make_federated_data(ds, splits)
    sharded = make_federated_data(ds, splits, sharding=NamedSharding(client_mesh(), P(CLIENT_AXIS)))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = sharded.train.x
    assert x.sharding.spec == P(CLIENT_AXIS)
    assert {s.data.shape[0] for s in x.addressable_shards} == {8 // jax.device_count()}


def test_memory_budget_picks_clients_in_flight(tiny_data):
    # placement map on one device: 4 clients, candidates 1, 2, 4 in flight
    cfg = make_config("fedavg", overrides={"data.dataset": "synthetic", "data.num_clients": 4, "run.placement": "map",
                                           **TINY["fedavg"]})
    gib = {}
    for c in (1, 4):
        trial = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, client_chunk_size=c))
        a = algorithm_module("fedavg").build(trial, tiny_data.info)
        gib[c] = round_memory_gib(a, a.init(init_key(0)), tiny_data, round_key(0, 0))
    assert gib[4] > gib[1] > 0  # more clients in flight, more memory
    logs = []
    roomy = fit_memory_budget(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, memory_budget_gib=100.0)),
                              tiny_data, logs.append)
    assert roomy.run.client_chunk_size == 4 and "using client_chunk_size=4" in logs[-1]
    between = (gib[1] + gib[4]) / 2
    mid = fit_memory_budget(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, memory_budget_gib=between)),
                            tiny_data, logs.append)
    assert mid.run.client_chunk_size in (1, 2)
    tight = fit_memory_budget(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, memory_budget_gib=gib[1] / 2)),
                              tiny_data, logs.append)
    assert tight.run.client_chunk_size == 1 and logs[-2].startswith("warning:")
    assert fit_memory_budget(cfg, tiny_data, logs.append) is cfg  # no budget: unchanged
