"""The DARTS search space (Liu et al., "DARTS: Differentiable Architecture Search",
arXiv:1806.09055), as used by FedNAS, SPIDER and DP-FNAS.

* :mod:`.operations` -- candidate ops, :func:`make_op`, ``PRIMITIVES`` / ``PRIMITIVES_S2``;
* :mod:`.config` -- :class:`DartsSpaceConfig`, the config fields the algorithms share;
* :mod:`.search` -- the supernet :class:`DartsSearchNetwork` (``params`` / ``arch`` /
  ``batch_stats``) with :class:`MixedOp` and :class:`SearchCell`;
* :mod:`.genotypes` -- :class:`Genotype`, :func:`derive`, known cells;
* :mod:`.network` -- the evaluation network :class:`DartsNetwork` (``build``);
* :mod:`.plot` -- cell diagrams.
"""
from .config import DartsSpaceConfig, group_edges_param, primitives_param
from .genotypes import DARTS, DARTS_V1, DARTS_V2, derive, derive_from_weights, FEDNAS_V1, Genotype
from .network import (AUX_WEIGHT, aux_input_size, aux_pool, AuxiliaryHeadCIFAR, build, DartsNetwork, drop_path, EvalCell,
                      network_params)
# depthwise convolutions live in the engine (jaxfednas.nn); re-exported here as before
from jaxfednas.nn import DEPTHWISE_IMPLS, default_depthwise_impl, depthwise_conv, DepthwiseConv, SeparableConv
from .operations import (
    AvgPool3x3,
    BN_EPS,
    BN_MOMENTUM,
    Conv7x1_1x7,
    DilConv,
    FactorizedReduce,
    Identity,
    make_op,
    MaxPool3x3,
    NORMS,
    OPS,
    PRIMITIVE_SETS,
    PRIMITIVES,
    PRIMITIVES_S2,
    ReLUConvBN,
    SepConv,
    Zero,
)
from .plot import plot_cell, plot_genotype
from .search import (cell_plan, DartsSearchNetwork, edge_table, MixedOp, num_edges, SearchCell, supernet_of, unroll_variables,
                     unstack_scanned)

__all__ = [
    "AUX_WEIGHT", "AuxiliaryHeadCIFAR", "AvgPool3x3", "BN_EPS", "BN_MOMENTUM", "Conv7x1_1x7", "DARTS", "DARTS_V1",
    "DARTS_V2", "DartsSpaceConfig", "DEPTHWISE_IMPLS", "DartsNetwork", "DartsSearchNetwork", "DepthwiseConv",
    "DilConv", "EvalCell", "FEDNAS_V1", "FactorizedReduce", "Genotype", "Identity", "MaxPool3x3", "MixedOp",
    "NORMS", "OPS", "PRIMITIVE_SETS", "PRIMITIVES", "PRIMITIVES_S2", "ReLUConvBN", "SearchCell", "SepConv",
    "SeparableConv", "Zero", "aux_input_size", "aux_pool", "build", "cell_plan", "default_depthwise_impl",
    "depthwise_conv", "derive", "derive_from_weights", "drop_path", "group_edges_param", "make_op",
    "network_params", "num_edges", "plot_cell", "plot_genotype", "primitives_param", "supernet_of",
    "unroll_variables", "unstack_scanned", "edge_table",
]
