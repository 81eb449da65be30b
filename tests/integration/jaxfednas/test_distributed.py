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
from jaxfednas import cli
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.distributed import DistributedError, initialize
from jaxfednas.memory_fit import fit_memory_budget, round_memory_gib
from jaxfednas.registry import build_algorithm, ALGORITHMS, make_config
from jaxfednas.rng import init_key, round_key
from jaxfednas.config import apply_overrides
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import CLIENT_AXIS, client_mesh, Placement

FEDAVG = ["fedavg", "--clients", "8", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"]
FEDNAS = ["fednas", "--clients", "4", "--set", "algo.C=4", "--set", "algo.layers=1", "--set", "algo.nodes=1",
          "--set", "algo.primitives=tiny", "--set", "algo.local_epochs=1", "--set", "algo.batch_size=32"]


TINY_ARGS = {name: [a for k, v in TINY.get(name, {}).items() for a in ("--set", f"{k}={v}")] for name in ALGORITHMS}


def _free_port(slurm: bool = False) -> int:
    """A free local port (for a SLURM job, one JAX can derive from a job id: 61440-65535)."""
    candidates = np.random.default_rng().permutation(np.arange(61440, 65536)) if slurm else [0]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port)))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


# XLA:CPU sizes a process's thread pool at max(cores, devices) and its matrix kernels block
# their sums by that size: the layouts compared here (1 x 4 against 2 x 2 or 4 x 1 devices)
# compute the same bits only with one pool size for every process, at least every layout's
# devices per process.
POOL_THREADS = 4


def _env(devices: int, **extra) -> dict:
    assert devices <= POOL_THREADS, f"{devices} devices in a process: raise POOL_THREADS to at least that"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS",
                                                                      "SLURM_", "OMPI_"))}
    # A loaded 2-core machine can keep one device thread of a collective waiting past XLA:CPU's
    # default rendezvous limit (40 s); the processes' own heartbeats still catch a dead peer.
    flags = (f"--xla_force_host_platform_device_count={devices} --xla_cpu_collective_call_terminate_timeout_seconds=600 "
             "--xla_cpu_collective_timeout_seconds=600")
    return dict(env, XLA_FLAGS=flags, JAXFEDNAS_CACHE="off", NPROC=str(POOL_THREADS), **extra)


def _start(args: list[str], out: Path, *, processes: int, devices: int, rounds: int, resume=False, env=None,
           form="flags"):
    """``processes`` CLI processes of one run (``devices`` fake CPU devices each), told of
    each other by the CLI's flags, by ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/
    ``JAX_PROCESS_ID`` (``form="env"``), or by the variables of a SLURM job step that JAX
    detects by itself (``form="slurm"``, the coordinator on localhost)."""
    cmd = [sys.executable, "-m", "jaxfednas.cli", "run", *args, "--rounds", str(rounds), "--out", str(out),
           "--no-progress"] + (["--resume"] if resume else [])
    if processes == 1:
        return [subprocess.Popen(cmd, env=_env(devices, **(env or {})), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]
    port = _free_port(slurm=form == "slurm")
    procs = []
    for i in range(processes):
        extra, flags = dict(env or {}), []
        if form == "flags":
            flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)]
        elif form == "env":
            extra.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                         JAX_PROCESS_ID=str(i))
        else:  # JAX derives the port from the job id: 65535 - 4095 + id % 4096
            extra.update(SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST="localhost",
                         SLURM_NTASKS=str(processes), SLURM_STEP_NUM_TASKS=str(processes), SLURM_PROCID=str(i),
                         SLURM_LOCALID=str(i))
        procs.append(subprocess.Popen(cmd + flags, env=_env(devices, **extra), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


TIMEOUT_S = 300  # one CLI run of these tests: ~20-60 s on a loaded 2-core machine


def _run(args, out, **kw) -> list[str]:
    """Run the CLI processes to the end; their logs. A run past ``TIMEOUT_S`` fails the
    test with the end of its log: a stall is a bug (SPIDER's search once stalled here in
    XLA:CPU's collective rendezvous, from a collective inside a ``lax.cond``; see
    ``map_clients``' ``active`` and test_contract.py's check that no round does that)."""
    procs = _start(args, out, **kw)
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] or "" for p in procs]
        raise AssertionError(f"timed out after {TIMEOUT_S} s:\n{logs[0][-3000:]}") from None
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-3000:]}"
    return logs


def _same_run(a: Path, b: Path) -> None:
    assert (a / "metrics.jsonl").read_bytes() == (b / "metrics.jsonl").read_bytes()
    assert (a / "checkpoint.msgpack").read_bytes() == (b / "checkpoint.msgpack").read_bytes()


@pytest.mark.slow
def test_fedavg_two_processes_equal_one_and_resume_in_one(tmp_path):
    # 1 process x 4 devices, 3 rounds: the reference
    _run(FEDAVG, tmp_path / "one", processes=1, devices=4, rounds=3)
    # 2 processes x 2 devices, 2 rounds; then the same directory resumed by 1 process x 4 devices
    logs = _run(FEDAVG, tmp_path / "two", processes=2, devices=2, rounds=2)
    assert "run directory:" in logs[0] and "run directory:" not in logs[1]  # process 0 reports, alone
    # no temporary file left by a second writer; the run's lock, taken by process 0 alone
    assert [p.relative_to(tmp_path) for p in tmp_path.glob("two/**/.*")] == [Path("two/.lock")]
    _run(FEDAVG, tmp_path / "two", processes=1, devices=4, rounds=3, resume=True)
    _same_run(tmp_path / "one", tmp_path / "two")


# opt-in (-m slow, ~36 s): the default tier keeps FedAvg's two-process check, and the slow
# test_every_algorithm_two_processes runs FedNAS across processes too
@pytest.mark.slow
def test_fednas_two_processes_equal_one_device_count(tmp_path):
    # the tiny DARTS space: 2 processes x 1 device == 1 process x 2 devices, bitwise
    # (same global device count: the same per-device program; across device counts the
    # per-client search may differ by float reassociation, ~1e-10 on α)
    _run(FEDNAS, tmp_path / "one", processes=1, devices=2, rounds=2)
    _run(FEDNAS, tmp_path / "two", processes=2, devices=1, rounds=2, form="env")
    _same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_rows_split_over_processes(tmp_path):
    # local-only keeps a model per client, split across the two processes; 2 of 4 clients
    # per round, so each round gathers rows from the other process and scatters them back
    # (and the final report gathers them all: every process must take part)
    args = ["local_only", "--dataset", "synthetic", "--clients", "4", "--clients-per-round", "2",
            *TINY_ARGS["local_only"]]
    _run(args, tmp_path / "one", processes=1, devices=2, rounds=2)
    _run(args, tmp_path / "two", processes=2, devices=1, rounds=2)
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
    args += TINY_ARGS[name]
    _run(args, tmp_path / "one", processes=1, devices=2, rounds=2)
    _run(args, tmp_path / "two", processes=2, devices=1, rounds=2)
    _same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_a_dead_process_stops_the_others(tmp_path):
    # (the two processes find each other as the tasks of a SLURM job step)
    out = tmp_path / "run"
    procs = _start(FEDAVG, out, processes=2, devices=1, rounds=500, env={"JAXFEDNAS_HEARTBEAT_S": "5"},
                   form="slurm")
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


@pytest.mark.slow
def test_memory_budget_picks_clients_in_flight(tiny_data):
    # placement map on one device: 4 clients, candidates 1, 2, 4 in flight
    cfg = make_config("fedavg", overrides={"data.dataset": "synthetic", "data.num_clients": 4, "run.placement": "map",
                                           **TINY["fedavg"]})
    gib = {}
    for c in (1, 4):
        trial = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, client_chunk_size=c))
        a = build_algorithm(trial, tiny_data.info)
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


def test_auto_placement_fills_an_accelerator_by_itself(monkeypatch, tiny_data):
    """placement=auto on an accelerator (faked here: 10 GiB, so 9 GiB usable) keeps every
    client at once when that round fits and otherwise takes the largest chunk that fits; a
    chunk size, a budget or another placement given by the user turns it off, as does the CPU."""
    from jaxfednas import memory_fit as mf

    cfg = make_config("fedavg", overrides={"data.dataset": "synthetic", "data.num_clients": 4, **TINY["fedavg"]})
    assert mf.auto_memory_budget_gib(cfg) is None  # the CPU: clients one after another, nothing to fit
    monkeypatch.setattr(mf, "on_accelerator", lambda: True)
    monkeypatch.setattr(mf, "device_memory_limit", lambda: 10 * 2**30)
    monkeypatch.setattr(Placement, "clients_per_device", lambda self, n: n)  # one device holds every client
    assert mf.auto_memory_budget_gib(cfg) == pytest.approx(9.0)
    for given in ({"run.client_chunk_size": 2}, {"run.memory_budget_gib": 5.0}, {"run.placement": "map"}):
        assert mf.auto_memory_budget_gib(apply_overrides(cfg, given)) is None
    # GiB of the round by clients in flight (None: as configured, every client at once)
    for need, want in (({None: 8.0}, None), ({None: 20.0, 1: 2.0, 2: 4.0, 4: 20.0}, 2),
                       ({None: 20.0, 1: 12.0, 2: 14.0, 4: 20.0}, 1)):
        logs = []
        monkeypatch.setattr(mf, "_round_gib", lambda c, d, need=need: need[c.run.client_chunk_size])
        assert mf.fit_memory_budget(cfg, tiny_data, logs.append).run.client_chunk_size == want
        assert logs[-1].startswith("placement=auto (9 GiB: 90% of the device)")
        assert (want == 1) == any(line.startswith("warning:") for line in logs)


def test_initialize_arguments(monkeypatch):
    # nothing given, no launcher: one process, nothing initialised
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NODELIST",
              "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")  # a salloc shell without a job step
    assert initialize() is False
    with pytest.raises(DistributedError, match="missing process_id"):
        initialize("127.0.0.1:1234", 2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(DistributedError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        initialize("127.0.0.1:1234", process_id=0)
    with pytest.raises(DistributedError, match="HOST:PORT"):
        initialize("localhost", 2, 0)
    with pytest.raises(DistributedError, match="process_id < num_processes"):
        initialize("127.0.0.1:1234", 2, 2)


def test_cli_reports_bad_multiprocess_flags(capsys):
    assert cli.main(["run", "fedavg", "--coordinator", "127.0.0.1:1234", "--num-processes", "2"]) == 2
    assert "missing process_id" in capsys.readouterr().err


@pytest.mark.slow
def test_per_client_rows_split_along_the_mesh(count_traces):
    # Ditto's personal models (8 clients, 8 devices): each device keeps its own client's
    # row between rounds; round 2 compiles nothing; the values are those of one device
    from jaxfednas.algorithms.ditto import ditto, DittoConfig
    from jaxfednas.runtime import Placement

    ds = load_dataset("synthetic", num_train=256, num_test=32)
    splits = part.split_client_indices(part.partition(ds.y_train, "iid", 8, seed=0), (0.75, 0.0, 0.25), seed=0)
    data = make_federated_data(ds, splits, sharding=NamedSharding(client_mesh(), P(CLIENT_AXIS)))
    whole = make_federated_data(ds, splits)
    cfg = DittoConfig(local_epochs=1, batch_size=32)
    split = ditto(cfg, data.info, run=RunOptions(placement=Placement("shard_map")))
    one = ditto(cfg, data.info, run=RunOptions(placement=Placement("map")))
    s, ref = split.init(init_key(0)), one.init(init_key(0))
    for r in range(2):
        with count_traces() as traced:
            s, _ = split.round(s, data, round_key(0, r))
        assert r == 0 or traced == []
        ref, _ = one.round(ref, whole, round_key(0, r))
    for leaf in jax.tree.leaves(s.personal):
        assert leaf.sharding.spec == P(CLIENT_AXIS) and {sh.data.shape[0] for sh in leaf.addressable_shards} == {1}
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(s.variables))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(s)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
