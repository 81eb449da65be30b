"""The README's "Adding an algorithm" block is real code: saved as a module and
registered, it runs through the registry and the runner, and its server momentum is
checked by hand against FedAvg's averaged update from the same clients."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas.algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg
from jaxfednas import registry
from jaxfednas.experiment import run_experiment
from jaxfednas.runtime import Placement

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fedavgm_module(tmp_path_factory):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-algorithm -->\n```python\n(.*?)```", text, re.S).group(1)
    d = tmp_path_factory.mktemp("readme_algo")
    (d / "readme_fedavgm.py").write_text(block)
    sys.path.insert(0, str(d))
    registry.ALGORITHMS["fedavgm"] = "readme_fedavgm"
    import readme_fedavgm

    yield readme_fedavgm
    del registry.ALGORITHMS["fedavgm"]
    sys.path.remove(str(d))


def test_readme_algorithm_runs_through_the_registry_and_runner(fedavgm_module, tmp_path):
    cfg = registry.make_config("fedavgm", preset="smoke", overrides={
        "data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2, "run.rounds": 2,
        "algo.batch_size": 64})
    summary = run_experiment(cfg, tmp_path / "r", progress=False, log=lambda s: None)
    assert summary["rounds"] == 2 and summary["algorithm"] == "fedavgm"
    assert (tmp_path / "r" / "checkpoint.msgpack").exists()


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def test_readme_algorithm_server_momentum_by_hand(fedavgm_module, tiny_data):
    cfg = fedavgm_module.FedAvgMConfig(batch_size=64, server_momentum=0.5, server_lr=0.7)
    algo = fedavgm_module.fedavgm(cfg, tiny_data.info, clients_per_round=2, placement=Placement("vmap"))
    # FedAvg with η_s = 1 returns the n_k-weighted average of the same clients' models
    fa = fedavg(FedAvgConfig(batch_size=64), tiny_data.info, clients_per_round=2, placement=Placement("vmap"))
    s0 = algo.init(jax.random.PRNGKey(0))
    s, u = s0, None
    for r in range(2):
        key = jax.random.PRNGKey(10 + r)
        w = s.variables["params"]
        avg, _ = fa.round(FedAvgState(variables=s.variables, round=jnp.int32(r)), tiny_data, key)
        d = jax.tree.map(lambda p, a: p - a, w, avg.variables["params"])
        u = d if u is None else jax.tree.map(lambda ui, di: 0.5 * ui + di, u, d)  # u_0 = 0
        want = jax.tree.map(lambda p, ui: p - 0.7 * ui, w, u)
        s, _ = algo.round(s, tiny_data, key)
        _close(s.variables["params"], want)
        _close(s.velocity, u)
