"""The registry of server aggregators (``run.aggregator``), free of JAX so that
:mod:`jaxfednas.config` can validate a name without importing it.

An aggregator is one function of one leaf, registered under its name::

    from jaxfednas.server import register_aggregator

    @register_aggregator("max_reporting")
    def max_reporting(x, weights, valid, server):
        return jnp.where(valid, x, -jnp.inf).max(0)

and then ``run.aggregator=max_reporting`` works from Python and, after ``--import`` of
the module that registers it, from the command line. Arguments, for a leaf of the
clients' models with ``m`` clients:

* ``x``: ``[m, ...]`` float32, client axis first;
* ``weights``: ``[m, 1, ..., 1]`` float32 (broadcastable to ``x``): the sampler's
  aggregation weights (``n_k``, or one per draw for ``proportional``), 0 for a client that
  did not report;
* ``valid``: ``[m, ...]`` bool, ``x``'s shape: which values count, i.e. the client reported
  (weight > 0) and, for :meth:`~jaxfednas.server.Server.masked_aggregate`
  (PerFedRLNAS' subnets), its mask covers the entry;
* ``server``: the :class:`~jaxfednas.server.Server` (its options: ``server.trim_fraction``,
  ``server.seed``, ...).

It returns ``x``'s shape less the client axis. Where no value counts (``valid`` false for
every client), the server substitutes its fallback (the previous model), whatever the
function returned there. The function runs inside the compiled round: JAX operations
only, static shapes. The built-ins ``mean``, ``median`` and ``trimmed_mean`` are
registered the same way by :mod:`jaxfednas.server`.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxfednas.errors import ConfigError, RegistrationError

#: The built-in aggregators, registered by :mod:`jaxfednas.server` when it is imported.
BUILTIN: tuple[str, ...] = ("mean", "median", "trimmed_mean")

_RULES: dict[str, Callable[..., Any] | None] = dict.fromkeys(BUILTIN)  # None: a built-in not yet imported


class _Names(Sequence):
    """The registered names, live (a registration shows at once), in registration order."""

    def __getitem__(self, i):
        return tuple(_RULES)[i]

    def __len__(self) -> int:
        return len(_RULES)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_RULES))

    def __contains__(self, name: object) -> bool:
        return name in _RULES

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _Names)) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    #: appended to :func:`jaxfednas.config.check_fields`' error for a name not registered
    hint = (" (an aggregator of your own: @register_aggregator in a module imported first; on the command line "
            "--import MODULE_OR_FILE)")


#: Every registered aggregator's name (``run.aggregator``'s choices).
AGGREGATORS: Sequence[str] = _Names()


def register_aggregator(name: str, fn: Callable[..., Any] | None = None, *, replace: bool = False):
    """Register ``fn`` as aggregator ``name`` (a decorator when ``fn`` is omitted); returns
    ``fn``. A name already taken by another function is refused unless ``replace``; the
    same function registered again (its module imported twice) replaces itself."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise RegistrationError(f"aggregator name must be letters, digits, '_', '.' or '-', got {name!r}")

    def add(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"aggregator {name!r} must be a function, got {f!r}")
        old = _RULES.get(name)
        same = old is not None and (getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == (
            getattr(f, "__module__", None), getattr(f, "__qualname__", None))
        if old is not None and not (replace or same):
            raise RegistrationError(f"aggregator {name!r} is already registered ({old.__module__}.{old.__qualname__}); "
                             f"pass replace=True to replace it")
        _RULES[name] = f
        return f

    return add if fn is None else add(fn)


def unregister_aggregator(name: str) -> None:
    """Remove aggregator ``name`` (not a built-in)."""
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in aggregator")
    _RULES.pop(name, None)


def aggregator_rule(name: str) -> Callable[..., Any]:
    """The function registered as ``name``; :class:`~jaxfednas.errors.ConfigError` listing
    the registered names if there is none. The built-ins are registered when
    :mod:`jaxfednas.server` (which applies the rules) is imported."""
    if name in BUILTIN and _RULES[name] is None:
        raise ConfigError(f"run.aggregator={name!r} is a built-in registered by jaxfednas.server: import it first")
    rule = _RULES.get(name)
    if rule is None:
        raise ConfigError(unknown_message(name))
    return rule


def unknown_message(name: Any) -> str:
    """The error for an unknown aggregator ``name``: the registered ones, and how to add one."""
    return f"run.aggregator={name!r} is not allowed: choose one of {list(AGGREGATORS)}{_Names.hint}"


__all__ = ["AGGREGATORS", "BUILTIN", "register_aggregator", "unregister_aggregator", "aggregator_rule"]
