"""Search spaces (supernets as Flax modules, discrete architectures, derive/build).

The DARTS space (FedNAS, SPIDER, DP-FNAS) and the ShuffleNetV2 choice-block space
(DFNAS) arrive with their algorithms; this package is installed now so that the
layering (search_spaces imports only jaxfednas) is fixed from the start.
"""
