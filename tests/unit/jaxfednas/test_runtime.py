"""Runtime: sampling, placements, aggregation, per-client rows, FedAvg rounds."""
import contextlib
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.algorithms.common import make_local_train
from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg
from jaxfednas.algorithms.local_only import LocalOnlyConfig, local_only
from jaxfednas import rng
from jaxfednas import runtime
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import (
    Placement,
    CPU_COMPILER_OPTIONS,
    CPU_OPT_LEVEL,
    client_keys,
    compiler_options,
    KEEP_CALLS_OPTIONS,
    gather_rows,
    jit,
    map_clients,
    masked_weighted_mean,
    nothing_to_aggregate,
    reporting_clients,
    resolve_clients_per_round,
    sample_clients,
    scatter_rows,
    step_if,
    weighted_mean,
)


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_weighted_mean_by_hand():
    tree = {"w": jnp.array([[1.0, 2.0], [5.0, 6.0]]), "bn": {"mean": jnp.array([[0.0], [4.0]])}}
    out = weighted_mean(tree, jnp.array([1, 3]))
    np.testing.assert_allclose(out["w"], [(1 + 15) / 4, (2 + 18) / 4])
    np.testing.assert_allclose(out["bn"]["mean"], [3.0])


def test_weighted_mean_with_no_weight_keeps_the_fallback():
    tree = {"w": jnp.array([[1.0, 2.0], [5.0, 6.0]])}
    prev = {"w": jnp.array([7.0, 8.0])}
    np.testing.assert_array_equal(weighted_mean(tree, jnp.array([0, 0]), fallback=prev)["w"], [7.0, 8.0])
    np.testing.assert_array_equal(weighted_mean(tree, jnp.array([1, 3]), fallback=prev)["w"],
                                  weighted_mean(tree, jnp.array([1, 3]))["w"])
    assert float(nothing_to_aggregate(jnp.array([0, 0]))) == 1.0
    assert float(nothing_to_aggregate(jnp.array([0, 2]))) == 0.0


def test_fedavg_round_without_training_examples_keeps_the_server_state(tiny_data):
    """Every sampled client has an empty train split (label skew on tiny clients): the
    average is undefined, so the server keeps w and BatchNorm statistics and says so."""
    empty = tiny_data.replace(train=tiny_data.train.replace(counts=jnp.zeros_like(tiny_data.train.counts)))
    algo = fedavg(FedAvgConfig(batch_size=16), tiny_data.info, run=RunOptions(clients_per_round=3, placement=Placement("map")))
    s0 = algo.init(jax.random.PRNGKey(0))
    s1, m1 = algo.round(s0, empty, jax.random.PRNGKey(7))
    for a, b in zip(jax.tree.leaves(s0.variables), jax.tree.leaves(s1.variables)):
        np.testing.assert_array_equal(a, b)
    assert float(m1["server_update_skipped"]) == 1.0
    _, m2 = algo.round(s0, tiny_data, jax.random.PRNGKey(7))
    assert float(m2["server_update_skipped"]) == 0.0


def test_dropped_clients_are_left_out_of_the_aggregate_and_keep_their_rows(tiny_data):
    """run.dropout_rate: the aggregate is the n_k-weighted mean over the clients that
    reported (hand-computed from the same per-client function), a dropped client's persistent
    row is untouched, the draw is a function of (round key, client), and rate 0 changes
    nothing."""
    data, n = tiny_data, tiny_data.info.num_clients
    ids = jnp.arange(n, dtype=jnp.int32)
    rk = next(jax.random.PRNGKey(s) for s in range(100)
              if 0 < int(reporting_clients(jax.random.PRNGKey(s), ids, 0.5).sum()) < n)
    rep = np.asarray(reporting_clients(rk, ids, 0.5))
    np.testing.assert_array_equal(rep, reporting_clients(rk, ids, 0.5))  # seeded: same key, same draw
    assert reporting_clients(rk, ids, 0.0).all()
    cfg = FedAvgConfig(batch_size=16)
    algo = fedavg(cfg, data.info, run=RunOptions(clients_per_round=n, placement=Placement("map"), dropout_rate=0.5))
    s0 = algo.init(jax.random.PRNGKey(0))
    s1, m1 = algo.round(s0, data, rk)
    assert int(m1["clients_reported"]) == rep.sum() and float(m1["server_update_skipped"]) == 0.0
    from jaxfednas.search_spaces.models import make_model

    local = jit(make_local_train(make_model(cfg.model, 10, data.info.name), data.info, cfg))  # the round's options
    keys = client_keys(rk, ids)
    outs = [local(s0.variables, data.clients("train", i), keys[i])[0] for i in range(n) if rep[i]]
    want = weighted_mean(jax.tree.map(lambda *a: jnp.stack(a), *outs), data.train.counts[rep])
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(s1.variables)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    # local-only: a dropped client's row is untouched, a reporting one's moved
    lo = local_only(LocalOnlyConfig(batch_size=16), data.info,
                    run=RunOptions(clients_per_round=n, placement=Placement("map"), dropout_rate=0.5))
    r0 = lo.init(jax.random.PRNGKey(0))
    r1, _ = lo.round(r0, data, rk)
    for k in range(n):
        same = all(np.array_equal(a[k], b[k]) for a, b in zip(jax.tree.leaves(r0.clients), jax.tree.leaves(r1.clients)))
        assert same == (not rep[k]), k


def test_masked_weighted_mean_by_hand():
    x = jnp.array([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]])
    m = jnp.array([[1, 0, 0], [1, 1, 0]])
    out = masked_weighted_mean(x, m, jnp.array([1.0, 3.0]), jnp.array([9.0, 9.0, 9.0]))
    # element 0: both clients (1*1 + 3*5) / 4; element 1: only client 1; element 2: nobody -> fallback
    np.testing.assert_allclose(out, [4.0, 6.0, 9.0])


def test_sampling_is_a_function_of_the_key():
    k = jax.random.PRNGKey(3)
    a = sample_clients(k, 20, 5)
    assert np.array_equal(a, sample_clients(k, 20, 5))
    assert len(set(np.asarray(a).tolist())) == 5 and np.all(np.diff(a) > 0)
    draws = {tuple(np.asarray(sample_clients(jax.random.fold_in(k, r), 20, 5))) for r in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("value, expect", [(4, 4), (0.5, 5), (1.0, 10), (0.01, 1)])
def test_clients_per_round(value, expect):
    assert resolve_clients_per_round(value, 10) == expect


@pytest.mark.parametrize("value", [0, 11, 1.5, -0.2, True])
def test_clients_per_round_errors(value):
    with pytest.raises(ValueError, match="clients_per_round"):
        resolve_clients_per_round(value, 10)


def test_placement_errors():
    with pytest.raises(ValueError, match="placement mode"):
        Placement("pmap")
    with pytest.raises(ValueError, match="client_chunk_size"):
        Placement("map", 0)


def test_gather_scatter_rows():
    rows = {"a": jnp.arange(12.0).reshape(6, 2)}
    idx = jnp.array([1, 4])
    got = gather_rows(rows, idx)
    np.testing.assert_array_equal(got["a"], [[2, 3], [8, 9]])
    new = scatter_rows(rows, idx, {"a": -got["a"]})
    expect = np.arange(12.0).reshape(6, 2)
    expect[[1, 4]] *= -1
    np.testing.assert_array_equal(new["a"], expect)


def _fn(c, shared):
    return {"y": jnp.sin(c["x"]) * shared + c["x"].sum(), "s": c["x"].sum()}


@pytest.mark.parametrize("n_clients", [3, 8, 11])
def test_map_clients_placements_agree_and_padding_is_dropped(n_clients):
    xs = {"x": jax.random.normal(jax.random.PRNGKey(n_clients), (n_clients, 5))}
    ref = [_fn({"x": xs["x"][i]}, 2.0) for i in range(n_clients)]
    for p in [Placement("vmap"), Placement("map"), Placement("map", 2), Placement("shard_map"),
              Placement("shard_map", 2, within="map")]:
        out = jax.jit(lambda t: map_clients(_fn, t, 2.0, placement=p))(xs)
        assert out["y"].shape == (n_clients, 5)
        for i in range(n_clients):
            np.testing.assert_allclose(out["y"][i], ref[i]["y"], rtol=1e-6)


def test_shard_map_padding_rows_skip_the_work_when_clients_run_in_turn():
    """3 clients on 8 devices: 5 padding rows. One after another within a device (``map``),
    they skip ``fn`` (it runs 3 times); vmapped, every row runs it (a vmapped branch is a
    select). Either way the outputs are the 3 clients'."""
    calls = []

    def fn(c, shared):
        jax.debug.callback(lambda: calls.append(1))
        return _fn(c, shared)

    xs = {"x": jax.random.normal(jax.random.PRNGKey(0), (3, 5))}
    for p, runs in ((Placement("shard_map", within="map"), 3), (Placement("shard_map"), 8)):
        calls.clear()
        out = jax.jit(lambda t: map_clients(fn, t, 2.0, placement=p))(xs)
        jax.block_until_ready(out)
        jax.effects_barrier()
        assert len(calls) == runs, p
        for i in range(3):
            np.testing.assert_allclose(out["y"][i], _fn({"x": xs["x"][i]}, 2.0)["y"], rtol=1e-6)


@pytest.mark.parametrize("active", [[True, False, True, False, True], False, True])
def test_map_clients_inactive_clients_skip_the_work_and_give_zeros(active):
    """``active``: per client or one flag for all; an inactive row is zeros and, clients in
    turn within a device, ``fn`` does not run for it; one flag false skips it vmapped too."""
    calls = []

    def fn(c, shared):
        jax.debug.callback(lambda: calls.append(1))
        return _fn(c, shared)

    xs = {"x": jax.random.normal(jax.random.PRNGKey(1), (5, 5))}
    flags = np.broadcast_to(active, (5,))
    for p in [Placement("vmap"), Placement("map"), Placement("shard_map"), Placement("shard_map", within="map")]:
        calls.clear()
        out = jax.jit(lambda t, a: map_clients(fn, t, 2.0, placement=p, active=a))(xs, jnp.asarray(active))
        jax.block_until_ready(out)
        jax.effects_barrier()
        for i in range(5):
            want = _fn({"x": xs["x"][i]}, 2.0)["y"] if flags[i] else np.zeros(5)
            np.testing.assert_allclose(out["y"][i], want, rtol=1e-6)
        if p.mode == "map" or p.within == "map":
            assert len(calls) == flags.sum(), p
        if np.ndim(active) == 0 and not active:
            assert calls == [], p


def _round_params(data, placement, m=3):
    algo = fedavg(FedAvgConfig(batch_size=16), data.info, run=RunOptions(clients_per_round=m, placement=placement))
    state = algo.init(jax.random.PRNGKey(0))
    state, metrics = algo.round(state, data, jax.random.PRNGKey(7))
    return state.variables, metrics


def test_fedavg_round_equal_across_placements_and_python_loop(tiny_data):
    data = tiny_data
    ref_vars, ref_metrics = _round_params(data, Placement("vmap"))
    # Sequential Python loop over the same jitted per-client function.
    cfg = FedAvgConfig(batch_size=16)
    algo = fedavg(cfg, data.info, run=RunOptions(clients_per_round=3, placement=Placement("vmap")))
    init_vars = algo.init(jax.random.PRNGKey(0)).variables
    from jaxfednas.search_spaces.models import make_model

    local = jit(make_local_train(make_model(cfg.model, 10, data.info.name), data.info, cfg))  # the round's options
    rk = jax.random.PRNGKey(7)
    idx = sample_clients(rng.sample_key(rk), data.info.num_clients, 3)
    keys = client_keys(rk, idx)
    outs = [local(init_vars, data.clients("train", i), k) for i, k in zip(idx, keys)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[o[0] for o in outs])
    loop_vars = weighted_mean(stacked, data.train.counts[idx])
    for p in [Placement("map"), Placement("map", 2), Placement("shard_map"), "loop"]:
        got = loop_vars if p == "loop" else _round_params(data, p)[0]
        for a, b in zip(jax.tree.leaves(ref_vars), jax.tree.leaves(got)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert np.isfinite(ref_metrics["train_loss"])


def test_fedavg_learns_and_local_only_keeps_unsampled_rows(tiny_data):
    algo = fedavg(FedAvgConfig(batch_size=16, lr=0.05), tiny_data.info, run=RunOptions(placement=Placement("vmap")))
    state = algo.init(jax.random.PRNGKey(0))
    before = float(algo.evaluate(state, tiny_data)["global_test_acc"])
    for r in range(4):
        state, _ = algo.round(state, tiny_data, jax.random.PRNGKey(r))
    after = algo.evaluate(state, tiny_data)
    assert float(after["global_test_acc"]) > before + 0.2
    assert after["client_test_acc"].shape == (4,)

    lo = local_only(LocalOnlyConfig(batch_size=16), tiny_data.info,
                    run=RunOptions(clients_per_round=2, placement=Placement("vmap")))
    s0 = lo.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(5)
    s1, _ = lo.round(s0, tiny_data, key)
    idx = set(np.asarray(sample_clients(rng.sample_key(key), 4, 2)).tolist())
    leaf0, leaf1 = jax.tree.leaves(s0.clients)[0], jax.tree.leaves(s1.clients)[0]
    for k in range(4):
        same = np.array_equal(leaf0[k], leaf1[k])
        assert same == (k not in idx)


def test_client_accuracy_summary_by_hand():
    from jaxfednas.evaluation import client_accuracy_summary

    out = client_accuracy_summary(jnp.array([3.0, 1.0, 0.0]), jnp.array([4, 1, 0]))
    np.testing.assert_allclose(out["client_test_acc_mean_unweighted"], (0.75 + 1.0) / 2)
    np.testing.assert_allclose(out["client_test_acc_mean_weighted"], 4 / 5)
    np.testing.assert_allclose(out["client_test_acc_std_unweighted"], 0.125)
    assert np.isnan(out["client_test_acc"][2])
    none = client_accuracy_summary(jnp.zeros(2), jnp.zeros(2, jnp.int32))
    assert np.isnan(none["client_test_acc_mean_weighted"])


# --- compiler options ------------------------------------------------------------------

def _two_independent_passes(w, a, b):  # the shape of a MiLeNAS step: two gradients that share nothing
    def loss(w, x):
        h = x
        for _ in range(6):
            h = jnp.tanh(h @ w)
        return jnp.sum(h)
    return jax.grad(loss)(w, a), jax.grad(loss)(w, b)


def test_jit_compiles_with_the_memory_scheduler_same_results_less_temporary_memory():
    assert compiler_options().items() >= CPU_COMPILER_OPTIONS.items()  # the suite runs on CPU
    w, a = jnp.full((256, 256), 0.01), jnp.ones((4096, 256))
    b = 2 * a
    # "plain": XLA's own scheduler at the same LLVM level (the scheduler only orders operations)
    ours = jit(_two_independent_passes)
    plain = jax.jit(_two_independent_passes, compiler_options=compiler_options("default"))
    temp = {name: f.lower(w, a, b).compile().memory_analysis().temp_size_in_bytes
            for name, f in (("ours", ours), ("plain", plain))}
    assert temp["ours"] < temp["plain"]  # measured 44 vs 52 MiB: both passes' activations no longer live at once
    for x, y in zip(ours(w, a, b), plain(w, a, b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _twice_nested(x):
    inner = jax.jit(lambda h: jnp.tanh(h * 1.5 + 0.25))  # a nested jit called twice
    return jax.grad(lambda h: jnp.sum(inner(inner(h)) ** 2))(x)


def test_keep_calls_keeps_nested_jits_as_calls_same_results(monkeypatch):
    monkeypatch.delenv("JAXFEDNAS_CPU_KEEP_CALLS", raising=False)
    x = jnp.linspace(-2.0, 2.0, 64)
    kept, inlined = jit(_twice_nested, keep_calls=True), jit(_twice_nested)
    assert kept.options.items() >= KEEP_CALLS_OPTIONS.items() and not inlined.options.items() & KEEP_CALLS_OPTIONS.items()
    calls = {name: f.lower(x).compile().as_text().count(" call(") for name, f in (("kept", kept), ("inlined", inlined))}
    assert calls["kept"] >= 2 and calls["inlined"] == 0  # XLA kept the calls, or inlined them all
    np.testing.assert_allclose(np.asarray(kept(x)), np.asarray(inlined(x)), rtol=1e-6, atol=1e-7)
    monkeypatch.setenv("JAXFEDNAS_CPU_KEEP_CALLS", "0")  # the environment overrides every program's choice
    assert not compiler_options(keep_calls=True).items() & KEEP_CALLS_OPTIONS.items()
    monkeypatch.setenv("JAXFEDNAS_CPU_KEEP_CALLS", "1")
    assert compiler_options().items() >= KEEP_CALLS_OPTIONS.items()
    monkeypatch.setenv("JAXFEDNAS_CPU_KEEP_CALLS", "yes")
    with pytest.raises(ValueError, match="JAXFEDNAS_CPU_KEEP_CALLS must be 0 or 1"):
        compiler_options()


def test_jit_traces_with_the_garbage_collector_paused_and_restores_it():
    import gc

    seen = []

    def f(x):
        seen.append(gc.isenabled())  # runs while JAX traces f
        return x + 1

    program = jit(f)
    assert gc.isenabled()
    assert float(program(jnp.float32(1))) == 2.0  # a top-level call traces under the pause
    program.lower(jnp.zeros(3))  # a new shape: traced again
    program.trace(jnp.zeros(4))
    program.eval_shape(jnp.zeros(5))
    assert seen == [False] * 4 and gc.isenabled()  # back on after each
    gc.disable()
    try:
        with runtime.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a collector the caller had switched off stays off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="boom"), runtime.gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()  # restored on an exception too


def test_jit_inside_another_jit_drops_the_options():  # JAX takes compiler options on the outermost jit only
    inner = jit(lambda x: x * 2)
    outer = jit(lambda x: inner(x) + 1)
    assert float(outer(jnp.float32(3))) == 7.0
    assert float(inner(jnp.float32(3))) == 6.0


@contextlib.contextmanager
def _most_optimizations_disabled(disabled: bool):
    """JAX's ``jax_disable_most_optimizations`` set for a block (the suite runs with it on)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", disabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture
def optimizing():
    """XLA's optimisations on for one test (the suite compiles with most of them off)."""
    with _most_optimizations_disabled(False):
        yield


def test_cpu_scheduler_per_program_and_environment_switch(monkeypatch, optimizing):
    monkeypatch.setenv("JAXFEDNAS_CPU_CONV", "ynn")  # (XLA's default: no options of its own)
    monkeypatch.delenv("JAXFEDNAS_CPU_SCHEDULER", raising=False)
    monkeypatch.delenv("JAXFEDNAS_CPU_OPT_LEVEL", raising=False)
    o2 = {"xla_backend_optimization_level": CPU_OPT_LEVEL}
    assert compiler_options("default") == o2  # DP-FNAS' choice: XLA's own scheduler
    monkeypatch.setenv("JAXFEDNAS_CPU_SCHEDULER", "memory")  # the environment overrides every program
    assert compiler_options("default") == {**o2, **CPU_COMPILER_OPTIONS}
    monkeypatch.setenv("JAXFEDNAS_CPU_SCHEDULER", "default")
    assert compiler_options() == o2
    monkeypatch.setenv("JAXFEDNAS_CPU_SCHEDULER", "fast")
    with pytest.raises(ValueError, match="'memory' or 'default'"):
        compiler_options()


def test_cpu_opt_level_left_to_jax_when_it_disables_optimisations(monkeypatch):
    monkeypatch.setenv("JAXFEDNAS_CPU_CONV", "ynn")  # (XLA's default: no options of its own)
    # JAX_DISABLE_MOST_OPTIMIZATIONS (this suite's setting) compiles at -O0; an explicit level
    # among the compiler options would override it
    monkeypatch.delenv("JAXFEDNAS_CPU_SCHEDULER", raising=False)
    monkeypatch.setenv("JAXFEDNAS_CPU_OPT_LEVEL", "3")
    with _most_optimizations_disabled(True):
        assert compiler_options() == CPU_COMPILER_OPTIONS and compiler_options("default") is None


def test_cpu_opt_level_default_environment_switch_and_effect(monkeypatch, optimizing):
    monkeypatch.setenv("JAXFEDNAS_CPU_CONV", "ynn")  # (XLA's default: no options of its own)
    monkeypatch.delenv("JAXFEDNAS_CPU_SCHEDULER", raising=False)
    monkeypatch.delenv("JAXFEDNAS_CPU_OPT_LEVEL", raising=False)
    assert CPU_OPT_LEVEL == 2 and compiler_options()["xla_backend_optimization_level"] == 2
    monkeypatch.setenv("JAXFEDNAS_CPU_OPT_LEVEL", "3")
    assert compiler_options("default") == {"xla_backend_optimization_level": 3}
    for bad in ("4", "O2", "-1"):
        monkeypatch.setenv("JAXFEDNAS_CPU_OPT_LEVEL", bad)
        with pytest.raises(ValueError, match="JAXFEDNAS_CPU_OPT_LEVEL must be 0, 1, 2 or 3"):
            compiler_options()
    # the option reaches XLA: the same program's serialised executable (which records the
    # level among its compile options, and the code built with it) at the default equals
    # -O2's and differs from -O3's; results agree
    from jax.experimental.serialize_executable import serialize
    w, a = jnp.full((64, 64), 0.01), jnp.ones((128, 64))
    compiled = {}
    for level in ("default", "2", "3"):
        if level == "default":
            monkeypatch.delenv("JAXFEDNAS_CPU_OPT_LEVEL")
        else:
            monkeypatch.setenv("JAXFEDNAS_CPU_OPT_LEVEL", level)
        compiled[level] = jit(_two_independent_passes).lower(w, a, 2 * a).compile()
    code = {level: serialize(c)[0] for level, c in compiled.items()}
    assert code["default"] == code["2"] and code["2"] != code["3"]
    for x, y in zip(compiled["2"](w, a, 2 * a), compiled["3"](w, a, 2 * a)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_step_if_traces_the_step_once_and_skips_to_zeros():
    traces = []

    def step(c):
        traces.append(1)  # a Python side effect: runs once per trace
        return c * 2.0, {"loss": c.sum(), "n": jnp.int32(1)}

    run = jax.jit(lambda c, p: step_if(p, step, c))
    c, out = run(jnp.arange(3.0), True)
    np.testing.assert_array_equal(c, [0.0, 2.0, 4.0])
    assert float(out["loss"]) == 3.0 and int(out["n"]) == 1
    c, out = run(jnp.arange(3.0), False)
    np.testing.assert_array_equal(c, [0.0, 1.0, 2.0])
    assert float(out["loss"]) == 0.0 and int(out["n"]) == 0 and out["n"].dtype == jnp.int32
    assert len(traces) == 1  # the shapes and the taken branch share one trace


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's (Linux)")
def test_release_freed_memory_hands_freed_heap_back():
    blocks = [bytes(4000) for _ in range(50_000)]  # ~200 MiB from malloc (objects over pymalloc's 512 bytes)
    keep = blocks[::50]  # survivors spread over the heap: glibc cannot simply cut its top
    del blocks
    before = _rss_mib()
    assert runtime.release_freed_memory()
    assert before - _rss_mib() > 100, (before, _rss_mib())
    assert len(keep) == 1000


def test_release_after_compiles_runs_once_per_long_compilation(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: calls.append(1) or True)
    fresh = lambda: jax.jit(lambda x: x * 3.0 + len(calls))  # noqa: E731  (a new program: not in any cache)
    x = jnp.ones(3)
    try:
        assert runtime.release_memory_after_compiles(min_seconds=0.0)
        fresh()(x).block_until_ready()
        assert len(calls) == 1
        fresh()(x).block_until_ready()
        assert len(calls) == 2
        assert runtime.release_memory_after_compiles(min_seconds=1e9)  # reinstalled, not added
        fresh()(x).block_until_ready()
        assert len(calls) == 2  # too short a compilation
        monkeypatch.setenv("JAXFEDNAS_RELEASE_MEMORY", "0")
        assert not runtime.release_memory_after_compiles(min_seconds=0.0)
        fresh()(x).block_until_ready()
        assert len(calls) == 2
    finally:
        runtime.release_memory_after_compiles(enable=False)


def test_drop_compiled_forgets_a_jitted_functions_programs(count_traces):
    for fn in (jit(lambda x: x * 5.0 + 1.0), jax.jit(lambda x: x * 7.0 - 1.0)):
        x = jnp.arange(3.0)
        fn(x)
        with count_traces() as traced:
            fn(x)
        assert traced == []
        runtime.drop_compiled(fn)
        with count_traces() as traced:
            np.testing.assert_allclose(fn(x), fn.__wrapped__(np.arange(3.0)))
        assert len(traced) == 1  # compiled again (from the persistent cache where it holds it)
    runtime.drop_compiled(lambda x: x)  # not jitted: nothing to drop, no error


def test_the_post_compile_memory_release_is_on_for_the_plain_api():
    """Importing the runtime installs the listener (unless JAXFEDNAS_RELEASE_MEMORY=0), so a
    user calling ``algo.round`` directly gets what run_experiment gets."""
    import subprocess
    import sys

    code = "import jaxfednas.runtime as r; print(r._RELEASE['listener'] is not None)"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "JAXFEDNAS_RELEASE_MEMORY": "0"}).stdout.strip()
    assert (on, off) == ("True", "False")


def test_auto_placement_on_one_accelerator_honours_a_chunk_size(monkeypatch):
    """On one GPU ``auto`` vmaps every client, unless a chunk size (given, or picked by
    run.memory_budget_gib) asks for fewer in flight: then clients run in chunks (lax.map).
    On CPU ``auto`` is map either way; several devices are shard_map."""
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Placement("auto").resolved() == "vmap"
    assert Placement("auto", client_chunk_size=2).resolved() == "map"
    assert Placement("vmap", client_chunk_size=2).resolved() == "vmap"  # explicit choices are kept
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert Placement("auto").resolved() == Placement("auto", client_chunk_size=2).resolved() == "map"
    monkeypatch.setattr(jax, "device_count", lambda *a: 2)
    assert Placement("auto", client_chunk_size=2).resolved() == "shard_map"


def test_cpu_convolutions_default_to_ynnpack_with_onednn_for_the_rest(monkeypatch):
    """On x86-64 every jaxfednas program asks XLA:CPU for oneDNN's convolutions where YNNPACK takes
    none (a training step's gradient convolutions); the gradients equal XLA's default's to float
    rounding; JAXFEDNAS_CPU_CONV picks another library or refuses an unknown one."""
    import platform

    from jaxfednas.runtime import CPU_CONV_BACKENDS, cpu_conv_backend

    monkeypatch.delenv("JAXFEDNAS_CPU_CONV", raising=False)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert cpu_conv_backend() == ("ynn+onednn" if x86 else "ynn")
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 8))
    w = 0.1 * jax.random.normal(jax.random.key(1), (3, 3, 8, 8))

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)

    grads = {}
    for backend in ("ynn+onednn", "ynn"):
        monkeypatch.setenv("JAXFEDNAS_CPU_CONV", backend)
        assert compiler_options().items() >= CPU_CONV_BACKENDS[backend].items()
        compiled = jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile()
        if x86:
            assert ("__onednn$convolution" in compiled.as_text()) == (backend == "ynn+onednn")
        grads[backend] = compiled(w, x)
    for a, b in zip(grads["ynn+onednn"], grads["ynn"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JAXFEDNAS_CPU_CONV", "mkl")
    with pytest.raises(ValueError, match="JAXFEDNAS_CPU_CONV must be one of ynn, xla, onednn, ynn\\+onednn"):
        compiler_options()
