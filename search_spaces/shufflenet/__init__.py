"""The ShuffleNetV2 choice-block space of SPOS / DSNAS (Guo et al., arXiv:1904.00420;
Hu et al., "DSNAS: Direct Neural Architecture Search without Parameter Retraining",
arXiv:2002.09128), used by DFNAS (Garg et al., arXiv:2010.06223).

* :mod:`.blocks` — the candidates (ShuffleNetV2 units k3/k5/k7, Shuffle-Xception);
* :mod:`.network` — :class:`ShuffleSpace` / :data:`SPACES` (geometries, incl. our
  32×32 one) and :class:`ShuffleNetwork` (supernet or child);
* :mod:`.arch` — :class:`ShuffleArch`, :func:`derive`, :func:`build`,
  :func:`child_variables`, :func:`child_cost` (parameters and multiply-adds),
  :func:`macs_table` (multiply-adds per block and candidate).
"""
from .arch import build, child_cost, child_variables, derive, macs_table, MacsTable, ShuffleArch, uniform_arch
from .blocks import auto_depthwise_impl, BN_EPS, BN_MOMENTUM, CANDIDATES, DSNAS_BN_EPS, channel_split, KERNELS, ShuffleUnit
from .network import BlockSpec, ChoiceBlock, get_space, init_alpha, ShuffleNetwork, ShuffleSpace, SPACES

__all__ = [
    "auto_depthwise_impl", "BN_EPS", "BN_MOMENTUM", "BlockSpec", "DSNAS_BN_EPS", "CANDIDATES", "ChoiceBlock",
    "KERNELS", "SPACES", "ShuffleArch", "ShuffleNetwork", "ShuffleSpace", "ShuffleUnit", "build", "channel_split",
    "child_cost", "child_variables", "derive", "get_space", "init_alpha", "macs_table", "MacsTable", "uniform_arch",
]
