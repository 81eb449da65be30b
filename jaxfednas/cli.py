"""The ``jaxfednas`` command line.

Usage::

    jaxfednas run ALGO [--dataset digits] [--clients 8] [--rounds 10] [--seed 0] [--out DIR]
                       [--preset smoke|paper] [--resume] [--set section.field=value ...]
                       [--import MODULE_OR_FILE ...]
                       [--coordinator HOST:PORT --num-processes N --process-id I]
    jaxfednas partition --dataset digits --method dirichlet --clients 16 --alpha 0.5 --seed 0 --out DIR
    jaxfednas privacy --sampling-prob P --noise-multiplier S --steps T --delta D [--target-epsilon E]
    jaxfednas plan ALGO [--preset paper] [--set section.field=value ...] [--memory-budget-gib G]
                        [--local-steps N] [--no-round] [--json FILE] [--import MODULE_OR_FILE ...]
    jaxfednas list
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from jaxfednas.config import ConfigError, DataConfig, RunConfig, describe, parse_set
from jaxfednas.data.datasets import DATASETS
from jaxfednas.errors import RegistrationError

EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPT, EXIT_TERMINATED = 2, 3, 130, 143


def _fields_help() -> str:
    from jaxfednas.registry import ALGORITHMS, algorithm_module

    lines = ["settings for --set (section.field=value):"]
    for section, cls in (("data", DataConfig), ("run", RunConfig)):
        for name, default, help_ in describe(cls):
            lines.append(f"  {section}.{name} (default {default!r}): {help_}")
    for algo in ALGORITHMS:
        mod = algorithm_module(algo)
        lines.append(f"algo.* for {algo} (presets: {', '.join(sorted(mod.PRESETS))}):")
        for name, default, help_ in describe(mod.CONFIG):
            lines.append(f"  algo.{name} (default {default!r}): {help_}")
    return "\n".join(lines)


_IMPORT_HELP = ("import this module (a dotted name) or .py file first, e.g. one that registers an aggregator with "
                "jaxfednas.server.register_aggregator for --set run.aggregator=NAME; repeatable")


def _add_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE_OR_FILE",
                        help=_IMPORT_HELP)


def import_module_or_file(spec: str):
    """Import ``spec``: a path ending in ``.py`` (as the module named by its stem) or a dotted
    module name (also looked up in the current directory). ConfigError if there is none, or
    if the module registers a name that is refused (taken, or not a valid name)."""
    try:
        return _import(spec)
    except RegistrationError as e:
        raise ConfigError(f"--import {spec}: {e}") from None


def _import(spec: str):
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = Path(spec).resolve()
        if not path.is_file():
            raise ConfigError(f"--import {spec}: no such file")
        name = path.stem
        loaded = sys.modules.get(name)
        if loaded is not None:
            if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
                return loaded
            raise ConfigError(f"--import {spec}: a module named {name!r} is already imported from elsewhere; "
                              f"rename the file")
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name != spec.split(".")[0] or "" in sys.path or str(Path.cwd()) in sys.path:
            raise ConfigError(f"--import {spec}: {e}") from None
    sys.path.insert(0, str(Path.cwd()))  # a console script's path lacks the current directory
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        raise ConfigError(f"--import {spec}: {e}") from None


def _import_first(argv: list[str]) -> None:
    """The ``--import`` modules of ``argv``, before the parser is built (so that ``--help``
    lists what they register)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_import(pre)
    for spec in pre.parse_known_args(argv)[0].imports:
        import_module_or_file(spec)


def _parser() -> argparse.ArgumentParser:
    from jaxfednas.registry import ALGORITHMS

    p = argparse.ArgumentParser(prog="jaxfednas", description="Federated (neural architecture search) experiments in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "run", help="run an algorithm into a run directory", epilog=_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run ALGO; writes config, partition manifest, metrics.jsonl, checkpoints, plots and summary.json to --out.",
    )
    r.add_argument("algorithm", choices=sorted(ALGORITHMS), help="algorithm to run")
    r.add_argument("--preset", help="named preset: smoke (CPU minutes) or paper (the paper's settings)")
    r.add_argument("--dataset", help=f"dataset (data.dataset): {', '.join(DATASETS)}")
    r.add_argument("--data-dir", help="prepared data directory (data.data_dir)")
    r.add_argument("--download", action="store_true", help=_DOWNLOAD_HELP)
    r.add_argument("--clients", type=int, help="number of clients K (data.num_clients)")
    r.add_argument("--partition", help="iid, dirichlet or label_skew (data.partition)")
    r.add_argument("--alpha", type=float, help="Dirichlet concentration (data.alpha)")
    r.add_argument("--rounds", type=int, help="federated rounds (run.rounds)")
    r.add_argument("--clients-per-round", help="count or fraction of clients per round (run.clients_per_round)")
    r.add_argument("--seed", type=int, help="seed (run.seed)")
    r.add_argument("--seeds", metavar="LIST", help="run once per seed (e.g. 0,1,2 or 0-4), each into --out/seed_<s>; "
                   "writes --out/results.md: every final metric's mean ± std over the seeds")
    r.add_argument("--placement", help="auto, vmap, map or shard_map (run.placement)")
    r.add_argument("--out", help="run directory (default runs/ALGO-DATASET-sSEED)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="any setting (see below); repeatable")
    r.add_argument("--no-progress", action="store_true", help="no progress line even on a terminal")
    _add_import(r)
    mp = r.add_argument_group(
        "several processes / hosts (jax.distributed; every process runs the same command with its own "
        "--process-id; or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; SLURM is detected)")
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    mp.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 .. N-1 (0 writes the run directory)")

    q = sub.add_parser("partition", help="partition a dataset, print the label table, write manifest and heatmap")
    q.add_argument("--dataset", default="digits")
    q.add_argument("--data-dir")
    q.add_argument("--download", action="store_true", help=_DOWNLOAD_HELP)
    q.add_argument("--method", default="dirichlet", help="iid, dirichlet or label_skew")
    q.add_argument("--clients", type=int, default=8)
    q.add_argument("--alpha", type=float, default=0.5)
    q.add_argument("--classes-per-client", type=int, default=2)
    q.add_argument("--min-size", type=int, default=10)
    q.add_argument("--split", default="0.75,0,0.25", help="train,val,test fractions of each client")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--out", required=True, help="output directory")

    pr = sub.add_parser("privacy", help="privacy accounting: CLT μ-GDP vs PLD vs RDP epsilons, calibration")
    add_privacy_arguments(pr)

    pl = sub.add_parser(
        "plan", help="compile a round at the real shapes (no dataset needed): memory, FLOPs, timing estimates",
        description="Build ALGO's round at the configured shapes with synthetic pixels (the dataset's sizes, "
                    "e.g. CIFAR-10: 50000/10000 images of 32x32x3), compile it ahead of time and report parameters, "
                    "XLA's memory and cost analysis, compile time, a measured round and the extrapolated run time.")
    pl.add_argument("algorithm", help="algorithm to plan (see `jaxfednas list`)")
    pl.add_argument("--preset", help="named preset, e.g. paper")
    pl.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="any setting, as for `run`; repeatable")
    pl.add_argument("--memory-budget-gib", type=float, metavar="G",
                    help="memory per device to fit client_chunk_size into (default: the device's memory)")
    pl.add_argument("--local-steps", type=int, metavar="N",
                    help="time rounds with N local-step slots of training (batch_size examples, every local epoch) "
                         "instead of a whole round and extrapolate (clients run one at a time; else the whole round)")
    pl.add_argument("--no-round", action="store_true", help="compile only: measure no round")
    pl.add_argument("--no-chunk-probe", action="store_true",
                    help="compile the round once (no per-client-in-flight memory, no budget fit)")
    pl.add_argument("--json", metavar="FILE", help="also write the figures as JSON to FILE")
    _add_import(pl)

    sub.add_parser("list", help="list algorithms and their presets")
    return p


def _run(args) -> int:
    from jaxfednas.distributed import initialize, is_main

    initialize(args.coordinator, args.num_processes, args.process_id)  # (before any other JAX work)
    from jaxfednas.experiment import NonFiniteError, run_experiment
    from jaxfednas.process import enable_compilation_cache
    from jaxfednas.registry import make_config
    from jaxfednas.resume import resume_config

    flags = {
        "data.dataset": args.dataset, "data.data_dir": args.data_dir, "data.num_clients": args.clients,
        "data.partition": args.partition, "data.alpha": args.alpha, "run.rounds": args.rounds,
        "run.clients_per_round": args.clients_per_round, "run.seed": args.seed, "run.placement": args.placement,
    }
    overrides = {k: v for k, v in flags.items() if v is not None}
    overrides.update(parse_set(args.set))
    if args.out is not None and not args.out.strip():
        raise ConfigError("--out is empty: give a directory, or leave --out out for runs/ALGO-DATASET-sSEED")
    if args.seeds is not None and (args.seed is not None or "run.seed" in overrides):
        raise ConfigError("give --seed (or run.seed) or --seeds, not both")
    if args.resume:
        if not args.out:
            raise ConfigError("--resume needs --out DIR (the run directory to continue)")
        src = Path(args.out)
        if args.seeds is not None:  # the first seed's run holds the configuration
            from jaxfednas.seeds import parse_seeds, seed_dir_name
            src = src / seed_dir_name(parse_seeds(args.seeds)[0])
        cfg = resume_config(src, overrides)
        if args.preset is not None:
            _check_preset_on_resume(args.algorithm, args.preset, cfg, overrides, src)
    else:
        cfg = make_config(args.algorithm, preset=args.preset, overrides=overrides)
    if cfg.algorithm != args.algorithm:
        raise ConfigError(f"--resume: {args.out} holds a {cfg.algorithm} run, not {args.algorithm}")
    out = args.out or f"runs/{cfg.algorithm}-{cfg.data.dataset}-s{cfg.run.seed}"
    if args.download:
        _download(cfg.data.dataset, cfg.data.data_dir)
    enable_compilation_cache()
    try:
        if args.seeds is not None:  # a diverged seed stops the job as a diverged run does
            return _run_seeds(args, cfg)
        summary = run_experiment(cfg, out, resume=args.resume, progress=False if args.no_progress else None)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    if not is_main():
        return 0
    print(f"partition ({cfg.data.partition}, {cfg.data.num_clients} clients):")
    print(summary["_partition_table"])
    if "_client_table" in summary:
        print("\nper-client test accuracy (final model):")
        print(summary["_client_table"])
    print()
    for k, v in summary["final"].items():
        print(f"{k:>36}: {v:.4f}")
    print(f"{'rounds':>36}: {summary['rounds']}")
    print(f"{'wall time (s)':>36}: {summary['timing']['wall_time_s']}")
    print(f"run directory: {out}")
    return 0


def _check_preset_on_resume(algorithm: str, preset: str, cfg, overrides: dict, src: Path) -> None:
    """``--preset`` with ``--resume``: the run continues with the configuration it was made with, so a
    preset that would change it is refused in one line (it was ignored without a word)."""
    from jaxfednas.config import apply_overrides
    from jaxfednas.registry import preset_overrides

    with_preset = apply_overrides(cfg, {**preset_overrides(algorithm, preset), **overrides})
    before, after = cfg.to_dict(), with_preset.to_dict()
    changed = [f"{s}.{k}={before[s][k]!r} -> {after[s][k]!r}" for s in ("data", "run", "algo")
               for k in before[s] if before[s][k] != after[s][k]]
    if changed:
        shown = ", ".join(changed[:2]) + (f" and {len(changed) - 2} more" if len(changed) > 2 else "")
        raise ConfigError(f"--preset {preset} with --resume: the run in {src} was not made with it ({shown}); a "
                          "resumed run keeps its configuration: leave --preset out, or start the preset in a new --out")


def _run_seeds(args, cfg) -> int:
    """``--seeds``: one run per seed into ``--out/seed_<s>`` (each resumable), then the table
    (the examples' seeds loop, :func:`jaxfednas.seeds.over_seeds`: ``results.md``,
    ``results.json``)."""
    import dataclasses

    from jaxfednas.distributed import is_main
    from jaxfednas.experiment import run_experiment
    from jaxfednas.rundir import holds_run
    from jaxfednas.seeds import over_seeds, parse_seeds

    seeds = parse_seeds(args.seeds)
    out = Path(args.out or f"runs/{cfg.algorithm}-{cfg.data.dataset}-seeds")

    def one_seed(seed: int, d: Path) -> dict:
        c = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))
        summary = run_experiment(c, d, resume=args.resume and holds_run(d),
                                 progress=False if args.no_progress else None)
        return {"numbers": {k: v for k, v in summary["final"].items() if isinstance(v, (int, float))}}

    over_seeds(seeds, one_seed, out, title=f"{cfg.algorithm} on {cfg.data.dataset}: final metrics over seeds",
               note="Each seed: a run directory of its own, `seed_<s>/` (`run.seed` draws the partition too).")
    if is_main():  # (the table's writer)
        print(f"run directories: {out}/seed_<s>; table: {out / 'results.md'}")
    return 0


def _check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output path that cannot be a file."""
    p = Path(path)
    if not path.strip() or p.is_dir():
        raise ConfigError(f"{flag} {path!r} is {'empty' if not path.strip() else 'a directory'}: give a file path")


def _plan(args) -> int:
    from jaxfednas.plan import format_plan, plan_run, write_json
    from jaxfednas.registry import make_config

    cfg = make_config(args.algorithm, preset=args.preset, overrides=parse_set(args.set))
    if args.json is not None:
        _check_output_file(args.json, "--json")
    print(f"planning {cfg.algorithm} (preset {args.preset or 'none'}): building data and compiling the round ...",
          flush=True)
    plan = plan_run(cfg, memory_budget_gib=args.memory_budget_gib, local_steps=args.local_steps,
                    measure=not args.no_round, probe_chunk=not args.no_chunk_probe,
                    log=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    print(format_plan(plan))
    if args.json:
        write_json(plan, args.json)
        print(f"wrote {args.json}")
    return 0


_DOWNLOAD_HELP = ("cifar10/cifar100: first fetch the official archive into --data-dir (md5 checked) unless one is "
                  "there; run it once before a multi-process run")


def _download(dataset: str, data_dir: str | None) -> None:
    from jaxfednas.data.datasets import download_cifar, find_cifar_archive

    if dataset not in ("cifar10", "cifar100") or not data_dir:
        raise ConfigError(f"--download fetches cifar10 or cifar100 into --data-dir DIR; got dataset {dataset!r}, "
                          f"data dir {data_dir!r}")
    if find_cifar_archive(dataset, data_dir) is None:
        print(f"downloaded {download_cifar(dataset, data_dir)}")


def _partition(args) -> int:
    from jaxfednas.config import ExperimentConfig, replace_fields
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.experiment import make_partition
    from jaxfednas.reports import write_partition_report
    from jaxfednas.rundir import check_run_directory, holds_run, RunDirectoryError

    d = replace_fields(DataConfig(), "data", {
        "dataset": args.dataset, "data_dir": args.data_dir, "num_clients": args.clients, "partition": args.method,
        "alpha": args.alpha, "classes_per_client": args.classes_per_client, "min_size": args.min_size,
        "split": args.split, "partition_seed": args.seed,
    })
    if args.download:
        _download(d.dataset, d.data_dir)
    if not args.out.strip():
        raise ConfigError("--out is empty: give a directory")
    out = Path(args.out)
    check_run_directory(out)
    if holds_run(out.absolute().parent) or holds_run(out):
        run_dir = out if holds_run(out) else out.absolute().parent
        raise RunDirectoryError(f"--out {args.out} lies in the run directory {run_dir}, whose partition is the "
                                "run's own record: choose another --out")
    _refuse_foreign_partition_files(out)
    dataset = load_dataset(d.dataset, d.data_dir)
    manifest = make_partition(ExperimentConfig("partition", d, RunConfig(seed=args.seed), None), dataset)
    print(write_partition_report(manifest, dataset, Path(args.out)))
    print(f"manifest sha256 {manifest['sha256']}; wrote {args.out}/manifest.json, label_counts.txt, label_heatmap.png")
    return 0


def _refuse_foreign_partition_files(out: Path) -> None:
    """A one-line RunDirectoryError where ``out`` holds files of the names ``partition`` writes
    that an earlier ``partition`` did not write (its manifest.json is not a partition manifest):
    they would be replaced."""
    from jaxfednas.data import partition as part
    from jaxfednas.rundir import RunDirectoryError

    present = [n for n in ("manifest.json", "label_counts.txt", "label_heatmap.png") if (out / n).exists()]
    if not present:
        return
    try:
        part.load_manifest(out / "manifest.json")
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        raise RunDirectoryError(f"--out {out} holds {', '.join(present)}, which no earlier `jaxfednas partition` "
                                "wrote there (no partition manifest) and which this one would replace: choose another "
                                "--out") from None


def _list() -> int:
    from jaxfednas.registry import ALGORITHMS, algorithm_module

    width = max(map(len, ALGORITHMS))
    for name in sorted(ALGORITHMS):
        mod = algorithm_module(name)
        print(f"{name:{width}} presets: {', '.join(sorted(mod.PRESETS)):14} {mod.DESCRIPTION}")
    return 0


# --- `jaxfednas privacy ...`: host-side accounting (no JAX) ----------------------------


def add_privacy_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``privacy`` sub-command's options to ``parser`` (an argparse subparser)."""
    parser.add_argument("--sampling-prob", type=float, required=True,
                        help="Poisson sampling probability p = batch size / local dataset size")
    parser.add_argument("--noise-multiplier", type=float, required=True,
                        help="noise std / per-example clipping norm (sigma)")
    parser.add_argument("--steps", type=int, required=True,
                        help="number of noisy steps T touching the dataset")
    parser.add_argument("--delta", type=float, required=True, help="target delta in (0, 1)")
    parser.add_argument("--target-epsilon", type=float, default=None,
                        help="also calibrate sigma for (p, T) and the step budget for (p, sigma)")
    from jaxfednas.privacy.accounting import ACCOUNTANTS

    parser.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                        help="accountant used for --target-epsilon calibration (default: pld)")
    parser.add_argument("--pld-interval", type=float, default=None,
                        help="PLD value discretisation interval (default 1e-4, dp-accounting's, coarser for "
                             "a noise multiplier below ~0.35; coarser is faster and looser)")
    return parser


def run_privacy_command(args: argparse.Namespace) -> int:
    """Print the comparison table (and calibration results); 0 on success, 2 on bad input."""
    from jaxfednas.privacy import calibrate_noise_multiplier, compare_accountants, max_steps  # noqa: PLC0415

    try:
        report = compare_accountants(sampling_prob=args.sampling_prob,
                                     noise_multiplier=args.noise_multiplier,
                                     steps=args.steps, delta=args.delta,
                                     **({} if args.pld_interval is None
                                        else {"value_discretization_interval": args.pld_interval}))
        print(report.to_table())
        if args.target_epsilon is not None:
            sigma = calibrate_noise_multiplier(
                sampling_prob=args.sampling_prob, steps=args.steps,
                target_epsilon=args.target_epsilon, delta=args.delta,
                accountant=args.accountant)
            budget = max_steps(sampling_prob=args.sampling_prob,
                               noise_multiplier=args.noise_multiplier,
                               target_epsilon=args.target_epsilon, delta=args.delta,
                               accountant=args.accountant,
                               **({} if args.pld_interval is None or args.accountant != "pld"
                                  else {"value_discretization_interval": args.pld_interval}))
            print(f"\ncalibration ({args.accountant}) for target epsilon = "
                  f"{args.target_epsilon:g} at delta = {args.delta:g}:")
            print(f"  smallest noise_multiplier for T = {args.steps}: {sigma:.4f}")
            print(f"  largest T for noise_multiplier = {args.noise_multiplier:g}: {budget}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt as e:  # (while modules import or arguments parse, before the command's own handling)
        if type(e).__name__ == "Terminated":
            print("terminated (SIGTERM)", file=sys.stderr)
            return EXIT_TERMINATED
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPT


def _main(argv: list[str]) -> int:
    try:
        _import_first(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args = _parser().parse_args(argv)
    from jaxfednas.data.datasets import DatasetUnavailableError
    from jaxfednas.distributed import DistributedError
    from jaxfednas.files import WriteError
    from jaxfednas.process import environment_error, stop_on_sigterm, Terminated
    from jaxfednas.rundir import RunDirectoryError

    stop_on_sigterm()
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "partition":
            return _partition(args)
        if args.command == "privacy":
            return run_privacy_command(args)
        if args.command == "plan":
            return _plan(args)
        return _list()
    except (ConfigError, DatasetUnavailableError, DistributedError, FileNotFoundError, RunDirectoryError,
            WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - out of memory or a file-system fault is one line; the rest propagates
        message = environment_error(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        if isinstance(e, Terminated):
            print("terminated (SIGTERM)", file=sys.stderr)
            return EXIT_TERMINATED
        return EXIT_INTERRUPT

def entry() -> None:
    """The ``jaxfednas`` command: :func:`main`, its status the process's
    (:func:`jaxfednas.process.exit_process`: no interpreter shutdown after a signal)."""
    code = main()
    if code in (EXIT_INTERRUPT, EXIT_TERMINATED):  # jax is imported by then
        from jaxfednas.process import exit_process  # noqa: PLC0415

        exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
