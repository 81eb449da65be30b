"""FedAvg (McMahan et al. 2017) on federated data, through the Python API.

    python examples/fedavg.py                      # digits, 8 Dirichlet(0.5) clients, 30 rounds
    python examples/fedavg.py --preset paper --data-dir DIR   # CIFAR-10 setting of the FedNAS paper's baseline
    python examples/fedavg.py --set algo.lr=0.1 --rounds 50 --out runs/my-fedavg

The same run as ``jaxfednas run fedavg ...``; this file shows the library calls
behind it: a config (defaults < preset < overrides) and ``run_experiment``.
"""
from __future__ import annotations

import argparse

from jaxfednas.config import ConfigError, parse_set
from jaxfednas.experiment import run_experiment
from jaxfednas.process import exit_process, run_script
from jaxfednas.registry import make_config


def get_config(preset: str | None = None, **overrides):
    base = {"data.dataset": "digits", "data.num_clients": 8, "data.partition": "dirichlet", "data.alpha": 0.5,
            "run.rounds": 30}
    if preset is not None:
        base = {}
    return make_config("fedavg", preset=preset, overrides={**base, **overrides})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset")
    p.add_argument("--rounds", type=int)
    p.add_argument("--data-dir", help="prepared data directory (CIFAR-10 for --preset paper)")
    p.add_argument("--out", default="runs/example-fedavg")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args()
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    def job():
        overrides = parse_set(args.set)  # SECTION.FIELD=VALUE, checked as the CLI checks it
        if args.rounds is not None:
            overrides["run.rounds"] = args.rounds
        if args.data_dir is not None:
            overrides["data.data_dir"] = args.data_dir
        if not str(args.out).strip():
            raise ConfigError("--out is empty: give a directory")
        summary = run_experiment(get_config(args.preset, **overrides), args.out, resume=args.resume)
        print(summary["_client_table"])
        print({k: round(v, 4) for k, v in summary["final"].items()})

    return run_script("examples/fedavg.py", job)


if __name__ == "__main__":
    exit_process(main())
