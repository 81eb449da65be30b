"""Tests for jaxfednas.data.datasets and jaxfednas.data.partition (host side, no JAX)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from jaxfednas.data.datasets import (
    DATASETS,
    NORMALIZATION,
    Dataset,
    DatasetUnavailableError,
    load_dataset,
)
from jaxfednas.data.partition import (
    PARTITION_METHODS,
    build_manifest,
    format_label_table,
    label_counts,
    load_manifest,
    manifest_splits,
    partition,
    partition_dirichlet,
    partition_iid,
    partition_label_skew,
    plot_label_heatmap,
    save_manifest,
    split_client_indices,
)


def _labels(num_classes: int = 10, per_class: int = 60, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    everything = np.concatenate(parts)
    assert everything.dtype == np.int64
    assert everything.size == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- partitions


def test_iid_exact_cover_and_near_equal_sizes():
    y = _labels(per_class=61)  # 610 examples, 7 clients -> sizes 88/87
    parts = partition_iid(y, 7, seed=3)
    _assert_exact_cover(parts, y.size)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert _same(parts, partition_iid(y, 7, seed=3))
    assert not _same(parts, partition_iid(y, 7, seed=4))


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_exact_cover_and_min_size(alpha):
    y = _labels(per_class=100)
    parts = partition_dirichlet(y, 10, alpha=alpha, seed=0, min_size=10)
    _assert_exact_cover(parts, y.size)
    assert min(p.size for p in parts) >= 10


def test_dirichlet_determinism():
    y = _labels()
    a = partition_dirichlet(y, 5, alpha=0.5, seed=1)
    assert _same(a, partition_dirichlet(y, 5, alpha=0.5, seed=1))
    assert not _same(a, partition_dirichlet(y, 5, alpha=0.5, seed=2))


def _fedml_hetero(y: np.ndarray, n_nets: int, alpha: float, seed: int) -> list[list[int]]:
    """Straight re-derivation of FedML's loop with the global legacy RNG, as documented in §1.1."""
    np.random.seed(seed)
    K, N = int(y.max()) + 1, y.shape[0]
    min_size = 0
    while min_size < 10:
        idx_batch: list[list[int]] = [[] for _ in range(n_nets)]
        for k in range(K):
            idx_k = np.where(y == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(alpha, n_nets))
            proportions = np.array([p * (len(idx_j) < N / n_nets) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min(len(idx_j) for idx_j in idx_batch)
    for j in range(n_nets):
        np.random.shuffle(idx_batch[j])
    return idx_batch


@pytest.mark.parametrize("seed,alpha,n", [(0, 0.5, 10), (9, 0.2, 8), (3, 1.0, 4)])
def test_dirichlet_matches_fedml_legacy_call_order(seed, alpha, n):
    y = _labels(per_class=80, seed=seed)
    state = np.random.get_state()
    try:
        expected = _fedml_hetero(y, n, alpha, seed)
    finally:
        np.random.set_state(state)
    got = partition_dirichlet(y, n, alpha=alpha, seed=seed)
    assert [p.tolist() for p in got] == expected


def test_dirichlet_tiny_golden():
    # Pinned output of the legacy RandomState stream (stable across NumPy versions by policy).
    y = np.array([0] * 6 + [1] * 6 + [2] * 6)
    got = partition_dirichlet(y, 3, alpha=0.5, seed=0, min_size=2)
    assert [p.tolist() for p in got] == [
        [5, 11, 14, 8, 16],
        [10, 1, 0, 7, 2, 3, 9],
        [13, 17, 6, 12, 4, 15],
    ]


def test_dirichlet_balance_rule_bounds_sizes_for_tiny_alpha():
    # A client stops receiving classes once it holds >= N/n, so it can exceed N/n by at most
    # one class. Without the balance rule alpha=1e-2 would hand whole classes to single clients.
    y = _labels(num_classes=20, per_class=50)
    n = 10
    parts = partition_dirichlet(y, n, alpha=0.01, seed=0, min_size=0)
    _assert_exact_cover(parts, y.size)
    assert max(p.size for p in parts) < y.size / n + 50


def test_dirichlet_unreachable_min_size_raises():
    y = _labels(num_classes=2, per_class=50)
    with pytest.raises(ValueError, match="min_size"):
        partition_dirichlet(y, 10, alpha=0.01, seed=0, min_size=10, max_tries=3)


def test_label_skew_every_client_exact_classes_and_counts():
    # 5 classes x 120 = 600 images, 20 clients, c = 5 -> chunk 6: every client holds every
    # class exactly 6 times and every image is used.
    y = _labels(num_classes=5, per_class=120)
    parts = partition_label_skew(y, 20, classes_per_client=5, seed=0)
    _assert_exact_cover(parts, y.size)
    counts = label_counts(y, parts, 5)
    np.testing.assert_array_equal(counts, np.full((20, 5), 6))


@pytest.mark.parametrize("seed", range(5))
def test_label_skew_paper_setting(seed):
    # Paper shape scaled down: 10 classes, N/(n*c) = 600/(20*5) = 6. Clients served while at
    # least c classes had images left hold exactly c classes x 6; once fewer remain, one client
    # takes everything left and the rest get nothing.
    y = _labels(num_classes=10, per_class=60, seed=seed)
    parts = partition_label_skew(y, 20, classes_per_client=5, seed=seed)
    _assert_exact_cover(parts, y.size)  # counts divide, so nothing is left unassigned
    counts = label_counts(y, parts, 10)
    regular = [bool((r > 0).sum() == 5 and set(r[r > 0].tolist()) == {6}) for r in counts]
    first_irregular = regular.index(False) if False in regular else len(regular)
    assert first_irregular >= 10  # the pool only runs short near the end
    assert all(r.sum() == 0 for r in counts[first_irregular + 1 :])
    assert _same(parts, partition_label_skew(y, 20, classes_per_client=5, seed=seed))


def test_label_skew_may_leave_examples_unassigned_and_is_disjoint():
    y = _labels(num_classes=4, per_class=25)
    parts = partition_label_skew(y, 3, classes_per_client=2, seed=1, num_per_class=5)
    everything = np.concatenate(parts)
    assert everything.size == 30 == np.unique(everything).size
    counts = label_counts(y, parts, 4)
    assert all(sorted(r[r > 0].tolist()) == [5, 5] for r in counts)


def test_partition_dispatcher_and_validation():
    y = _labels()
    for method in PARTITION_METHODS:
        parts = partition(y, method, 4, seed=0)
        assert len(parts) == 4
    with pytest.raises(ValueError, match="method.*iid, dirichlet, label_skew"):
        partition(y, "hetero", 4, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition(y, "iid", 0, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition(y, "iid", y.size + 1, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        partition(y, "dirichlet", 4, seed=0, alpha=0.0)
    with pytest.raises(ValueError, match=r"classes_per_client.*\[1, 10\]"):
        partition(y, "label_skew", 4, seed=0, classes_per_client=11)
    with pytest.raises(ValueError, match="labels"):
        partition(np.array([0.5, 1.0]), "iid", 1, seed=0)


# --------------------------------------------------------------------------- splits, counts, reports


def test_split_client_indices_sizes_and_cover():
    parts = [np.arange(0, 100), np.arange(100, 110), np.arange(110, 113)]
    splits = split_client_indices(parts, (0.6, 0.2, 0.2), seed=0)
    assert [s.size for s in splits["train"]] == [60, 6, 1]
    assert [s.size for s in splits["val"]] == [20, 2, 1]
    assert [s.size for s in splits["test"]] == [20, 2, 1]
    for j, part in enumerate(parts):
        joined = np.concatenate([splits[k][j] for k in ("train", "val", "test")])
        np.testing.assert_array_equal(np.sort(joined), part)
    default = split_client_indices(parts, seed=0)
    assert [s.size for s in default["train"]] == [75, 7, 2]
    assert [s.size for s in default["val"]] == [0, 0, 0]
    again = split_client_indices(parts, (0.6, 0.2, 0.2), seed=0)
    assert all(_same(splits[k], again[k]) for k in splits)
    other = split_client_indices(parts, (0.6, 0.2, 0.2), seed=1)
    assert not _same(splits["train"], other["train"])


@pytest.mark.parametrize("fractions", [(0.5, 0.5, 0.5), (0.0, 0.5, 0.5), (1.2, -0.2, 0.0), (0.5, 0.5)])
def test_split_client_indices_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_client_indices([np.arange(10)], fractions, seed=0)


def test_label_counts_and_table():
    y = _labels()
    parts = partition(y, "dirichlet", 6, seed=0)
    counts = label_counts(y, parts, 10)
    assert counts.shape == (6, 10) and counts.dtype == np.int64
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(y))
    np.testing.assert_array_equal(counts.sum(axis=1), [p.size for p in parts])
    table = format_label_table(counts)
    assert table.splitlines()[0].split()[:3] == ["client", "n", "c0"]
    assert table.splitlines()[-1].split()[:2] == ["total", str(y.size)]
    wide = format_label_table(np.ones((2, 30), dtype=np.int64), max_classes=4)
    assert "c3" in wide and "c4" not in wide and "..." in wide
    assert wide.splitlines()[-1].split()[:2] == ["total", "60"]
    with pytest.raises(ValueError, match="num_classes"):
        label_counts(y, parts, 5)


def test_heatmap_written_with_deterministic_bytes(tmp_path):
    counts = label_counts(_labels(), partition(_labels(), "dirichlet", 5, seed=0), 10)
    a, b = tmp_path / "a.png", tmp_path / "sub" / "b.png"
    plot_label_heatmap(counts, a, title="dirichlet alpha=0.5")
    plot_label_heatmap(counts, b, title="dirichlet alpha=0.5")
    data = a.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert data == b.read_bytes()


# --------------------------------------------------------------------------- manifest


def _manifest():
    y = _labels()
    parts = partition(y, "dirichlet", 4, seed=0, alpha=0.5)
    splits = split_client_indices(parts, (0.6, 0.2, 0.2), seed=0)
    params = {"alpha": 0.5, "fractions": [0.6, 0.2, 0.2]}
    return build_manifest(dataset="toy", method="dirichlet", params=params, seed=0, splits=splits), splits


def test_manifest_round_trip(tmp_path):
    manifest, splits = _manifest()
    assert manifest["num_clients"] == 4 and len(manifest["sha256"]) == 64
    path = tmp_path / "runs" / "manifest.json"
    save_manifest(manifest, path)
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temp file left
    loaded = load_manifest(path)
    assert loaded == json.loads(json.dumps(manifest))
    back = manifest_splits(loaded)
    for k in ("train", "val", "test"):
        assert _same(back[k], splits[k])
        assert all(a.dtype == np.int64 for a in back[k])


def test_manifest_hash_detects_changes(tmp_path):
    manifest, _ = _manifest()
    path = tmp_path / "m.json"
    # Move one index from train to val of client 0: same multiset of numbers, different split.
    edited = json.loads(json.dumps(manifest))
    edited["clients"][0]["val"].append(edited["clients"][0]["train"].pop())
    save_manifest(edited, path)
    with pytest.raises(ValueError, match="sha256"):
        load_manifest(path)


def test_build_manifest_validation():
    with pytest.raises(ValueError, match="splits"):
        build_manifest(dataset="d", method="iid", params={}, seed=0, splits={"train": [], "test": []})
    with pytest.raises(ValueError, match="params"):
        build_manifest(
            dataset="d", method="iid", params={"x": object()}, seed=0,
            splits={"train": [], "val": [], "test": []},
        )


# --------------------------------------------------------------------------- datasets


def test_digits_shapes_dtypes_and_stratification():
    ds = load_dataset("digits")
    assert isinstance(ds, Dataset)
    assert ds.x_train.shape == (1437, 8, 8, 1) and ds.x_test.shape == (360, 8, 8, 1)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
    assert ds.image_shape == (8, 8, 1) and ds.num_classes == 10 and ds.scale == 16.0
    assert int(ds.x_train.max()) == 16
    total = np.bincount(ds.y_train, minlength=10) + np.bincount(ds.y_test, minlength=10)
    assert np.all(np.abs(np.bincount(ds.y_test, minlength=10) - 0.2 * total) <= 1)
    assert len(ds.mean) == 1 and len(ds.std) == 1
    assert ds.mean[0] == pytest.approx(float((ds.x_train / 16.0).mean()), abs=1e-6)
    again = load_dataset("digits", seed=5)  # the split is part of the dataset, not seeded
    np.testing.assert_array_equal(again.y_train, ds.y_train)


def test_synthetic_determinism_and_kwargs():
    a = load_dataset("synthetic", seed=1, num_train=40, num_test=20, num_classes=4, image_shape=(6, 5, 3))
    b = load_dataset("synthetic", seed=1, num_train=40, num_test=20, num_classes=4, image_shape=(6, 5, 3))
    c = load_dataset("synthetic", seed=2, num_train=40, num_test=20, num_classes=4, image_shape=(6, 5, 3))
    assert a.x_train.shape == (40, 6, 5, 3) and a.x_test.shape == (20, 6, 5, 3)
    assert a.x_train.dtype == np.uint8 and a.y_train.dtype == np.int32
    assert len(a.mean) == 3 and a.scale == 255.0 and a.num_classes == 4
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, c.x_train)
    np.testing.assert_array_equal(np.bincount(a.y_train), [10, 10, 10, 10])


def test_synthetic_is_learnable_by_nearest_class_mean():
    ds = load_dataset("synthetic", seed=0)
    x_tr = ds.x_train.reshape(len(ds.x_train), -1).astype(np.float64)
    x_te = ds.x_test.reshape(len(ds.x_test), -1).astype(np.float64)
    centroids = np.stack([x_tr[ds.y_train == k].mean(axis=0) for k in range(ds.num_classes)])
    pred = np.argmin(((x_te[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == ds.y_test).mean() > 0.9


def _write_cinic_tree(root, classes=("cat", "airplane", "bird"), per_split=2, size=(32, 32)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "valid", "test"):
        for cls in classes:
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(per_split):
                arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(arr).save(d / f"{split}_{cls}_{i}.png")


def test_cinic10_from_folder_tree(tmp_path):
    _write_cinic_tree(tmp_path)
    ds = load_dataset("cinic10", tmp_path)
    assert ds.x_train.shape == (6, 32, 32, 3) and ds.x_test.shape == (6, 32, 32, 3)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
    assert ds.num_classes == 3
    # Classes sorted alphabetically: airplane=0, bird=1, cat=2; files sorted within a class.
    np.testing.assert_array_equal(ds.y_train, [0, 0, 1, 1, 2, 2])
    from PIL import Image

    first = np.asarray(Image.open(tmp_path / "train" / "airplane" / "train_airplane_0.png"))
    np.testing.assert_array_equal(ds.x_train[0], first)
    assert (ds.mean, ds.std) == NORMALIZATION["cinic10"]


def test_cinic10_errors(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="DataShare"):
        load_dataset("cinic10", None)
    with pytest.raises(DatasetUnavailableError, match="train"):
        load_dataset("cinic10", tmp_path / "missing")
    bad = tmp_path / "bad"
    _write_cinic_tree(bad, classes=("a",), per_split=1, size=(16, 32))
    with pytest.raises(ValueError, match=r"train_a_0\.png.*32x32"):
        load_dataset("cinic10", bad)
    mismatched = tmp_path / "mismatched"
    _write_cinic_tree(mismatched, classes=("a", "b"), per_split=1)
    (mismatched / "test" / "b" / "test_b_0.png").unlink()
    (mismatched / "test" / "b").rmdir()
    with pytest.raises(ValueError, match="class folders differ"):
        load_dataset("cinic10", mismatched)


def test_cifar_without_tfds_raises_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    for name in ("cifar10", "cifar100"):
        with pytest.raises(DatasetUnavailableError, match=r"pip install 'jaxfednas\[tfds\]'"):
            load_dataset(name)


def _fake_tfds(prepared: bool):
    x = np.arange(2 * 32 * 32 * 3, dtype=np.uint8).reshape(2, 32, 32, 3)

    class Builder:
        data_dir = "unused"

        def __init__(self, name, data_dir):
            self.name = name
            self.info = types.SimpleNamespace(splits={"train": 2, "test": 2} if prepared else {})

        def is_prepared(self):
            return prepared

        def as_dataset(self, *, split, batch_size, as_supervised):
            assert batch_size == -1 and as_supervised
            return x, np.array([3, 7], dtype=np.int64)

    return types.SimpleNamespace(builder=lambda name, data_dir=None: Builder(name, data_dir), as_numpy=lambda t: t)


def test_cifar_through_tfds_prepared_and_unprepared(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(prepared=False))
    with pytest.raises(DatasetUnavailableError, match="download_and_prepare") as err:
        load_dataset("cifar10", tmp_path)
    assert f"--data-dir {tmp_path}" in str(err.value)
    with pytest.raises(DatasetUnavailableError, match="data_dir"):
        load_dataset("cifar10", tmp_path / "nope")

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(prepared=True))
    ds = load_dataset("cifar100", tmp_path)
    assert ds.x_train.shape == (2, 32, 32, 3) and ds.y_train.dtype == np.int32
    assert ds.num_classes == 100 and (ds.mean, ds.std) == NORMALIZATION["cifar100"]


def test_load_dataset_bad_arguments():
    with pytest.raises(ValueError, match="name.*digits, cluttered_digits, synthetic, cifar10, cifar100, cinic10"):
        load_dataset("mnist")
    assert DATASETS == ("digits", "cluttered_digits", "synthetic", "cifar10", "cifar100", "cinic10")
    with pytest.raises(ValueError, match="num_train"):
        load_dataset("synthetic", num_train=0)
    with pytest.raises(ValueError, match="image_shape"):
        load_dataset("synthetic", image_shape=(8, 8))
    with pytest.raises(TypeError, match="num_train"):
        load_dataset("digits", num_train=10)


def test_independent_split_of_an_example_does_not_depend_on_the_other_examples():
    """data.split_method=independent (DP-FNAS): adding or removing one example leaves every
    other example's split unchanged — the shuffle-and-cut split does not (seen: 0..9 vs
    0..10 move examples between train and val) — and the fractions hold on average."""
    from jaxfednas.data.partition import split_client_indices

    def where(splits):
        return {int(i): name for name, parts in splits.items() for i in parts[0]}

    fr = (0.5, 0.25, 0.25)
    base = where(split_client_indices([np.arange(200)], fr, seed=3, method="independent"))
    for extra in (200, 57):  # add a new example; remove example 57
        ids = np.arange(201) if extra == 200 else np.delete(np.arange(200), 57)
        other = where(split_client_indices([ids], fr, seed=3, method="independent"))
        assert all(other[i] == base[i] for i in other if i in base)
    shuffled = [where(split_client_indices([np.arange(n)], fr, seed=3)) for n in (10, 11)]
    assert any(shuffled[0][i] != shuffled[1][i] for i in range(10))  # why the option exists
    big = split_client_indices([np.arange(20000)], fr, seed=0, method="independent")
    sizes = np.array([len(big[s][0]) for s in ("train", "val", "test")]) / 20000
    np.testing.assert_allclose(sizes, fr, atol=0.015)
    with pytest.raises(ValueError, match="split method"):
        split_client_indices([np.arange(4)], fr, seed=0, method="hash")
