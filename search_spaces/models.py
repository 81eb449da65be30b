"""Fixed (non-searched) networks for the baselines: a small CNN, CIFAR ResNet-18s and the
all-k3 ShuffleNetV2 child (the DFNAS space's hand-designed network).

All take ``train`` and an optional example ``mask`` ([B] booleans) so that the
padded rows of a partial batch never enter BatchNorm statistics.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfednas.nn import Conv


class CNN(nn.Module):
    """Two 3x3 convolutions, max-pool, two dense layers (for the bundled digits and tiny tests)."""

    num_classes: int
    features: Sequence[int] = (32, 64)
    hidden: int = 128

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for f in self.features:
            x = nn.relu(Conv(f, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


class BasicBlock(nn.Module):
    features: int
    stride: int = 1

    @nn.compact
    def __call__(self, x, train: bool, mask):
        bn = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)  # noqa: E731
        m = None if mask is None else mask[:, None, None, None]
        y = Conv(self.features, (3, 3), (self.stride, self.stride), use_bias=False)(x)
        y = nn.relu(bn()(y, mask=m))
        y = Conv(self.features, (3, 3), use_bias=False)(y)
        y = bn()(y, mask=m)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = Conv(self.features, (1, 1), (self.stride, self.stride), use_bias=False)(x)
            x = bn()(x, mask=m)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """CIFAR ResNet (3x3 stem, no max-pool). ``stage_sizes=(2,2,2,2), width=64`` is ResNet-18."""

    num_classes: int
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    width: int = 64

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        m = None if mask is None else mask[:, None, None, None]
        x = Conv(self.width, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x, mask=m))
        for i, n in enumerate(self.stage_sizes):
            for j in range(n):
                x = BasicBlock(self.width * 2**i, stride=2 if i > 0 and j == 0 else 1)(x, train, mask)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


SHUFFLENET_SPACES = ("tiny", "small", "cross_silo", "cross_device", "imagenet")
"""The ShuffleNet search spaces (``jaxfednas.search_spaces.shufflenet.SPACES``) whose all-k3 child is a
model here: ``shufflenetv2_<space>``."""
MODELS = ("auto", "cnn", "resnet18", "resnet_tiny", "shufflenetv2", *(f"shufflenetv2_{s}" for s in SHUFFLENET_SPACES))


# Image side of the bundled datasets (synthetic: its default shape); the others are 32x32.
_SMALL_SIDE = {"digits": 8, "synthetic": 8, "cluttered_digits": 16}


def shufflenetv2(num_classes: int, dataset: str, space: str | None = None) -> nn.Module:
    """A plain ShuffleNetV2 (3x3 depthwise in every unit) in DFNAS' geometry: the all-k3
    child of ``space`` — by default of the ``small`` space for the bundled digits,
    cluttered digits and synthetic data, of ``cross_silo`` otherwise — the hand-designed
    network DFNAS is compared with (paper Fig. 2; the DFNAS example trains the child of the
    space it searched)."""
    from jaxfednas.search_spaces.shufflenet import auto_depthwise_impl, build, uniform_arch  # noqa: PLC0415

    small = dataset in _SMALL_SIDE
    impl = auto_depthwise_impl(_SMALL_SIDE.get(dataset, 32))
    space = space or ("small" if small else "cross_silo")
    return build(uniform_arch(space, "k3"), num_classes, dw_impl=impl)


def child_model_name(arch) -> str:
    """The model name of a ShuffleNetV2 child (a :class:`jaxfednas.search_spaces.shufflenet.ShuffleArch`):
    ``shufflenetv2_<space>:<c_1>,<c_2>,...``, one candidate index per block."""
    return f"shufflenetv2_{arch.space}:{','.join(str(c) for c in arch.choices)}"


def child_of_model_name(name: str):
    """The ShuffleArch a ``shufflenetv2_<space>:<indices>`` name denotes; ValueError if malformed."""
    from jaxfednas.search_spaces.shufflenet import ShuffleArch  # noqa: PLC0415

    head, _, tail = name.partition(":")
    space = head.removeprefix("shufflenetv2_")
    if not head.startswith("shufflenetv2_") or space not in SHUFFLENET_SPACES:
        raise ValueError(f"a child model is shufflenetv2_<space>:<indices> with a space of {SHUFFLENET_SPACES}, "
                         f"got {name!r}")
    try:
        choices = tuple(int(c) for c in tail.split(","))
    except ValueError:
        raise ValueError(f"{name!r}: the indices after ':' must be comma-separated integers") from None
    return ShuffleArch(space, choices)


def check_model_name(name: str) -> None:
    """``ValueError`` (one line) unless ``name`` is one of :data:`MODELS` or a child name."""
    if name not in MODELS:
        if ":" not in name:
            raise ValueError(f"model must be one of {MODELS} or shufflenetv2_<space>:<indices>, got {name!r}")
        child_of_model_name(name)


def make_model(name: str, num_classes: int, dataset: str) -> nn.Module:
    """``auto`` picks the CNN for the bundled digits, cluttered digits and synthetic data,
    ResNet-18 for CIFAR-like data.
    ``resnet_tiny`` (one block per stage, width 8) is for tests. ``shufflenetv2_<space>:<c_1>,...``
    is any child of a DFNAS space (:func:`child_model_name`): a searched or a random one."""
    if ":" in name:
        from jaxfednas.search_spaces.shufflenet import auto_depthwise_impl, build  # noqa: PLC0415

        return build(child_of_model_name(name), num_classes,
                     dw_impl=auto_depthwise_impl(_SMALL_SIDE.get(dataset, 32)))
    if name == "auto":
        name = "cnn" if dataset in _SMALL_SIDE else "resnet18"
    if name == "cnn":
        return CNN(num_classes)
    if name == "resnet18":
        return ResNet(num_classes)
    if name == "resnet_tiny":
        return ResNet(num_classes, stage_sizes=(1, 1), width=8)
    if name == "shufflenetv2":
        return shufflenetv2(num_classes, dataset)
    if name.startswith("shufflenetv2_") and name.removeprefix("shufflenetv2_") in SHUFFLENET_SPACES:
        return shufflenetv2(num_classes, dataset, name.removeprefix("shufflenetv2_"))
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def init_variables(model: nn.Module, key: jax.Array, image_shape) -> dict:
    """``{"params": ..., "batch_stats": ...}`` (``batch_stats`` empty for models without BN)."""
    variables = model.init(key, jnp.zeros((1,) + tuple(image_shape), jnp.float32), train=False)
    variables = dict(variables)
    variables.setdefault("batch_stats", {})
    return variables
