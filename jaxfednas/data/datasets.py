"""Image classification datasets as plain NumPy arrays (host side, no JAX).

Every loader returns a :class:`Dataset`: uint8 images in NHWC layout (even
single-channel ones), int32 labels, and the normalisation constants the
training pipeline needs. Normalisation is *not* applied here: the model input
is ``(x / scale - mean) / std``, computed on device, so the arrays stay small
(uint8) and augmentation such as Cutout can act in normalised space, as the
FedML pipeline does (docs/authors_code.md §0.6 and §1.4).

Available datasets (:data:`DATASETS`):

``digits``
    scikit-learn's bundled 8x8 handwritten digits (1 797 images, values 0..16).
    Works offline; the default for smoke tests and CPU examples.
``synthetic``
    Tiny, seeded, learnable toy data for unit tests.
``cifar10`` / ``cifar100``
    Through ``tensorflow_datasets`` (optional extra ``jaxfednas[tfds]``); the
    data must already be prepared in ``data_dir`` (this package never
    downloads anything).
``cinic10``
    CINIC-10 (Darlow et al., "CINIC-10 is not ImageNet or CIFAR-10",
    arXiv:1810.03505) read from its standard folder layout.

Example::

    >>> ds = load_dataset("digits")
    >>> ds.x_train.shape, ds.x_train.dtype, ds.image_shape
    ((1437, 8, 8, 1), dtype('uint8'), (8, 8, 1))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "Dataset",
    "DatasetUnavailableError",
    "load_dataset",
]

DATASETS: tuple[str, ...] = ("digits", "synthetic", "cifar10", "cifar100", "cinic10")

# Per-channel (mean, std) of x/255 used by the reference code bases (§1.4):
# DARTS/FedML for CIFAR-10, FedML/SPIDER for CIFAR-100, FedML for CINIC-10.
NORMALIZATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": (
        (0.49139968, 0.48215827, 0.44653124),
        (0.24703233, 0.24348505, 0.26158768),
    ),
    "cifar100": (
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
    "cinic10": (
        (0.47889522, 0.47227842, 0.43047404),
        (0.24205776, 0.23828046, 0.25874835),
    ),
}

_TFDS_INSTALL_HINT = "pip install 'jaxfednas[tfds]'"
_CINIC10_HINT = (
    "Download the 'CINIC-10' tarball (CINIC-10.tar.gz) from the University of "
    "Edinburgh DataShare (https://datashare.ed.ac.uk/handle/10283/3192), extract it "
    "to a directory DIR and pass --data-dir DIR. Expected layout: "
    "DIR/train/<class>/*.png and DIR/test/<class>/*.png (DIR/valid is not used), "
    "every image RGB 32x32."
)


class DatasetUnavailableError(RuntimeError):
    """The requested dataset cannot be loaded on this machine.

    Raised when an optional dependency is missing or the data has not been
    downloaded/prepared. The message always says how to fix it; nothing is
    ever downloaded implicitly.
    """


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An image classification dataset held in host memory.

    Attributes:
      name: Dataset name, one of :data:`DATASETS`.
      x_train: Training images, ``[N, H, W, C]`` uint8 (NHWC, also for C=1).
      y_train: Training labels, ``[N]`` int32 in ``[0, num_classes)``.
      x_test: Test images, same layout as ``x_train``.
      y_test: Test labels, same layout as ``y_train``.
      num_classes: Number of classes.
      scale: Raw pixel value that maps to 1.0 (255.0 for 8-bit images, 16.0 for
        ``digits``). The model input is ``(x / scale - mean) / std``.
      mean: Per-channel mean of ``x / scale`` (length C).
      std: Per-channel standard deviation of ``x / scale`` (length C).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of one image."""
        h, w, c = self.x_train.shape[1:]
        return (int(h), int(w), int(c))


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    **kwargs: Any,
) -> Dataset:
    """Load dataset ``name`` into host memory.

    Args:
      name: One of :data:`DATASETS`.
      data_dir: Where prepared data lives. Used by ``cifar10``/``cifar100``
        (the tensorflow_datasets data directory; ``None`` means the tfds
        default) and required by ``cinic10`` (the extracted CINIC-10 root).
        Ignored by ``digits`` and ``synthetic``.
      seed: Seed for ``synthetic``. The other datasets are fixed (the digits
        train/test split is part of the dataset definition and always uses
        seed 0), so ``seed`` does not change them.
      **kwargs: Options of ``synthetic`` only: ``num_train`` (512),
        ``num_test`` (128), ``num_classes`` (10), ``image_shape`` ((8, 8, 1)).

    Returns:
      A :class:`Dataset`.

    Raises:
      ValueError: ``name`` is unknown, or an argument value is invalid.
      TypeError: A keyword argument the dataset does not accept was given.
      ~jaxfednas.data.datasets.DatasetUnavailableError: The data or an optional dependency is missing;
        the message explains how to get it.
    """
    if name not in DATASETS:
        raise ValueError(f"name={name!r} is not a known dataset; valid names: {', '.join(DATASETS)}")
    if name != "synthetic" and kwargs:
        raise TypeError(
            f"load_dataset(name={name!r}) takes no extra keyword arguments, got {sorted(kwargs)}; "
            "only name='synthetic' accepts num_train, num_test, num_classes, image_shape"
        )
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _load_synthetic(seed=seed, **kwargs)
    if name in ("cifar10", "cifar100"):
        return _load_tfds(name, data_dir)
    return _load_cinic10(data_dir)


def _channel_stats(x: np.ndarray, scale: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of ``x / scale``, rounded to 6 decimals for stability."""
    xf = x.astype(np.float64) / scale
    axes = tuple(range(x.ndim - 1))
    mean = tuple(round(float(v), 6) for v in xf.mean(axis=axes))
    std = tuple(round(float(v), 6) for v in xf.std(axis=axes))
    return mean, std


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    # Pixel values are integers 0..16 stored as float64; uint8 is exact.
    x = raw.images.astype(np.uint8)[..., None]
    y = raw.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )
    mean, std = _channel_stats(x_train, 16.0)
    return Dataset(
        name="digits",
        x_train=np.ascontiguousarray(x_train),
        y_train=np.ascontiguousarray(y_train),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.ascontiguousarray(y_test),
        num_classes=10,
        scale=16.0,
        mean=mean,
        std=std,
    )


def _load_synthetic(
    *,
    seed: int,
    num_train: int = 512,
    num_test: int = 128,
    num_classes: int = 10,
    image_shape: Sequence[int] = (8, 8, 1),
) -> Dataset:
    """Class templates plus Gaussian noise: learnable, tiny and fully seeded.

    Each class gets a random uint8 template image; an example is its class
    template plus N(0, 40^2) noise, clipped to [0, 255]. Labels are balanced
    (round-robin) and shuffled.
    """
    for arg, value, low in (("num_train", num_train, 1), ("num_test", num_test, 1), ("num_classes", num_classes, 2)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
    shape = tuple(int(s) for s in image_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"image_shape must be (H, W, C) with positive entries, got {image_shape!r}")

    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(num_classes, *shape)).astype(np.float64)

    def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
        noise = rng.normal(0.0, 40.0, size=(n, *shape))
        x = np.clip(np.rint(templates[y] + noise), 0, 255).astype(np.uint8)
        return x, y

    x_train, y_train = sample(int(num_train))
    x_test, y_test = sample(int(num_test))
    mean, std = _channel_stats(x_train, 255.0)
    return Dataset(
        name="synthetic",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=int(num_classes),
        scale=255.0,
        mean=mean,
        std=std,
    )


def _tfds_prepare_hint(name: str, data_dir: str | os.PathLike[str] | None) -> str:
    shown = str(data_dir) if data_dir is not None else "DIR"
    return (
        f"On a machine with internet access run\n"
        f"  python -c \"import tensorflow_datasets as tfds; "
        f"tfds.builder('{name}', data_dir='{shown}').download_and_prepare()\"\n"
        f"then copy {shown} to this machine and pass --data-dir {shown} "
        f"(data_dir={shown!r} in Python)."
    )


def _load_tfds(name: str, data_dir: str | os.PathLike[str] | None) -> Dataset:
    try:
        import tensorflow_datasets as tfds  # optional heavy dependency, imported lazily
    except ImportError as e:
        raise DatasetUnavailableError(
            f"name={name!r} needs tensorflow_datasets, which is not installed. "
            f"Install it with: {_TFDS_INSTALL_HINT}"
        ) from e

    if data_dir is not None and not Path(data_dir).is_dir():
        raise DatasetUnavailableError(
            f"data_dir={str(data_dir)!r} does not exist, so {name!r} is not prepared there.\n"
            + _tfds_prepare_hint(name, data_dir)
        )
    try:
        builder = tfds.builder(name, data_dir=None if data_dir is None else os.fspath(data_dir))
        is_prepared = getattr(builder, "is_prepared", None)
        if is_prepared is not None:
            prepared = bool(is_prepared())
        else:  # older tfds: a prepared dataset has its version directory on disk
            prepared = Path(os.fspath(builder.data_dir)).is_dir()
        if not prepared or not builder.info.splits:
            raise FileNotFoundError(f"{name!r} is not prepared in data_dir={data_dir!r}")
        arrays = {
            split: tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))
            for split in ("train", "test")
        }
    except Exception as e:  # tfds raises a variety of types for "not there"
        raise DatasetUnavailableError(
            f"Could not load {name!r} from data_dir={data_dir!r}: {e}\n" + _tfds_prepare_hint(name, data_dir)
        ) from e

    (x_train, y_train), (x_test, y_test) = arrays["train"], arrays["test"]
    mean, std = NORMALIZATION[name]
    return Dataset(
        name=name,
        x_train=np.asarray(x_train, dtype=np.uint8),
        y_train=np.asarray(y_train, dtype=np.int32),
        x_test=np.asarray(x_test, dtype=np.uint8),
        y_test=np.asarray(y_test, dtype=np.int32),
        num_classes=10 if name == "cifar10" else 100,
        scale=255.0,
        mean=mean,
        std=std,
    )


def _read_image_folder(split_dir: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for path in sorted((split_dir / cls).glob("*.png")):
            with Image.open(path) as img:
                arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
            if arr.shape != (32, 32, 3):
                raise ValueError(
                    f"CINIC-10 image {path} has size {arr.shape[1]}x{arr.shape[0]}; expected 32x32"
                )
            images.append(arr)
            labels.append(label)
    if not images:
        raise DatasetUnavailableError(f"No *.png images found under {split_dir}. {_CINIC10_HINT}")
    return np.stack(images), np.asarray(labels, dtype=np.int32)


def _load_cinic10(data_dir: str | os.PathLike[str] | None) -> Dataset:
    """CINIC-10 from ``data_dir/{train,test}/<class>/*.png``.

    Class names sorted alphabetically give the label ids; files are read in
    sorted order. As in FedML, ``train`` (90 000 images) is the training set,
    ``test`` (90 000) the test set, and ``valid`` is not used. Any number of
    class folders is accepted, but ``train`` and ``test`` must hold the same.
    """
    if data_dir is None:
        raise DatasetUnavailableError(f"name='cinic10' needs data_dir (the extracted CINIC-10 root). {_CINIC10_HINT}")
    root = Path(data_dir)
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise DatasetUnavailableError(
                f"data_dir={str(data_dir)!r} has no '{split}' folder. {_CINIC10_HINT}"
            )
    train_classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    test_classes = sorted(p.name for p in (root / "test").iterdir() if p.is_dir())
    if not train_classes:
        raise DatasetUnavailableError(f"data_dir={str(data_dir)!r}: 'train' has no class folders. {_CINIC10_HINT}")
    if train_classes != test_classes:
        raise ValueError(
            f"data_dir={str(data_dir)!r}: class folders differ between train {train_classes} "
            f"and test {test_classes}"
        )
    x_train, y_train = _read_image_folder(root / "train", train_classes)
    x_test, y_test = _read_image_folder(root / "test", train_classes)
    mean, std = NORMALIZATION["cinic10"]
    return Dataset(
        name="cinic10",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=len(train_classes),
        scale=255.0,
        mean=mean,
        std=std,
    )
