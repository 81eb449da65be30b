"""The library's error for bad settings, at the bottom of the import graph so that every
module (the aggregator registry included) can raise it without importing the configuration."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range."""


class RegistrationError(ValueError):
    """A name cannot be registered (an algorithm or an aggregator): not a valid name, or taken
    by another module without ``replace=True``. The command line's ``--import`` reports it in
    one line, as a setting's error."""


__all__ = ["ConfigError", "RegistrationError"]
