"""The bundled cluttered digits (jaxfednas.data.cluttered): same bytes every time, the digit
really in its image, and no test digit in any training image."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from jaxfednas.data import cluttered
from jaxfednas.data import images as ds_mod
from jaxfednas.data.cluttered import ClutterLayout, cluttered_digits, plot_samples, render
from jaxfednas.data.datasets import DATASETS, load_dataset

# sha256 of x_train, y_train, x_test, y_test of load_dataset("cluttered_digits"): a change of
# the construction, of NumPy's PCG64 stream or of scikit-learn's digits split shows here.
GOLDEN_SHA256 = "d1c251637de685c6a6d4cdf9e2b4ee9083ba2c67db0bcc0586228d65dfd96f07"


def _sha256(ds) -> str:
    h = hashlib.sha256()
    for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test):
        h.update(a.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def built():
    return cluttered_digits()


def test_deterministic_and_pinned():
    a, b = load_dataset("cluttered_digits"), load_dataset("cluttered_digits")
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    assert (a.mean, a.std) == (b.mean, b.std)
    assert _sha256(a) == GOLDEN_SHA256
    assert "cluttered_digits" in DATASETS


def test_shapes_dtypes_labels_and_normalisation():
    ds, digits = load_dataset("cluttered_digits"), load_dataset("digits")
    side = cluttered.CANVAS
    assert ds.name == "cluttered_digits" and ds.num_classes == 10 and ds.scale == digits.scale == 16.0
    r = cluttered.RENDERS
    assert r == 3 and ds.x_train.shape == (r * 1437, side, side, 1) and ds.x_test.shape == (r * 360, side, side, 1)
    assert ds.image_shape == (side, side, 1)
    assert ds.x_train.dtype == ds.x_test.dtype == np.uint8
    assert ds.y_train.dtype == ds.y_test.dtype == np.int32
    assert int(ds.x_train.max()) == 16 and int(max(ds.x_train.max(), ds.x_test.max())) <= 16
    # image i + r N of a split shows digit i of the same split of digits: the labels, repeated
    np.testing.assert_array_equal(ds.y_train, np.tile(digits.y_train, r))
    np.testing.assert_array_equal(ds.y_test, np.tile(digits.y_test, r))
    assert set(np.unique(ds.y_test)) == set(range(10))
    # the digits' convention: statistics of x_train / scale, rounded to 6 decimals
    xf = ds.x_train.astype(np.float64) / 16.0
    assert ds.mean == (round(float(xf.mean()), 6),) and ds.std == (round(float(xf.std()), 6),)
    with pytest.raises(TypeError, match="no extra keyword arguments"):
        load_dataset("cluttered_digits", num_train=5)


def _paste_loop(digits: np.ndarray, layout: ClutterLayout, canvas: int) -> np.ndarray:
    """The images of ``layout``, one pixel at a time (independent of render's indexing)."""
    n, k = layout.fragment.shape
    f = layout.fragment_size
    out = np.zeros((n, canvas, canvas), np.uint8)
    for i in range(n):
        r, c = layout.digit_pos[i]
        for a in range(8):
            for b in range(8):
                out[i, r + a, c + b] = max(out[i, r + a, c + b], digits[layout.digit[i], a, b])
        for j in range(k):
            (r, c), (cr, cc) = layout.fragment_pos[i, j], layout.fragment_crop[i, j]
            for a in range(f):
                for b in range(f):
                    out[i, r + a, c + b] = max(out[i, r + a, c + b], digits[layout.fragment[i, j], cr + a, cc + b])
    return out[..., None]


def test_layout_describes_every_image(built):
    ds, layouts = built
    raw = ds_mod.digits_split()[0][..., 0]
    canvas, f = cluttered.CANVAS, cluttered.FRAGMENT_SIZE
    for x, layout in ((ds.x_train, layouts["train"]), (ds.x_test, layouts["test"])):
        n = len(x)
        assert layout.fragment.shape == (n, cluttered.NUM_FRAGMENTS) and layout.fragment_size == f
        # every piece wholly on the canvas, every crop inside its digit
        assert layout.digit_pos.min() >= 0 and layout.digit_pos.max() <= canvas - 8
        assert layout.fragment_pos.min() >= 0 and layout.fragment_pos.max() <= canvas - f
        assert layout.fragment_crop.min() >= 0 and layout.fragment_crop.max() <= 8 - f
        # the digit really is in its image: no pixel of it dimmed by the clutter
        for i in range(n):
            (r, c), digit = layout.digit_pos[i], raw[layout.digit[i]]
            assert (x[i, r:r + 8, c:c + 8, 0] >= digit).all()
        assert (x.reshape(n, -1).sum(1) >= raw[layout.digit].reshape(n, -1).sum(1)).all()
        # and nothing but the recorded pieces: the layout rebuilds the image exactly
        np.testing.assert_array_equal(_paste_loop(raw, layout, canvas), x)
        np.testing.assert_array_equal(render(raw, layout, canvas=canvas), x)
        # fragments are cut from another digit, with ink
        assert (layout.fragment != layout.digit[:, None]).all()
        rows = layout.fragment_crop[..., 0, None, None] + np.arange(f)[:, None]
        cols = layout.fragment_crop[..., 1, None, None] + np.arange(f)[None, :]
        ink = raw[layout.fragment[..., None, None], rows, cols].sum(axis=(-2, -1), dtype=np.int64)
        assert ink.min() >= cluttered.MIN_FRAGMENT_INK


def test_train_and_test_digit_sources_are_disjoint(built):
    _, layouts = built
    _, _, train_idx, test_idx = ds_mod.digits_split()
    train, test = layouts["train"], layouts["test"]
    r = cluttered.RENDERS  # each training digit r times, in the digits' order
    np.testing.assert_array_equal(train.digit, np.tile(train_idx, r))
    np.testing.assert_array_equal(test.digit, np.tile(test_idx, r))
    train_sources = set(train.digit) | set(train.fragment.ravel())
    test_sources = set(test.digit) | set(test.fragment.ravel())
    assert train_sources <= set(train_idx) and test_sources <= set(test_idx)
    assert not train_sources & test_sources
    assert len(set(test.fragment.ravel())) > 100  # clutter drawn from across the split, not a few digits


def _poison_test_digits(monkeypatch) -> None:
    """Make the cluttered digits read every test digit with its pixels inverted."""
    split = ds_mod.digits_split

    def poisoned():
        x, y, train_idx, test_idx = split()
        x = x.copy()
        x[test_idx] = 16 - x[test_idx]
        return x, y, train_idx, test_idx

    monkeypatch.setattr(cluttered, "digits_split", poisoned)


def test_no_test_pixels_in_training_images(built, monkeypatch):
    """Change every test digit's pixels: the training images stay the same bytes."""
    ds = built[0]
    _poison_test_digits(monkeypatch)
    other = cluttered_digits()[0]
    assert other.x_train.tobytes() == ds.x_train.tobytes()
    assert (other.mean, other.std) == (ds.mean, ds.std)  # statistics of training images only
    assert not np.array_equal(other.x_test, ds.x_test)


def test_variants_and_bad_arguments():
    digits = load_dataset("digits")
    plain, layouts = cluttered_digits(canvas=8, num_fragments=0, renders=1)  # no room to move, no clutter
    np.testing.assert_array_equal(plain.x_train, digits.x_train)
    np.testing.assert_array_equal(plain.x_test, digits.x_test)
    assert plain.mean == digits.mean and plain.std == digits.std
    assert layouts["train"].fragment.shape == (1437, 0)
    big, _ = cluttered_digits(canvas=24, num_fragments=5, fragment_size=4, seed=1, renders=1)
    assert big.x_train.shape == (1437, 24, 24, 1)
    assert not np.array_equal(cluttered_digits(seed=1)[0].x_train, load_dataset("cluttered_digits").x_train)
    for kwargs, message in (({"canvas": 7}, "canvas"), ({"fragment_size": 9}, "fragment_size"),
                            ({"fragment_size": 0}, "fragment_size"), ({"num_fragments": -1}, "num_fragments"),
                            ({"fragment_size": 1}, "lower min_fragment_ink")):  # a 1x1 crop holds at most 16
        with pytest.raises(ValueError, match=message):
            cluttered_digits(**kwargs)


def test_plot_samples(tmp_path):
    ds = load_dataset("cluttered_digits")
    plot_samples(ds, tmp_path / "a" / "samples.png", rows=2, cols=3, title="cluttered digits")
    plot_samples(ds, tmp_path / "test.png", split="test")
    png = (tmp_path / "a" / "samples.png").read_bytes()
    assert png.startswith(b"\x89PNG") and (tmp_path / "test.png").stat().st_size > 0


def test_auto_model_is_the_small_cnn():
    from jaxfednas.search_spaces.models import CNN, make_model

    assert isinstance(make_model("auto", 10, "cluttered_digits"), CNN)


@pytest.mark.slow
def test_cli_run_fedavg_on_cluttered_digits(tmp_path, capsys):
    from jaxfednas import cli

    out = tmp_path / "run"
    rc = cli.main(["run", "fedavg", "--dataset", "cluttered_digits", "--clients", "4", "--rounds", "1",
                   "--no-progress", "--out", str(out), "--set", "algo.batch_size=64",
                   "--set", "run.placement=vmap"])
    assert rc == 0
    assert "global_test_acc" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "cluttered_digits"
    assert 0.0 <= summary["final"]["global_test_acc"] <= 1.0


def test_renders_give_each_digit_several_images_and_start_with_the_single_render(monkeypatch):
    one, _ = cluttered_digits(renders=1)
    three, layouts = cluttered_digits(renders=3)
    assert three.x_train.shape == (3 * 1437, 16, 16, 1) and three.x_test.shape == (3 * 360, 16, 16, 1)
    np.testing.assert_array_equal(three.x_train[:1437], one.x_train)  # render 0 is the single render
    np.testing.assert_array_equal(three.x_test[:360], one.x_test)
    np.testing.assert_array_equal(three.y_train, np.tile(one.y_train, 3))
    np.testing.assert_array_equal(layouts["train"].digit, np.tile(layouts["train"].digit[:1437], 3))
    for r in (1, 2):  # the same digit, placed and cluttered anew
        assert not np.array_equal(three.x_train[r * 1437:(r + 1) * 1437], one.x_train)
        assert (layouts["test"].digit_pos[r * 360:(r + 1) * 360] != layouts["test"].digit_pos[:360]).any()
    np.testing.assert_array_equal(render(ds_mod.digits_split()[0][..., 0], layouts["test"]), three.x_test)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="renders"):
            cluttered_digits(renders=bad)
    _poison_test_digits(monkeypatch)  # every render of the training split is made of training digits only
    assert cluttered_digits(renders=3)[0].x_train.tobytes() == three.x_train.tobytes()
