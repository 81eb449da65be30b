"""Plan a run before it starts: compile its round at the real shapes, read XLA's figures.

``jaxfednas plan ALGO --preset paper`` needs no dataset: it builds the configured
partition over *synthetic* pixels at the dataset's real shapes (CIFAR-10: 50 000 train
and 10 000 test images of 32x32x3, 10 classes, split over the clients as the
configuration says), builds the algorithm, lowers and compiles one round ahead of time
(``jax.jit(...).lower(...).compile()``) and reports:

* the model's parameters (:func:`jaxfednas.cost.count_params`) and the whole state's size;
* XLA's memory analysis of the compiled round per device (arguments, outputs, aliased,
  temporaries), and the memory one more client in flight costs (the difference between
  the round compiled at ``run.client_chunk_size`` 1 and 2), from which the largest
  ``client_chunk_size`` that fits a memory budget is *estimated* (linear in the clients
  in flight);
* XLA's cost analysis of the round (FLOPs and bytes accessed; XLA counts the body of a
  loop once, so for rounds made of ``scan`` / ``map`` loops this is far below the real
  count) and the multiply-accumulates of the round's jaxpr with every loop's trip count
  (:func:`jaxfednas.cost.count_macs`: every padded local-step slot counted, an upper
  bound; of the program as built for this backend, e.g. on CPU a separable convolution
  runs as one dense convolution, so the CPU figure is larger than the GPU one);
* the round compiled in each compute precision (``run.precision``: fp32 and bf16, where the
  algorithm takes it): XLA's memory and cost analysis of each, side by side (the rest of the
  plan is of the configured precision);
* trace, lower and compile times, one measured round on this device (or a few local steps
  of it, extrapolated: :func:`plan_run`'s ``local_steps``), and the wall time of the whole
  run extrapolated from it (rounds x round time; compilation, evaluation, checkpoints and
  data loading excluded).

Figures XLA does not give for a backend or an algorithm are reported as ``None``
("not available"), never guessed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.config import PRECISIONS, ConfigError, ExperimentConfig
from jaxfednas.cost import count_macs, count_params
from jaxfednas.data.datasets import NORMALIZATION, Dataset, load_dataset
from jaxfednas.data.federated import FederatedData, make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.registry import build_algorithm
from jaxfednas.rng import init_key, round_key
from jaxfednas.runtime import Placement, device_memory_limit, gc_paused, on_accelerator

GIB = 2**30

#: (train images, test images, classes, image shape) of each dataset as published
DATASET_SHAPES: dict[str, tuple[int, int, int, tuple[int, int, int]]] = {
    "cifar10": (50_000, 10_000, 10, (32, 32, 3)),
    "cifar100": (50_000, 10_000, 100, (32, 32, 3)),
    "cinic10": (90_000, 90_000, 10, (32, 32, 3)),  # CINIC-10 train / test (valid unused)
}


def synthetic_like(name: str, *, num_train: int | None = None, num_test: int | None = None,
                   seed: int = 0) -> Dataset:
    """A :class:`~jaxfednas.data.images.Dataset` named ``name`` with its real image shape,
    classes and normalisation but uniformly random pixels (balanced labels), so an algorithm
    built on it has the model and the arrays of a run on the real data. ``num_train`` /
    ``num_test`` default to the dataset's sizes (:data:`DATASET_SHAPES`). ``digits`` and
    ``synthetic`` need no download: they are loaded as they are (sizes then ignored)."""
    if name not in DATASET_SHAPES:
        return load_dataset(name, seed=seed)
    n_train, n_test, classes, shape = DATASET_SHAPES[name]
    n_train, n_test = num_train or n_train, num_test or n_test
    rng = np.random.default_rng(seed)

    def sample(n):
        return (rng.integers(0, 256, size=(n, *shape), dtype=np.uint8),
                rng.permutation(np.arange(n) % classes).astype(np.int32))

    (x_train, y_train), (x_test, y_test) = sample(n_train), sample(n_test)
    mean, std = NORMALIZATION[name]
    return Dataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   num_classes=classes, scale=255.0, mean=mean, std=std)


def plan_data(cfg: ExperimentConfig, *, num_train: int | None = None, num_test: int | None = None) -> FederatedData:
    """The federated data of ``cfg`` (its partition of the dataset over ``data.num_clients``
    clients and ``data.split``) with synthetic pixels at the dataset's shapes."""
    from jaxfednas.experiment import make_partition

    dataset = synthetic_like(cfg.data.dataset, num_train=num_train, num_test=num_test, seed=cfg.run.seed)
    return make_federated_data(dataset, part.manifest_splits(make_partition(cfg, dataset)))


def model_params(state: Any, num_clients: int) -> int | None:
    """Parameters of one model in ``state``: ``state.variables["params"]`` (the global model,
    or the supernet without its architecture parameters), else one row of the per-client
    models ``state.clients["params"]``; None when the state holds neither."""
    variables = getattr(state, "variables", None)
    if isinstance(variables, dict) and "params" in variables:
        return count_params(variables["params"])
    clients = getattr(state, "clients", None)
    if isinstance(clients, dict) and "params" in clients:
        return count_params(clients["params"]) // num_clients
    return None


def _memory(compiled) -> dict[str, int] | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- a backend without it raises
        return None
    if m is None:
        return None
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _cost(compiled) -> dict[str, float] | None:
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        return None
    if isinstance(c, (list, tuple)):
        c = c[0] if c else None
    if not c:
        return None
    return {k: float(c[k]) for k in ("flops", "bytes accessed") if k in c}


def _device_memory_bytes() -> tuple[int | None, str]:
    """The default device's memory and where the figure comes from."""
    limit = device_memory_limit()
    if limit is not None:
        return limit, f"{jax.devices()[0].device_kind} bytes_limit"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host physical memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def _with_chunk(cfg: ExperimentConfig, chunk: int | None) -> ExperimentConfig:
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, client_chunk_size=chunk, memory_budget_gib=None))


def _compile(cfg: ExperimentConfig, data: FederatedData) -> dict[str, Any]:
    """Build the algorithm of ``cfg``, trace, lower and compile its round (AOT)."""
    algo = build_algorithm(cfg, data.info)
    state = algo.init(init_key(cfg.run.seed))
    key = round_key(cfg.run.seed, 0)
    out: dict[str, Any] = {"algo": algo, "state": state, "key": key, "compiled": None, "jaxpr": None}
    round_fn = algo.round if hasattr(algo.round, "lower") else jax.jit(algo.round)
    t0 = time.perf_counter()
    try:
        with gc_paused():  # as jaxfednas.runtime.jit traces and lowers
            traced = round_fn.trace(state, data, key) if hasattr(round_fn, "trace") else None
            t1 = time.perf_counter()
            lowered = traced.lower() if traced is not None else round_fn.lower(state, data, key)
            t2 = time.perf_counter()
        out["compiled"] = lowered.compile()
        t3 = time.perf_counter()
    except Exception as e:  # noqa: BLE001 -- a round that is not one compiled function
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return out
    out["jaxpr"] = traced.jaxpr if traced is not None else None
    out["times"] = {"trace_s": (t1 - t0) if traced is not None else None,
                    "lower_s": t2 - t1, "compile_s": t3 - t2}
    return out


def _by_precision(cfg: ExperimentConfig, data: FederatedData, built: dict, precisions, say) -> dict[str, Any]:
    """XLA's memory and cost analysis of the round compiled in each of ``precisions``
    (``run.precision``; ``built``: the round of ``cfg``'s own, reused). A precision the
    algorithm refuses, or a round that does not compile, is reported with the reason."""
    out: dict[str, Any] = {}
    for p in precisions:
        if p == cfg.run.precision:
            b = built
        else:
            try:  # a refusal may come from the config or from the algorithm's build
                other = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, precision=p))
                say(f"compiling the round in {p} ...")
                b = _compile(other, data)
            except ConfigError as e:
                out[p] = {"available": False, "error": str(e)}
                continue
        if b["compiled"] is None:
            out[p] = {"available": False, "error": b["error"]}
            continue
        out[p] = {"available": True, "compile_s": round(b["times"]["compile_s"], 3),
                  "memory_bytes_per_device": _memory(b["compiled"]), "xla_cost": _cost(b["compiled"])}
    return out


def _run_timed(compiled, state, data, key) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(state, data, key))
    return time.perf_counter() - t0


def _sequential_clients(cfg: ExperimentConfig) -> bool:
    """Whether this device runs its clients one at a time (``lax.map``, chunk 1): then a local
    step past a client's count is a real ``lax.cond`` skip and costs (almost) nothing. Under
    ``vmap`` a skipped step is a select that computes the step anyway."""
    p = Placement.from_run(cfg.run)
    mode = p.resolved()
    sequential = mode == "map" or (mode == "shard_map" and p.resolved_within() == "map")
    return sequential and (p.client_chunk_size or 1) == 1


def _chunks_apply(cfg: ExperimentConfig) -> bool:
    """Whether ``run.client_chunk_size`` changes the round of ``cfg`` on these devices: clients
    under ``lax.map`` (placement ``map``, or within each device under ``shard_map``); under
    ``vmap`` every client of a device runs at once whatever the chunk size."""
    p = Placement.from_run(_with_chunk(cfg, 2).run)
    mode = p.resolved()
    return mode == "map" or (mode == "shard_map" and p.resolved_within() == "map")


def _with_train_counts(data: FederatedData, counts: np.ndarray) -> FederatedData:
    return data.replace(train=data.train.replace(counts=jnp.asarray(counts, jnp.int32)))


def measure_round(cfg: ExperimentConfig, data: FederatedData, built: dict, local_steps: int | None) -> dict[str, Any]:
    """Seconds of one round on this device: the whole round, or (``local_steps``) rounds
    whose clients hold only a few training examples, extrapolated linearly. ``built``:
    ``{"compiled", "state", "key"}``, the round of ``cfg`` compiled ahead of time. On an
    accelerator every figure is a steady-state call (the first call, which loads the
    program and autotunes its kernels there, is run and left out); on CPU a call of 10 s
    or more (60 s for a few local steps) is taken as it is, its warm-up a small part of it."""
    compiled, state, key = built["compiled"], built["state"], built["key"]
    counts = np.asarray(data.train.counts)
    k = len(counts)
    steady = on_accelerator()
    if local_steps is None or not _sequential_clients(cfg):
        note = "" if local_steps is None else (
            "clients run vmapped here (a skipped local step costs as much as a real one): measured the whole round")
        first = _run_timed(compiled, state, data, key)
        if first >= 10.0 and not steady:  # one call: a long round's one-time warm-up is a small part of it
            return {"method": "whole round (first call)", "round_s": first, "note": note or None}
        again = _run_timed(compiled, state, data, key)  # steady state, warm-up excluded
        return {"method": "whole round (second call)", "round_s": again, "first_call_s": first, "note": note or None}
    from jaxfednas.runtime import resolve_clients_per_round

    b = getattr(cfg.algo, "batch_size", None)
    per_round = resolve_clients_per_round(cfg.run.clients_per_round, k)
    unit = int(b) if b else 1  # examples per measured step slot
    c = min(local_steps * unit, int(data.train.max_examples))
    # full participation: one client keeps c training examples, the others none; a sampled
    # subset: every client keeps c (the sampled ones then train on c each)
    reduced = np.zeros(k, np.int64)
    if per_round == k:
        reduced[0], active = c, 1
    else:
        reduced[:], active = c, per_round
    empty = _with_train_counts(data, np.zeros(k, np.int64))
    few = _with_train_counts(data, reduced)
    t_few = _run_timed(compiled, state, few, key)  # the first call includes a one-time warm-up:
    if t_few < 60.0 or steady:  # the warm-up is small against a long call on CPU, else measure again
        t_few = _run_timed(compiled, state, few, key)
    t_empty = _run_timed(compiled, state, empty, key)
    if b:
        measured_units = active * math.ceil(c / unit)
        full_units = per_round / k * sum(math.ceil(int(n) / unit) for n in counts)
        unit_name = f"local-step slots of {unit} examples (x local epochs)"
    else:
        measured_units, full_units, unit_name = active * c, per_round / k * float(counts.sum()), "training examples"
    per_unit = max(t_few - t_empty, 0.0) / measured_units
    return {"method": "local steps, extrapolated", "round_s": t_empty + per_unit * full_units,
            "empty_round_s": t_empty, "few_steps_round_s": t_few, "measured_units": measured_units,
            "round_units": full_units, "unit": unit_name,
            "note": (f"estimate: a round with no training examples ({t_empty:.3g} s) plus one with "
                     f"{measured_units} {unit_name} ({t_few:.3g} s), scaled linearly to the round's "
                     f"{full_units:.6g} (expected over the sampled clients)")}


def largest_chunk(chunk_1_bytes: int, chunk_2_bytes: int, per_device: int, budget_bytes: int) -> int:
    """Estimated largest ``client_chunk_size`` (at most ``per_device``) whose round fits
    ``budget_bytes``, linear in the clients in flight through the round's memory at chunk
    sizes 1 and 2; 0 when even one client in flight does not fit."""
    if chunk_1_bytes > budget_bytes:
        return 0
    slope = chunk_2_bytes - chunk_1_bytes
    if slope <= 0:
        return per_device
    return int(min(per_device, 1 + (budget_bytes - chunk_1_bytes) // slope))


def plan_run(cfg: ExperimentConfig, *, memory_budget_gib: float | None = None, local_steps: int | None = None,
             measure: bool = True, probe_chunk: bool = True, data: FederatedData | None = None,
             macs: bool = True, precisions: tuple[str, ...] = PRECISIONS, log: Any = None) -> dict[str, Any]:
    """The plan of ``cfg`` (see the module docstring) as a JSON-ready dict; ``None`` marks a
    figure that is not available. ``precisions``: compile the round in each of these
    ``run.precision`` values too and report their memory and cost analysis (``()``: only the
    configured one, compiled once). ``local_steps``: time rounds with only that many local-step
    slots (of ``algo.batch_size`` examples) instead of a whole round, and extrapolate;
    ``measure=False``: time nothing. ``probe_chunk=False``: compile once (no per-client
    figure). ``data``: federated data to use instead of :func:`plan_data`'s. ``log(line)``, if
    given, hears what is being done (the steps can take minutes each)."""
    say = log or (lambda line: None)
    if local_steps is not None and local_steps < 1:
        raise ConfigError(f"--local-steps must be >= 1, got {local_steps}")
    if memory_budget_gib is not None and not (memory_budget_gib > 0 and math.isfinite(memory_budget_gib)):
        raise ConfigError(f"--memory-budget-gib must be a finite number > 0, got {memory_budget_gib}")
    t0 = time.perf_counter()
    if data is None:
        data = plan_data(cfg)
    t_data = time.perf_counter() - t0
    info = data.info
    placement = Placement.from_run(cfg.run)
    per_device = placement.clients_per_device(info.num_clients)
    dev = jax.devices()[0]
    plan: dict[str, Any] = {
        "algorithm": cfg.algorithm,
        "config": cfg.to_dict(),
        "device": {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count()},
        "data": {"dataset": info.name, "synthetic_pixels": info.name in DATASET_SHAPES, "image_shape": list(info.image_shape),
                 "num_classes": info.num_classes, "num_clients": info.num_clients,
                 "train_examples_per_client": [int(n) for n in np.asarray(data.train.counts)],
                 "padded_shape": {s: list(getattr(data, s).x.shape) for s in ("train", "val", "test")},
                 "build_s": round(t_data, 3)},
        "placement": {"resolved": placement.resolved(), "client_chunk_size": cfg.run.client_chunk_size,
                      "clients_per_device": per_device},
    }
    say(f"data built ({t_data:.1f} s); tracing, lowering and compiling the round ...")
    built = _compile(cfg, data)
    state = built["state"]
    plan["parameters"] = {"model": model_params(state, info.num_clients), "state_scalars": count_params(state)}
    if built["compiled"] is None:
        plan["round"] = {"available": False, "error": built["error"]}
        return plan
    compiled = built["compiled"]
    memory = _memory(compiled)
    cost = _cost(compiled)
    plan["round"] = {"available": True, **{k: round(v, 3) if v is not None else None for k, v in built["times"].items()},
                     "memory_bytes_per_device": memory, "xla_cost": cost}
    if macs and built["jaxpr"] is not None:
        from jax.extend.core import jaxpr_as_fun

        say("counting the round's multiply-accumulates ...")
        closed = built["jaxpr"]
        plan["round"]["jaxpr_macs_upper_bound"] = count_macs(jaxpr_as_fun(closed), *[
            jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals])
    else:
        plan["round"]["jaxpr_macs_upper_bound"] = None
    plan["precisions"] = _by_precision(cfg, data, built, precisions, say)

    # clients in flight: the round at client_chunk_size 1 and 2
    per_client = None
    chunks_apply = _chunks_apply(cfg)
    if not chunks_apply:
        plan["clients_in_flight_note"] = (
            f"run.placement={cfg.run.placement} resolves to {placement.resolved()} on this device, which runs every "
            "client at once and ignores run.client_chunk_size (--set run.placement=map to chunk the clients)")
    if probe_chunk and chunks_apply and memory is not None and per_device >= 2:
        # the round as compiled already is the chunk-1 round when clients run one at a time
        same = cfg.run.client_chunk_size == 1 or (cfg.run.client_chunk_size is None and placement.resolved() == "map")
        say("compiling the round with 2 clients in flight ...")
        probe = {c: built if c == 1 and same else _compile(_with_chunk(cfg, c), data) for c in (1, 2)}
        mem = {c: _memory(b["compiled"]) if b["compiled"] is not None else None for c, b in probe.items()}
        if mem[1] is not None and mem[2] is not None:
            per_client = {"chunk_1_total": mem[1]["total"], "chunk_2_total": mem[2]["total"],
                          "per_client_in_flight": mem[2]["total"] - mem[1]["total"],
                          "compile_s": {str(c): round(b["times"]["compile_s"], 3) for c, b in probe.items()}}
        del probe
    plan["clients_in_flight"] = per_client

    budget_bytes, budget_from = ((int(memory_budget_gib * GIB), "--memory-budget-gib") if memory_budget_gib
                                 else _device_memory_bytes())
    fit: dict[str, Any] = {"budget_bytes": budget_bytes, "budget_from": budget_from, "largest_chunk_estimate": None}
    if per_client is not None and budget_bytes is not None:
        fit["largest_chunk_estimate"] = largest_chunk(per_client["chunk_1_total"], per_client["chunk_2_total"],
                                                      per_device, budget_bytes)
        fit["how"] = ("estimate: linear in the clients in flight from the round compiled at client_chunk_size "
                      "1 and 2 (run.memory_budget_gib compiles the candidates exactly)")
    plan["memory_fit"] = fit

    plan["timing"] = None
    device_bytes, device_from = _device_memory_bytes()
    if measure and memory is not None and device_bytes is not None and memory["total"] > device_bytes:
        plan["timing"] = {"skipped": f"the round needs {_bytes(memory['total'])} per device, more than the "
                                     f"{_bytes(device_bytes)} of {device_from}: not run (fewer clients in flight, "
                                     "run.client_chunk_size, lower it)"}
    elif measure:
        say("measuring the round ..." if local_steps is None else f"measuring rounds with {local_steps} local-step slots ...")
        t = measure_round(cfg, data, built, local_steps)
        rounds = cfg.run.rounds
        t["rounds"] = rounds
        t["run_s_estimate"] = t["round_s"] * rounds
        t["assumptions"] = ("estimate: rounds x one round's time on this device; compilation, evaluation, "
                            "checkpoints and data loading excluded")
        plan["timing"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items()}
    return plan


# --- report -------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    if n is None:
        return "not available"
    return f"{n / GIB:.3f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "not available"
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _duration(s: float | None) -> str:
    if s is None:
        return "not available"
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 2 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} days"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as printable lines."""
    d, p = plan["data"], plan["parameters"]
    cfg = plan["config"]
    lines = [f"plan: {plan['algorithm']} on {d['dataset']} "
             f"({'synthetic pixels at its shapes' if d['synthetic_pixels'] else 'the dataset itself'}), "
             f"{plan['device']['device_count']} x {plan['device']['device_kind']} ({plan['device']['platform']})",
             f"  data: {d['num_clients']} clients, images {'x'.join(map(str, d['image_shape']))}, "
             f"{d['num_classes']} classes; padded train {d['padded_shape']['train']}, "
             f"val {d['padded_shape']['val']}, test {d['padded_shape']['test']}",
             f"  clients per round: {cfg['run']['clients_per_round']}; rounds: {cfg['run']['rounds']}; placement "
             f"{plan['placement']['resolved']} (client_chunk_size {plan['placement']['client_chunk_size']}, "
             f"{plan['placement']['clients_per_device']} clients per device)",
             f"  parameters: model {p['model'] if p['model'] is not None else 'not available'}"
             f" ({_num(p['model']) if p['model'] is not None else '-'}); whole state {p['state_scalars']} scalars"]
    r = plan["round"]
    if not r["available"]:
        lines.append(f"  compiled round: not available ({r['error']})")
        return "\n".join(lines)
    trace = f"trace {r['trace_s']:.3g} s, " if r.get("trace_s") is not None else ""
    lines.append(f"  compile time of the round: {trace}lower {r['lower_s']:.3g} s, compile {r['compile_s']:.3g} s")
    m = r["memory_bytes_per_device"]
    if m is None:
        lines.append("  XLA memory analysis: not available")
    else:
        lines.append(f"  XLA memory per device: arguments {_bytes(m['argument'])}, outputs {_bytes(m['output'])}, "
                     f"aliased {_bytes(m['alias'])}, temporaries {_bytes(m['temp'])}; total {_bytes(m['total'])}")
    for prec, f in plan.get("precisions", {}).items():
        if not f["available"]:
            lines.append(f"  round in {prec}: not available ({f['error']})")
            continue
        m, cost = f["memory_bytes_per_device"], f["xla_cost"] or {}
        mem = "memory not available" if m is None else f"total {_bytes(m['total'])} (temporaries {_bytes(m['temp'])})"
        mark = " (configured)" if prec == cfg["run"].get("precision", "fp32") else ""
        lines.append(f"  round in {prec}{mark}: XLA memory per device {mem}, {_num(cost.get('flops'), 'FLOP')}, "
                     f"compile {f['compile_s']:.3g} s")
    c = plan.get("clients_in_flight")
    if c is None:
        why = plan.get("clients_in_flight_note") or "needs >= 2 clients per device and XLA's memory analysis"
        lines.append(f"  per client in flight: not available ({why})")
    else:
        lines.append(f"  per client in flight: {_bytes(c['per_client_in_flight'])} (round at client_chunk_size 1: "
                     f"{_bytes(c['chunk_1_total'])}, at 2: {_bytes(c['chunk_2_total'])})")
    f = plan["memory_fit"]
    if f["largest_chunk_estimate"] is None:
        lines.append(f"  largest client_chunk_size within {_bytes(f['budget_bytes'])} ({f['budget_from']}): not available")
    else:
        lines.append(f"  largest client_chunk_size within {_bytes(f['budget_bytes'])} ({f['budget_from']}): "
                     f"{f['largest_chunk_estimate']} ({f['how']})")
    cost = r["xla_cost"] or {}
    lines.append(f"  XLA cost analysis per round: {_num(cost.get('flops'), 'FLOP')}, "
                 f"{_num(cost.get('bytes accessed'), 'B')} accessed (XLA counts a loop body once: a lower bound "
                 "for a round of loops)")
    lines.append(f"  jaxpr multiply-accumulates per round: {_num(r.get('jaxpr_macs_upper_bound'), 'MAC')} "
                 "(of the program built for this backend; every loop trip counted, padded step slots "
                 "included: an upper bound)")
    t = plan.get("timing")
    if t is None:
        lines.append("  measured round: not measured")
    elif "skipped" in t:
        lines.append(f"  measured round: {t['skipped']}")
    else:
        lines.append(f"  round on this device: {_duration(t['round_s'])} ({t['method']})")
        if t.get("note"):
            lines.append(f"    {t['note']}")
        lines.append(f"  whole run: {_duration(t['run_s_estimate'])} for {t['rounds']} rounds ({t['assumptions']})")
    return "\n".join(lines)


def write_json(plan: dict[str, Any], path: str | os.PathLike) -> None:
    from jaxfednas.checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(plan, indent=1, sort_keys=True) + "\n")
