"""Peak memory of one FedNAS round through the plain Python API, with and without the
post-compile memory release.

A user who calls ``fednas(cfg, info).round(...)`` directly (no ``run_experiment``) gets
:func:`jaxfednas.runtime.release_memory_after_compiles` by default: after each long XLA
compilation the C allocator hands the compiler's freed temporaries back to the system
before the program first runs. This script measures what that buys: each variant runs in
a fresh process (peak RSS is a per-process high-water mark) that builds 4 synthetic
32x32x3 clients, FedNAS at config (a) (C=8, 5 cells, batch 32; ``--config b``: C=16, 8
cells, batch 64) with ``Placement("map")``, ``init`` and one round of E=1 local epoch
(``--steps`` minibatches per client), and reports the process's peak RSS, the RSS after
the round, and the wall time of the first round (compile + run). ``off`` sets
``JAXFEDNAS_RELEASE_MEMORY=0`` (the listener never installs); ``on`` is the default.
``torch`` runs the same round in the PyTorch port of the authors' step
(``benchmarks/torch_darts.py``) in its own process, the baseline of the speed and memory
ratios printed under the table (measured in the same run, never taken from elsewhere).

    PYTHONPATH=. python benchmarks/api_memory.py                 # config (a), 10 steps per client
    PYTHONPATH=. python benchmarks/api_memory.py --quick         # a tiny supernet, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _bench_util as bu

CONFIGS = {"a": (8, 5, 32, 4), "b": (16, 8, 64, 4), "q": (4, 1, 8, 1)}  # C, cells, batch, nodes
QUICK = {"config": "q", "steps": 2, "clients": 2}
VARIANTS = ("off", "on", "torch")

def worker(args) -> dict:
    import jax

    from jaxfednas.algorithms.fednas import FedNASConfig, fednas
    from jaxfednas.run_options import RunOptions
    from jaxfednas.data import make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.registry import make_config
    from jaxfednas.rng import init_key, round_key
    from jaxfednas.runtime import Placement

    C, layers, batch, nodes = CONFIGS[args.config]
    K = args.clients
    per_client = 2 * args.steps * batch  # half search-train, half search-val (split 0.5 / 0.5)
    ecfg = make_config("fednas", overrides={"data.dataset": "synthetic", "data.num_clients": K,
                                            "data.partition": "iid", "data.split": (0.5, 0.5, 0.0)})
    ds = load_dataset("synthetic", seed=0, num_train=K * per_client, image_shape=(32, 32, 3))
    data = make_federated_data(ds, part.manifest_splits(make_partition(ecfg, ds)))
    cfg = FedNASConfig(C=C, layers=layers, nodes=nodes, batch_size=batch, local_epochs=1)
    algo = fednas(cfg, data.info, run=RunOptions(clients_per_round=K, placement=Placement(args.placement)))
    state = algo.init(init_key(0))
    t0 = time.perf_counter()
    state, metrics = algo.round(state, data, round_key(0, 0))
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    out = {"peak_rss_mib": bu.peak_rss_mib(), "rss_after_mib": bu.rss_mib(), "first_round_s": first,
           "local_steps": int(metrics["local_steps"]), "train_loss": float(metrics["train_loss"]),
           "devices": jax.device_count(), "placement": Placement(args.placement).resolved()}
    if args.second_round:
        t0 = time.perf_counter()
        jax.block_until_ready(algo.round(state, data, round_key(0, 1)))
        out["second_round_s"] = time.perf_counter() - t0
    return out


def torch_worker(args) -> dict:
    """The same round in the PyTorch port of the authors' step (``benchmarks/torch_darts.py``, their
    3-pass MiLeNAS order, ``torch.set_num_threads(2)``): the clients one after another, as in their
    code, each from the round's starting weights and α with fresh optimizers, the average of the
    clients' weights and α at the end. Jax is not imported in this process."""
    import copy
    import platform

    import torch

    import torch_darts as td

    torch.set_num_threads(2)
    torch.manual_seed(0)
    C, layers, batch, nodes = CONFIGS[args.config]
    net = td.DartsSearchNetwork(C, 10, layers, steps=nodes, multiplier=nodes)
    net.train()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2 * args.steps, batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (2 * args.steps, batch), generator=g)) for _ in range(args.clients)]

    def one_round() -> float:
        start = copy.deepcopy(net.state_dict()), [a.detach().clone() for a in net.arch_parameters()]
        sums = None
        t0 = time.perf_counter()
        for x, y in data:
            net.load_state_dict(start[0])
            with torch.no_grad():
                for a, a0 in zip(net.arch_parameters(), start[1]):
                    a.copy_(a0)
            w_opt, a_opt = td.make_optimizers(net)
            for i in range(args.steps):
                td.milenas_step(net, w_opt, a_opt, x[i], y[i], x[args.steps + i], y[args.steps + i])
            tensors = [t.detach().clone() for t in net.state_dict().values()] + \
                [a.detach().clone() for a in net.arch_parameters()]
            sums = tensors if sums is None else [s + t for s, t in zip(sums, tensors)]
        return time.perf_counter() - t0

    first = one_round()
    out = {"first_round_s": first, "local_steps": args.clients * args.steps, "devices": 1,
           "placement": "clients one after another", "torch": torch.__version__,
           "python": platform.python_version()}
    if args.second_round:
        out["second_round_s"] = one_round()
    out.update(peak_rss_mib=bu.peak_rss_mib(), rss_after_mib=bu.rss_mib())
    return out


def versus_torch(results: dict) -> str:
    """Speed and peak memory of the default API (release on) against the PyTorch port, this run."""
    if "on" not in results or "torch" not in results:
        return ""
    ours, theirs = results["on"], results["torch"]
    key = "second_round_s" if "second_round_s" in ours and "second_round_s" in theirs else "first_round_s"
    what = "second round" if key == "second_round_s" else "first round (ours includes its compilation)"
    return (f"\n\nAgainst the PyTorch port of the authors' step in this run (torch {theirs['torch']} on Python "
            f"{theirs['python']}, 2 threads, "
            f"clients one after another): {what} {ours[key]:.1f} vs {theirs[key]:.1f} s = "
            f"**{theirs[key] / ours[key]:.2f}x** its speed; peak RSS {ours['peak_rss_mib'] / 1024:.2f} vs "
            f"{theirs['peak_rss_mib'] / 1024:.2f} GiB = **{ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}x**.")


def per_config(p, text: str, configs: list[str], what: str) -> list[int]:
    """``--steps`` / ``--clients``: one positive integer for every config, or one per config."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"--{what} must be an integer or a comma list of integers, got {text!r}")
    if len(values) == 1:
        values *= len(configs)
    if len(values) != len(configs) or min(values) < 1:
        p.error(f"--{what} needs one positive integer, or one per config ({len(configs)}), got {text!r}")
    return values


def measure(args, config: str, steps: int, clients: int, torch_exe: str | None) -> str:
    """Every variant of one config, each in a fresh process; the section's text."""
    rows, results = [], {}
    for variant in args.variants.split(","):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bu.REPO_ROOT), str(bu.BENCH_DIR)]),
               "JAXFEDNAS_RELEASE_MEMORY": "0" if variant == "off" else "1", "JAXFEDNAS_CACHE": "off",
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}").strip()}
        cmd = [torch_exe if variant == "torch" else sys.executable, __file__, "--worker", variant,
               "--config", config, "--steps", str(steps), "--clients", str(clients), "--placement", args.placement]
        if args.second_round:
            cmd.append("--second-round")
        print(f"[api_memory] config {config}: {variant} ...", flush=True)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the {variant} worker of config {config} failed (exit {out.returncode})")
        res = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
        results[variant] = res
        names = {"off": "JAX, release off", "on": "JAX, release on",
                 "torch": f"PyTorch port {res.get('torch')} (Python {res.get('python')})"}
        rows.append([names[variant], f"{res['peak_rss_mib'] / 1024:.2f}", f"{res['rss_after_mib'] / 1024:.2f}",
                     f"{res['first_round_s']:.1f}",
                     f"{res['second_round_s']:.1f}" if "second_round_s" in res else "-", res["local_steps"],
                     f"{res['devices']} x {res['placement']}"])
    if "on" in results and "off" in results and results["on"]["train_loss"] != results["off"]["train_loss"]:
        raise SystemExit("the release changed the round's result")
    C, layers, batch, nodes = CONFIGS[config]
    both = {"on", "off"} <= set(results)
    body = (f"FedNAS config ({config}): C={C}, {layers} cells, {nodes} nodes, batch {batch}; {clients} "
            f"synthetic 32x32x3 clients x {steps} local steps, Placement({args.placement!r}) on "
            f"{args.devices} host device(s), the plain Python API "
            "(`fednas(cfg, info).init` then one `round`), each variant in a fresh process, no compilation cache. "
            + ("Same train loss with the release on and off (checked).\n\n" if both else "\n\n")
            + bu.markdown_table(["variant (memory release after compiles)", "peak RSS (GiB)",
                                 "RSS after the round (GiB)", "first round incl. compile (s)", "second round (s)",
                                 "local steps", "devices x placement"], rows)
            + (f"\n\nPeak with the release / without: "
               f"{results['on']['peak_rss_mib'] / results['off']['peak_rss_mib']:.2f}x." if both else ""))
    return body + versus_torch(results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="a", help=f"a config from {sorted(CONFIGS)}, or a comma list of them "
                   "(one section per config, in one run)")
    p.add_argument("--steps", default="10", help="local minibatches per client (one value, or one per config)")
    p.add_argument("--clients", default="4", help="clients of the round (one value, or one per config)")
    p.add_argument("--placement", default="map", help="run.placement of the round (auto, vmap, map, shard_map)")
    p.add_argument("--devices", type=int, default=1, help="host CPU devices (XLA_FLAGS device count) of each worker")
    p.add_argument("--variants", default="off,on", help=f"comma list from {VARIANTS}: the round with the memory "
                   "release off / on, and the PyTorch port of the authors' step (needs torch)")
    p.add_argument("--second-round", action="store_true", help="also time a second round (no compile)")
    bu.add_torch_python_arg(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    bu.add_output_args(p, "config q (C=4, one cell of one node), 2 clients x 2 steps")
    args = bu.parse_with_quick(p, argv, QUICK)
    bu.check_choices(p, args.variants, VARIANTS, "variant")
    configs = bu.check_choices(p, args.config, sorted(CONFIGS), "config")
    steps, clients = per_config(p, str(args.steps), configs, "steps"), per_config(p, str(args.clients), configs,
                                                                                "clients")
    if args.worker:
        args.steps, args.clients = steps[0], clients[0]
        print("RESULT " + json.dumps(torch_worker(args) if args.worker == "torch" else worker(args)))
        return 0
    torch_exe = None
    if "torch" in args.variants.split(","):
        torch_exe = bu.torch_python(p, args)
        if torch_exe is None:
            p.error("the torch variant needs PyTorch: `pip install torch`, or `--torch-python` naming a Python that has it")
    body = "\n\n".join(measure(args, c, n, k, torch_exe) for c, n, k in zip(configs, steps, clients))
    bu.publish("FedNAS round memory through the plain API", "api_memory.py", body,
               write=True, path=bu.results_path(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
