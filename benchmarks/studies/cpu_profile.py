"""Where a FedNAS local search step spends its time on XLA:CPU, and how busy it keeps the cores.

Two measurements, each in its own subprocess:

* ``step`` -- one client's FedNAS local search (``make_local_search`` as
  ``benchmarks/fednas_search.py`` builds it: config (a) C=8, 5 cells, batch 32 or (b) C=16,
  8 cells, batch 64; 32x32x3 synthetic inputs), compiled and warmed up, then one run under
  ``jax.profiler`` (a Perfetto trace). XLA:CPU records one trace event per executed
  operation ("thunk"): the table sums them by kind (``ynn_fusion`` = a convolution or matmul
  handed to the YNNPACK library, ``*_fusion`` = XLA's own fused elementwise / reduction loops),
  and the concurrency line
  says for how much of the run 0, 1 or 2 worker threads were inside an operation. Control
  flow (``cond``, ``while``) counts its own time only, not that of the operations it ran.
* ``conv`` -- one convolution of config (b)'s widths (5x5, 16 -> 64 channels, batch 64,
  32x32) run alone, with the process allowed both cores and then one
  (``os.sched_setaffinity``): equal times mean the library runs it on one thread. Also with
  ``--xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION``
  (XLA's Eigen convolution instead of YNNPACK's), and the whole ``step`` compiled with
  ``compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""}`` (the same), timed
  alternately with the default program.

    PYTHONPATH=. python benchmarks/studies/cpu_profile.py                 # config (a) step + conv
    PYTHONPATH=. python benchmarks/studies/cpu_profile.py --configs a,b   # + config (b): 11.4 min in all (measured)

Frozen study: not maintained, may need the code of its time; its finding is in
``benchmarks/studies/README.md``.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (_bench_util)
import _bench_util as bu  # noqa: E402

EIGEN_CONV = "--xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
_OUTER = ("ThunkExecutor", "$", "PjitFunction")  # executor / Python events that contain the operations
_MARKERS = ("end: ", "SlinkyThreadPool")  # an operation's completion and a library's wait for its threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="a", help="comma list of fednas_search.py's configs: a, b")
    p.add_argument("--steps", type=int, default=2, help="MiLeNAS steps in the profiled run (one scan)")
    p.add_argument("--top", type=int, default=12, help="rows of the operation table")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for c in args.configs.split(","):
        if c not in ("a", "b"):
            p.error(f"unknown config {c!r}; choose from a, b")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


# --- trace analysis -------------------------------------------------------------------


def _events(trace_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise RuntimeError(f"jax.profiler wrote no Perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and not e["name"].startswith(_OUTER)]


def _merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _self_times(events: list[dict]) -> list[tuple[str, float]]:
    """``(name, exclusive µs)`` of every operation event: its duration less that of the
    events nested in it on its thread (a ``cond`` or ``while`` keeps only its own overhead,
    its operations count for themselves)."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in events:
        if not e["name"].startswith(_MARKERS):
            by_thread[e["tid"]].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, exclusive time] of the open events, outermost first
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                out.append(tuple(stack.pop()))
            if stack:
                stack[-1][1] -= min(e["dur"], stack[-1][0]["ts"] + stack[-1][0]["dur"] - e["ts"])
            stack.append([e, e["dur"]])
        out += [tuple(x) for x in stack]
    return [(e["name"], t) for e, t in out]


_INSTR = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_MOVES = ("copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "bitcast",
          "reshape", "broadcast", "reverse", "gather", "scatter", "tuple", "get-tuple-element", "parameter", "constant")


def _shape(type_text):
    m = re.search(r"\[([\d,]*)\]", type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _conv_label(window, out_dims, op_name, library):
    size = re.search(r"size=(\d+)x(\d+)", window)
    k = int(size.group(1)) if size else 1
    dilated = re.search(r"rhs_dilate=2", window) is not None
    strided = re.search(r"stride=2", window) is not None or re.search(r"lhs_dilate=2", window) is not None
    if k >= 8:  # the window spans the image: a kernel gradient (activations * output gradient), whose
        k = out_dims[1] if len(out_dims) == 4 else k  # window strides are the forward's dilation and
        dilated, strided = strided, dilated  # window dilation the forward's stride
        direction = "kernel gradient"
    else:
        direction = "input gradient" if "transpose(" in op_name else "forward"
    kind = f"{k}x{k}" + (" dilated" if dilated else "") + (" stride 2" if strided else "")
    return f"conv {kind}, {direction} [{library}]"


def hlo_classes(hlo: str) -> dict:
    """The operation class of every instruction of an optimised HLO module's text, by name (the
    names its trace events carry): a convolution by kernel, dilation, stride, direction (forward,
    input gradient, kernel gradient: the backward pass's ops carry ``transpose(`` in their
    ``op_name``) and library (YNNPACK fusion, oneDNN custom call, XLA's own); pooling; reductions
    (BatchNorm statistics and sums); elementwise loops (BatchNorm, ReLU, the mixed-op sums, the
    optimiser updates); data movement; control flow."""
    comps, cur = {}, None
    instrs = {}
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(" "):
            cur = h.group(1)
            comps[cur] = []
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            comps[cur].append(line)
            instrs[m.group(1)] = (m.group(2), m.group(3), line)
    out = {}
    for name, (type_text, op, line) in instrs.items():
        op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        back = "transpose(" in op_name
        phase = "backward" if back else "forward"
        body = []
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        if op == "fusion" and calls:
            body = comps.get(calls.group(1), [])
        text = "\n".join(body)
        library = "YNNPACK" if name.startswith("ynn_fusion") else "XLA"
        conv = line if op == "convolution" else next((l for l in body if " convolution(" in l), None)
        if op == "custom-call" and "__onednn$convolution" in line:
            cfg = json.loads(re.search(r"backend_config=(\{.*\})\s*$", line).group(1))["onednn_conv_config"]
            shp = [int(s) for s in cfg["kernel"]["filter"]["shape"]]
            w = cfg["window"]
            window = (f"size={shp[0]}x{shp[1]}" + (" rhs_dilate=2" if "2" in w["window_dilations"] else "")
                      + (" stride=2" if "2" in w["strides"] else ""))
            outs = re.findall(r"f32\[([\d,]*)\]", type_text)
            out_dims = [int(d) for d in outs[0].split(",")] if outs else []
            out[name] = _conv_label(window, out_dims, op_name, "oneDNN")
        elif conv is not None:
            window = (re.search(r"window=\{([^}]*)\}", conv) or [None, ""])[1]
            cm = _INSTR.match(conv)
            out[name] = _conv_label(window, _shape(cm.group(2)) if cm else [], op_name, library)
        elif op == "dot" or " dot(" in text:
            out[name] = f"matmul, {phase}"
        elif op == "reduce-window" or " reduce-window(" in text or op == "select-and-scatter" or " select-and-scatter(" in text:
            out[name] = f"pooling, {phase}"
        elif op in ("reduce",) or " reduce(" in text:
            out[name] = f"reductions (BatchNorm statistics, sums), {phase}"
        elif op in ("while", "conditional", "call"):
            out[name] = "control flow (while, cond)"
        elif op in _MOVES or (op == "fusion" and all(_INSTR.match(l).group(3) in _MOVES for l in body if _INSTR.match(l))):
            out[name] = "data movement (copy, slice, pad, concatenate)"
        else:
            out[name] = f"elementwise (BatchNorm, ReLU, mixed-op sums), {phase}"
    # a custom call's trace event carries its target after its name
    out.update({n + "__onednn$convolution": c for n, c in list(out.items()) if c.endswith("[oneDNN]")})
    return out


def analyse(events: list[dict], classes: dict | None = None) -> dict:
    """Per-kind and per-class (:func:`hlo_classes`) operation time and the worker threads'
    concurrency over the run."""
    kinds, counts = collections.Counter(), collections.Counter()
    by_class, class_counts = collections.Counter(), collections.Counter()
    classes = classes or {}
    for name, t in _self_times(events):
        kind = re.sub(r"\.\d+.*$", "", name)
        kinds[kind] += t
        counts[kind] += 1
        c = classes.get(name) or f"not in the HLO: {kind}"
        by_class[c] += t
        class_counts[c] += 1
    per_thread = collections.Counter(e["tid"] for e in events)
    workers = [t for t, n in per_thread.most_common() if n >= 0.01 * len(events)]
    edges = []
    busy = {}
    for t in workers:
        m = _merged((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == t)
        busy[t] = sum(b - a for a, b in m)
        edges += [(a, 1) for a, _ in m] + [(b, -1) for _, b in m]
    edges.sort()
    level, last, span = 0, edges[0][0], collections.Counter()
    for t, d in edges:
        span[level] += t - last
        level, last = level + d, t
    total = edges[-1][0] - edges[0][0]
    return {"kinds": {k: (v / 1e3, counts[k]) for k, v in kinds.items()},
            "classes": {k: (v / 1e3, class_counts[k]) for k, v in by_class.items()}, "threads": len(workers),
            "span_ms": total / 1e3, "busy_ms": [v / 1e3 for v in busy.values()],
            "concurrency_ms": {k: v / 1e3 for k, v in sorted(span.items())}, "events": len(events)}


# --- workers ----------------------------------------------------------------------------


def worker_step(config: str, steps: int) -> dict:
    import jax

    import fednas_search as fs
    from jaxfednas.algorithms.fednas import FedNASConfig, cpu_scheduler
    from jaxfednas.runtime import compiler_options

    C, layers, batch = fs.CONFIGS[config]
    cfg = FedNASConfig(C=C, layers=layers, batch_size=batch, local_epochs=1)
    _, _, local, variables, train, val = fs.local_search_setup(cfg, steps, 0)
    compiled = local.lower(variables, train, val, jax.random.PRNGKey(1)).compile()
    bu.timed(lambda: compiled(variables, train, val, jax.random.PRNGKey(1)))  # warm-up
    untraced, _ = bu.timed(lambda: compiled(variables, train, val, jax.random.PRNGKey(2)))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        traced, _ = bu.timed(lambda: compiled(variables, train, val, jax.random.PRNGKey(3)))
        jax.profiler.stop_trace()
        res = analyse(_events(d), hlo_classes(compiled.as_text()))
    # the same step with XLA's Eigen convolutions (multi-threaded) instead of YNNPACK's, alternated
    options = {**(compiler_options(cpu_scheduler(cfg)) or {}), "xla_cpu_experimental_ynn_fusion_type": ""}
    eigen = jax.jit(local.__wrapped__, compiler_options=options).lower(
        variables, train, val, jax.random.PRNGKey(1)).compile()
    bu.timed(lambda: eigen(variables, train, val, jax.random.PRNGKey(1)))  # warm-up
    times, outs = {"default": [], "eigen": []}, {}
    for _ in range(2):
        for name, prog in (("default", compiled), ("eigen", eigen)):
            t, outs[name] = bu.timed(lambda: prog(variables, train, val, jax.random.PRNGKey(2)))
            times[name].append(t / steps)
    diff = max(float(abs(a - b).max()) for a, b in zip(jax.tree.leaves(outs["default"]),
                                                        jax.tree.leaves(outs["eigen"])))
    return dict(res, kind=f"step:{config}", s_step=untraced / steps, s_step_traced=traced / steps,
                ab={k: bu.median(v) for k, v in times.items()}, ab_max_diff=diff, load=bu.load_line())


def worker_conv(one_core: bool) -> dict:
    if one_core:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import jax
    import jax.numpy as jnp
    from jax import lax

    x, k = jnp.ones((64, 32, 32, 16)), jnp.ones((5, 5, 16, 64))
    conv = jax.jit(lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
    conv(x, k).block_until_ready()
    times = [bu.timed(lambda: conv(x, k))[0] for _ in range(10)]
    return {"kind": "conv", "ms": 1e3 * min(times), "gflop": 2 * 64 * 32 * 32 * 25 * 16 * 64 / 1e9}


def spawn(kind: str, args, env_extra: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, __file__, "--worker", kind, "--json-out", out, "--steps", str(args.steps)]
        r = subprocess.run(cmd, env=dict(os.environ, **(env_extra or {})), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"worker {kind} failed:\n{r.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def run_worker(args) -> dict:
    if args.worker.startswith("step:"):
        return worker_step(args.worker.split(":")[1], args.steps)
    return worker_conv(args.worker == "conv:1")


# --- report -----------------------------------------------------------------------------


def class_tables(classes: dict, top: int) -> list[str]:
    """Two tables of the time by operation class (:func:`hlo_classes`): the classes grouped
    (convolutions by direction, the rest as they are), then the ``top`` largest classes."""
    if not classes:
        return []
    total = sum(ms for ms, _ in classes.values())
    groups, libs = collections.Counter(), collections.defaultdict(collections.Counter)
    for k, (ms, _) in classes.items():
        if k.startswith("conv "):
            direction, lib = k.split(", ", 1)[1].rstrip("]").split(" [")
            groups[f"convolutions, {direction}"] += ms
            libs[f"convolutions, {direction}"][lib] += ms
        else:
            groups[k] += ms
    runtime = sum(ms for g, ms in groups.items() if g.startswith("not in the HLO"))  # the runtime's own events
    groups = collections.Counter({g: ms for g, ms in groups.items() if not g.startswith("not in the HLO")})
    rows = [[g, f"{ms:.0f}", f"{100 * ms / total:.1f}%",
             ", ".join(f"{lib} {100 * v / ms:.0f}%" for lib, v in libs[g].most_common()) if g in libs else ""]
            for g, ms in groups.most_common()]
    rows.append(["the runtime's own events (not in the HLO)", f"{runtime:.0f}", f"{100 * runtime / total:.1f}%", ""])
    detail = sorted(classes.items(), key=lambda kv: -kv[1][0])[:top]
    rows2 = [[k, n, f"{ms:.0f}", f"{100 * ms / total:.1f}%"] for k, (ms, n) in detail]
    return ["By operation class (from the compiled HLO: a convolution's direction from its window and "
            "`op_name`, its library from the thunk):", "",
            bu.markdown_table(["class", "ms (summed over threads)", "share", "by library"], rows), "",
            bu.markdown_table(["class (largest)", "events", "ms", "share"], rows2), ""]


def report(args, steps: dict, convs: list) -> str:
    import fednas_search as fs

    lines = []
    for config, r in steps.items():
        kinds = sorted(r["kinds"].items(), key=lambda kv: -kv[1][0])
        total = sum(ms for ms, _ in r["kinds"].values())
        rows = [[k, n, f"{ms:.0f}", f"{100 * ms / total:.1f}%"] for k, (ms, n) in kinds[:args.top]]
        conc, busy, span = r["concurrency_ms"], r["busy_ms"], r["span_ms"]
        lines += [f"**{fs.config_label(config)}**: {r['s_step']:.2f} s/step untraced, "
                  f"{r['s_step_traced']:.2f} traced ({args.steps} steps profiled, {r['events']} operation events, "
                  f"load {r['load']}).", "",
                  bu.markdown_table(["operation kind", "events", "ms (summed over threads)", "share"], rows), "",
                  f"Worker threads: {r['threads']}; busy {', '.join(f'{b:.0f}' for b in busy)} ms of a "
                  f"{span:.0f} ms run ({', '.join(f'{100 * b / span:.0f}%' for b in busy)}). "
                  "Time with 0 / 1 / 2 threads inside an operation: "
                  + " / ".join(f"{conc.get(str(k), 0.0):.0f} ms ({100 * conc.get(str(k), 0.0) / span:.0f}%)"
                               for k in range(3)) + ".", ""]
        lines += class_tables(r.get("classes", {}), args.top)
    rows = [[fs.config_label(c), f"{r['ab']['default']:.2f}", f"{r['ab']['eigen']:.2f}",
             f"{r['ab']['default'] / r['ab']['eigen']:.2f}x", f"{r['ab_max_diff']:.1e}"] for c, r in steps.items()]
    lines += ["**The whole step with Eigen's convolutions** (compiler option `xla_cpu_experimental_ynn_fusion_type`"
              " = empty: no YNNPACK fusions), 2 runs each, alternated with the default program, medians:", "",
              bu.markdown_table(["config", "default s/step", "Eigen s/step", "speed of Eigen", "max |Δ| of outputs"],
                                rows), ""]
    if convs:
        rows = [[label, f"{r['ms']:.1f}", f"{r['gflop'] / r['ms'] * 1e3:.0f}"] for label, r in convs]
        lines += ["**One convolution alone** (5x5, 16 -> 64 channels, batch 64, 32x32, best of 10):", "",
                  bu.markdown_table(["XLA:CPU convolution / cores allowed", "ms", "GFLOP/s"], rows), ""]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    bu.ensure_repo_on_path()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fednas_search
    if bu.serve_worker(args, run_worker):
        return 0
    t0 = time.perf_counter()
    steps = {c: spawn(f"step:{c}", args) for c in args.configs.split(",")}
    convs = []
    for label, env in (("YNNPACK (default)", {}), ("Eigen", {"XLA_FLAGS": EIGEN_CONV})):
        for cores in (2, 1):
            convs.append((f"{label}, {cores} core{'s' * (cores > 1)}", spawn(f"conv:{cores}", args, env)))
    body = report(args, steps, convs) + f"\nTotal wall time of this run: {(time.perf_counter() - t0) / 60:.1f} min.\n"
    bu.publish("Where a FedNAS step's time goes on XLA:CPU", "studies/cpu_profile.py", body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
