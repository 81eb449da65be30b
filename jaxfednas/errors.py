"""The library's error for bad settings, at the bottom of the import graph so that every
module (the aggregator registry included) can raise it without importing the configuration."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range."""


__all__ = ["ConfigError"]
