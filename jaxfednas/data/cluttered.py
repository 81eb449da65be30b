"""Cluttered digits: the bundled 8x8 digits at random positions on a larger canvas, among
fragments of other digits — a small task on which the network's architecture matters more
than on the plain digits.

The construction is that of cluttered translated MNIST (Mnih et al., "Recurrent Models of
Visual Attention", arXiv:1406.6247: a digit at a random place on a larger canvas, with
clutter made of random crops of other digits), scaled to the 8x8 digits of
:func:`jaxfednas.data.datasets.load_dataset` ``("digits")``:

* every image holds one digit of the split, at a position drawn uniformly on a
  :data:`CANVAS` x :data:`CANVAS` canvas (the digit wholly inside), and keeps its label:
  each split holds :data:`RENDERS` images of every one of its digits, image ``i + r N`` of
  a split of ``N`` digits made from digit ``i`` of the same split of ``digits``, so the
  labels are those of ``digits`` repeated :data:`RENDERS` times;
* :data:`NUM_FRAGMENTS` fragments, each a :data:`FRAGMENT_SIZE` x :data:`FRAGMENT_SIZE`
  crop (with some ink, at least :data:`MIN_FRAGMENT_INK`) of *another* digit of the
  *same* split, are placed uniformly on the canvas, over or beside the digit;
* overlapping pixels keep the larger value, so pixels stay integers in ``0..16`` (the
  digits' scale) and the digit's own strokes are never dimmed.

The defaults keep the paper's proportions: its 60x60 canvas is about twice its 28x28
digits (here 16x16 for 8x8) and its four 8x8 fragments cover 7 % of the canvas (here two
3x3 fragments, 18 of 256 pixels). A network must find the digit anywhere on the canvas
and ignore strokes beside it, which the plain digits (centred, uncluttered) never ask:
trained centrally (one seed, Adam, 40 epochs), the small CNN of
:func:`jaxfednas.search_spaces.models.make_model` (one pooling before its dense layers)
reaches 0.99 test accuracy on ``digits`` but 0.59 here; a CNN with a pooling after each
convolution and a global max-pool 0.99 and 0.83; a linear classifier (scikit-learn's
logistic regression) 0.97 and 0.12.

Training images are made only from training digits and test images only from test digits,
so no pixel of a test digit is in any training image. Everything is integer arithmetic on
draws of the PCG64 bit generator (:data:`SEED`), whose output NumPy keeps fixed across
versions and platforms, so the dataset is the same bytes everywhere (given scikit-learn's
digits and its train/test split).

Example::

    >>> from jaxfednas.data.datasets import load_dataset
    >>> ds = load_dataset("cluttered_digits")
    >>> ds.x_train.shape, ds.x_test.shape, ds.scale
    ((4311, 16, 16, 1), (1080, 16, 16, 1), 16.0)
    >>> bool((ds.y_train[:1437] == load_dataset("digits").y_train).all())
    True
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxfednas.data.images import Dataset, channel_stats, digits_split

__all__ = [
    "CANVAS",
    "FRAGMENT_SIZE",
    "MIN_FRAGMENT_INK",
    "NUM_FRAGMENTS",
    "RENDERS",
    "SEED",
    "ClutterLayout",
    "cluttered_digits",
    "plot_samples",
    "render",
]

CANVAS = 16
"""Side of the square canvas, in pixels (the digits are 8x8)."""
NUM_FRAGMENTS = 2
"""Clutter fragments per image."""
FRAGMENT_SIZE = 3
"""Side of a square clutter fragment, in pixels."""
MIN_FRAGMENT_INK = 32
"""Least sum of a fragment's pixels (two full-ink pixels at the digits' scale of 16); blank
crops from a digit's empty border are drawn again."""
RENDERS = 3
"""Images of every digit in each split, each with its own position and clutter. Three, so
that a network sees each training digit in three places among three clutters and a test
accuracy averages three views of each test digit: an architecture's accuracy then moves
less from training seed to training seed (docs/guides/data.md)."""
SEED = 0
"""Seed of the PCG64 bit generator; the training split draws from stream ``(SEED, 0)``, the
test split from ``(SEED, 1)``."""

_DIGIT = 8  # side of a bundled digit
_MAX_REDRAWS = 100  # the defaults draw blank fragments again 4 times in either split


@dataclasses.dataclass(frozen=True)
class ClutterLayout:
    """Where every piece of the ``N`` images of one split comes from.

    Indices are into scikit-learn's 1 797 digits (``sklearn.datasets.load_digits().images``);
    positions are ``(row, column)`` of a piece's top-left pixel.

    Attributes:
      digit: ``[N]`` the digit each image shows (its label is that digit's).
      digit_pos: ``[N, 2]`` where the digit is on the canvas.
      fragment: ``[N, K]`` the digit each clutter fragment is cut from (never ``digit``).
      fragment_crop: ``[N, K, 2]`` where the fragment is cut from that digit.
      fragment_pos: ``[N, K, 2]`` where the fragment is on the canvas.
      fragment_size: Side of every fragment, in pixels.
    """

    digit: np.ndarray
    digit_pos: np.ndarray
    fragment: np.ndarray
    fragment_crop: np.ndarray
    fragment_pos: np.ndarray
    fragment_size: int


def _uniform(bitgen: np.random.PCG64, shape: tuple[int, ...], high: int | np.ndarray) -> np.ndarray:
    """Integers in ``[0, high)`` from raw 64-bit draws (``Generator.integers`` may change
    its algorithm between NumPy versions; the PCG64 stream does not). The modulo bias is
    below 2**-50 here."""
    raw = bitgen.random_raw(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    return (raw % np.asarray(high, dtype=np.uint64)).astype(np.int64)


def _draw_layout(
    digits: np.ndarray, split: np.ndarray, bitgen: np.random.PCG64, *, canvas: int, num_fragments: int,
    fragment_size: int, min_ink: int,
) -> ClutterLayout:
    """The layout of one split: ``split`` holds the indices (into ``digits``) of its digits."""
    n, k, f = len(split), num_fragments, fragment_size
    if n < 2:
        raise ValueError(f"a split needs at least 2 digits to cut fragments of other digits from, got {n}")
    digit_pos = _uniform(bitgen, (n, 2), canvas - _DIGIT + 1)
    # The j-th other digit of the split: an offset in 1..n-1 from the image's own position.
    other = (np.arange(n)[:, None] + 1 + _uniform(bitgen, (n, k), n - 1)) % n
    crop = _uniform(bitgen, (n, k, 2), _DIGIT - f + 1)
    for _ in range(_MAX_REDRAWS):  # draw blank fragments again until all have ink (same stream: deterministic)
        rows = crop[..., 0, None, None] + np.arange(f)[:, None]
        cols = crop[..., 1, None, None] + np.arange(f)[None, :]
        ink = digits[split[other][..., None, None], rows, cols].sum(axis=(-2, -1), dtype=np.int64)
        blank = np.flatnonzero(ink < min_ink)
        if blank.size == 0:
            break
        flat_other, flat_crop = other.reshape(-1), crop.reshape(-1, 2)  # views: writes reach other, crop
        image = blank // k
        flat_other[blank] = (image + 1 + _uniform(bitgen, (blank.size,), n - 1)) % n
        flat_crop[blank] = _uniform(bitgen, (blank.size, 2), _DIGIT - f + 1)
    else:
        raise ValueError(f"{blank.size} fragments still had less ink than min_fragment_ink={min_ink} after "
                         f"{_MAX_REDRAWS} draws; a {f}x{f} crop holds at most {16 * f * f}: lower min_fragment_ink")
    fragment_pos = _uniform(bitgen, (n, k, 2), canvas - f + 1)
    return ClutterLayout(digit=split.astype(np.int64), digit_pos=digit_pos, fragment=split[other].astype(np.int64),
                         fragment_crop=crop, fragment_pos=fragment_pos, fragment_size=f)


def render(digits: np.ndarray, layout: ClutterLayout, *, canvas: int = CANVAS) -> np.ndarray:
    """The images ``[N, canvas, canvas, 1]`` uint8 of ``layout``, from ``digits``
    ``[M, 8, 8]`` (the pixels ``layout``'s indices point at): each digit and fragment pasted
    at its position, overlaps keeping the larger value. Reads no digit ``layout`` does not
    name."""
    n, k = layout.fragment.shape
    f = layout.fragment_size
    out = np.zeros((n, canvas, canvas), dtype=np.uint8)
    image = np.arange(n)[:, None, None]

    def paste(pos: np.ndarray, patch: np.ndarray, side: int) -> None:
        rows = pos[:, 0, None, None] + np.arange(side)[:, None]
        cols = pos[:, 1, None, None] + np.arange(side)[None, :]
        out[image, rows, cols] = np.maximum(out[image, rows, cols], patch)

    paste(layout.digit_pos, digits[layout.digit], _DIGIT)
    for j in range(k):
        crop = layout.fragment_crop[:, j]
        rows = crop[:, 0, None, None] + np.arange(f)[:, None]
        cols = crop[:, 1, None, None] + np.arange(f)[None, :]
        paste(layout.fragment_pos[:, j], digits[layout.fragment[:, j, None, None], rows, cols], f)
    return out[..., None]


def cluttered_digits(
    *,
    canvas: int = CANVAS,
    num_fragments: int = NUM_FRAGMENTS,
    fragment_size: int = FRAGMENT_SIZE,
    min_fragment_ink: int = MIN_FRAGMENT_INK,
    seed: int = SEED,
    renders: int = RENDERS,
) -> tuple[Dataset, dict[str, ClutterLayout]]:
    """Build the cluttered digits; :func:`~jaxfednas.data.datasets.load_dataset`
    ``("cluttered_digits")`` is this with the module's defaults.

    The arguments make variants for experiments; the dataset named ``cluttered_digits`` is
    always the default one.

    Args:
      canvas: Side of the square canvas (at least 8, a digit's side).
      num_fragments: Clutter fragments per image (0: the digit alone, moved).
      fragment_size: Side of a fragment, 1..8.
      min_fragment_ink: Least pixel sum of a fragment; blanker crops are drawn again.
      seed: Seed of the PCG64 streams ``(seed, 0)`` (training) and ``(seed, 1)`` (test).
      renders: Images per digit: each split holds ``renders`` images of every one of its
        digits, each with its own position and clutter (image ``i + r N`` of a split of
        ``N`` digits is render ``r`` of digit ``i``; render ``r`` continues the split's stream
        after render ``r - 1``, so ``renders=1`` is the first render of any larger value).

    Returns:
      A pair ``(dataset, layouts)`` of the :class:`~jaxfednas.data.images.Dataset` and a
      dict from ``"train"`` and ``"test"`` to the split's :class:`ClutterLayout` (which
      digit and which fragments every image is made of, and where).
    """
    if canvas < _DIGIT:
        raise ValueError(f"canvas must be at least {_DIGIT} (a digit's side), got {canvas}")
    if not 1 <= fragment_size <= _DIGIT:
        raise ValueError(f"fragment_size must be in 1..{_DIGIT}, got {fragment_size}")
    if num_fragments < 0:
        raise ValueError(f"num_fragments must be >= 0, got {num_fragments}")
    if isinstance(renders, bool) or not isinstance(renders, int) or renders < 1:
        raise ValueError(f"renders must be an integer >= 1, got {renders!r}")
    x, y, train_idx, test_idx = digits_split()
    digits = x[..., 0]
    layouts, images = {}, {}
    for stream, (name, split) in enumerate((("train", train_idx), ("test", test_idx))):
        bitgen = np.random.PCG64([seed, stream])
        parts = [_draw_layout(digits, split, bitgen, canvas=canvas, num_fragments=num_fragments,
                              fragment_size=fragment_size, min_ink=min_fragment_ink) for _ in range(renders)]
        layout = ClutterLayout(**{f.name: np.concatenate([getattr(q, f.name) for q in parts])
                                  for f in dataclasses.fields(ClutterLayout) if f.name != "fragment_size"},
                               fragment_size=fragment_size)
        layouts[name] = layout
        images[name] = render(digits, layout, canvas=canvas)
    mean, std = channel_stats(images["train"], 16.0)
    dataset = Dataset(name="cluttered_digits", x_train=images["train"], y_train=np.tile(y[train_idx], renders),
                      x_test=images["test"], y_test=np.tile(y[test_idx], renders), num_classes=10, scale=16.0,
                      mean=mean, std=std)
    return dataset, layouts


def plot_samples(dataset: Dataset, path: str | os.PathLike[str], *, rows: int = 4, cols: int = 8, split: str = "train",
                 title: str = "") -> None:
    """A grid of the first ``rows * cols`` images of ``split`` (``"train"`` or ``"test"``)
    of ``dataset`` (a :class:`~jaxfednas.data.images.Dataset`, channel 0 if several),
    each titled with its label, written as a PNG to ``path`` through
    :func:`jaxfednas.files.save_figure` (matplotlib's Agg backend)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from jaxfednas.files import save_figure  # noqa: PLC0415

    x, y = (dataset.x_train, dataset.y_train) if split == "train" else (dataset.x_test, dataset.y_test)
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 * cols, 1.35 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < len(x):
            ax.imshow(x[i, :, :, 0], cmap="gray_r", vmin=0, vmax=dataset.scale, interpolation="nearest")
            ax.set_title(str(int(y[i])), fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
