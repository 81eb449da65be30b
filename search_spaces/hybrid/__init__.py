"""A hybrid convolution / transformer supernet in the spirit of NASViT (Gong et al.,
ICLR 2022) as a choice space for PerFedRLNAS (Yao & Li, AAAI 2024, Table 1): elastic width / depth / kernel per conv stage and
width / depth / heads / MLP ratio per transformer stage, single path.

* :class:`HybridViT` — the space (``init``, ``subnet``, ``variable_mask``, ``cost``,
  ``describe``; :mod:`jaxfednas.search_spaces.choice` protocol), :data:`SPACES` its presets;
* :class:`HybridSubnet` — a subnet over the supernet's variables, applied like a Flax
  module.
"""
from .network import BN_EPS, BN_MOMENTUM, ConvStage, get_space, HybridSubnet, HybridViT, LN_EPS, SPACES, ViTStage

__all__ = ["BN_EPS", "BN_MOMENTUM", "ConvStage", "HybridSubnet", "HybridViT", "LN_EPS", "SPACES", "ViTStage",
           "get_space"]
