"""FedNAS local search on CPU: the MiLeNAS step in JAX vs PyTorch, a search round by
client placement, supernet compile time and memory per client.

Parts (``--parts``, default all):

* ``step``    -- one client's FedNAS local search (``jaxfednas.algorithms.fednas.make_local_search``,
  1 local epoch of ``--steps`` minibatches, i.e. one ``lax.scan`` of ``--steps`` MiLeNAS
  steps of Eq. 4: train batch -> ∇w, ∇α; own validation batch -> ∇α; optax update),
  AOT-compiled (lower + compile timed), then run ``1 + --repeats`` times (the first run is
  the warm-up); s/step = median over repeats of run time / steps. Configs: (a) C=8, 5
  cells, batch 32; (b) C=16, 8 cells, batch 64 (the FedNAS paper's); 32x32x3 inputs,
  10 classes, the 8-op DARTS space, no augmentation. Config (a) also with
  ``order="alpha_first"`` (the authors' order: α step, then the w step at the new α).
* ``torch``   -- the same-run PyTorch baseline (``benchmarks/torch_darts.py``): the same
  supernet written in PyTorch and the authors' MiLeNAS step (α step by autograd.grad
  w.r.t. α of L_train and L_val, Adam; then the w step, SGD), ``torch.set_num_threads(2)``,
  the same configs and number of steps (one warm-up step, then ``--repeats`` times
  ``--steps`` steps). Skipped with a note when torch is not importable.
* ``round``   -- one FedNAS round (``fednas(...).round``) of 4 synthetic 32x32x3 clients (64
  search-train / 32 search-val examples each, iid), config (a) (``--round-config``), E=1: ``Placement("vmap")``,
  ``Placement("map")`` (sequential) and a Python loop over clients of a jitted
  single-client ``make_local_search`` then a jitted ``weighted_mean``.
* ``compile`` -- lower + XLA compile of config (b)'s (``--memory-config``) local search (scanned layout, the
  default), from the config (b) ``step`` process.
* ``memory``  -- memory per client, config (b), batch 64: in the config (b) ``step`` process
  (one client), the RSS right before the first run (model, data, compiled executable
  resident) is subtracted from the peak RSS of all runs; the peak is measured by resetting
  the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) after compilation,
  so compile-time memory does not count. The same for the PyTorch process.

Every measurement runs in a fresh subprocess (peak RSS is a per-process high-water mark).

    PYTHONPATH=. python benchmarks/fednas_search.py --quick   # CI: config q, 1 step, every part in seconds
    PYTHONPATH=. python benchmarks/fednas_search.py      # full run (~25 min): (a) 3 steps x 3, (b) 2 steps x 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _bench_util as bu

CONFIGS = {  # name: (C, layers, batch)
    "a": (8, 5, 32),
    "b": (16, 8, 64),
    "q": (4, 1, 8),  # --quick: one (reduction) cell of 1 node, small enough to compile in seconds
}
NODES = {"q": 1}  # intermediate nodes per cell (DARTS' `steps`) where not the DARTS 4
PARTS = ("step", "torch", "round", "compile", "memory")
PLACEMENTS = ("vmap", "map", "loop")
# The authors' FedNAS code measured by the team on a 2-core machine like this one (not in this run).
REFERENCE = {"a": {"s_step": 7.5, "rss_gib": None}, "b": {"s_step": 41.0, "rss_gib": 13.0}}
QUICK = {"configs": "q", "round_config": "q", "memory_config": "q", "steps": 1, "repeats": 1, "b_steps": 1,
         "b_repeats": 1, "placements": "map,loop", "round_clients": 2, "round_train": 16}
DFNAS_GPU_GB_PER_CLIENT = 10.8  # DFNAS paper: FedNAS memory per client on GPU, batch 64
ROUND_CLIENTS, ROUND_TRAIN_PER_CLIENT = 4, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="a,b", help="comma list of a (C=8, 5 cells, B=32), b (C=16, 8 cells, B=64)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list from {PARTS}")
    p.add_argument("--steps", type=int, default=3, help="MiLeNAS steps per timed run (one scan)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (median reported)")
    p.add_argument("--b-steps", type=int, default=2, help="--steps for config b (0: --steps)")
    p.add_argument("--b-repeats", type=int, default=1, help="--repeats for config b (0: --repeats)")
    p.add_argument("--round-repeats", type=int, default=1, help="timed rounds per placement")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma list from {PLACEMENTS}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="FedNASConfig override for every JAX worker, e.g. --set group_edges=off (repeatable)")
    p.add_argument("--round-config", default="a", help="config of the `round` part")
    p.add_argument("--round-clients", type=int, default=ROUND_CLIENTS, help="clients of the `round` part")
    p.add_argument("--round-train", type=int, default=ROUND_TRAIN_PER_CLIENT,
                   help="search-train examples per client in the `round` part (half as many search-val)")
    p.add_argument("--memory-config", default="b", help="config of the `compile` and `memory` parts")
    p.add_argument("--no-write", action="store_true", help="print only; do not write to RESULTS.md")
    bu.add_output_args(p, "config q (C=4, 1 cell of 1 node, B=8) for every part, 1 step x 1 run, rounds by `map` and "
                       "the Python loop; without torch installed the PyTorch rows are skipped")
    bu.add_torch_python_arg(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = bu.parse_with_quick(p, argv, QUICK)
    for c in args.configs.split(",") + [args.round_config, args.memory_config]:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; choose from {sorted(CONFIGS)}")
    for part in args.parts.split(","):
        if part not in PARTS:
            p.error(f"unknown part {part!r}; choose from {PARTS}")
    for pl in args.placements.split(","):
        if pl not in PLACEMENTS:
            p.error(f"unknown placement {pl!r}; choose from {PLACEMENTS}")
    wants_torch = not args.worker and {"torch", "memory"} & set(args.parts.split(","))
    args.torch_exe = bu.torch_python(p, args) if wants_torch else None
    return args


def steps_repeats(args, config: str) -> tuple[int, int]:
    if config == "b":
        return (args.b_steps or args.steps), (args.b_repeats or args.repeats)
    return args.steps, args.repeats


# --- memory probes (Linux /proc) ------------------------------------------------------


rss_mib, hwm_mib, reset_hwm = bu.rss_mib, bu.hwm_mib, bu.reset_hwm  # (dfnas_cost, elastic_single_path use fs.*)


# --- JAX workers ----------------------------------------------------------------------


def _single_client_data(n_train: int, n_val: int, seed: int):
    """One synthetic 32x32x3 client: search-train rows 0..n_train-1, search-val the next n_val."""
    import numpy as np

    from jaxfednas.data import make_federated_data
    from jaxfednas.data.datasets import load_dataset

    ds = load_dataset("synthetic", seed=seed, num_train=n_train + n_val, image_shape=(32, 32, 3))
    splits = {"train": [np.arange(n_train)], "val": [np.arange(n_train, n_train + n_val)], "test": [np.arange(1)]}
    data = make_federated_data(ds, splits)
    first = lambda split: jax_tree_row(data.all_clients(split), 0)  # noqa: E731
    return data.info, first("train"), first("val")


def jax_tree_row(tree, i):
    import jax

    return jax.tree.map(lambda a: a[i], tree)


def with_overrides(cfg, args):
    """``cfg`` with the ``--set FIELD=VALUE`` pairs applied (coerced and checked as the CLI's
    ``--set algo.FIELD=VALUE``)."""
    from jaxfednas.config import parse_set, replace_fields

    return replace_fields(cfg, "algo", parse_set(args.set))


def local_search_setup(cfg, steps: int, seed: int):
    """One synthetic client's FedNAS local search of ``steps`` minibatches under ``cfg`` (a
    ``FedNASConfig``): ``(info, model, local, variables, train, val)``, ``local`` jitted with the
    XLA:CPU scheduler ``fednas()``'s round uses, ``variables`` from a jitted ``init``."""
    import jax

    from jaxfednas.algorithms.fednas import cpu_scheduler, make_local_search, make_supernet
    from jaxfednas.runtime import drop_compiled, jit

    info, train, val = _single_client_data(steps * cfg.batch_size, cfg.batch_size, seed)
    model = make_supernet(cfg, info)
    local = jit(make_local_search(cfg, info, model, epochs=1), scheduler=cpu_scheduler(cfg),
                keep_calls=model.runs_grouped(info.image_shape))  # as fednas()'s round
    x0 = jax.numpy.zeros((1,) + info.image_shape)
    # jitted, as an algorithm's init is (eager init leaves ~0.6 GiB of per-op programs resident)
    init = jax.jit(lambda k: model.init({"params": k}, x0, train=False))
    variables = dict(init(jax.random.PRNGKey(seed)))
    drop_compiled(init)  # as run_experiment drops init's program
    return info, model, local, variables, train, val


def worker_jax_step(args, config: str, order: str) -> dict:
    import jax

    from jaxfednas.algorithms.fednas import FedNASConfig
    from jaxfednas.cost import count_params
    from jaxfednas.nn import default_depthwise_impl
    from jaxfednas.runtime import release_memory_after_compiles

    C, layers, batch = CONFIGS[config]
    steps, repeats = steps_repeats(args, config)
    cfg = with_overrides(FedNASConfig(C=C, layers=layers, nodes=NODES.get(config, 4), batch_size=batch,
                                      local_epochs=1, order=order), args)
    release_memory_after_compiles()  # as run_experiment does
    info, model, local, variables, train, val = local_search_setup(cfg, steps, args.seed)
    keys = [jax.random.PRNGKey(1000 + r) for r in range(repeats + 1)]
    res = {"kind": f"jax:{config}:{order}", "machine": bu.machine_info(), "load_start": bu.load_line(),
           "params": count_params(variables["params"]), "steps": steps, "repeats": repeats,
           "dw_impl": default_depthwise_impl()}

    t0 = time.perf_counter()
    lowered = local.lower(variables, train, val, keys[0])
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    res.update(lower_s=t1 - t0, compile_s=t2 - t1)

    jax.block_until_ready((variables, train, val, keys))
    res["hwm_compile_mib"] = hwm_mib()
    res["rss_before_mib"] = rss_mib()
    res["hwm_reset"] = reset_hwm()
    first_s, (_, met) = bu.timed(lambda: compiled(variables, train, val, keys[0]))
    res["first_s"] = first_s
    res["hwm_first_mib"] = hwm_mib()
    if int(met["steps"]) != steps:
        raise RuntimeError(f"expected {steps} local steps, the local search ran {int(met['steps'])}")
    times = []
    for k in keys[1:]:
        t, _ = bu.timed(lambda: compiled(variables, train, val, k))
        times.append(t)
    res["hwm_runs_mib"] = hwm_mib()
    res["peak_rss_mib"] = max(res["hwm_compile_mib"], res["hwm_runs_mib"])
    res["device_peak_mib"] = bu.device_peak_mib()
    res["train_loss"] = float(met["loss_sum"]) / float(met["examples"])
    # achieved FLOP/s (after the measurements above: its compilation must not count in them)
    x = jax.numpy.zeros((batch,) + info.image_shape)
    fwd = bu.compiled_flops(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]), variables, x)
    res["fwd_gflop"] = fwd / 1e9 if fwd else None
    res["matmul_gflops"] = bu.matmul_gflops()
    res.update(times=times, load_end=bu.load_line())
    return res


def worker_round(args, placement: str) -> dict:
    import jax
    import numpy as np

    from jaxfednas.algorithms.fednas import cpu_scheduler, FedNASConfig, fednas, make_local_search, make_supernet
    from jaxfednas.run_options import RunOptions
    from jaxfednas.data import make_federated_data
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.data.federated import ClientData
    from jaxfednas.experiment import make_partition
    from jaxfednas.rng import init_key, round_key
    from jaxfednas.registry import make_config
    from jaxfednas.runtime import Placement, jit, release_memory_after_compiles, round_clients, weighted_mean

    release_memory_after_compiles()  # as run_experiment does
    C, layers, batch = CONFIGS[args.round_config]
    K = args.round_clients
    ecfg = make_config("fednas", overrides={
        "data.dataset": "synthetic", "data.num_clients": K, "data.partition": "iid", "run.seed": args.seed,
    })
    ds = load_dataset("synthetic", seed=args.seed, num_train=2 * K * args.round_train, image_shape=(32, 32, 3))
    from jaxfednas.data import partition as part

    data = make_federated_data(ds, part.manifest_splits(make_partition(ecfg, ds)))
    info = data.info
    cfg = with_overrides(FedNASConfig(C=C, layers=layers, nodes=NODES.get(args.round_config, 4), batch_size=batch,
                                      local_epochs=1), args)
    state0 = fednas(cfg, info, run=RunOptions(clients_per_round=K, placement=Placement("map"))).init(init_key(args.seed))
    keys = [round_key(args.seed, r) for r in range(args.round_repeats + 1)]
    res = {"kind": f"round:{placement}", "machine": bu.machine_info(), "load_start": bu.load_line(),
           "train_counts": [int(c) for c in np.asarray(data.train.counts)],
           "val_counts": [int(c) for c in np.asarray(data.val.counts)]}

    if placement == "loop":
        model = make_supernet(cfg, info)
        local = jit(make_local_search(cfg, info, model, cfg.local_epochs), scheduler=cpu_scheduler(cfg),
                    keep_calls=model.runs_grouped(info.image_shape))

        def prepare(key):
            return round_clients(key, K, K)

        def aggregate(outs, counts, idx):
            stacked = jax.tree.map(lambda *a: jax.numpy.stack(a), *outs)
            return weighted_mean(stacked, counts[idx])

        tr, va = data.train, data.val
        clients = [(ClientData(x=tr.x[k], y=tr.y[k], count=tr.counts[k]),
                    ClientData(x=va.x[k], y=va.y[k], count=va.counts[k])) for k in range(K)]
        t0 = time.perf_counter()
        lp = jax.jit(prepare).lower(keys[0])
        idx_s, keys_s = jax.eval_shape(prepare, keys[0])
        ll = local.lower(state0.variables, clients[0][0], clients[0][1], keys[0])
        out_s = jax.eval_shape(local, state0.variables, clients[0][0], clients[0][1], keys[0])
        la = jax.jit(aggregate).lower([out_s[0]] * K, tr.counts, idx_s)
        t1 = time.perf_counter()
        prep_c, local_c, agg_c = lp.compile(), ll.compile(), la.compile()
        t2 = time.perf_counter()

        def run(key):
            idx, ks = prep_c(key)
            outs = [local_c(state0.variables, *clients[int(k)], ks[i]) for i, k in enumerate(np.asarray(idx))]
            avg = agg_c([o[0] for o in outs], tr.counts, idx)
            return avg, sum(int(o[1]["steps"]) for o in outs)
    else:
        algo = fednas(cfg, info, run=RunOptions(clients_per_round=K, placement=Placement(placement)))
        t0 = time.perf_counter()
        lowered = algo.round.lower(state0, data, keys[0])
        t1 = time.perf_counter()
        round_c = lowered.compile()
        t2 = time.perf_counter()

        def run(key):
            state, met = round_c(state0, data, key)
            return state.variables, int(met["local_steps"])

    res.update(lower_s=t1 - t0, compile_s=t2 - t1)
    first_s, (avg, n_steps) = bu.timed(lambda: run(keys[0]))
    res["first_s"], res["local_steps"] = first_s, n_steps
    res["arch_after_round0"] = {k: np.asarray(v).tolist() for k, v in avg["arch"].items()}
    times, steps = [], []
    for k in keys[1:]:
        t, (_, s) = bu.timed(lambda: run(k))
        times.append(t)
        steps.append(s)
    res.update(times=times, step_counts=steps, peak_rss_mib=bu.peak_rss_mib(), load_end=bu.load_line())
    return res


# --- PyTorch worker (no jax imported in this process) ------------------------------------


def worker_torch(args, config: str) -> dict:
    import platform

    import torch

    import torch_darts as td

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    C, layers, batch = CONFIGS[config]
    steps, repeats = steps_repeats(args, config)
    n = NODES.get(config, 4)
    net = td.DartsSearchNetwork(C, 10, layers, steps=n, multiplier=n)
    net.train()
    w_opt, a_opt = td.make_optimizers(net)
    g = torch.Generator().manual_seed(args.seed)
    # as many distinct train batches as the JAX side has, one val batch per step
    x_tr = torch.randn(steps, batch, 3, 32, 32, generator=g)
    y_tr = torch.randint(0, 10, (steps, batch), generator=g)
    x_val = torch.randn(steps, batch, 3, 32, 32, generator=g)
    y_val = torch.randint(0, 10, (steps, batch), generator=g)
    res = {"kind": f"torch:{config}", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "python": platform.python_version(), "params": td.count_weights(net), "steps": steps,
           "repeats": repeats, "load_start": bu.load_line()}

    def run(n):
        t0 = time.perf_counter()
        for i in range(n):
            loss = td.milenas_step(net, w_opt, a_opt, x_tr[i % steps], y_tr[i % steps], x_val[i % steps],
                                   y_val[i % steps])
        return time.perf_counter() - t0, loss

    res["hwm_setup_mib"] = hwm_mib()
    res["rss_before_mib"] = rss_mib()
    res["hwm_reset"] = reset_hwm()
    res["first_s"], _ = run(1)  # warm-up step
    res["hwm_first_mib"] = hwm_mib()
    times = []
    for _ in range(repeats):
        t, loss = run(steps)
        times.append(t)
    res["train_loss"] = loss
    res["hwm_runs_mib"] = hwm_mib()
    res["peak_rss_mib"] = max(res["hwm_setup_mib"], res["hwm_runs_mib"])
    res.update(times=times, load_end=bu.load_line())
    return res


def run_worker(args) -> dict:
    kind, *rest = args.worker.split(":")
    if kind == "jax":
        return worker_jax_step(args, rest[0], rest[1])
    if kind == "torch":
        return worker_torch(args, rest[0])
    if kind == "round":
        return worker_round(args, rest[0])
    raise ValueError(args.worker)


# --- driver ---------------------------------------------------------------------------


def worker_env() -> dict:
    env = dict(os.environ)
    paths = [str(bu.REPO_ROOT), str(bu.BENCH_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def spawn(kind: str, python: str = sys.executable) -> dict:
    """Run one worker in a fresh process of ``python`` (the PyTorch worker's may be another
    interpreter: ``--torch-python``)."""
    return bu.run_worker([python, os.path.abspath(__file__), *sys.argv[1:], "--worker", kind],
                         worker_env(), {"kind": kind})


def jax_param_counts(configs) -> dict:
    """Weights of our supernet per config (the PyTorch worker reports its own: they must agree)."""
    bu.ensure_repo_on_path()
    import jax

    from jaxfednas.search_spaces.darts import DartsSearchNetwork
    from jaxfednas.cost import count_params

    out = {}
    for c in configs:
        C, layers, _ = CONFIGS[c]
        n = NODES.get(c, 4)
        net = DartsSearchNetwork(C, 10, layers, steps=n, multiplier=n)
        v = jax.eval_shape(lambda net=net: net.init(jax.random.PRNGKey(0), jax.numpy.zeros((2, 32, 32, 3)), train=False))
        out[c] = count_params(v["params"])
    return out


def ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def gib(mib: float) -> str:
    return f"{mib / 1024:.2f}"


def config_label(c: str) -> str:
    C, layers, batch = CONFIGS[c]
    nodes = f" of {NODES[c]} node{'s' if NODES[c] > 1 else ''}" if c in NODES else ""
    return f"({c}) C={C}, {layers} cells{nodes}, B={batch}"


# model FLOPs of one step in forwards: a pass with kernel gradients = forward + input gradient +
# kernel gradient (3x); Eq. 4 = training pass (3x) + validation pass without kernel gradients
# (2x); alpha_first = both of those for the α step + a training pass for the w step (3x)
FORWARDS_PER_STEP = {"simultaneous": 5, "alpha_first": 8}


def flops_table(res: dict, configs, s_step) -> list[str]:
    """Achieved FLOP/s of the JAX rows against the device's dense matmul rate (same worker)."""
    rows = []
    for c in configs:
        for order in FORWARDS_PER_STEP:
            r = res.get(f"jax:{c}:{order}")
            if r is None or "error" in r or not r.get("fwd_gflop"):
                continue
            gflop = r["fwd_gflop"] * FORWARDS_PER_STEP[order]
            rate = gflop / s_step(r)
            dev = r.get("device_peak_mib")
            rows.append([config_label(c), order, f"{r['fwd_gflop']:.1f}", f"{gflop:.0f}", f"{rate:.0f}",
                         f"{r['matmul_gflops']:.0f}", f"{rate / r['matmul_gflops']:.0%}",
                         gib(dev) if dev else "- (CPU: peak RSS above)"])
    if not rows:
        return []
    caption = ("**Achieved FLOP/s** (JAX rows): model FLOPs per step = XLA's cost-analysis FLOPs of the supernet's "
               "training-mode forward at this batch x forwards per step (Eq. 4: 5 = the training pass with input "
               "and kernel gradients 3 + the validation pass without kernel gradients 2; alpha_first: 8), divided "
               "by the median s/step above; against the rate of a dense float32 matmul measured in the same worker "
               "(2048^2 on CPU, 8192^2 on accelerators). Device peak memory: `memory_stats()['peak_bytes_in_use']` "
               "on accelerators.")
    header = ["config", "order", "forward GFLOP", "model GFLOP/step", "achieved GFLOP/s", "dense matmul GFLOP/s",
              "of matmul rate", "device peak memory GiB"]
    return [caption, "", bu.markdown_table(header, rows), ""]


def report(args, res: dict, params: dict, notes: list[str]) -> str:
    configs = args.configs.split(",")
    parts = args.parts.split(",")
    lines = []
    loads = [f"{r['kind']} {r['load_start']} / {r['load_end']}" for r in res.values() if "error" not in r]

    def s_step(r):
        return bu.median([t / r["steps"] for t in r["times"]])

    if "step" in parts or "torch" in parts:
        header = ["config", "implementation", "passes/step", "steps x runs", "compile s (lower + compile)",
                  "s/step (median)", "warm-up run s/step", "peak RSS GiB", "throughput vs PyTorch (same run)"]
        rows = []
        for c in configs:
            tr = res.get(f"torch:{c}")
            t_ok = tr is not None and "error" not in tr
            for order in (("simultaneous", "alpha_first") if c == "a" else ("simultaneous",)):
                r = res.get(f"jax:{c}:{order}")
                if r is None or "step" not in parts:
                    continue
                name = "JAX, Eq. 4 (simultaneous)" if order == "simultaneous" else "JAX, alpha_first (authors' order)"
                if "error" in r:
                    rows.append([config_label(c), name, "", "", "", "", "", "", r["error"]])
                    continue
                ratio = f"{s_step(tr) / s_step(r):.2f}x" if t_ok else "-"
                rows.append([config_label(c), name, "2 fwd + 2 bwd" if order == "simultaneous" else "3 fwd + 3 bwd",
                             f"{r['steps']} x {r['repeats']}", f"{r['lower_s']:.1f} + {r['compile_s']:.1f}",
                             ms(s_step(r)), ms(r["first_s"] / r["steps"]), gib(r["peak_rss_mib"]), ratio])
            if tr is not None:
                name = f"PyTorch {tr.get('torch', '')} on Python {tr.get('python', '?')} (this repo's torch_darts.py)"
                if "error" in tr:
                    rows.append([config_label(c), name, "", "", "", "", "", "", tr["error"]])
                else:
                    rows.append([config_label(c), name, "3 fwd + 3 bwd", f"{tr['steps']} x {tr['repeats']}",
                                 "- (eager)", ms(s_step(tr)), ms(tr["first_s"]), gib(tr["peak_rss_mib"]), "1.00x"])
            ref = REFERENCE.get(c)
            if ref:
                rows.append([config_label(c), "*reference: authors' FedNAS code (not measured in this run)*",
                             "3 fwd + 3 bwd", "-", "-", f"*{ref['s_step']}*", "-",
                             f"*{ref['rss_gib']}*" if ref["rss_gib"] else "-", "-"])
        caption = (
            "**MiLeNAS local search step** (one client; 32x32x3 synthetic inputs, 10 classes, 8-op DARTS space, "
            "no augmentation). JAX: `make_local_search` of `algorithms/fednas.py` over one local epoch of "
            "`steps` minibatches = one jitted `lax.scan` of that many steps (train batch -> ∇w, ∇α; a batch of the "
            "client's own validation split -> ∇α; optax update), compiled with the XLA:CPU scheduler `fednas()` uses "
            "(`jaxfednas.algorithms.fednas.cpu_scheduler`), AOT lower + compile, one warm-up run, then "
            "`runs` timed runs; s/step = median over runs of run time / steps. PyTorch: "
            "`benchmarks/torch_darts.py`, eager, `torch.set_num_threads(2)`, one warm-up step then `runs` x `steps` "
            "steps (the warm-up column is that single step). Peak RSS = the process's high-water mark (JAX: "
            "including compilation; as in `run_experiment`, the supernet is initialised by a jitted `init` and the C "
            "allocator's free memory is handed back after each long compilation, "
            "`jaxfednas.runtime.release_memory_after_compiles`). Throughput vs PyTorch = PyTorch s/step / this row's "
            "s/step, same config, "
            "same run; the like-for-like row is alpha_first (the authors' 3-pass order; Eq. 4 needs 2 passes)."
        )
        if "b" in configs and steps_repeats(args, "b") != steps_repeats(args, "a"):
            s, rep = steps_repeats(args, "b")
            caption += (f" Config (b) uses {s} steps x {rep} timed run(s) (a single measurement after the warm-up) "
                        "to keep the run within ~25 min: one (b) step takes tens of seconds in both frameworks.")
        if params:
            caption += " Weights: " + ", ".join(
                f"({c}) JAX {n:,} = PyTorch {n:,}" for c, n in params.items()) + " (asserted equal)."
        lines += [caption, "", bu.markdown_table(header, rows), ""]
        lines += flops_table(res, configs, s_step)

    if "round" in parts:
        header = ["placement", "compile s (lower + compile)", "s/round (median)", "client-steps/s",
                  "speed vs loop", "first round s", "peak RSS GiB", "max |Δα| vs loop (round 0)"]
        rows = []
        loop = res.get("round:loop")
        loop_ok = loop is not None and "error" not in loop
        import numpy as np

        for pl in args.placements.split(","):
            r = res.get(f"round:{pl}")
            label = {"vmap": "`Placement(\"vmap\")`", "map": "`Placement(\"map\")` (sequential)",
                     "loop": "Python loop, jitted client"}[pl]
            if r is None:
                continue
            if "error" in r:
                rows.append([label, "", "", "", "", "", "", r["error"]])
                continue
            t = bu.median(r["times"])
            sps = bu.median([s / x for s, x in zip(r["step_counts"], r["times"])])
            ratio = f"{bu.median(loop['times']) / t:.2f}x" if loop_ok else "-"
            if loop_ok:
                d = max(float(np.max(np.abs(np.asarray(r["arch_after_round0"][k]) - np.asarray(v))))
                        for k, v in loop["arch_after_round0"].items())
                delta = f"{d:.1e}"
            else:
                delta = "-"
            rows.append([label, f"{r['lower_s']:.1f} + {r['compile_s']:.1f}", ms(t), f"{sps:.2f}", ratio,
                         ms(r["first_s"]), gib(r["peak_rss_mib"]), delta])
        anyr = next((r for k, r in res.items() if k.startswith("round:") and "error" not in r), None)
        shape = ""
        if anyr:
            shape = (f" client search-train sizes {anyr['train_counts']}, search-val {anyr['val_counts']}; "
                     f"{anyr['local_steps']} local steps per round")
        lines += [
            f"**FedNAS search round by placement**: `fednas(...).round`, {args.round_clients} synthetic 32x32x3 clients "
            f"(iid), all sampled, config {config_label(args.round_config)}, E=1;{shape}; {args.round_repeats} timed rounds "
            "after a warm-up round, one subprocess per placement. Speed vs loop = loop s/round / this s/round "
            "(separate processes of the same run). The loop row runs the jitted single-client `make_local_search` "
            "per client in Python, then a jitted `weighted_mean`.",
            "",
            bu.markdown_table(header, rows),
            "",
        ]

    mc = args.memory_config
    rb = res.get(f"jax:{mc}:simultaneous")
    tb = res.get(f"torch:{mc}")
    if "compile" in parts and rb is not None:
        if "error" in rb:
            lines += [f"**Compile time, config ({mc})**: {rb['error']}", ""]
        else:
            total = rb["lower_s"] + rb["compile_s"]
            lines += [
                f"**Compile time of the supernet's local search** (config {config_label(mc)}, scanned layout, "
                f"`{rb['dw_impl']}` depthwise formulation, a scan of {rb['steps']} MiLeNAS steps, no "
                f"persistent compilation cache): trace + lower {rb['lower_s']:.1f} s, XLA compile "
                f"{rb['compile_s']:.1f} s, total **{total:.1f} s** (target < 40 s: "
                f"{'met' if total < 40 else 'not met'}).",
                "",
            ]
    if "memory" in parts and rb is not None and "error" not in rb:
        header = ["implementation", "RSS before first step GiB", "peak RSS during steps GiB",
                  "per-client memory GiB (peak - before)", "vs DFNAS paper (10.8 GB/client, GPU)"]
        rows = []

        def mem_row(name, r):
            delta = r["hwm_runs_mib"] - r["rss_before_mib"]
            gb = delta * 2**20 / 1e9
            return [name, gib(r["rss_before_mib"]), gib(r["hwm_runs_mib"]), f"{gib(delta)} ({gb:.2f} GB)",
                    f"{gb / DFNAS_GPU_GB_PER_CLIENT:.2f}x"]

        rows.append(mem_row("JAX (XLA:CPU), Eq. 4", rb))
        if tb is not None and "error" not in tb:
            rows.append(mem_row(f"PyTorch {tb['torch']} eager, authors' step", tb))
        method = ("the kernel's peak-RSS mark was reset (`/proc/self/clear_refs` = 5) right before the first step"
                  if rb.get("hwm_reset") else "peak RSS could not be reset; the process peak (incl. compile) is used")
        lines += [
            f"**Memory per client, config {config_label(mc)}**: one client per process; RSS right before the "
            "first step (model, optimizer state, data and, for JAX, the compiled executable resident) subtracted "
            f"from the peak RSS over all steps; {method}, so compilation and setup do not count. "
            "GiB = 2^30 bytes, GB = 10^9.",
            "",
            bu.markdown_table(header, rows),
            "",
        ]

    if notes:
        lines += ["Notes: " + " ".join(notes), ""]
    if loads:
        lines.append("Load average (1/5/15 min) at start / end of each worker: " + "; ".join(loads) + ".")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if bu.serve_worker(args, run_worker):
        return
    configs, parts = args.configs.split(","), args.parts.split(",")
    notes, params = [], {}
    have_torch = args.torch_exe is not None
    if "torch" in parts:
        if not have_torch:
            msg = ("PyTorch is not importable here (`pip install torch`, or `--torch-python` naming a Python that has "
                   "it): the PyTorch rows are skipped.")
            print("[fednas_search] " + msg, flush=True)
            notes.append(msg)
        else:
            params = jax_param_counts(configs)
    kinds = []
    if "step" in parts:
        for c in configs:
            kinds.append(f"jax:{c}:simultaneous")
            if c == "a":
                kinds.append("jax:a:alpha_first")
    mc = args.memory_config
    if ("compile" in parts or "memory" in parts) and f"jax:{mc}:simultaneous" not in kinds:
        kinds.append(f"jax:{mc}:simultaneous")
    if have_torch and ("torch" in parts or "memory" in parts):
        kinds += [f"torch:{c}" for c in configs if "torch" in parts]
        if "memory" in parts and f"torch:{mc}" not in kinds:
            kinds.append(f"torch:{mc}")
    if "round" in parts:
        kinds += [f"round:{pl}" for pl in args.placements.split(",")]

    t_start = time.perf_counter()
    res = {}
    for kind in kinds:
        print(f"[fednas_search] {kind} ...", flush=True)
        r = spawn(kind, args.torch_exe if kind.startswith("torch:") else sys.executable)
        res[kind] = r
        c = kind.split(":")[1] if kind.startswith("torch:") else None
        if c in params and "error" not in r:
            if r["params"] != params[c]:
                raise SystemExit(f"config {c}: the JAX supernet has {params[c]:,} weights, the PyTorch one "
                                 f"{r['params']:,}: not the same network")
            print(f"  weights ({c}) {params[c]:,} (JAX = PyTorch); torch {r['torch']} on Python {r['python']}",
                  flush=True)
        if "error" in r:
            print(f"  FAILED: {r['error']}", flush=True)
            continue
        per = "round" if kind.startswith("round") else "step"
        div = 1 if per == "round" else r["steps"]
        comp = f"compile {r['lower_s']:.1f}+{r['compile_s']:.1f}s, " if "lower_s" in r else ""
        print(f"  {comp}first {r['first_s'] / (div if kind.startswith('jax') else 1):.2f}s, median "
              f"{bu.median([t / div for t in r['times']]):.2f}s/{per}, peak rss {r['peak_rss_mib']:.0f} MiB, "
              f"worker wall {r['wall_s']:.0f}s", flush=True)
    wall = time.perf_counter() - t_start
    body = report(args, res, params, notes)
    body += f"\n\nTotal wall time of this run: {wall / 60:.1f} min."
    print()
    print(body)
    ok = [r for r in res.values() if "error" not in r and "machine" in r]
    if not args.no_write and res:
        info = ok[0]["machine"] if ok else bu.machine_info()
        title = "FedNAS local search on CPU: MiLeNAS step JAX vs PyTorch, search round by placement, compile, memory"
        path = bu.results_path(args)
        how = bu.write_results(title, bu.command_line("fednas_search.py"), info, body, path)
        print(f"\n{how} {path}")
    return 1 if any("error" in r for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
