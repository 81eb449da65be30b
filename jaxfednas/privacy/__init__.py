"""Differential privacy for federated NAS: host-side accounting and the on-device mechanism.

* :mod:`jaxfednas.privacy.accounting` — Gaussian-DP (the CLT of Bu et al.), μ-GDP ↔
  (ε, δ), PLD and RDP epsilons through dp-accounting, calibration, Poisson-batch
  overflow; NumPy/SciPy only. Its argument checks live in :mod:`jaxfednas.privacy.checks`
  and the sizing of the PLD grid in :mod:`jaxfednas.privacy.pld_grid`.
* :mod:`jaxfednas.privacy.dp_fnas` — DP-FNAS's two mechanisms per party (Theorem 3.1),
  the per-round accountant and the iteration budget of a target ε; host-side.
* :mod:`jaxfednas.privacy.mechanism` — per-example clipping, Gaussian noise, Poisson
  sampling with a fixed physical batch, as JAX functions and an optax transformation.
  Import it explicitly (``from jaxfednas.privacy import mechanism``): it needs JAX.

The accounting names are re-exported here; ``import jaxfednas.privacy`` imports no JAX,
so the accounting can be audited and run without an accelerator stack. Unit of privacy
everywhere: one example of one party's data, add/remove-one neighbours; the assumptions
behind every number are listed in :mod:`jaxfednas.privacy.accounting`.

``jaxfednas privacy ...`` (the CLI, :mod:`jaxfednas.cli`) prints the accountants side by
side.
"""
from jaxfednas.privacy.accounting import (  # noqa: F401
    ACCOUNTANTS,
    AccountingReport,
    calibrate_noise_multiplier,
    compare_accountants,
    gdp_delta,
    gdp_epsilon,
    gdp_mu_poisson,
    gdp_mu_uniform,
    max_steps,
    overflow_probability,
    pld_epsilon,
    pld_interval,
    rdp_epsilon,
)
from jaxfednas.privacy.dp_fnas import (  # noqa: F401
    NO_BUDGET,
    Accountant,
    DPFNASReport,
    MechanismSpec,
    dpfnas_report,
    max_iterations,
)

__all__ = [
    "ACCOUNTANTS", "Accountant", "AccountingReport", "DPFNASReport", "MechanismSpec", "NO_BUDGET",
    "calibrate_noise_multiplier", "compare_accountants", "dpfnas_report", "gdp_delta", "gdp_epsilon",
    "gdp_mu_poisson", "gdp_mu_uniform", "max_iterations", "max_steps", "overflow_probability", "pld_epsilon",
    "pld_interval", "rdp_epsilon",
]
