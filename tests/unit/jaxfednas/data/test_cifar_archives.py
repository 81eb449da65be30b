"""CIFAR-10/100 from the official archives (binary, python, and their .tar.gz), without tfds.

Each test writes tiny archives (20 training, 10 test images) from known NHWC arrays, in the
layouts of https://www.cs.toronto.edu/~kriz/cifar.html: binary records of label byte(s) then
3072 pixel bytes (1024 red, 1024 green, 1024 blue, each plane row-major), and python batches
pickled as Python 2 / numpy 1 wrote them (protocol 2, byte strings, numpy.core.multiarray).
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import pickletools
import struct
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from jaxfednas.data.datasets import NORMALIZATION, DatasetUnavailableError, download_cifar, load_dataset

N_TRAIN, N_TEST = 20, 10
ROUTES = ("binary", "python", "binary_tar", "python_tar")
FOLDER = {
    ("cifar10", "binary"): "cifar-10-batches-bin", ("cifar10", "python"): "cifar-10-batches-py",
    ("cifar100", "binary"): "cifar-100-binary", ("cifar100", "python"): "cifar-100-python",
}
ARCHIVE = {
    ("cifar10", "binary"): "cifar-10-binary.tar.gz", ("cifar10", "python"): "cifar-10-python.tar.gz",
    ("cifar100", "binary"): "cifar-100-binary.tar.gz", ("cifar100", "python"): "cifar-100-python.tar.gz",
}


def _truth(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Known images (NHWC uint8) and labels; CIFAR-100 coarse labels differ from the fine ones."""
    rng = np.random.default_rng(seed)
    classes = 10 if name == "cifar10" else 100
    t = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        t[f"x_{split}"] = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        t[f"y_{split}"] = rng.integers(0, classes, size=n).astype(np.int32)
        t[f"coarse_{split}"] = ((t[f"y_{split}"] + 7) % 20).astype(np.int32)
    return t


def _rows(x: np.ndarray) -> np.ndarray:
    """NHWC images -> the official [N, 3072] rows (channel planes, each row-major)."""
    return x.transpose(0, 3, 1, 2).reshape(len(x), 3072)


def _py2_pickle(obj, dtype: bytes = b"u1") -> bytes:
    """Pickle ``obj`` (dicts, lists, ints, byte strings, 2-D uint8 arrays) as Python 2's cPickle
    with numpy 1.x does at protocol 2: byte strings as (SHORT_)BINSTRING, arrays through
    numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype."""
    out = bytearray(b"\x80\x02")

    def emit(o):
        if isinstance(o, dict):
            out.extend(b"}(")
            for k, v in o.items():
                emit(k)
                emit(v)
            out.extend(b"u")
        elif isinstance(o, list):
            out.extend(b"](")
            for v in o:
                emit(v)
            out.extend(b"e")
        elif isinstance(o, (int, np.integer)):
            out.extend(b"J" + struct.pack("<i", int(o)))
        elif isinstance(o, bytes):
            out.extend((b"U" + bytes([len(o)]) if len(o) < 256 else b"T" + struct.pack("<i", len(o))) + o)
        elif isinstance(o, np.ndarray):
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n")
            emit(0)
            out.extend(b"\x85")  # TUPLE1
            emit(b"b")
            out.extend(b"\x87R(")  # TUPLE3, REDUCE, MARK (the state tuple)
            emit(1)
            out.extend(b"(")
            for d in o.shape:
                emit(d)
            out.extend(b"tcnumpy\ndtype\n")
            emit(dtype)
            emit(0)
            emit(1)
            out.extend(b"\x87R(")
            emit(3)
            emit(b"|")
            out.extend(b"NNN")
            emit(-1)
            emit(-1)
            emit(0)
            out.extend(b"tb\x89")  # dtype BUILD; fortran_order False
            emit(o.tobytes())
            out.extend(b"tb")  # array BUILD
        else:
            raise TypeError(type(o))

    emit(obj)
    out.extend(b".")
    return bytes(out)


def _members(name: str, fmt: str, t: dict[str, np.ndarray]) -> dict[str, bytes]:
    """The archive members (file name -> contents) of release ``fmt`` holding ``t``."""
    if name == "cifar10":
        splits = {f"data_batch_{i + 1}": slice(4 * i, 4 * i + 4) for i in range(5)}  # 5 batches of 4
        test, labels_key = "test_batch", b"labels"
    else:
        splits, test, labels_key = {"train": slice(None)}, "test", b"fine_labels"
    files = [(m, "train", s) for m, s in splits.items()] + [(test, "test", slice(None))]
    members = {}
    for member, split, s in files:
        x, y, coarse = t[f"x_{split}"][s], t[f"y_{split}"][s], t[f"coarse_{split}"][s]
        if fmt == "binary":
            labels = y[:, None] if name == "cifar10" else np.stack([coarse, y], axis=1)
            members[member + ".bin"] = np.concatenate([labels.astype(np.uint8), _rows(x)], axis=1).tobytes()
        else:
            batch = {b"batch_label": b"tiny " + member.encode(), labels_key: [int(v) for v in y], b"data": _rows(x),
                     b"filenames": [b"img_%d.png" % i for i in range(len(y))]}
            if name == "cifar100":
                batch[b"coarse_labels"] = [int(v) for v in coarse]
            members[member] = _py2_pickle(batch)
    return members


def _write(root: Path, name: str, route: str, t: dict[str, np.ndarray]) -> Path:
    """Writes the release of ``route`` into ``root`` as torchvision/keras would leave it."""
    fmt = route.removesuffix("_tar")
    folder = FOLDER[name, fmt]
    members = _members(name, fmt, t)
    root.mkdir(parents=True, exist_ok=True)
    if route.endswith("_tar"):
        with tarfile.open(root / ARCHIVE[name, fmt], "w:gz") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(f"{folder}/{member}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        (root / folder).mkdir()
        for member, data in members.items():
            (root / folder / member).write_bytes(data)
    return root


def _assert_matches(ds, name: str, t: dict[str, np.ndarray]) -> None:
    assert ds.name == name and ds.num_classes == (10 if name == "cifar10" else 100)
    for key in ("x_train", "y_train", "x_test", "y_test"):
        got, want = getattr(ds, key), t[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_array_equal(got, want, err_msg=key)
        assert got.flags.c_contiguous
    assert ds.image_shape == (32, 32, 3) and ds.scale == 255.0
    assert (ds.mean, ds.std) == NORMALIZATION[name]


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_gives_the_known_arrays(tmp_path, name, route, capsys):
    """Same NHWC images, fine labels and batch order from every release, folder or tar.gz;
    a copy smaller than the official one is read with a one-line warning."""
    t = _truth(name)
    ds = load_dataset(name, _write(tmp_path, name, route, t))
    _assert_matches(ds, name, t)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and f"holds {N_TRAIN} training and {N_TEST} test images; the official " in warning
    assert "has 50000 and 10000 (a truncated or edited copy?)" in warning
    if name == "cifar10":  # batches concatenated 1..5: batch 2 starts at image 4
        np.testing.assert_array_equal(ds.x_train[4:8], t["x_train"][4:8])
    else:  # the class label is the fine one, not the coarse
        assert not np.array_equal(ds.y_train, t["coarse_train"])


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_lookup_order_binary_folder_python_folder_then_archives(tmp_path, name):
    """With several releases in data_dir (each holding different data) the documented one wins."""
    truths = {route: _truth(name, seed=i + 1) for i, route in enumerate(ROUTES)}
    for route in ROUTES:
        _write(tmp_path, name, route, truths[route])
    for route in ROUTES:
        _assert_matches(load_dataset(name, tmp_path), name, truths[route])
        fmt = route.removesuffix("_tar")
        if route.endswith("_tar"):
            (tmp_path / ARCHIVE[name, fmt]).unlink()
        else:
            for f in (tmp_path / FOLDER[name, fmt]).iterdir():
                f.unlink()
            (tmp_path / FOLDER[name, fmt]).rmdir()


@pytest.mark.parametrize("fmt", ["binary", "python"])
def test_data_dir_may_be_the_extracted_folder(tmp_path, fmt):
    t = _truth("cifar10")
    _write(tmp_path, "cifar10", fmt, t)
    _assert_matches(load_dataset("cifar10", tmp_path / FOLDER["cifar10", fmt]), "cifar10", t)


def test_py2_style_pickle_is_what_plain_pickle_reads():
    """The test's Python-2-style batches are valid pickles; the restricted loader agrees with pickle."""
    t = _truth("cifar100")
    raw = _members("cifar100", "python", t)["train"]
    pickletools.dis(raw, out=io.StringIO())  # well formed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2 aliases numpy.core
        plain = pickle.loads(raw, encoding="bytes")
    assert sorted(plain) == [b"batch_label", b"coarse_labels", b"data", b"filenames", b"fine_labels"]
    np.testing.assert_array_equal(plain[b"data"], _rows(t["x_train"]))
    assert plain[b"data"].dtype == np.uint8 and plain[b"fine_labels"] == t["y_train"].tolist()


def test_batches_repickled_by_python3_numpy2_load(tmp_path):
    """A batch written by today's pickle (protocol 4, numpy._core) needs the same three globals."""
    t = _truth("cifar10")
    _write(tmp_path, "cifar10", "python", t)
    folder = tmp_path / FOLDER["cifar10", "python"]
    for f in folder.iterdir():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            batch = pickle.loads(f.read_bytes(), encoding="bytes")
        f.write_bytes(pickle.dumps(batch, protocol=4))
    _assert_matches(load_dataset("cifar10", tmp_path), "cifar10", t)


class _Evil:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "object dtype"])
def test_malicious_pickle_is_refused(tmp_path, payload):
    _write(tmp_path, "cifar10", "python", _truth("cifar10"))
    marker = tmp_path / "pwned"
    if payload == "os.system":
        evil = pickle.dumps({b"data": _Evil(os.system, f"touch {marker}")}, protocol=4)
        match = r"refusing to unpickle (posix|nt)\.system"
    elif payload == "builtins.eval":
        evil = pickle.dumps(_Evil(eval, f"open({str(marker)!r}, 'w')"), protocol=2)
        match = r"refusing to unpickle __builtin__\.eval"  # protocol 2 writes Python 2 module names
    else:
        evil = _py2_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]}, dtype=b"O")
        match = r"refusing numpy\.dtype\(b'O'\)"
    (tmp_path / FOLDER["cifar10", "python"] / "data_batch_3").write_bytes(evil)
    with pytest.raises(DatasetUnavailableError, match=match) as err:
        load_dataset("cifar10", tmp_path)
    assert "data_batch_3" in str(err.value)
    assert not marker.exists()


def test_truncated_or_corrupt_files_raise_clear_errors(tmp_path):
    t = _truth("cifar100")
    binary = _write(tmp_path / "bin", "cifar100", "binary", t) / "cifar-100-binary" / "train.bin"
    binary.write_bytes(binary.read_bytes()[:-100])
    with pytest.raises(DatasetUnavailableError, match=r"train\.bin.*not a whole number of 3074-byte records"):
        load_dataset("cifar100", tmp_path / "bin")

    python = _write(tmp_path / "py", "cifar100", "python", t) / "cifar-100-python" / "test"
    python.write_bytes(python.read_bytes()[:5000])
    with pytest.raises(DatasetUnavailableError, match=r"cifar-100-python/test is not a valid CIFAR-100 file"):
        load_dataset("cifar100", tmp_path / "py")

    archive = _write(tmp_path / "tar", "cifar100", "binary_tar", t) / "cifar-100-binary.tar.gz"
    archive.write_bytes(archive.read_bytes()[:-2000])
    with pytest.raises(DatasetUnavailableError, match=r"cifar-100-binary\.tar\.gz is not a valid.*truncated"):
        load_dataset("cifar100", tmp_path / "tar")

    labels = _write(tmp_path / "lab", "cifar10", "binary", _truth("cifar10")) / "cifar-10-batches-bin"
    raw = bytearray((labels / "test_batch.bin").read_bytes())
    raw[0] = 10  # a CIFAR-10 label must be 0..9
    (labels / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DatasetUnavailableError, match=r"test_batch\.bin.*labels outside 0\.\.9"):
        load_dataset("cifar10", tmp_path / "lab")

    (labels / "data_batch_5.bin").unlink()
    with pytest.raises(DatasetUnavailableError, match=r"lacks data_batch_5\.bin"):
        load_dataset("cifar10", tmp_path / "lab")


def test_nothing_found_names_what_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # tfds not installed
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset("cifar10", tmp_path)
    msg = str(err.value)
    for expected in (f"{tmp_path}/cifar-10-batches-bin/", f"{tmp_path}/cifar-10-batches-py/",
                     f"{tmp_path}/cifar-10-binary.tar.gz", f"{tmp_path}/cifar-10-python.tar.gz",
                     "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz", "download_cifar",
                     "pip install 'jaxfednas[tfds]'"):
        assert expected in msg


def test_download_cifar_from_a_file_url(tmp_path):
    """Offline stand-in for the real download: a file:// URL and the archive's own md5."""
    t = _truth("cifar10")
    src = _write(tmp_path / "mirror", "cifar10", "binary_tar", t) / "cifar-10-binary.tar.gz"
    md5 = hashlib.md5(src.read_bytes()).hexdigest()
    dest = tmp_path / "data"
    with pytest.raises(DatasetUnavailableError, match="md5 .* expected 0+: the download is incomplete"):
        download_cifar("cifar10", dest, url=src.as_uri(), md5="0" * 32)
    assert not dest.exists() or not any(dest.iterdir())  # nothing kept, not even the .part file

    path = download_cifar("cifar10", dest, url=src.as_uri(), md5=md5)
    assert path == dest / "cifar-10-binary.tar.gz" and path.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == ["cifar-10-binary.tar.gz"]
    _assert_matches(load_dataset("cifar10", dest), "cifar10", t)
    # Already there with the right md5: not fetched again (this URL does not exist).
    assert download_cifar("cifar10", dest, url=(tmp_path / "gone.tar.gz").as_uri(), md5=md5) == path

    with pytest.raises(DatasetUnavailableError, match="Downloading .*gone.tar.gz failed"):
        download_cifar("cifar100", dest, version="python", url=(tmp_path / "gone.tar.gz").as_uri())
    with pytest.raises(ValueError, match="version"):
        download_cifar("cifar10", dest, version="matlab")
    with pytest.raises(ValueError, match="cifar10 or cifar100"):
        download_cifar("cinic10", dest)


def test_cli_download_flag_fetches_only_when_missing(tmp_path, monkeypatch, capsys):
    from jaxfednas import cli
    from jaxfednas.data import datasets

    t = _truth("cifar10")
    mirror = _write(tmp_path / "mirror", "cifar10", "binary_tar", t) / "cifar-10-binary.tar.gz"
    calls = []

    def fake_download(name, data_dir):  # the real fetch, from a local copy (this machine is offline)
        calls.append(name)
        return download_cifar(name, data_dir, url=mirror.as_uri(), md5=hashlib.md5(mirror.read_bytes()).hexdigest())

    monkeypatch.setattr(datasets, "download_cifar", fake_download)
    data = tmp_path / "data"
    argv = ["partition", "--dataset", "cifar10", "--data-dir", str(data), "--download", "--method", "iid",
            "--clients", "2", "--split", "0.5,0,0.5", "--out", str(tmp_path / "part")]
    assert cli.main(argv) == 0 and calls == ["cifar10"]
    assert (data / "cifar-10-binary.tar.gz").is_file() and "downloaded" in capsys.readouterr().out
    assert cli.main(argv) == 0 and calls == ["cifar10"]  # already there: not fetched again
    for bad in (["--dataset", "digits", "--data-dir", str(data)], ["--dataset", "cifar100"]):  # no data dir
        assert cli.main(["partition", *bad, "--download", "--out", str(tmp_path / "p2")]) == 2
        assert "--download fetches cifar10 or cifar100 into --data-dir" in capsys.readouterr().err
    assert calls == ["cifar10"]
