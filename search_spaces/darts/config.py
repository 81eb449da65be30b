"""Config fields of the DARTS search space, declared once for the algorithms that search
it (FedNAS, SPIDER, DP-FNAS).

An algorithm's config inherits :class:`DartsSpaceConfig` (the supernet's geometry and
candidate ops, first in its field list) and adds its own fields;
:func:`~jaxfednas.search_spaces.darts.search.supernet_of` builds the supernet such a config
describes. A different default or help text is a redeclaration in the subclass, which
keeps the field's place::

    @dataclasses.dataclass(frozen=True)
    class SpiderConfig(DartsSpaceConfig):
        primitives: str = primitives_param("s2", "candidate ops (paper: s2)")
        prox_lambda: float = param(0.01, "...")
"""
from __future__ import annotations

import dataclasses

from jaxfednas.config import ConfigError, Validated, param
from jaxfednas.nn import DEPTHWISE_IMPLS

from .operations import PRIMITIVE_SETS


def primitives_param(default: str = "darts", help: str = "candidate operations") -> dataclasses.Field:
    """The ``primitives`` field: a name in :data:`PRIMITIVE_SETS`."""
    return param(default, help, choices=tuple(PRIMITIVE_SETS))


def group_edges_param() -> dataclasses.Field:
    """The ``group_edges`` field ("auto" / "on" / "off"; :func:`supernet_of` maps it to
    ``DartsSearchNetwork.group_edges`` None / True / False). A function rather than a
    mixin field so that each algorithm keeps it where its help lists it."""
    return param("auto", "run a cell's edges grouped by source state (search_spaces/darts/wide.py: "
                 "same variables and math, ~2x faster steps on CPU at 32x32, ~3x the compile time; "
                 "~9x fewer GPU kernels): auto (where dw_impl is auto or fused; on CPU for images of 16x16 "
                 "pixels and more), on, off (the edge scan)",
                 choices=("auto", "on", "off"))


@dataclasses.dataclass(frozen=True)
class DartsSpaceConfig(Validated):
    """The DARTS supernet's geometry and candidate ops (the ``algo`` section's first fields)."""

    SECTION = "algo"
    RENAMED = {"steps": "nodes"}
    C: int = param(8, "supernet initial channels C (paper 16)", range=(2, 512))
    layers: int = param(5, "supernet cells (paper 8); reductions at layers//3 and 2*layers//3", range=(1, 64))
    nodes: int = param(4, "intermediate nodes per cell (DARTS 4); all are concatenated", range=(1, 8))
    primitives: str = primitives_param()
    dw_impl: str = param("auto", "formulation of every separable / dilated conv (the same math, jaxfednas.nn): "
                         "grouped (lax grouped conv), slices (k*k shifted products), fused (one dense k x k conv), "
                         "auto (the backend's default: fused on CPU, grouped elsewhere, fused in grouped cells)",
                         choices=("auto",) + DEPTHWISE_IMPLS)

    def check(self):
        """Subclasses that add checks call ``super().check()`` first."""
        if self.C % 2:
            raise ConfigError(f"{self.SECTION}.C={self.C} must be even (FactorizedReduce splits channels in two)")
        if getattr(self, "group_edges", "auto") == "on" and self.dw_impl not in ("auto", "fused"):
            raise ConfigError(f"{self.SECTION}.group_edges=on needs {self.SECTION}.dw_impl=fused (or auto); "
                              f"got dw_impl={self.dw_impl}")
