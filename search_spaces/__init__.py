"""Search spaces (supernets as Flax modules, discrete architectures, derive/build).

The DARTS space (FedNAS, SPIDER, DP-FNAS) and the ShuffleNetV2 choice-block space
(DFNAS); it imports nothing from jaxfednas.algorithms. :func:`arch_entropy` measures any
space's architecture parameters.
"""
import jax
import jax.numpy as jnp


def arch_entropy(alphas) -> jax.Array:
    """Mean entropy (nats) of the rows of softmax(α): the mean over the leaves of a
    pytree of logit arrays (e.g. DARTS' normal and reduce α) of each leaf's mean row
    entropy. Uniform rows over n choices give ln n; one-hot rows give 0."""
    ents = [(-(jax.nn.softmax(a, -1) * jax.nn.log_softmax(a, -1)).sum(-1)).mean() for a in jax.tree.leaves(alphas)]
    return jnp.mean(jnp.stack(ents))
