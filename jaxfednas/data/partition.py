"""Seeded client partitions of a labelled dataset, their splits and a manifest.

Three ways to deal examples to ``num_clients`` clients (:data:`PARTITION_METHODS`):

``iid``
    A random permutation cut into near-equal chunks (FedML ``"homo"``).
``dirichlet``
    FedML's ``"hetero"`` latent-Dirichlet-allocation partition, used by FedNAS
    (He et al., "FedNAS: Federated Deep Learning via Neural Architecture
    Search", arXiv:2004.08546), DFNAS and SPIDER (docs/authors_code.md §1.1). For every
    class, proportions p ~ Dir(alpha) say how much of the class each client
    gets; small alpha means few classes per client. Reproduced bit for bit,
    including the legacy ``np.random`` call order, so a partition made with
    ``seed=0`` is the one FedNAS 2020 trained on.
``label_skew``
    Each client gets ``classes_per_client`` classes with an equal number of
    images of each (SPIDER's ``partition_data_byclass``, used for the FedNAS
    personalisation experiment; docs/authors_code.md §1.2).

Each client's indices are then split into local train/val/test
(:func:`split_client_indices`, docs/authors_code.md §1.3) and the result can be frozen in
a JSON manifest (:func:`build_manifest`, :func:`save_manifest`) whose SHA-256
lets every later run check that it trains on exactly the same split.

Everything here is host-side NumPy; indices are ``int64`` arrays.

Example::

    >>> import numpy as np
    >>> labels = np.repeat(np.arange(10), 100)
    >>> parts = partition(labels, "dirichlet", 5, seed=0, alpha=0.5)
    >>> sorted(np.concatenate(parts).tolist()) == list(range(1000))
    True
    >>> splits = split_client_indices(parts, (0.75, 0.0, 0.25), seed=0)
    >>> manifest = build_manifest(dataset="toy", method="dirichlet",
    ...                           params={"alpha": 0.5}, seed=0, splits=splits)
    >>> manifest["num_clients"]
    5
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PARTITION_METHODS",
    "SPLIT_NAMES",
    "build_manifest",
    "format_label_table",
    "label_counts",
    "load_manifest",
    "manifest_splits",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_label_skew",
    "plot_label_heatmap",
    "save_manifest",
    "split_client_indices",
]

PARTITION_METHODS: tuple[str, ...] = ("iid", "dirichlet", "label_skew")
SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")


# --------------------------------------------------------------------------- validation


def _as_labels(labels: Any) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"labels must be >= 0, got minimum {int(y.min())}")
    return y.astype(np.int64, copy=False)


def _check_num_clients(num_clients: int, n: int) -> int:
    if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool):
        raise ValueError(f"num_clients must be an integer, got {num_clients!r}")
    if not 1 <= num_clients <= n:
        raise ValueError(f"num_clients must be in [1, {n}] (the number of labels), got {num_clients}")
    return int(num_clients)


# --------------------------------------------------------------------------- partitions


def partition_iid(labels: Any, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Deal examples uniformly at random into near-equal chunks (FedML "homo").

    A seeded permutation of ``range(len(labels))`` is cut with
    ``np.array_split``, so client sizes differ by at most one and the first
    ``N % num_clients`` clients get the extra example.

    Args:
      labels: ``[N]`` integer labels (only the length is used).
      num_clients: Number of clients, in ``[1, N]``.
      seed: Seed of ``np.random.default_rng``.

    Returns:
      ``num_clients`` int64 index arrays that together hold every index once.
    """
    y = _as_labels(labels)
    n = _check_num_clients(num_clients, y.size)
    perm = np.random.default_rng(seed).permutation(y.size).astype(np.int64)
    return [np.asarray(chunk, dtype=np.int64) for chunk in np.array_split(perm, n)]


def partition_dirichlet(
    labels: Any,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """FedML's "hetero" Dirichlet (LDA) partition, reproduced exactly (docs/authors_code.md §1.1).

    With ``rs = np.random.RandomState(seed)``, ``N`` examples, ``n`` clients and
    classes ``k = 0 .. max(labels)``, one *try* is:

    1. start every client with an empty list;
    2. for each class ``k`` in order: shuffle its indices (``rs.shuffle``),
       draw ``p ~ Dir(alpha * 1_n)`` (``rs.dirichlet``), set ``p_j = 0`` for
       every client that already holds ``>= N / n`` examples (the *balance*
       rule, which keeps client sizes bounded even for tiny ``alpha``),
       renormalise, cut the shuffled class at ``floor(cumsum(p) * |class|)``
       (last cut point dropped) and append piece ``j`` to client ``j``.

    Tries repeat (continuing the same random stream) until the smallest client
    holds ``>= min_size`` examples; then each client's list is shuffled with
    ``rs.shuffle``. FedML hard-codes ``min_size=10``; FedNAS 2020 used seed 0,
    SPIDER seed 9.

    One deliberate difference: where the legacy code would divide by zero
    (all remaining mass on full clients, or every Dirichlet component
    underflowing to 0 for extremely small ``alpha``) the class is spread
    uniformly over the clients that are not yet full. The legacy code would
    produce NaN cut points there, so no reproducible result is lost.

    Args:
      labels: ``[N]`` integer labels in ``[0, K)``.
      num_clients: Number of clients ``n``, in ``[1, N]``.
      alpha: Dirichlet concentration, > 0 (FedNAS 0.5, SPIDER 0.2).
      seed: Seed of the legacy ``np.random.RandomState``.
      min_size: Minimum examples per client, >= 0 and <= N / n.
      max_tries: Give up after this many tries, >= 1.

    Returns:
      ``num_clients`` int64 index arrays, each in shuffled order, that
      together hold every index exactly once.

    Raises:
      ValueError: Invalid argument, or ``min_size`` was not reached within
        ``max_tries`` tries (too many clients for the data, or ``alpha`` too
        small).
    """
    y = _as_labels(labels)
    n = _check_num_clients(num_clients, y.size)
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if not isinstance(min_size, (int, np.integer)) or not 0 <= min_size <= y.size // n:
        raise ValueError(
            f"min_size must be an integer in [0, {y.size // n}] (N // num_clients = {y.size} // {n}), "
            f"got {min_size!r}"
        )
    if not isinstance(max_tries, (int, np.integer)) or max_tries < 1:
        raise ValueError(f"max_tries must be an integer >= 1, got {max_tries!r}")

    total = y.size
    num_classes = int(y.max()) + 1
    class_indices = [np.flatnonzero(y == k).astype(np.int64) for k in range(num_classes)]
    rs = np.random.RandomState(seed)

    for _ in range(max_tries):
        clients: list[list[int]] = [[] for _ in range(n)]
        for k in range(num_classes):
            idx_k = class_indices[k].copy()
            # Call order matters for reproducing FedML: shuffle, then dirichlet.
            rs.shuffle(idx_k)
            p = rs.dirichlet(np.repeat(alpha, n))
            # Balance rule; the comparison is float (len < N / n) as in FedML.
            open_ = np.array([len(c) < total / n for c in clients])
            p = p * open_
            if not p.sum() > 0:
                p = open_.astype(np.float64)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            for client, piece in zip(clients, np.split(idx_k, cuts)):
                client.extend(piece.tolist())
        if min(len(c) for c in clients) >= min_size:
            break
    else:
        raise ValueError(
            f"partition_dirichlet could not give every client >= min_size={min_size} examples in "
            f"max_tries={max_tries} tries (N={total}, num_clients={n}, alpha={alpha}). Use fewer "
            f"clients, a larger alpha or a smaller min_size."
        )

    parts = []
    for client in clients:
        arr = np.asarray(client, dtype=np.int64)
        rs.shuffle(arr)
        parts.append(arr)
    return parts


def partition_label_skew(
    labels: Any,
    num_clients: int,
    *,
    classes_per_client: int,
    seed: int,
    num_per_class: int | None = None,
) -> list[np.ndarray]:
    """Give every client ``c = classes_per_client`` classes in equal amounts (docs/authors_code.md §1.2).

    The indices of each class are shuffled once (seeded). Each client, in
    order, picks ``c`` distinct classes uniformly at random among the classes
    that still have images and takes the next ``chunk`` images of each, where
    ``chunk = num_per_class`` or, by default, ``N // (num_clients * c)``
    (CIFAR-10 train+test: 60 000 // (20 * 5) = 600). A class that runs out
    leaves the pool (its last chunk may be short). When fewer than ``c``
    classes remain, the client gets all remaining images of all of them; when
    none remain it gets nothing. Examples that no client takes stay
    unassigned, so the parts need not cover ``range(N)``.

    Args:
      labels: ``[N]`` integer labels in ``[0, K)``.
      num_clients: Number of clients, in ``[1, N]``.
      classes_per_client: ``c``, in ``[1, K]``.
      seed: Seed of ``np.random.default_rng``.
      num_per_class: Images per (client, class) chunk, >= 1; default
        ``N // (num_clients * c)``.

    Returns:
      ``num_clients`` disjoint int64 index arrays, grouped by class in the
      order the classes were picked.
    """
    y = _as_labels(labels)
    n = _check_num_clients(num_clients, y.size)
    num_classes = int(y.max()) + 1
    c = classes_per_client
    if not isinstance(c, (int, np.integer)) or not 1 <= c <= num_classes:
        raise ValueError(f"classes_per_client must be an integer in [1, {num_classes}], got {c!r}")
    if num_per_class is None:
        chunk = y.size // (n * c)
        if chunk < 1:
            raise ValueError(
                f"N // (num_clients * classes_per_client) = {y.size} // ({n} * {c}) is 0; "
                "use fewer clients or fewer classes_per_client, or pass num_per_class"
            )
    else:
        if not isinstance(num_per_class, (int, np.integer)) or num_per_class < 1:
            raise ValueError(f"num_per_class must be an integer >= 1, got {num_per_class!r}")
        chunk = int(num_per_class)

    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(y == k)).astype(np.int64) for k in range(num_classes)]
    taken = [0] * num_classes
    pool = [k for k in range(num_classes) if by_class[k].size > 0]

    parts: list[np.ndarray] = []
    for _ in range(n):
        if len(pool) >= c:
            picked = [int(k) for k in rng.choice(pool, size=c, replace=False)]
            amount = chunk
        else:
            picked, amount = list(pool), None  # take everything that is left
        pieces = []
        for k in picked:
            end = by_class[k].size if amount is None else min(taken[k] + amount, by_class[k].size)
            pieces.append(by_class[k][taken[k] : end])
            taken[k] = end
        pool = [k for k in pool if taken[k] < by_class[k].size]
        parts.append(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64))
    return parts


def partition(
    labels: Any,
    method: str,
    num_clients: int,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Partition ``labels`` among ``num_clients`` clients with ``method``.

    Dispatches to :func:`partition_iid`, :func:`partition_dirichlet` (uses
    ``alpha``, ``min_size``) or :func:`partition_label_skew` (uses
    ``classes_per_client``); arguments a method does not use are ignored.

    Raises:
      ValueError: ``method`` is not in :data:`PARTITION_METHODS`, or an
        argument is out of range.
    """
    if method == "iid":
        return partition_iid(labels, num_clients, seed=seed)
    if method == "dirichlet":
        return partition_dirichlet(labels, num_clients, alpha=alpha, seed=seed, min_size=min_size)
    if method == "label_skew":
        return partition_label_skew(labels, num_clients, classes_per_client=classes_per_client, seed=seed)
    raise ValueError(f"method={method!r} is not a partition method; valid: {', '.join(PARTITION_METHODS)}")


# --------------------------------------------------------------------------- per-client splits


def split_client_indices(
    parts: Sequence[Any],
    fractions: Sequence[float] = (0.75, 0.0, 0.25),
    *,
    seed: int,
    method: str = "shuffle",
) -> dict[str, list[np.ndarray]]:
    """Split each client's indices into local train / val / test.

    ``method="shuffle"`` (default): client ``j``'s indices are shuffled with
    ``np.random.default_rng([seed, j])`` (so a client's split does not depend on the
    others) and cut in order into train, val and test, with ``n_test = round(f_test * n)``
    and ``n_val = round(f_val * n)`` (halves round up) and train taking the rest: exact
    sizes, but adding one example to a client moves others between its splits.

    ``method="independent"``: every example goes to train / val / test with
    probabilities ``fractions``, from a hash of ``(seed, example index)`` alone
    (:func:`example_uniforms`), so an example's split never depends on which other
    examples exist — what counting train and validation as disjoint data in a privacy
    analysis (parallel composition, DP-FNAS) needs. Sizes are then binomial.
    Defaults follow the FedNAS personalisation setup (75 % / 25 %); SPIDER uses
    ``(0.6, 0.2, 0.2)`` (docs/authors_code.md §1.3).

    Args:
      parts: Per-client index arrays, e.g. from :func:`partition`.
      fractions: ``(train, val, test)``, each >= 0, summing to 1, train > 0.
      seed: Split seed.

    Returns:
      ``{"train": [...], "val": [...], "test": [...]}``, one int64 array per
      client in each list.
    """
    fr = tuple(float(f) for f in fractions)
    if len(fr) != 3 or any(not np.isfinite(f) or f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6 or fr[0] <= 0:
        raise ValueError(
            "fractions must be three numbers (train, val, test), each >= 0, train > 0, summing to 1; "
            f"got {tuple(fractions)!r}"
        )
    if method not in SPLIT_METHODS:
        raise ValueError(f"split method must be one of {SPLIT_METHODS}, got {method!r}")
    _, f_val, f_test = fr
    out: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_NAMES}
    for j, part in enumerate(parts):
        idx = np.asarray(part, dtype=np.int64).reshape(-1)
        if method == "independent":
            u = example_uniforms(idx, seed)
            out["train"].append(idx[u < fr[0]])
            out["val"].append(idx[(u >= fr[0]) & (u < fr[0] + f_val)])
            out["test"].append(idx[u >= fr[0] + f_val])
            continue
        idx = np.random.default_rng([seed, j]).permutation(idx)
        n = idx.size
        n_test = min(int(np.floor(f_test * n + 0.5)), n)
        n_val = min(int(np.floor(f_val * n + 0.5)), n - n_test)
        n_train = n - n_val - n_test
        out["train"].append(idx[:n_train])
        out["val"].append(idx[n_train : n_train + n_val])
        out["test"].append(idx[n_train + n_val :])
    return out


SPLIT_METHODS = ("shuffle", "independent")


def example_uniforms(indices: Any, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per example, a function of ``(seed, index)`` only
    (splitmix64 of the two, 53 bits), for per-example independent split assignment."""
    with np.errstate(over="ignore"):
        z = (np.asarray(indices, np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64(0xD1B54A32D192ED03))
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


# --------------------------------------------------------------------------- reporting


def label_counts(labels: Any, parts: Sequence[Any], num_classes: int) -> np.ndarray:
    """Per-client class histogram.

    Returns:
      ``[num_clients, num_classes]`` int64 array; entry ``[j, k]`` counts the
      examples of class ``k`` held by client ``j``.
    """
    y = _as_labels(labels)
    if not isinstance(num_classes, (int, np.integer)) or num_classes <= int(y.max()):
        raise ValueError(f"num_classes must be an integer > max(labels) = {int(y.max())}, got {num_classes!r}")
    rows = [np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=int(num_classes)) for p in parts]
    if not rows:
        return np.zeros((0, int(num_classes)), dtype=np.int64)
    return np.stack(rows).astype(np.int64)


def format_label_table(counts: Any, *, max_classes: int = 20) -> str:
    """Plain-text table of a :func:`label_counts` matrix.

    One row per client (``client``, total ``n``, one column per class) and a
    final ``total`` row. Columns beyond ``max_classes`` are replaced by a
    single ``...`` column (``n`` still counts every class).
    """
    m = np.asarray(counts, dtype=np.int64)
    if m.ndim != 2:
        raise ValueError(f"counts must be a 2-D [num_clients, num_classes] array, got shape {m.shape}")
    if max_classes < 1:
        raise ValueError(f"max_classes must be >= 1, got {max_classes!r}")
    shown = min(m.shape[1], max_classes)
    truncated = m.shape[1] > shown
    header = ["client", "n"] + [f"c{k}" for k in range(shown)] + (["..."] if truncated else [])

    def row(name: str, values: np.ndarray) -> list[str]:
        cells = [name, str(int(values.sum()))] + [str(int(v)) for v in values[:shown]]
        return cells + (["..."] if truncated else [])

    rows = [header] + [row(str(j), m[j]) for j in range(m.shape[0])] + [row("total", m.sum(axis=0))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def plot_label_heatmap(counts: Any, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Save a clients x classes heatmap of ``counts`` as a PNG at ``path``.

    Cells are annotated with their counts when the matrix is small enough to
    read (at most 400 cells). The PNG carries no software/version metadata,
    so the same counts always give the same bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = np.asarray(counts, dtype=np.int64)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"counts must be a non-empty 2-D [num_clients, num_classes] array, got shape {m.shape}")
    num_clients, num_classes = m.shape
    width = min(max(4.0, 0.45 * num_classes + 2.0), 24.0)
    height = min(max(3.0, 0.35 * num_clients + 1.5), 24.0)
    # A bare Figure (no pyplot) leaves global backend state alone.
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(m, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="examples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if title is not None:
        ax.set_title(title)
    if m.size <= 400:
        threshold = m.max() / 2.0
        for j in range(num_clients):
            for k in range(num_classes):
                ax.text(k, j, str(int(m[j, k])), ha="center", va="center", fontsize=7,
                        color="black" if m[j, k] > threshold else "white")
    fig.tight_layout()
    from jaxfednas.files import save_figure  # noqa: PLC0415

    save_figure(fig, path)
    fig.clf()


# --------------------------------------------------------------------------- manifest


def _splits_digest(clients: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 over all index arrays: client order, then train/val/test.

    Each array is preceded by a ``client:split:length`` header so that moving
    an index from one array to the next changes the hash.
    """
    h = hashlib.sha256()
    for j, client in enumerate(clients):
        for name in SPLIT_NAMES:
            arr = np.asarray(client[name], dtype="<i8").reshape(-1)
            h.update(f"{j}:{name}:{arr.size};".encode())
            h.update(arr.tobytes())
    return h.hexdigest()


def build_manifest(
    *,
    dataset: str,
    method: str,
    params: Mapping[str, Any],
    seed: int,
    splits: Mapping[str, Sequence[Any]],
) -> dict[str, Any]:
    """A JSON-able record of a partition and its per-client splits.

    Args:
      dataset: Dataset name.
      method: Partition method.
      params: Partition/split parameters (``alpha``, ``fractions``, ...); must
        be JSON-serialisable.
      seed: The partition seed.
      splits: ``{"train", "val", "test"}`` -> per-client index arrays, as
        returned by :func:`split_client_indices`.

    Returns:
      ``{"dataset", "method", "params", "seed", "num_clients", "clients",
      "sha256"}`` where ``clients[j] = {"train": [...], "val": [...],
      "test": [...]}`` and ``sha256`` covers every index array.
    """
    missing = [name for name in SPLIT_NAMES if name not in splits]
    if missing:
        raise ValueError(f"splits must have keys {SPLIT_NAMES}, missing {missing}")
    sizes = {len(splits[name]) for name in SPLIT_NAMES}
    if len(sizes) != 1:
        raise ValueError(f"splits must list the same number of clients in train/val/test, got {sorted(sizes)}")
    try:
        params_json = json.loads(json.dumps(dict(params), sort_keys=True))
    except TypeError as e:
        raise ValueError(f"params must be JSON-serialisable: {e}") from e
    num_clients = sizes.pop()
    clients = [
        {name: np.asarray(splits[name][j], dtype=np.int64).reshape(-1).tolist() for name in SPLIT_NAMES}
        for j in range(num_clients)
    ]
    return {
        "dataset": str(dataset),
        "method": str(method),
        "params": params_json,
        "seed": int(seed),
        "num_clients": num_clients,
        "clients": clients,
        "sha256": _splits_digest(clients),
    }


def save_manifest(manifest: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``manifest`` as compact, key-sorted JSON, atomically.

    The file is written next to ``path`` and moved into place with
    ``os.replace``, so a crash never leaves a half-written manifest.
    """
    from jaxfednas.files import write_text  # noqa: PLC0415

    write_text(path, json.dumps(manifest, sort_keys=True, separators=(",", ":")) + "\n")


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a manifest written by :func:`save_manifest` and verify its hash.

    Raises:
      ValueError: The file is not a manifest, or its index arrays do not
        match the stored ``sha256`` (the file was edited or corrupted).
    """
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    required = ("dataset", "method", "params", "seed", "num_clients", "clients", "sha256")
    if not isinstance(manifest, dict) or any(key not in manifest for key in required):
        raise ValueError(f"{os.fspath(path)!r} is not a partition manifest (needs keys {required})")
    clients = manifest["clients"]
    if len(clients) != manifest["num_clients"]:
        raise ValueError(
            f"manifest {os.fspath(path)!r}: num_clients={manifest['num_clients']} but "
            f"{len(clients)} client entries"
        )
    digest = _splits_digest(clients)
    if digest != manifest["sha256"]:
        raise ValueError(
            f"manifest {os.fspath(path)!r}: sha256 mismatch (stored {manifest['sha256']}, "
            f"computed {digest}); the index lists were modified"
        )
    return manifest


def manifest_splits(manifest: Mapping[str, Any]) -> dict[str, list[np.ndarray]]:
    """The per-client index arrays of a manifest, in :func:`split_client_indices` form."""
    return {
        name: [np.asarray(client[name], dtype=np.int64) for client in manifest["clients"]]
        for name in SPLIT_NAMES
    }
