"""Elastic (Once-for-All-style) search spaces as choice spaces for PerFedRLNAS
(:mod:`jaxfednas.search_spaces.choice`).

* :mod:`.mobilenet` — :class:`ElasticMobileNet`: an OFA MobileNetV3 supernet with an
  elastic depth, kernel size, expand ratio and width per stage (Cai et al.,
  "Once-for-All", arXiv:1908.09791), single path under a traced choice, and
  :func:`depthwise_taps`, its depthwise conv with a backward that XLA:CPU runs in
  bounded memory;
  :data:`SPACES` holds its geometries (``"cifar"``, ``"small"``, ``"tiny"``).
"""
from .mobilenet import (ACTIVATIONS, BN_EPS, BN_MOMENTUM, Block, ElasticMobileNet, ElasticSubnet, Geometry, SPACES,
                        Stage, StageDims, depthwise_taps, get_geometry)

__all__ = ["ACTIVATIONS", "BN_EPS", "BN_MOMENTUM", "Block", "ElasticMobileNet", "ElasticSubnet", "Geometry", "SPACES",
           "Stage", "StageDims", "depthwise_taps", "get_geometry"]
