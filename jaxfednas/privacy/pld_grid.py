r"""The PLD accountant's grid: which value discretisation interval a noise multiplier gets,
and which noises no grid the accountant allows can serve.

dp-accounting represents a privacy loss distribution on a grid of losses of width
``value_discretization_interval``; a grid that is too fine for a small noise takes minutes
and GiBs, one that is too coarse gives a loose (still valid: pessimistic) epsilon. The
functions here size the grid before any table is built and refuse, in one line naming
what works, the settings no grid serves. SciPy only.
"""
from __future__ import annotations

import math
import numbers

from scipy import special

from jaxfednas.privacy.checks import _check_noise_multiplier, _real

DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4  # dp-accounting's own PLDAccountant default
# With value_discretization_interval=None the PLD's grid is kept under this many points:
# building it costs ~7 us a point on one core (a Poisson-subsampled Gaussian), so ~7 s.
PLD_MAX_POINTS = 1_000_000
PLD_MAX_INTERVAL = 100.0  # dp-accounting overflows (expm1 of the interval) far above this
PLD_MAX_EXPLICIT_POINTS = 2e7  # an explicit interval finer than this grid takes GiBs and minutes: refused
_PLD_LOG_TAIL = -50.0  # dp-accounting's log_mass_truncation_bound of the Gaussian


def pld_interval(noise_multiplier: float, *, max_points: int = PLD_MAX_POINTS) -> float:
    r"""The PLD value discretisation interval used when none is given.

    dp-accounting's 1e-4, or coarser where the noise is small: a Gaussian step of
    sensitivity 1 and noise sigma has privacy losses ``(1/2 - x)/sigma^2`` over the
    ``x`` it keeps, ``|x| <= k sigma (+1)`` with ``k = 9.75`` (tail mass
    ``e^-50``), a range of about ``(2 k sigma + 1)/sigma^2``; the interval is that
    range over ``max_points``.  A coarser interval gives a larger epsilon that is
    still an upper bound (pessimistic discretisation), so the guarantee holds;
    above sigma ~0.35 nothing changes.  Without it sigma = 0.03 takes minutes
    per epsilon and smaller sigmas run out of memory.  Below sigma ~1e-3 (losses
    over ~1e6: epsilon is of that order) the interval would exceed 1 and this
    raises ``ValueError``; an explicit interval up to ``PLD_MAX_INTERVAL`` is
    still accepted by :func:`pld_epsilon`.

    >>> pld_interval(1.0)
    0.0001
    >>> round(pld_interval(0.01), 4)
    0.0119
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    if isinstance(max_points, bool) or not isinstance(max_points, numbers.Integral) or max_points < 1:
        raise ValueError(f"max_points must be a positive integer, got {max_points!r}")
    loss_range = _loss_range(sigma)  # (2 k sigma + 1)/sigma^2 without underflow
    v = max(DEFAULT_VALUE_DISCRETIZATION_INTERVAL, loss_range / int(max_points))
    _refuse_beyond_any_interval(sigma)
    if v > 1.0:
        raise ValueError(
            f"noise_multiplier={sigma:g} is too small for the PLD accountant: the privacy losses of one step "
            f"span ~{loss_range:.3g} (epsilon is of that order), a grid of {int(max_points):,} points of "
            f"width {v:.3g}; a larger noise multiplier, an explicit value_discretization_interval "
            f"(`jaxfednas privacy --pld-interval`) up to {PLD_MAX_INTERVAL:g}, or the RDP accountant")
    return v


def _check_interval(value, noise_multiplier: float) -> float:
    if value is None:
        return pld_interval(noise_multiplier)
    v = _real("value_discretization_interval", value)
    if not 0.0 < v <= PLD_MAX_INTERVAL:
        raise ValueError(f"value_discretization_interval must be in (0, {PLD_MAX_INTERVAL:g}], got {v!r}")
    sigma = _check_noise_multiplier(noise_multiplier)
    _refuse_beyond_any_interval(sigma)
    points = _loss_range(sigma) / v  # (estimated before any table is built)
    if points > PLD_MAX_EXPLICIT_POINTS:
        raise ValueError(f"value_discretization_interval={v:g} needs a grid of ~{points:.2g} points per PLD table at "
                         f"noise_multiplier={noise_multiplier:g} (several GiB, minutes); at most "
                         f"{PLD_MAX_EXPLICIT_POINTS:.0e} points: an interval of at least "
                         f"{_loss_range(noise_multiplier) / PLD_MAX_EXPLICIT_POINTS * 1.001:.3g}")
    return v


def _smallest_pld_noise() -> float:
    """The noise multiplier whose loss range the coarsest interval allowed covers in the largest grid
    allowed (``PLD_MAX_INTERVAL`` x ``PLD_MAX_EXPLICIT_POINTS``): the root of ``R s^2 - 2 k s - 1``."""
    k = -float(special.ndtri(0.5 * math.exp(_PLD_LOG_TAIL)))
    r = PLD_MAX_INTERVAL * PLD_MAX_EXPLICIT_POINTS
    return (k + math.sqrt(k * k + r)) / r


def _refuse_beyond_any_interval(sigma: float) -> None:
    """A noise so small that no interval the accountant allows gives a grid it can build: one line
    naming what works (a larger noise or the RDP accountant), instead of advising an interval."""
    smallest = _smallest_pld_noise()
    if sigma < smallest:
        span = _loss_range(sigma)
        span_text = f"~{span:.3g}" if math.isfinite(span) else "beyond floating point"
        raise ValueError(
            f"noise_multiplier={sigma:g} is too small for the PLD accountant at any interval it allows: the privacy "
            f"losses of one step span {span_text} (epsilon is of that order, i.e. no meaningful privacy); a noise "
            f"multiplier of at least {smallest * 1.001:.3g}, or the RDP accountant (`jaxfednas privacy --accountant "
            "rdp`)")


def _loss_range(sigma: float) -> float:
    """The span of one Gaussian step's privacy losses that the PLD grid covers, ``(2 k sigma + 1)/sigma^2``
    (:func:`pld_interval`)."""
    k = -float(special.ndtri(0.5 * math.exp(_PLD_LOG_TAIL)))
    return (2.0 * k + 1.0 / sigma) / sigma
