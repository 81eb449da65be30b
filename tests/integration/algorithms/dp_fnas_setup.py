"""Shared set-up of the DP-FNAS tests (test_dp_fnas*.py): a tiny DARTS space (C=4, one
reduction cell, 1 node, 3 ops) on 2 synthetic parties, and a host-drawn initial state."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxfednas.algorithms.dp_fnas import DPFNASConfig, dp_fnas
from jaxfednas.data import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.data.datasets import load_dataset
from jaxfednas.experiment import make_partition
from jaxfednas.registry import make_config
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement

# plain server SGD on W (no momentum, decay or clip) so updates can be written by hand
TINY = dict(C=4, layers=1, nodes=1, primitives="tiny", eval_batch_size=64, server_momentum=0.0,
            server_weight_decay=0.0, server_grad_clip=0.0, arch_server_weight_decay=0.0)


def make_data2(num_train: int = 128):
    """2 synthetic parties (8x8x1, 10 classes), ``num_train`` examples split 50/25/25 into
    search-train / search-val / test (128: about 32 / 16 / 16 each)."""
    cfg = make_config("dp_fnas", overrides={"data.dataset": "synthetic", "data.num_clients": 2})
    assert cfg.data.split == (0.5, 0.25, 0.25) and cfg.data.partition == "iid"  # DP-FNAS's DEFAULTS
    ds = load_dataset("synthetic", num_train=num_train, num_test=32)
    return make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))


def make_s0(data2):
    """An initial state shared by both configurations (same supernet and optimizer layout).

    Drawn on the host with the shapes ``init`` gives: compiling the real ``init`` costs
    seconds on XLA:CPU, and a fresh optimizer state is all zeros."""
    algo = dp_fnas(DPFNASConfig(**TINY), data2.info, run=RunOptions(placement=Placement("map")))
    shapes = jax.eval_shape(algo.init, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        if "variables" not in name:
            return jnp.zeros(s.shape, s.dtype)  # optimizer states, counters
        if "alphas" in name:
            return jnp.asarray(1e-3 * rng.standard_normal(s.shape), s.dtype)
        if "'scale'" in name:
            return jnp.ones(s.shape, s.dtype)
        fan_in = int(np.prod(s.shape[:-1])) or 1
        return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


