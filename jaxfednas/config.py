"""Configuration: small frozen dataclasses with validated fields, presets, overrides.

An experiment is ``ExperimentConfig(algorithm, data, run, algo)``: the data and
run sections are shared by every algorithm; ``algo`` is the algorithm's own
dataclass (``FedAvgConfig``, ...). Each field carries its help text and its
allowed range in ``dataclasses.field(metadata=...)``; a value outside it raises
:class:`ConfigError` naming the field and the range. Presets and the command
line are flat ``{"section.field": value}`` overrides applied in order
defaults < preset < flags < ``--set``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any

from jaxfednas.errors import ConfigError
from jaxfednas.aggregators import AGGREGATORS  # run.aggregator's choices: live, grows with register_aggregator
from jaxfednas.data.datasets import DATASETS
from jaxfednas.data.partition import PARTITION_METHODS, SPLIT_METHODS

#: How clients are laid on devices (:class:`jaxfednas.runtime.Placement`).
PLACEMENTS: tuple[str, ...] = ("auto", "vmap", "map", "shard_map")
#: What client training computes in (:mod:`jaxfednas.precision`).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
#: The server's choices (:mod:`jaxfednas.server`): client samplers, aggregators, server optimizers.
SAMPLERS: tuple[str, ...] = ("uniform", "proportional", "available")
AVAILABILITY_PATTERNS: tuple[str, ...] = ("cyclic", "markov")
SERVER_OPTIMIZERS: tuple[str, ...] = ("none", "sgd", "avgm", "adagrad", "adam", "yogi")


def param(default: Any, help: str, *, range: tuple[Any, Any] | None = None, choices: tuple | None = None):
    """A config field with its help text and allowed range (inclusive) or choices."""
    meta = {"help": help, "range": range, "choices": choices}
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "None")


def _check_type(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_check_type(v, args[0]) for v in value)
        return len(value) == len(args) and all(_check_type(v, a) for v, a in zip(value, args))
    if tp is typing.Any:
        return True
    return isinstance(value, tp)


def check_fields(cfg: Any, section: str) -> None:
    """Validate every field of dataclass ``cfg`` against its type and metadata."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        name = f"{section}.{f.name}"
        if not _check_type(v, hints[f.name]):
            raise ConfigError(f"{name}={v!r} has the wrong type: expected {_type_name(hints[f.name])}")
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(f"{name}={v!r} is not allowed: choose one of {list(choices)}{getattr(choices, 'hint', '')}")
        rng = f.metadata.get("range")
        if rng is not None and v is not None:
            lo, hi = rng
            vals = v if isinstance(v, tuple) else (v,)
            for x in vals:
                if isinstance(x, float) and not math.isfinite(x):  # NaN passes both comparisons below
                    raise ConfigError(f"{name}={v!r} must be a finite number")
                if (lo is not None and x < lo) or (hi is not None and x > hi):
                    lo_s = "-inf" if lo is None else lo
                    hi_s = "inf" if hi is None else hi
                    raise ConfigError(f"{name}={v!r} is out of range: must be in [{lo_s}, {hi_s}]")


class _AcceptsFormerNames(type):
    """Construction by keyword maps a former field name (``RENAMED``) to today's, with the
    same one-line warning as an override."""

    def __call__(cls, *args, **kwargs):
        if kwargs and cls.RENAMED:
            kwargs = _renamed(cls, cls.SECTION, kwargs, warn=True, stacklevel=3)
        if kwargs and cls.RETIRED:
            kwargs = _retired(cls, cls.SECTION, kwargs, warn=True)
        return super().__call__(*args, **kwargs)


class Validated(metaclass=_AcceptsFormerNames):
    """Mixin: validate on construction; ``SECTION`` names the config section.

    ``RENAMED`` maps a field's former name to its name now: the former name is accepted
    (with a one-line :class:`FutureWarning`) as a constructor keyword and in overrides,
    presets and ``--set``, and silently in a run directory's ``config.json``, so old
    runs still resume. A subclass extends its parent's map (``{**Parent.RENAMED, ...}``).

    ``RETIRED`` maps a field that is gone to ``(value, advice)``: the field at ``value``
    (what it always was where it had no effect left) is dropped -- silently from a run
    directory's ``config.json``, with a :class:`FutureWarning` elsewhere -- and any other
    value is a :class:`ConfigError` giving ``advice`` (what to set instead)."""

    SECTION = "config"
    RENAMED: typing.ClassVar[dict[str, str]] = {}
    RETIRED: typing.ClassVar[dict[str, tuple[typing.Any, str]]] = {}

    def __post_init__(self):
        check_fields(self, self.SECTION)
        self.check()

    def check(self) -> None:
        """Cross-field checks (override)."""


@dataclasses.dataclass(frozen=True)
class DataConfig(Validated):
    """Dataset and partition (shared by every algorithm)."""

    SECTION = "data"
    dataset: str = param("digits", "dataset name", choices=DATASETS)
    data_dir: str | None = param(None, "directory with prepared data (tfds data_dir or CINIC-10 root)")
    num_clients: int = param(8, "number of clients K", range=(1, 100_000))
    partition: str = param("dirichlet", "partition method", choices=PARTITION_METHODS)
    alpha: float = param(0.5, "Dirichlet concentration (partition=dirichlet)", range=(1e-6, None))
    classes_per_client: int = param(2, "classes per client (partition=label_skew)", range=(1, 1000))
    min_size: int = param(10, "minimum examples per client (partition=dirichlet)", range=(0, None))
    split: tuple[float, float, float] = param(
        (0.75, 0.0, 0.25), "each client's train/val/test fractions", range=(0.0, 1.0)
    )
    split_method: str = param("shuffle", "how examples go to each client's splits: shuffle and cut (exact sizes) or "
                              "independent (per example, from a hash of seed and index; DP-FNAS)",
                              choices=SPLIT_METHODS)
    partition_seed: int | None = param(None, "seed of the partition (None: run.seed)", range=(0, 2**31 - 1))

    def check(self):
        if abs(sum(self.split) - 1.0) > 1e-6 or self.split[0] <= 0:
            raise ConfigError(f"data.split={self.split} must sum to 1 with a train fraction > 0")


@dataclasses.dataclass(frozen=True)
class RunConfig(Validated):
    """Rounds, sampling, placement, checkpointing (shared by every algorithm)."""

    SECTION = "run"
    rounds: int = param(10, "federated rounds T", range=(1, 1_000_000))
    clients_per_round: int | float = param(
        1.0, "clients sampled per round: an integer count, or a float fraction in (0, 1]", range=(1e-9, None)
    )
    dropout_rate: float = param(0.0, "probability that a sampled client fails to report in a round (seeded by "
                                "seed, round, client; left out of the aggregate, its rows not updated)",
                                range=(0.0, 0.999))
    seed: int = param(0, "seed of initialisation, client sampling and local randomness", range=(0, 2**31 - 1))
    placement: str = param("auto", "how clients are laid on devices", choices=PLACEMENTS)
    client_chunk_size: int | None = param(None, "clients in flight per device: clients vmapped together per lax.map "
                                          "chunk (placement map, and within each device under shard_map); None: "
                                          "one at a time with map/auto-on-CPU, all at once with vmap/auto-on-one-"
                                          "accelerator (a size makes auto chunk there too)",
                                          range=(1, None))
    memory_budget_gib: float | None = param(None, "pick client_chunk_size as the largest whose compiled round fits "
                                            "this many GiB per device (XLA's memory analysis; compiles a few "
                                            "candidates once); None: client_chunk_size as given", range=(0.001, None))
    precision: str = param("fp32", "what client training computes in: fp32, or bf16 (forward and backward in "
                           "bfloat16; parameters, BatchNorm statistics, optimizer state and evaluation float32)",
                           choices=PRECISIONS)
    eval_every: int = param(1, "evaluate every N rounds (and after the last)", range=(1, None))
    checkpoint_every: int = param(1, "checkpoint every N rounds (and after the last)", range=(1, None))
    # The server (jaxfednas.server): samplers, aggregators, server optimizers.
    sampler: str = param("uniform", "client sampler: uniform (without replacement, n_k-weighted mean), proportional "
                         "(∝ n_k with replacement, one weight per draw: unbiased), available (uniform among the "
                         "clients online in a seeded cyclic pattern)",
                         choices=SAMPLERS)
    availability_period: int = param(2, "sampler=available: clients split at random into this many groups, "
                                     "online in turn", range=(1, 1_000_000))
    availability_on: int = param(1, "sampler=available: rounds of every availability_period a client is online",
                                 range=(1, 1_000_000))
    availability_pattern: str = param("cyclic", "sampler=available: which clients are online in a round: cyclic "
                                      "(availability_period groups in turn) or markov (each client on or off by its "
                                      "own seeded two-state Markov chain)", choices=AVAILABILITY_PATTERNS)
    availability_fraction: float = param(0.5, "availability_pattern=markov: probability a client is online in a "
                                         "round (its long-run fraction of rounds online)", range=(0.001, 1.0))
    availability_persistence: float = param(0.5, "availability_pattern=markov: probability a client's on/off state "
                                            "carries over to the next round rather than being redrawn (0: "
                                            "independent rounds)", range=(0.0, 0.999))
    aggregator: str = param("mean", "how the server combines the clients' models: n_k-weighted mean, "
                            "coordinate-wise median or trimmed_mean (Yin et al. 2018), or one registered with "
                            "jaxfednas.server.register_aggregator",
                            choices=AGGREGATORS)
    trim_fraction: float = param(0.1, "aggregator=trimmed_mean: fraction β dropped from each end per coordinate",
                                 range=(0.0, 0.499))
    server_optimizer: str = param("none", "server optimizer of the weights on the pseudo-gradient (current − "
                                  "aggregate), Reddi et al. 2021: none (the aggregate), sgd, avgm (FedAvgM), "
                                  "adagrad, adam, yogi",
                                  choices=SERVER_OPTIMIZERS)
    server_lr: float = param(1.0, "server_optimizer's learning rate η", range=(0.0, 100.0))
    server_momentum: float = param(0.9, "server_optimizer=avgm: momentum μ", range=(0.0, 1.0))
    server_b1: float = param(0.9, "adagrad/adam/yogi: β1 of the server's first moment", range=(0.0, 1.0))
    server_b2: float = param(0.99, "adam/yogi: β2 of the server's second moment", range=(0.0, 1.0))
    server_tau: float = param(1e-3, "adagrad/adam/yogi: adaptivity τ (second moment starts at τ²)",
                              range=(1e-12, 10.0))
    arch_server_optimizer: str = param("none", "server optimizer of the architecture parameters α where the server "
                                       "averages them (FedNAS, DFNAS); momentum, b1, b2, tau shared with "
                                       "server_optimizer",
                                       choices=SERVER_OPTIMIZERS)
    arch_server_lr: float = param(1.0, "server learning rate of arch_server_optimizer", range=(0.0, 100.0))

    def check(self):
        if self.availability_on > self.availability_period:
            raise ConfigError(f"run.availability_on={self.availability_on} must be at most "
                              f"run.availability_period={self.availability_period}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: which algorithm, on what data, for how long."""

    algorithm: str
    data: DataConfig
    run: RunConfig
    algo: Any

    def __post_init__(self):
        cpr, k = self.run.clients_per_round, self.data.num_clients
        if isinstance(cpr, float) and cpr > 1.0:
            raise ConfigError(f"run.clients_per_round={cpr} as a fraction must be in (0, 1]")
        if isinstance(cpr, int) and cpr > k:
            raise ConfigError(f"run.clients_per_round={cpr} is out of range: must be in [1, {k}] (data.num_clients)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "data": dataclasses.asdict(self.data),
            "run": dataclasses.asdict(self.run),
            "algo": dataclasses.asdict(self.algo),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


_SERVER_OPTS = ("server_optimizer", "arch_server_optimizer")  # (momentum, b1, b2, tau: shared by both)
# A setting that acts only under another: (section, field) -> (its section, the fields any of which must
# hold one of the values). A value other than the default where none holds has no effect.
ONLY_UNDER = {
    ("data", "alpha"): ("data", ("partition",), ("dirichlet",)),
    ("data", "min_size"): ("data", ("partition",), ("dirichlet",)),
    ("data", "classes_per_client"): ("data", ("partition",), ("label_skew",)),
    ("run", "availability_period"): ("run", ("sampler",), ("available",)),
    ("run", "availability_on"): ("run", ("sampler",), ("available",)),
    ("run", "availability_pattern"): ("run", ("sampler",), ("available",)),
    ("run", "availability_fraction"): ("run", ("availability_pattern",), ("markov",)),
    ("run", "availability_persistence"): ("run", ("availability_pattern",), ("markov",)),
    ("run", "trim_fraction"): ("run", ("aggregator",), ("trimmed_mean",)),
    ("run", "client_chunk_size"): ("run", ("placement",), ("auto", "map", "shard_map")),  # (vmap: all at once)
    ("run", "memory_budget_gib"): ("run", ("placement",), ("auto", "map", "shard_map")),  # (it picks the chunk)
    ("run", "server_lr"): ("run", ("server_optimizer",), ("sgd", "avgm", "adagrad", "adam", "yogi")),
    ("run", "server_momentum"): ("run", _SERVER_OPTS, ("avgm",)),
    ("run", "server_b1"): ("run", _SERVER_OPTS, ("adagrad", "adam", "yogi")),
    ("run", "server_b2"): ("run", _SERVER_OPTS, ("adam", "yogi")),
    ("run", "server_tau"): ("run", _SERVER_OPTS, ("adagrad", "adam", "yogi")),
    ("run", "arch_server_lr"): ("run", ("arch_server_optimizer",), ("sgd", "avgm", "adagrad", "adam", "yogi")),
}


def setting_warnings(cfg: ExperimentConfig) -> list[str]:
    """Legal settings that are almost surely a mistake, one line each: a learning rate of 0
    (whatever it steps stays at its initial value), a setting changed from its default where
    the setting it acts under (``ONLY_UNDER``) is off, so that it has no effect."""
    out = []
    for (section, name), (where, fields, values) in ONLY_UNDER.items():
        sub, under = getattr(cfg, section), getattr(cfg, where)
        if any(f.name == name for f in dataclasses.fields(sub)) and getattr(sub, name) != _default(sub, name) \
                and not any(getattr(under, f, None) in values for f in fields):
            now = ", ".join(f"{where}.{f}={getattr(under, f)}" for f in fields if hasattr(under, f))
            out.append(f"{section}.{name}={getattr(sub, name)} has no effect with {now} (it acts only with "
                       f"{' or '.join(f'{where}.{fields[0]}={v}' for v in values)})")
    for section in ("data", "run", "algo"):
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if (f.name == "lr" or f.name.endswith("_lr")) and isinstance(value, (int, float)) and value == 0 \
                    and f.default != 0:
                out.append(f"{section}.{f.name}=0: this learning rate takes no step, so what it trains keeps its "
                           f"initial value (default {f.default:g})")
    return out


def _default(sub, name: str):
    f = next(f for f in dataclasses.fields(sub) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Turn a command-line string (or JSON value) into a value of type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if type(None) in args:
                return None
        # int before float so that "4" is a count and "0.5" a fraction.
        for a in sorted((a for a in args if a is not type(None)), key=lambda a: a is float):
            try:
                return _coerce(value, a, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={value!r}: expected {_type_name(tp)}")
    if not isinstance(value, str):
        if origin is tuple and isinstance(value, list):
            return tuple(value)
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    try:
        if tp is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(value)
        if tp is float:
            return float(value)
        if origin is tuple:  # "0.75,0,0.25", also written "[0.75, 0, 0.25]" or "(0.75, 0, 0.25)"
            args = typing.get_args(tp)
            inner = value.strip()
            if inner[:1] + inner[-1:] in ("[]", "()"):
                inner = inner[1:-1]
            return tuple(_coerce(v.strip(), args[0], name) for v in inner.split(","))
        return value
    except ValueError:
        want = _type_name(tp)
        if origin is tuple:
            want = f"comma-separated {_type_name(typing.get_args(tp)[0])} values, e.g. 0.75,0,0.25"
        raise ConfigError(f"{name}={value!r}: expected {want}") from None


REMOVAL_VERSION = "0.3"


def former_module_names(module: str, renamed: Mapping[str, str], namespace: Mapping[str, Any]):
    """A module ``__getattr__`` resolving each former name in ``renamed`` (old -> new) to the
    object now named ``new`` in ``namespace`` (the module's ``globals()``), with the same
    one-line :class:`FutureWarning` as a renamed config field."""
    def __getattr__(name):
        if name in renamed:
            warnings.warn(f"{module}.{name} is now {module}.{renamed[name]}; the old name goes in jaxfednas "
                          f"{REMOVAL_VERSION}", FutureWarning, stacklevel=2)
            return namespace[renamed[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__


def current_name(cls: type, name: str) -> str:
    """A config field's name now, given its name now or a former one (``cls.RENAMED``)."""
    return getattr(cls, "RENAMED", {}).get(name, name)


def _renamed(cls: type, section: str, updates: Mapping[str, Any], warn: bool, stacklevel: int = 5) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in updates.items():
        new = current_name(cls, k)
        if new != k:
            if new in updates:
                raise ConfigError(f"{section}.{k} and {section}.{new} both given: {k} is the former name of {new}")
            if warn:
                warnings.warn(f"{section}.{k} is now {section}.{new}; the old name goes in jaxfednas "
                              f"{REMOVAL_VERSION}", FutureWarning, stacklevel=stacklevel)
        out[new] = v
    return out


def _retired(cls: type, section: str, updates: Mapping[str, Any], warn: bool) -> dict[str, Any]:
    retired = getattr(cls, "RETIRED", {})
    out: dict[str, Any] = {}
    for k, v in updates.items():
        if k not in retired:
            out[k] = v
            continue
        value, advice = retired[k]
        try:
            same = _coerce(v, type(value), f"{section}.{k}") == value
        except ConfigError:
            same = False
        if not same:
            raise ConfigError(f"{section}.{k}={v}: the setting is gone; {advice}")
        if warn:
            warnings.warn(f"{section}.{k}={value!r} has no effect and goes in jaxfednas {REMOVAL_VERSION}; {advice}",
                          FutureWarning, stacklevel=6)
    return out


def replace_fields(cfg: Any, section: str, updates: Mapping[str, Any], *, warn_renamed: bool = True) -> Any:
    """``dataclasses.replace`` with string coercion, former names (``RENAMED``), retired
    fields (``RETIRED``) and unknown-name errors."""
    updates = _retired(type(cfg), section, _renamed(type(cfg), section, updates, warn_renamed), warn_renamed)
    hints = typing.get_type_hints(type(cfg))
    known = {f.name for f in dataclasses.fields(cfg)}
    for k in updates:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {section}.{near[0]}? " if near else ""
            raise ConfigError(f"unknown setting {section}.{k}; {hint}known: {sorted(known)}")
    vals = {k: _coerce(v, hints[k], f"{section}.{k}") for k, v in updates.items()}
    return dataclasses.replace(cfg, **vals)


def apply_overrides(cfg: ExperimentConfig, overrides: Mapping[str, Any], *,
                    warn_renamed: bool = True) -> ExperimentConfig:
    """Apply ``{"data.alpha": "0.1", "algo.lr": 0.05, ...}`` to ``cfg`` (former field
    names are accepted, with a warning unless ``warn_renamed`` is false)."""
    by_section: dict[str, dict[str, Any]] = {"data": {}, "run": {}, "algo": {}}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section not in by_section or not name:
            raise ConfigError(f"unknown setting {key!r}: use data.<field>, run.<field> or algo.<field>")
        by_section[section][name] = value
    return dataclasses.replace(
        cfg,
        data=replace_fields(cfg.data, "data", by_section["data"], warn_renamed=warn_renamed),
        run=replace_fields(cfg.run, "run", by_section["run"], warn_renamed=warn_renamed),
        algo=replace_fields(cfg.algo, "algo", by_section["algo"], warn_renamed=warn_renamed),
    )


def parse_set(items) -> dict[str, str]:
    """Repeatable ``--set SECTION.FIELD=VALUE`` items -> flat overrides (values stay strings;
    :func:`apply_overrides` coerces and validates them)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        out[key.strip()] = value.strip()
    return out


def describe(cfg_cls: type) -> list[tuple[str, Any, str]]:
    """``(name, default, help with range)`` rows for ``--help`` and docs."""
    rows = []
    for f in dataclasses.fields(cfg_cls):
        extra = ""
        if f.metadata.get("choices"):
            extra = f" {{{', '.join(map(str, f.metadata['choices']))}}}"
        elif f.metadata.get("range"):
            lo, hi = f.metadata["range"]
            extra = f" [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        rows.append((f.name, f.default, f.metadata.get("help", "") + extra))
    return rows
