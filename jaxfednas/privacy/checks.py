"""Argument checks of the privacy accounting (STYLE item 7: fail early, name the argument and
its range), shared by :mod:`jaxfednas.privacy.accounting` and :mod:`jaxfednas.privacy.dp_fnas`.

Plain Python: no JAX, no dp-accounting.
"""
from __future__ import annotations

import math
import numbers

ACCOUNTANTS = ("pld", "rdp", "clt")
MAX_NOISE_MULTIPLIER = 1e150  # sigma^2 overflows a float near 1e154; epsilon is 0 to float precision long before


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


def _check_sampling_prob(value) -> float:
    p = _real("sampling_prob", value)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"sampling_prob must be in (0, 1], got {p!r}")
    return p


def _check_noise_multiplier(value) -> float:
    sigma = _real("noise_multiplier", value)
    if sigma == 0.0:
        raise ValueError(
            "noise_multiplier must be in (0, inf); 0 means no noise and no privacy "
            "(epsilon = inf), which no accountant can report")
    if not 0.0 < sigma < math.inf:
        raise ValueError(f"noise_multiplier must be in (0, inf), got {sigma!r}")
    if sigma > MAX_NOISE_MULTIPLIER:
        raise ValueError(f"noise_multiplier {sigma:g} is above {MAX_NOISE_MULTIPLIER:g}, where sigma^2 overflows the "
                         "accountants' floats; any such noise gives epsilon 0 to float precision")
    return sigma


def _check_steps(value, name: str = "steps") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(value, numbers.Integral):
        steps = int(value)
    else:
        as_float = float(value)
        if not math.isfinite(as_float) or as_float != math.floor(as_float):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r} "
                             "(round it explicitly, e.g. epochs / sampling_prob)")
        steps = int(as_float)
    if steps < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return steps


def _check_delta(value) -> float:
    delta = _real("delta", value)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return delta


def _check_epsilon(value, name: str = "epsilon") -> float:
    eps = _real(name, value)
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"{name} must be in [0, inf), got {eps!r}")
    return eps


def _check_mu(value) -> float:
    mu = _real("mu", value)
    if not mu > 0.0:  # +inf is allowed: "no privacy", delta = 1, epsilon = inf
        raise ValueError(f"mu must be in (0, inf], got {mu!r}")
    return mu


def _check_accountant(value) -> str:
    if value not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {value!r}")
    return value
