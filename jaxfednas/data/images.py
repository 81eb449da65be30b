"""The in-memory image dataset record every loader returns, and the bundled digits the
offline datasets are made from (:mod:`jaxfednas.data.datasets` loads them by name;
:mod:`jaxfednas.data.cluttered` builds on the digits). NumPy and scikit-learn only."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Dataset", "channel_stats", "digits_split"]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An image classification dataset held in host memory.

    Attributes:
      name: Dataset name, one of :data:`jaxfednas.data.datasets.DATASETS`.
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


def channel_stats(x: np.ndarray, scale: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of ``x / scale``, rounded to 6 decimals for stability."""
    xf = x.astype(np.float64) / scale
    axes = tuple(range(x.ndim - 1))
    mean = tuple(round(float(v), 6) for v in xf.mean(axis=axes))
    std = tuple(round(float(v), 6) for v in xf.std(axis=axes))
    return mean, std


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits ``x`` ``[1797, 8, 8, 1]`` uint8 and ``y`` int32, and the
    indices of the fixed stratified 80/20 train/test split (seed 0) into them."""
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    raw = load_digits()
    # Pixel values are integers 0..16 stored as float64; uint8 is exact.
    x = raw.images.astype(np.uint8)[..., None]
    y = raw.target.astype(np.int32)
    train_idx, test_idx = train_test_split(np.arange(len(y)), test_size=0.2, stratify=y, random_state=0)
    return x, y, train_idx, test_idx
