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
``cluttered_digits``
    The same digits at random positions on a 16x16 canvas among fragments of
    other digits of the same split (:mod:`jaxfednas.data.cluttered`; three images of every
    digit: 4 311 / 1 080 images, the digits' labels, values 0..16). Works offline; made
    deterministically, test digits never in training images.
``synthetic``
    Tiny, seeded, learnable toy data for unit tests.
``cifar10`` / ``cifar100``
    From the official archives of https://www.cs.toronto.edu/~kriz/cifar.html
    in ``data_dir``, as torchvision and keras leave them: the extracted binary
    folder (``cifar-10-batches-bin``, ``cifar-100-binary``), else the extracted
    python folder (``cifar-10-batches-py``, ``cifar-100-python``), else either
    ``.tar.gz`` archive itself (read without extracting). Failing those,
    through ``tensorflow_datasets`` (optional extra ``jaxfednas[tfds]``) with
    the data already prepared in ``data_dir``. Nothing is downloaded unless
    asked: :func:`download_cifar` fetches an official archive.
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
import hashlib
import io
import os
import pickle
import sys
import tarfile
import urllib.request
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxfednas.data.images import Dataset
from jaxfednas.data.images import channel_stats as _channel_stats
from jaxfednas.data.images import digits_split as _digits_split

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "Dataset",
    "DatasetUnavailableError",
    "download_cifar",
    "find_cifar_archive",
    "load_dataset",
]

DATASETS: tuple[str, ...] = ("digits", "cluttered_digits", "synthetic", "cifar10", "cifar100", "cinic10")

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
      data_dir: Where prepared data lives. Used by ``cifar10``/``cifar100``:
        the directory holding the official CIFAR archives (extracted folders
        or ``.tar.gz``, see the module docstring) or, failing those, the
        tensorflow_datasets data directory (``None``: only the tfds default).
        Required by ``cinic10`` (the extracted CINIC-10 root). Ignored by
        ``digits``, ``cluttered_digits`` and ``synthetic``.
      seed: Seed for ``synthetic``. The other datasets are fixed (the digits
        train/test split is part of the dataset definition and always uses
        seed 0, as are the clutter's draws), so ``seed`` does not change them.
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
    if name == "cluttered_digits":
        from jaxfednas.data.cluttered import cluttered_digits  # noqa: PLC0415

        return cluttered_digits()[0]
    if name == "synthetic":
        return _load_synthetic(seed=seed, **kwargs)
    if name in ("cifar10", "cifar100"):
        if data_dir is not None:
            found = _load_cifar_archives(name, Path(data_dir))
            if found is not None:
                return found
        return _load_tfds(name, data_dir)
    return _load_cinic10(data_dir)


def _load_digits() -> Dataset:
    x, y, train_idx, test_idx = _digits_split()
    x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
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
        _cifar_archive_hint(name, data_dir) + "\n"
        f"Or, for the tensorflow-datasets route, on a machine with internet access run\n"
        f"  python -c \"import tensorflow_datasets as tfds; "
        f"tfds.builder('{name}', data_dir='{shown}').download_and_prepare()\"\n"
        f"then copy {shown} to this machine and pass --data-dir {shown} "
        f"(data_dir={shown!r} in Python)."
    )


def _load_tfds(name: str, data_dir: str | os.PathLike[str] | None) -> Dataset:
    try:
        import tensorflow_datasets as tfds  # optional heavy dependency, imported lazily
    except ImportError as e:
        where = "no data_dir was given" if data_dir is None else f"none was found in data_dir={str(data_dir)!r}"
        raise DatasetUnavailableError(
            f"name={name!r} reads the official CIFAR archives from data_dir, but {where}; "
            f"the other route, tensorflow_datasets, is not installed (install it with: {_TFDS_INSTALL_HINT}).\n"
            + _cifar_archive_hint(name, data_dir)
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
    return _cifar_dataset(name, x_train, y_train, x_test, y_test)


def _cifar_dataset(name: str, x_train: Any, y_train: Any, x_test: Any, y_test: Any) -> Dataset:
    """The :class:`Dataset` of CIFAR arrays (NHWC images), whichever route read them."""
    mean, std = NORMALIZATION[name]
    return Dataset(
        name=name,
        x_train=np.ascontiguousarray(x_train, dtype=np.uint8),
        y_train=np.ascontiguousarray(y_train, dtype=np.int32),
        x_test=np.ascontiguousarray(x_test, dtype=np.uint8),
        y_test=np.ascontiguousarray(y_test, dtype=np.int32),
        num_classes=_CIFAR[name].num_classes,
        scale=255.0,
        mean=mean,
        std=std,
    )


# --- CIFAR from the official archives (https://www.cs.toronto.edu/~kriz/cifar.html) ---------------

_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
_CIFAR_SIZES = (50_000, 10_000)  # training and test images of both CIFAR-10 and CIFAR-100
_CIFAR_PIXELS = 3 * 32 * 32  # one image: 1024 red, 1024 green, 1024 blue bytes, each plane row-major


@dataclasses.dataclass(frozen=True)
class _CifarFormat:
    """One official release of one CIFAR dataset: its archive, folder and members."""

    version: str  # "binary" or "python"
    archive: str  # the .tar.gz file name, as published
    md5: str  # md5 of the archive, as published on the CIFAR page
    folder: str  # the folder the archive extracts to
    train: tuple[str, ...]  # training members, in the order they are concatenated
    test: str


@dataclasses.dataclass(frozen=True)
class _CifarSpec:
    title: str
    num_classes: int
    label_bytes: int  # binary records: label bytes before the pixels
    label_index: int  # binary records: which label byte is the class label
    label_key: bytes  # python batches: the key of the class labels
    formats: tuple[_CifarFormat, ...]  # in the order they are looked for


_CIFAR: dict[str, _CifarSpec] = {
    "cifar10": _CifarSpec(
        "CIFAR-10", 10, 1, 0, b"labels", (
            _CifarFormat("binary", "cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530",
                         "cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin"),
            _CifarFormat("python", "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a",
                         "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch"),
        ),
    ),
    # Records are <coarse label><fine label><pixels>; the class label is the fine (100-way) one,
    # as in tensorflow-datasets and torchvision.
    "cifar100": _CifarSpec(
        "CIFAR-100", 100, 2, 1, b"fine_labels", (
            _CifarFormat("binary", "cifar-100-binary.tar.gz", "03b5dce01913d631647c71ecec9e9cb8",
                         "cifar-100-binary", ("train.bin",), "test.bin"),
            _CifarFormat("python", "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85",
                         "cifar-100-python", ("train",), "test"),
        ),
    ),
}


def _cifar_format(name: str, version: str) -> _CifarFormat:
    for fmt in _CIFAR[name].formats:
        if fmt.version == version:
            return fmt
    raise ValueError(f"version={version!r} is not a CIFAR release; valid: binary, python")


def _cifar_archive_hint(name: str, data_dir: str | os.PathLike[str] | None) -> str:
    """What the archive route looks for, and how to get it."""
    shown = str(data_dir) if data_dir is not None else "DIR"
    spec = _CIFAR[name]
    looked = []
    for fmt in spec.formats:
        looked.append(f"  {shown}/{fmt.folder}/ ({', '.join((*fmt.train, fmt.test))})")
    looked += [f"  {shown}/{fmt.archive}" for fmt in spec.formats]
    binary = spec.formats[0]
    return (
        f"The {spec.title} archive route looks, in this order, for\n" + "\n".join(looked) + "\n"
        f"To get one: download {_CIFAR_URL}{binary.archive} (md5 {binary.md5}) into {shown}, "
        f"or, on a machine with internet access, run `jaxfednas partition --dataset {name} --data-dir {shown} "
        f"--download --out runs/{name}-partition` (or jaxfednas.data.datasets.download_cifar({name!r}, "
        f"{shown!r})); then pass --data-dir {shown}. A torchvision or keras "
        f"download directory holding {spec.formats[1].folder}/ or {spec.formats[1].archive} works as it is."
    )


def _numpy_reconstruct() -> Any:
    """numpy's array-unpickling function (``numpy.core.multiarray._reconstruct`` before numpy 2)."""
    return np.empty(0, np.uint8).__reduce__()[0]


def _uint8_dtype(spec: Any, *args: Any) -> np.dtype:
    """``numpy.dtype`` for the restricted unpickler: CIFAR batches hold uint8 arrays only."""
    if spec not in ("u1", b"u1"):
        raise pickle.UnpicklingError(f"refusing numpy.dtype({spec!r}): CIFAR batches hold uint8 ('u1') arrays only")
    return np.dtype("u1", *args)


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR python batches and nothing else.

    The official batches are dicts of bytes, lists of ints and one uint8
    array; a (protocol 2) pickled numpy array needs exactly three globals:
    ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray`` and
    ``numpy.dtype``. Every other global (``os.system``, ``builtins.eval``, ...)
    is refused, so a tampered file cannot run code.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return _numpy_reconstruct()
        if module == "numpy" and name == "ndarray":
            return np.ndarray
        if module == "numpy" and name == "dtype":
            return _uint8_dtype
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: a CIFAR batch only needs "
            "numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype"
        )


def _corrupt(what: str, why: str, name: str) -> DatasetUnavailableError:
    fmt = _CIFAR[name].formats[0]
    return DatasetUnavailableError(
        f"{what} is not a valid {_CIFAR[name].title} file: {why}. It is probably truncated or corrupt; "
        f"download it again (e.g. {_CIFAR_URL}{fmt.archive}, md5 {fmt.md5})."
    )


def _parse_cifar_binary(raw: bytes, name: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``label_bytes`` label bytes then 3072 pixel bytes -> (NHWC uint8, int32 labels)."""
    spec = _CIFAR[name]
    record = spec.label_bytes + _CIFAR_PIXELS
    if not raw or len(raw) % record:
        raise _corrupt(what, f"its {len(raw)} bytes are not a whole number of {record}-byte records", name)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, spec.label_index].astype(np.int32)
    images = rows[:, spec.label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels


def _parse_cifar_python(raw: bytes, name: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A pickled batch dict (``data`` [N, 3072] uint8, labels) -> (NHWC uint8, int32 labels)."""
    spec = _CIFAR[name]
    try:
        batch = _CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except pickle.UnpicklingError as e:
        if "refusing" in str(e):
            raise DatasetUnavailableError(f"{what} was not loaded: {e}") from e
        raise _corrupt(what, f"unpickling failed ({e})", name) from e
    except Exception as e:  # a damaged pickle fails in many ways (EOFError, KeyError, ValueError, ...)
        raise _corrupt(what, f"unpickling failed ({type(e).__name__}: {e})", name) from e
    if not isinstance(batch, dict):
        raise _corrupt(what, f"it holds a {type(batch).__name__}, not a dict", name)
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    label_key = spec.label_key.decode()
    if "data" not in batch or label_key not in batch:
        raise _corrupt(what, f"it has keys {sorted(map(str, batch))}, not 'data' and {label_key!r}", name)
    data, labels = batch["data"], np.asarray(batch[label_key])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        shape = getattr(data, "shape", None)
        raise _corrupt(what, f"'data' is {type(data).__name__} {shape}, not a uint8 [N, {_CIFAR_PIXELS}] array", name)
    if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise _corrupt(what, f"{label_key!r} has shape {labels.shape}, not one integer per image", name)
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels.astype(np.int32)


def _read_cifar_members(fmt: _CifarFormat, read: Any, name: str, where: str) -> Dataset:
    parse = _parse_cifar_binary if fmt.version == "binary" else _parse_cifar_python
    parts = [parse(read(member), name, f"{where}/{member}") for member in (*fmt.train, fmt.test)]
    for (_, labels), member in zip(parts, (*fmt.train, fmt.test)):
        if labels.size and (labels.min() < 0 or labels.max() >= _CIFAR[name].num_classes):
            raise _corrupt(f"{where}/{member}", f"labels outside 0..{_CIFAR[name].num_classes - 1}", name)
    x_train = np.concatenate([x for x, _ in parts[:-1]])
    y_train = np.concatenate([y for _, y in parts[:-1]])
    sizes = (len(y_train), len(parts[-1][1]))
    if sizes != _CIFAR_SIZES:  # legal (a subset made on purpose) but most often a truncated copy
        print(f"warning: {where} holds {sizes[0]} training and {sizes[1]} test images; the official "
              f"{_CIFAR[name].title} has {_CIFAR_SIZES[0]} and {_CIFAR_SIZES[1]} (a truncated or edited copy?)",
              file=sys.stderr)
    return _cifar_dataset(name, x_train, y_train, *parts[-1])


def _read_cifar_folder(fmt: _CifarFormat, folder: Path, name: str) -> Dataset:
    missing = [m for m in (*fmt.train, fmt.test) if not (folder / m).is_file()]
    if missing:
        raise DatasetUnavailableError(
            f"{folder} is the {_CIFAR[name].title} {fmt.version} folder but lacks {', '.join(missing)}; "
            f"extract {fmt.archive} again.\n" + _cifar_archive_hint(name, folder.parent)
        )
    return _read_cifar_members(fmt, lambda member: (folder / member).read_bytes(), name, str(folder))


def _read_cifar_tar(fmt: _CifarFormat, archive: Path, name: str) -> Dataset:
    """Reads the members straight out of the .tar.gz (one pass, nothing extracted to disk)."""
    wanted = {f"{fmt.folder}/{m}": m for m in (*fmt.train, fmt.test)}
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:
                member = wanted.get(info.name.removeprefix("./"))
                if member is not None and info.isfile():
                    f = tar.extractfile(info)
                    assert f is not None  # a regular file always has contents
                    members[member] = f.read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise _corrupt(str(archive), f"reading the archive failed ({type(e).__name__}: {e})", name) from e
    missing = [m for m in wanted if wanted[m] not in members]
    if missing:
        raise _corrupt(str(archive), f"it has no member {', '.join(missing)}", name)
    return _read_cifar_members(fmt, members.__getitem__, name, str(archive))


def _load_cifar_archives(name: str, root: Path) -> Dataset | None:
    """CIFAR from the official archives under ``root``; ``None`` when there are none.

    Looks for, in this order: the extracted binary folder, the extracted python
    folder, the binary .tar.gz, the python .tar.gz. ``root`` may also be one of
    the extracted folders itself. Training batches are concatenated in their
    official order (data_batch_1 .. data_batch_5 for CIFAR-10), the order
    torchvision and keras use.
    """
    found = find_cifar_archive(name, root)
    if found is None:
        return None
    fmt = next(f for f in _CIFAR[name].formats if found.name in (f.folder, f.archive))
    return _read_cifar_folder(fmt, found, name) if found.is_dir() else _read_cifar_tar(fmt, found, name)


def find_cifar_archive(name: str, data_dir: str | os.PathLike[str]) -> Path | None:
    """The official CIFAR folder or archive ``load_dataset(name, data_dir)`` reads, or ``None``.

    Only looks, in the order of the module docstring; nothing is read.
    """
    root = Path(data_dir)
    formats = _CIFAR[name].formats
    for fmt in formats:
        for folder in (root / fmt.folder, root):
            if folder.name == fmt.folder and folder.is_dir():
                return folder
    for fmt in formats:
        if (root / fmt.archive).is_file():
            return root / fmt.archive
    return None


def download_cifar(
    name: str,
    data_dir: str | os.PathLike[str],
    *,
    version: str = "binary",
    url: str | None = None,
    md5: str | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download an official CIFAR archive into ``data_dir`` and check its md5.

    Afterwards ``load_dataset(name, data_dir)`` reads it (without extracting
    it). An archive already in ``data_dir`` with the right md5 is kept and not
    fetched again. The file is written under a temporary name and renamed
    only once its checksum matches.

    Args:
      name: ``"cifar10"`` or ``"cifar100"``.
      data_dir: Directory to write the archive to (created if missing).
      version: ``"binary"`` (the default: plain records, no unpickling) or
        ``"python"`` (the release torchvision uses). Both give the same arrays.
      url: Where to fetch from; default the official
        ``https://www.cs.toronto.edu/~kriz/<archive>``. Any URL urllib opens
        (a mirror, ``file://``) works.
      md5: Expected md5 of the archive; default the published one.
      timeout: Seconds to wait for the server.

    Returns:
      The path of the archive.

    Raises:
      ValueError: ``name`` or ``version`` is not a CIFAR release.
      ~jaxfednas.data.datasets.DatasetUnavailableError: The download failed or
        its md5 did not match (nothing is left behind).
    """
    if name not in _CIFAR:
        raise ValueError(f"name={name!r}: download_cifar fetches {' or '.join(_CIFAR)}")
    fmt = _cifar_format(name, version)
    url = url or _CIFAR_URL + fmt.archive
    md5 = (md5 or fmt.md5).lower()
    target = Path(data_dir) / fmt.archive

    def file_md5(path: Path) -> str:
        h = hashlib.md5()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    if target.is_file() and file_md5(target) == md5:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    h = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
    except OSError as e:  # URLError, timeouts and disk errors are all OSErrors
        partial.unlink(missing_ok=True)
        raise DatasetUnavailableError(
            f"Downloading {url} failed ({type(e).__name__}: {e}). On a machine with internet access, "
            f"download it and copy {fmt.archive} into {data_dir}."
        ) from e
    if h.hexdigest() != md5:
        partial.unlink()
        raise DatasetUnavailableError(
            f"{url} has md5 {h.hexdigest()}, expected {md5}: the download is incomplete or not the "
            f"official {fmt.archive}; nothing was kept."
        )
    os.replace(partial, target)
    return target


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
