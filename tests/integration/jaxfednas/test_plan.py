"""``jaxfednas plan``: the figures of a compiled round, on a tiny configuration."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxfednas import plan as plan_mod
from jaxfednas.cli import main
from jaxfednas.plan import DATASET_SHAPES, format_plan, largest_chunk, plan_data, plan_run, synthetic_like
from jaxfednas.registry import make_config

# one device (the test suite has 8 CPU devices), clients one after another
TINY = {"data.dataset": "synthetic", "data.num_clients": 4, "run.rounds": 3, "run.placement": "map"}


@pytest.fixture(scope="module")
def tiny_plan():
    cfg = make_config("fedavg", overrides=TINY)
    return cfg, plan_run(cfg)


def test_plan_figures_present_and_positive(tiny_plan):
    cfg, plan = tiny_plan
    assert plan["parameters"]["model"] > 0
    assert plan["parameters"]["state_scalars"] >= plan["parameters"]["model"]
    r = plan["round"]
    assert r["available"] and r["compile_s"] > 0 and r["lower_s"] > 0
    m = r["memory_bytes_per_device"]
    assert m["argument"] > 0 and m["output"] > 0 and m["temp"] > 0
    assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"]
    assert r["xla_cost"]["flops"] > 0
    assert r["jaxpr_macs_upper_bound"] > 0
    per_device = plan["placement"]["clients_per_device"]
    assert per_device >= 2
    c = plan["clients_in_flight"]  # chunk 1 and 2 compiled
    assert c["chunk_2_total"] > c["chunk_1_total"] > 0
    assert c["per_client_in_flight"] == c["chunk_2_total"] - c["chunk_1_total"]
    assert 1 <= plan["memory_fit"]["largest_chunk_estimate"] <= per_device
    t = plan["timing"]
    assert t["round_s"] > 0 and t["rounds"] == 3
    assert t["run_s_estimate"] == pytest.approx(3 * t["round_s"], rel=1e-3)
    text = format_plan(plan)
    for figure in ("parameters: model", "XLA memory per device", "per client in flight", "XLA cost analysis",
                   "compile time", "round on this device", "whole run", "estimate"):
        assert figure in text, figure


def test_round_compiled_in_each_precision(tiny_plan):
    cfg, plan = tiny_plan
    p = plan["precisions"]
    assert set(p) == {"fp32", "bf16"} and all(f["available"] for f in p.values())
    # the configured precision's figures are the round's own (compiled once)
    assert p["fp32"]["memory_bytes_per_device"] == plan["round"]["memory_bytes_per_device"]
    assert p["fp32"]["xla_cost"] == plan["round"]["xla_cost"]
    for f in p.values():
        assert f["memory_bytes_per_device"]["total"] > 0 and f["xla_cost"]["flops"] > 0 and f["compile_s"] > 0
    text = format_plan(plan)
    assert "round in fp32 (configured): XLA memory per device total" in text and "round in bf16: XLA memory" in text


def test_precision_an_algorithm_refuses_is_said():
    """DP-FNAS refuses bf16 with its default second-order finite difference (in its build)."""
    cfg = make_config("dp_fnas", overrides={**TINY, "data.split": (0.5, 0.25, 0.25)})
    out = plan_mod._by_precision(cfg, plan_data(cfg), None, ("bf16",), lambda line: None)  # refused before compiling
    assert out["bf16"]["available"] is False and "algo.arch_gradient=second_fd" in out["bf16"]["error"], out


def test_budget_fit_follows_the_budget(tiny_plan):
    gib = 2**30
    assert largest_chunk(2 * gib, 3 * gib, 16, 1 * gib) == 0  # one client does not fit
    assert largest_chunk(2 * gib, 3 * gib, 16, 2 * gib) == 1
    assert largest_chunk(2 * gib, 3 * gib, 16, 6 * gib) == 5  # 2 GiB + 4 more clients at 1 GiB each
    assert largest_chunk(2 * gib, 3 * gib, 16, 100 * gib) == 16  # at most every client of the device
    assert largest_chunk(2 * gib, 2 * gib, 16, 3 * gib) == 16
    _, plan = tiny_plan
    f, c = plan["memory_fit"], plan["clients_in_flight"]
    assert f["budget_from"] == "host physical memory" and f["budget_bytes"] > 0
    assert f["largest_chunk_estimate"] == largest_chunk(c["chunk_1_total"], c["chunk_2_total"],
                                                        plan["placement"]["clients_per_device"], f["budget_bytes"])


def test_local_steps_extrapolation(tiny_plan):
    cfg, _ = tiny_plan
    plan = plan_run(cfg, local_steps=2, probe_chunk=False, macs=False)
    t = plan["timing"]
    assert t["method"] == "local steps, extrapolated"
    assert t["measured_units"] == 2  # one client (full participation), two slots of batch_size
    counts = plan["data"]["train_examples_per_client"]
    assert t["round_units"] == sum(math.ceil(n / cfg.algo.batch_size) for n in counts)
    assert t["round_s"] >= t["empty_round_s"] > 0
    assert plan["clients_in_flight"] is None


def test_cli_plan_json_round_trip(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "fedavg", "--no-chunk-probe", "--memory-budget-gib", "0.5", "--json", str(out)]
    for k, v in TINY.items():
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["algorithm"] == "fedavg" and plan["config"]["run"]["rounds"] == 3
    m = plan["round"]["memory_bytes_per_device"]
    assert f"total {plan_mod._bytes(m['total'])}" in text
    assert plan["timing"]["round_s"] > 0 and plan["parameters"]["model"] > 0
    assert str(plan["parameters"]["model"]) in text
    assert plan["memory_fit"]["budget_bytes"] == 2**29 and plan["memory_fit"]["budget_from"] == "--memory-budget-gib"
    assert "measured round" not in text and "round on this device" in text


def test_not_available_figures_are_said(monkeypatch, tiny_plan):
    cfg, _ = tiny_plan
    monkeypatch.setattr(plan_mod, "_memory", lambda compiled: None)
    monkeypatch.setattr(plan_mod, "_cost", lambda compiled: None)
    plan = plan_run(cfg, measure=False, macs=False)
    assert plan["timing"] is None and "measured round: not measured" in format_plan(plan)
    assert plan["round"]["memory_bytes_per_device"] is None and plan["clients_in_flight"] is None
    text = format_plan(plan)
    assert "XLA memory analysis: not available" in text
    assert "per client in flight: not available" in text
    assert "XLA cost analysis per round: not available" in text


def test_round_that_does_not_compile_is_reported(monkeypatch, tiny_plan):
    cfg, _ = tiny_plan
    real_build = plan_mod.build_algorithm

    def build(c, info):
        algo = real_build(c, info)

        def host_round(state, data, key):  # a round with a host-side step in it
            return algo.round(state, data, key)[0], {"n": float(np.asarray(state.round))}

        return algo._replace(round=host_round)

    monkeypatch.setattr(plan_mod, "build_algorithm", build)
    plan = plan_run(cfg)
    assert plan["round"]["available"] is False and plan["round"]["error"]
    assert "compiled round: not available" in format_plan(plan)


@pytest.mark.parametrize("args, message", [
    (["plan", "nosuch"], "unknown algorithm 'nosuch'"),
    (["plan", "fedavg", "--preset", "nosuch"], "unknown preset 'nosuch' for fedavg"),
    (["plan", "fedavg", "--set", "run.nosuch=1"], "nosuch"),
    (["plan", "fedavg", "--local-steps", "0"], "--local-steps must be >= 1"),
    (["plan", "fedavg", "--memory-budget-gib", "nan"], "--memory-budget-gib must be a finite number > 0"),
    (["plan", "fedavg", "--memory-budget-gib", "0"], "--memory-budget-gib must be a finite number > 0"),
])
def test_cli_plan_errors(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_synthetic_like_has_the_dataset_shapes():
    for name, (_, _, classes, shape) in DATASET_SHAPES.items():
        ds = synthetic_like(name, num_train=30, num_test=7)
        assert ds.x_train.shape == (30, *shape) and ds.x_test.shape == (7, *shape)
        assert ds.num_classes == classes and ds.x_train.dtype == np.uint8
        assert ds.y_train.max() < classes
    assert DATASET_SHAPES["cifar10"][:2] == (50_000, 10_000)
    cfg = make_config("fednas", preset="paper")
    data = plan_data(cfg, num_train=2000, num_test=10)
    assert data.info.num_clients == 16 and data.train.x.shape[2:] == (32, 32, 3)


def test_memory_total_counts_donated_buffers_once():
    class Analysis:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes, temp_size_in_bytes = 100, 80, 60, 7

    class Compiled:
        def memory_analysis(self):
            return Analysis()

    class NoAnalysis:
        def memory_analysis(self):
            return None

    assert plan_mod._memory(Compiled()) == {"argument": 100, "output": 80, "alias": 60, "temp": 7, "total": 127}
    assert plan_mod._memory(NoAnalysis()) is None


def test_round_larger_than_the_device_is_not_run(monkeypatch, tiny_plan):
    cfg, full = tiny_plan
    need = full["round"]["memory_bytes_per_device"]["total"]
    monkeypatch.setattr(plan_mod, "_device_memory_bytes", lambda: (need - 1, "a tiny device"))
    monkeypatch.setattr(plan_mod, "_run_timed", lambda *a: pytest.fail("a round that does not fit was run"))
    plan = plan_run(cfg, probe_chunk=False, macs=False)
    assert "a tiny device" in plan["timing"]["skipped"]
    assert "measured round: the round needs" in format_plan(plan)


def test_chunk_probe_only_where_chunks_apply(tiny_plan):
    cfg, _ = tiny_plan
    vmapped = make_config("fedavg", overrides={**TINY, "run.placement": "vmap"})
    plan = plan_run(vmapped, measure=False, macs=False)
    assert plan["clients_in_flight"] is None and plan["memory_fit"]["largest_chunk_estimate"] is None
    assert "ignores run.client_chunk_size" in format_plan(plan)


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_long_first_call_is_the_round_only_on_cpu(monkeypatch, accelerator):
    """On an accelerator the first call (program load, kernel autotuning) is never a round's
    time: the second is; on CPU a first call of 10 s or more is taken as it is."""
    calls = iter([12.0, 0.5])
    monkeypatch.setattr(plan_mod, "_run_timed", lambda *a: next(calls))
    monkeypatch.setattr(plan_mod, "on_accelerator", lambda: accelerator)
    cfg = make_config("fedavg", preset="smoke")
    data = type("Data", (), {"train": type("Split", (), {"counts": np.ones(4, np.int32)})()})()
    t = plan_mod.measure_round(cfg, data, {"compiled": None, "state": None, "key": None}, None)
    assert t["round_s"] == (0.5 if accelerator else 12.0)
    assert t["method"] == ("whole round (second call)" if accelerator else "whole round (first call)")


def test_partial_participation_extrapolation_by_hand(monkeypatch):
    """With 2 of 4 clients a round, plan times rounds where every client holds c examples
    and none, and scales to the round's expected step slots (m/K of all clients' slots);
    the round's time is its own reported parts. A fake device whose round costs 0.5 s
    plus 0.02 s per expected step slot must come out at exactly that."""
    from conftest import tiny_federation

    cfg, data = tiny_federation("fedavg", **{"run.placement": "map"})
    k, m, b = data.info.num_clients, 2, cfg.algo.batch_size
    assert cfg.run.clients_per_round == m

    def fake_round(compiled, state, d, key):
        slots = sum(math.ceil(int(n) / b) for n in np.asarray(d.train.counts))
        return 0.5 + 0.02 * m / k * slots

    monkeypatch.setattr(plan_mod, "_run_timed", fake_round)
    t = plan_mod.measure_round(cfg, data, {"compiled": None, "state": None, "key": None}, 2)
    counts = np.asarray(data.train.counts)
    assert t["round_units"] == pytest.approx(m / k * sum(math.ceil(int(n) / b) for n in counts))
    c = min(2 * b, int(data.train.max_examples))  # two slots' examples, at most a client's rows
    assert t["measured_units"] == m * math.ceil(c / b)  # every client holds them, m of them train
    assert t["round_s"] == pytest.approx(0.5 + 0.02 * t["round_units"], rel=1e-12)
    per_unit = (t["few_steps_round_s"] - t["empty_round_s"]) / t["measured_units"]
    assert t["round_s"] == pytest.approx(t["empty_round_s"] + per_unit * t["round_units"], rel=1e-12)
