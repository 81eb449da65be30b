"""Test set-up: 8 fake CPU devices (for shard_map), JAX's persistent compilation cache,
and XLA's optimisations mostly off.

Compiling, not running, dominates the suite on CPU (a DARTS supernet's gradient takes
7-15 s to compile on 2 cores): with ``JAX_DISABLE_MOST_OPTIMIZATIONS`` the suite's
programs compile ~20 % faster (tests/integration/algorithms/test_spider.py + test_dfnas.py cold: 216 s -> 174 s)
and run slower, which tiny test settings do not notice. Examples and benchmarks run
fully optimised. Set ``JAXFEDNAS_TEST_OPTIMIZE=1`` to test the optimised programs.

Run networks through ``jax.jit`` in tests, not eagerly: an eager Flax ``init`` or ``apply``
compiles one small program per op and shape (a DARTS supernet's init: ~190 programs, ~10 s on
2 cores, against ~4 s for one compiled init). Before the heaviest eager tests were changed,
~3,500 such programs took 140 s of XLA compile across the suite.

XLA_FLAGS and JAX_* must be set before jax is imported (and reach the CLI subprocesses
of tests), hence here at the top.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
if os.environ.get("JAXFEDNAS_TEST_OPTIMIZE") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import contextlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from pathlib import Path  # noqa: E402

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
_CACHE = os.environ.get("JAXFEDNAS_TEST_CACHE", _CACHE)
os.environ["JAXFEDNAS_CACHE"] = _CACHE  # the CLI and examples, called from tests, use the same cache
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@contextlib.contextmanager
def _count_traces():
    """Inside the block, the names of the functions JAX traced to compile them (JAX's
    public ``jax.monitoring`` events; a cached program is not traced again)."""
    seen = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            seen.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def count_traces():
    """``with count_traces() as traced: ...`` then ``traced == []`` means nothing compiled."""
    return _count_traces


@pytest.fixture(scope="session")
def tiny_data():
    """4 clients of a synthetic 8x8x1, 10-class dataset (Dirichlet 0.5, 0.75/0/0.25 splits):
    FedAvg's :func:`tiny_federation`."""
    return tiny_federation("fedavg")[1]


def assert_accuracy(acc, n: int) -> None:
    """``acc`` is the accuracy of ``n`` examples: ``k / n`` for an integer ``0 <= k <= n``."""
    k = float(acc) * n
    assert 0.0 <= float(acc) <= 1.0 and abs(k - round(k)) < max(1e-3, 1e-6 * n), (acc, n)


def assert_client_summary(out: dict, counts, tag: str = "") -> None:
    """The unweighted and test-size-weighted means in ``out`` are those of its per-client
    accuracies ``client_test_acc<tag>`` (clients without test data excluded)."""
    acc = np.asarray(out[f"client_test_acc{tag}"], np.float64)
    counts = np.asarray(counts, np.float64)
    valid = counts > 0
    for k, c in zip(acc[valid], counts[valid]):
        assert_accuracy(k, int(c))
    np.testing.assert_allclose(float(out[f"client_test_acc{tag}_mean_unweighted"]), acc[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(out[f"client_test_acc{tag}_mean_weighted"]),
                               (acc[valid] * counts[valid]).sum() / counts[valid].sum(), rtol=1e-5)


def assert_summary_consistent(run_dir) -> None:
    """A finished run directory's summary agrees with its own files: the final global
    accuracy is an accuracy of the test set's size and the last metrics row's value; the
    per-client mean is that of ``clients.csv``'s accuracies (clients with test data)."""
    import csv
    import json
    from pathlib import Path

    from jaxfednas.data.datasets import load_dataset

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    final = summary["final"]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    n_test = load_dataset(config["data"]["dataset"], config["data"].get("data_dir")).y_test.shape[0]
    assert_accuracy(final["global_test_acc"], n_test)
    assert final["global_test_acc"] == last["global_test_acc"]
    with open(run_dir / "clients.csv") as f:
        rows = [r for r in csv.DictReader(f) if int(r["n_test"]) > 0]
    for r in rows:
        assert_accuracy(float(r["test_acc"]), int(r["n_test"]))
    np.testing.assert_allclose(final["client_test_acc_mean_unweighted"],
                               np.mean([float(r["test_acc"]) for r in rows]), rtol=1e-5)


# The smallest settings of each algorithm that still run its real code path; an
# algorithm not listed here runs with its defaults (on the tiny federation below).
TINY = {
    "fedavg": {"algo.local_epochs": 1, "algo.batch_size": 32},
    "local_only": {"algo.local_epochs": 1, "algo.batch_size": 32},
    "local_adaptation": {"algo.local_epochs": 1, "algo.batch_size": 32},
    "ditto": {"algo.local_epochs": 1, "algo.batch_size": 32},
    "perfedavg": {"algo.local_epochs": 1, "algo.batch_size": 32},
    "fednas": {"algo.C": 4, "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny"},
    "fednas_train": {"algo.C": 4, "algo.layers": 2, "algo.genotype": "FEDNAS_V1"},
    "dp_fnas": {"algo.C": 4, "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny",
                "algo.iterations_per_round": 1},
    # batch 64 > any client's 54 training rows: one step per epoch; a large α step, so that
    # test_dfnas.py's averaging checks see α move (its rounds are these: one compilation)
    "dfnas": {"algo.space": "tiny", "algo.local_epochs": 1, "algo.batch_size": 64, "algo.arch_lr": 0.05},
    # the search runs in the first round (t_s = 0) and the next
    "spider": {"algo.C": 4, "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny",
               "algo.warmup_rounds": 0, "algo.recovery_rounds": 1},
    "perfedrlnas": {"algo.C": 4, "algo.layers": 1, "algo.nodes": 1, "algo.primitives": "tiny",
                    "algo.local_epochs": 1},
}
EVERY_PARTY = {"dp_fnas"}  # Algorithm 1 of DP-FNAS has every party in every iteration


def poison_algorithms(monkeypatch, round_fn=None, evaluate=None) -> None:
    """Make the runner build algorithms whose ``round`` / ``evaluate`` results pass through
    ``round_fn(state, metrics) -> (state, metrics)`` / ``evaluate(state, metrics) -> metrics``
    (e.g. NaN from some round on), to test how a run reacts."""
    import jaxfednas.experiment as exp

    real = exp.build_algorithm

    def build(cfg, info):
        algo = real(cfg, info)
        changes = {}
        if round_fn is not None:
            changes["round"] = lambda state, data, key: round_fn(*algo.round(state, data, key))
        if evaluate is not None:
            changes["evaluate"] = lambda state, data: evaluate(state, dict(algo.evaluate(state, data)))
        return algo._replace(**changes)

    monkeypatch.setattr(exp, "build_algorithm", build)


def load_example(name: str):
    """``examples/<name>.py`` imported as a fresh module (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", Path(__file__).resolve().parents[1]
                                                  / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_federation(name: str, **overrides):
    """``(config, data)`` of test_contract.py's run of algorithm ``name``: 4 synthetic 8x8x1
    clients (256 training, 64 test examples), 2 per round (every party for
    :data:`EVERY_PARTY`), 2 rounds, the :data:`TINY` settings, then ``overrides``
    (``"section.field": value``). An algorithm's own tests that build their round from it
    without overrides run the program test_contract.py compiled: the persistent cache
    serves it to whichever test process comes second."""
    from jaxfednas.data import make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import make_config

    over = {"data.dataset": "synthetic", "data.num_clients": 4, "run.rounds": 2, **TINY.get(name, {})}
    if name not in EVERY_PARTY:
        over["run.clients_per_round"] = 2
    cfg = make_config(name, overrides={**over, **overrides})
    ds = load_dataset("synthetic", num_train=256, num_test=64)
    return cfg, make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))


@pytest.fixture(scope="session", autouse=True)
def _installed_names_only():
    """The repository's ``algorithms/`` and ``search_spaces/`` install as ``jaxfednas.algorithms``
    and ``jaxfednas.search_spaces``. From a source checkout a stray ``import algorithms`` would
    still work (the current directory is on sys.path) and load a second copy of the module;
    fail the session instead."""
    yield
    stray = sorted(m for m in list(__import__("sys").modules) if m.split(".")[0] in ("algorithms", "search_spaces"))
    assert not stray, f"imported outside the jaxfednas namespace: {stray}"


# The layout: a module's tests are found from its path. ``tests/unit/<path>/test_<module>*.py``
# holds the fast tier (``python -m pytest -m fast`` or ``python -m pytest tests/unit``, about a
# minute on 2 cores): unit tests of the engine on tiny inputs -- data, partitions, random
# streams, runtime, checkpoints, privacy accounting, optimizers, sampling, packaging, the
# README. ``tests/integration/<path>/`` holds the rest: compiled rounds and whole runs of the
# algorithms, the search spaces' networks, the examples. A test joins the fast tier by the
# folder it is in, never by a list of names.
UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if UNIT in item.path.parents and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
