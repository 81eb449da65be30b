"""The command-line flags every paper example shares, declared and checked in one place.

Each example in ``examples/`` builds an :class:`ExampleParser`, names the flags it takes
with the ``add_*`` methods (its own help where its meaning is its own), adds its own
flags with ``add_argument``, and calls :meth:`ExampleParser.parse`, which makes every
wrong value of a shared flag the same one-line usage error in every example::

    p = ExampleParser(__doc__)
    p.add_preset(("smoke", "paper"))
    p.add_data("prepared CIFAR-10 (tfds data_dir) for --preset paper")
    p.add_rounds("search rounds")
    p.add_methods(("spider", "ditto"), default=("spider",), help="a subset of the methods")
    p.add_control(random=5, random_help="...", min_train_seeds=1, train_seeds_help="...")
    p.add_seeds("the whole job once per seed ...")
    p.add_run_dir("runs/fednas", set_help="override a search setting")
    args = p.parse(argv)          # args.overrides: --set, then --rounds, --dataset, ...
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxfednas.config import parse_set
from jaxfednas.data.datasets import DATASETS
from jaxfednas.errors import ConfigError
from jaxfednas.seeds import parse_seeds

DATASET_HELP = ("dataset of every stage (default: the embedded digits, or the preset's); e.g. cluttered_digits, "
                "where the architecture matters more (docs/guides/data.md)")


class ExampleParser(argparse.ArgumentParser):
    """``argparse`` with the examples' shared flags; see the module docstring."""

    def __init__(self, doc: str | None):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self._min_train_seeds: int | None = None
        self._flag_overrides: list[tuple[str, str]] = []  # (args attribute, config key)
        self._train_algorithm: str | None = None

    def add_preset(self, presets: Sequence[str], help: str = "named preset of every stage (default: digits "
                   "settings)") -> None:
        self.add_argument("--preset", choices=tuple(presets), help=help)

    def add_data(self, data_dir_help: str) -> None:
        """``--dataset`` (one of the bundled or downloadable datasets) and ``--data-dir``."""
        self.add_argument("--dataset", choices=DATASETS, help=DATASET_HELP)
        self.add_argument("--data-dir", help=data_dir_help)
        self._flag_overrides += [("dataset", "data.dataset"), ("data_dir", "data.data_dir")]

    def add_rounds(self, help: str) -> None:
        self.add_argument("--rounds", type=int, help=help)
        self._flag_overrides.append(("rounds", "run.rounds"))

    def add_seed(self) -> None:
        self.add_argument("--seed", type=int, help="run.seed of every stage (also draws the partition)")
        self._flag_overrides.append(("seed", "run.seed"))

    def add_control(self, *, random: int, random_help: str, min_train_seeds: int, train_seeds_help: str,
                    match_size_help: str | None = None) -> None:
        """The searched-vs-random control: ``--random N``, ``--train-seeds N`` (at least
        ``min_train_seeds``) and, where the example has it, ``--match-size``."""
        self.add_argument("--random", type=int, default=random, metavar="N", help=random_help)
        self.add_argument("--train-seeds", type=int, default=3, metavar="N", help=train_seeds_help)
        if match_size_help is not None:
            self.add_argument("--match-size", action="store_true", help=match_size_help)
        self._min_train_seeds = min_train_seeds

    def add_train_set(self, algorithm: str, help: str) -> None:
        """``--train-set SECTION.FIELD=VALUE`` (repeatable): ``algo.*`` and ``run.*`` settings
        of the trainings that evaluate architectures (configurations of ``algorithm``);
        :meth:`parse` checks them against that algorithm and leaves them in
        ``args.train_overrides``."""
        self.add_argument("--train-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                          help=help + "; repeatable")
        self._train_algorithm = algorithm

    def add_methods(self, choices: Sequence[str], *, default: Sequence[str] | None, help: str,
                    flag: str = "--only") -> None:
        """``--only METHOD[,METHOD]``: a comma-separated subset of ``choices``, left in ``args``
        as a tuple in the order of ``choices`` (``default`` when the flag is absent); an
        unknown or empty list is a one-line usage error."""
        choices = tuple(choices)

        def methods(text: str) -> tuple[str, ...]:
            names = [m.strip() for m in text.split(",") if m.strip()]
            bad = [m for m in names if m not in choices]
            if bad or not names:
                raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; choose from {', '.join(choices)}")
            return tuple(m for m in choices if m in names)

        self.add_argument(flag, type=methods, default=None if default is None else tuple(default),
                          metavar="METHOD[,METHOD]", help=help)

    def add_seeds(self, help: str) -> None:
        self.add_argument("--seeds", metavar="LIST", help=help)

    def add_run_dir(self, out: str | None, *, set_help: str, out_help: str = "output directory") -> None:
        """``--out``, ``--resume`` and ``--set SECTION.FIELD=VALUE`` (repeatable)."""
        self.add_argument("--out", default=out, help=out_help)
        self.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
        self.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                          help=set_help + "; repeatable")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parse and check the shared flags; ``args.overrides`` holds ``--set`` and then the
        settings the shared flags name (``--rounds`` -> ``run.rounds``, ``--dataset`` ...)."""
        args = self.parse_args(argv)
        try:
            args.overrides = parse_set(args.set)
            if getattr(args, "seeds", None) is not None:
                parse_seeds(args.seeds)
        except ConfigError as e:
            self.error(str(e))
        if self._min_train_seeds is not None:
            if args.random < 0:
                self.error(f"--random {args.random}: must be >= 0")
            if args.train_seeds < self._min_train_seeds:
                self.error(f"--train-seeds {args.train_seeds}: must be >= {self._min_train_seeds}"
                           + (" (one seed has no spread)" if self._min_train_seeds == 2 else ""))
        if self._train_algorithm is not None:
            args.train_overrides = self._checked_train_set(args.train_set)
        if getattr(args, "seeds", None) is not None and "run.seed" in args.overrides:
            self.error("--seeds sets run.seed of every run itself: drop --set run.seed")
        for attr, key in self._flag_overrides:
            if getattr(args, attr) is not None:
                args.overrides[key] = getattr(args, attr)
        return args

    def _checked_train_set(self, items: Sequence[str]) -> dict:
        from jaxfednas.registry import make_config  # noqa: PLC0415  (the algorithms' modules, when used)

        try:
            over = parse_set(items)
            make_config(self._train_algorithm, overrides=over)  # a wrong name or value: a usage error now
        except ConfigError as e:
            self.error(str(e))
        if any(not k.startswith(("algo.", "run.")) for k in over):
            self.error(f"--train-set {', '.join(k for k in over if not k.startswith(('algo.', 'run.')))}: only "
                       "algo.* and run.* settings (the trainings use the search's clients)")
        return over
