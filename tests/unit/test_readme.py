"""The README's "Adding an algorithm" block is real code: saved as a file and imported,
it registers itself, runs through the registry and the runner, honours the run's server
options with no line of its own and refuses the one it does not list, and its
norm-bounded updates are checked by hand against the clients' own local training of the
same round."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas import registry
from jaxfednas.cli import import_module_or_file
from jaxfednas.algorithms.common import make_local_train
from jaxfednas.algorithms.fedavg import FedAvgConfig, FedAvgState, fedavg
from jaxfednas.experiment import run_experiment
from jaxfednas.config import ConfigError
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement, round_clients
from jaxfednas.search_spaces.models import make_model

ROOT = Path(__file__).resolve().parents[2]
NAME = "fedavg_normbound"


@pytest.fixture(scope="module")
def readme_module(tmp_path_factory):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-algorithm -->\n```python\n(.*?)```", text, re.S).group(1)
    d = tmp_path_factory.mktemp("readme_algo")
    (d / "readme_algorithm.py").write_text(block)
    assert NAME not in registry.ALGORITHMS
    module = import_module_or_file(str(d / "readme_algorithm.py"))  # what --import does
    assert registry.ALGORITHMS[NAME] == "readme_algorithm"  # @register_algorithm did it

    yield module
    del registry.ALGORITHMS[NAME], registry._FACTORIES[NAME], sys.modules["readme_algorithm"]


def test_readme_algorithm_runs_through_the_registry_and_runner(readme_module, tmp_path):
    cfg = registry.make_config(NAME, preset="smoke", overrides={
        "data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2, "run.rounds": 2,
        "algo.batch_size": 64, "algo.max_update_norm": 0.5})
    summary = run_experiment(cfg, tmp_path / "r", progress=False, log=lambda s: None)
    assert summary["rounds"] == 2 and summary["algorithm"] == NAME
    assert (tmp_path / "r" / "checkpoint.msgpack").exists()


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_readme_algorithm_bounds_each_update_by_hand(readme_module, tiny_data):
    """Each sampled client's update w_k - w, trained by hand with the library's local SGD
    on the same client and key, is scaled to norm <= M; the new model is their n_k-weighted
    mean (BatchNorm statistics, where the network has them, averaged unscaled)."""
    M = 0.05
    cfg = readme_module.NormBoundConfig(batch_size=64, max_update_norm=M)
    algo = readme_module.fedavg_normbound(cfg, tiny_data.info, run=RunOptions(clients_per_round=2,
                                                                               placement=Placement("vmap")))
    s0 = algo.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(10)
    s1, _ = algo.round(s0, tiny_data, key)

    local = jax.jit(make_local_train(make_model(cfg.model, tiny_data.info.num_classes, tiny_data.info.name),
                                     tiny_data.info, cfg))
    ids, keys = round_clients(key, tiny_data.info.num_clients, 2)
    clients = tiny_data.clients("train", ids)
    w = _flat(s0.variables["params"])
    counts = np.asarray(clients.count, np.float64)
    bounded, stats, norms = [], [], []
    for k in range(2):
        new, _ = local(s0.variables, jax.tree.map(lambda a: a[k], clients), keys[k])
        d = _flat(new["params"]) - w
        norms.append(np.linalg.norm(d))
        bounded.append(w + d * min(1.0, M / norms[-1]))
        stats.append(new.get("batch_stats", {}))
    assert min(norms) > M  # the bound binds for both clients at this M
    want = sum(c * b for c, b in zip(counts, bounded)) / counts.sum()
    np.testing.assert_allclose(_flat(s1.variables["params"]), want, rtol=2e-5, atol=2e-6)
    if jax.tree.leaves(stats[0]):  # a network with BatchNorm: its statistics are averaged unscaled
        np.testing.assert_allclose(_flat(s1.variables["batch_stats"]),
                                   sum(c * _flat(b) for c, b in zip(counts, stats)) / counts.sum(), rtol=2e-5, atol=2e-6)
    assert np.linalg.norm(_flat(s1.variables["params"]) - w) <= M * (1 + 1e-5)


def test_readme_algorithm_with_a_loose_bound_is_fedavg(readme_module, tiny_data):
    cfg = readme_module.NormBoundConfig(batch_size=64, max_update_norm=1e6)
    algo = readme_module.fedavg_normbound(cfg, tiny_data.info, run=RunOptions(clients_per_round=2,
                                                                               placement=Placement("vmap")))
    fa = fedavg(FedAvgConfig(batch_size=64), tiny_data.info, run=RunOptions(clients_per_round=2, placement=Placement("vmap")))
    s0 = algo.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(11)
    s1, _ = algo.round(s0, tiny_data, key)
    avg, _ = fa.round(FedAvgState(variables=s0.variables, round=jnp.int32(0)), tiny_data, key)
    _close(s1.variables, avg.variables)


def test_readme_algorithm_honours_the_runs_aggregator_with_no_line_of_its_own(readme_module, tiny_data):
    """Built by the runner's one seam with --set run.aggregator=median, a round of the
    README's algorithm (a loose bound: the clients' models as trained) is the coordinate
    median of 3 clients' models trained by hand, which is not their n_k-weighted mean."""
    over = {"run.clients_per_round": 3, "algo.batch_size": 64, "algo.max_update_norm": 1e6}
    median = registry.build_algorithm(registry.make_config(NAME, overrides={**over, "run.aggregator": "median"}),
                                      tiny_data.info)
    mean = registry.build_algorithm(registry.make_config(NAME, overrides=over), tiny_data.info)
    s0, key = median.init(jax.random.PRNGKey(0)), jax.random.PRNGKey(12)
    got = _flat(median.round(s0, tiny_data, key)[0].variables["params"])
    cfg = readme_module.NormBoundConfig(batch_size=64)
    local = jax.jit(make_local_train(make_model(cfg.model, tiny_data.info.num_classes, tiny_data.info.name),
                                     tiny_data.info, cfg))
    ids, keys = round_clients(key, tiny_data.info.num_clients, 3)
    clients = tiny_data.clients("train", ids)
    models = np.stack([_flat(local(s0.variables, jax.tree.map(lambda a: a[k], clients), keys[k])[0]["params"])
                       for k in range(3)])
    np.testing.assert_allclose(got, np.median(models, axis=0), rtol=2e-5, atol=2e-6)
    counts = np.asarray(clients.count, np.float64)
    np.testing.assert_allclose(_flat(mean.round(s0, tiny_data, key)[0].variables["params"]),
                               counts @ models / counts.sum(), rtol=2e-5, atol=2e-6)
    assert np.abs(got - counts @ models / counts.sum()).max() > 1e-3


def test_readme_algorithm_refuses_a_run_option_it_does_not_list(readme_module, tiny_data):
    cfg = registry.make_config(NAME, overrides={"run.precision": "bf16"})
    with pytest.raises(ConfigError, match=r"^run\.precision='bf16' does not apply to fedavg_normbound: it honours only "
                                          r"aggregator, clients_per_round, dropout_rate, sampler, server_optimizer"):
        registry.build_algorithm(cfg, tiny_data.info)
    registry.build_algorithm(registry.make_config(NAME, overrides={"run.dropout_rate": 0.5}), tiny_data.info)


def test_readme_python_example_equals_the_command_line_for_the_same_seed(tmp_path, capsys):
    """The "From Python" block and the command it names give the same state, bit for bit:
    one key derivation (jaxfednas.rng) and one partition."""
    from jaxfednas import cli
    from jaxfednas.checkpoint import read_checkpoint, shape_template

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## From Python\n.*?```python\n(.*?)```", text, re.S).group(1)
    command = re.search(r"prints what `(jaxfednas run fedavg[^`]*)`", " ".join(text.split())).group(1)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    out = tmp_path / "cli"
    assert cli.main(command.split()[1:] + ["--out", str(out), "--no-progress"]) == 0
    state, rounds = read_checkpoint(out / "checkpoint.msgpack", shape_template(namespace["state"]))
    assert rounds == 10
    for a, b in zip(jax.tree.leaves(namespace["state"]), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), b)
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert np.float32(summary["final"]["global_test_acc"]) == np.float32(printed)  # (a float32 printed)


def test_the_guide_carries_the_readme_algorithm_unchanged():
    def block(text, marker):
        return re.search(marker + r"\n```python\n(.*?)```", text, re.S).group(1)

    readme = block((ROOT / "README.md").read_text(), "<!-- readme-algorithm -->")
    guide = (ROOT / "docs" / "guides" / "writing_an_algorithm.md").read_text()
    assert block(guide, r"it does not list, is refused:\n") == readme
