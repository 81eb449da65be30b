"""An aggregator of one's own in one file (jaxfednas.server.register_aggregator): by hand
on constructed updates (plain and masked), through the configuration, a FedAvg round, and
the command line's ``--import``; unknown names refused with the registered ones listed."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfednas import aggregators, cli
from jaxfednas.config import AGGREGATORS, ConfigError, RunConfig
from jaxfednas.registry import make_config
from jaxfednas.server import Server, register_aggregator

# six clients, one coordinate each column
CLIENTS = np.array([[0., 5., -3.], [1., 5., -2.], [2., 5., -1.], [4., 5., 0.], [8., 5., 1.], [1000., -1e6, 50.]],
                   np.float32)


@pytest.fixture
def max_reporting():
    """The brief's example: coordinate-wise max of the values that count."""
    @register_aggregator("max_reporting")
    def rule(x, weights, valid, server):
        return jnp.where(valid, x, -jnp.inf).max(0)

    yield rule
    aggregators.unregister_aggregator("max_reporting")


def test_a_registered_aggregator_runs_through_the_server_by_hand(max_reporting):
    s = Server(aggregator="max_reporting")
    w = jnp.array([10., 1., 1., 1., 1., 0.])  # client 5 (the outlier) did not report
    fb = {"x": jnp.full((3,), 7.0)}
    np.testing.assert_array_equal(s.aggregate({"x": CLIENTS}, w, fb)["x"], [8, 5, 1])
    np.testing.assert_array_equal(jax.jit(s.aggregate)({"x": CLIENTS}, w.at[5].set(1.0), fb)["x"], [1000, 5, 50])
    np.testing.assert_array_equal(s.aggregate({"x": CLIENTS}, jnp.zeros(6), fb)["x"], [7, 7, 7])  # nobody: fallback
    # masked (PerFedRLNAS' subnets): per entry over the reporting clients covering it
    x = jnp.array([[1., 10., 3., 9.], [2., 20., 4., 9.], [100., 30., 5., 9.]])
    masks = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0]])
    out = s.masked_aggregate(x, masks, jnp.array([1., 1., 0.]), jnp.full((4,), -7.0))  # client 2 failed
    np.testing.assert_array_equal(out, [2, 20, -7, -7])
    # the weights reach the rule broadcastable to the leaf; bfloat16 leaves come back bfloat16
    seen = {}

    @register_aggregator("spy")
    def spy(x, weights, valid, server):
        seen.update(x=x.dtype, w=weights.shape, valid=valid.shape, server=server)
        return x[0]

    try:
        got = Server(aggregator="spy").aggregate({"b": jnp.ones((3, 2, 4), jnp.bfloat16)}, jnp.ones(3))
        assert got["b"].dtype == jnp.bfloat16
        assert seen["x"] == jnp.float32 and seen["w"] == (3, 1, 1) and seen["valid"] == (3, 2, 4)
        assert seen["server"].aggregator == "spy"
    finally:
        aggregators.unregister_aggregator("spy")


def test_registration_reaches_the_config_and_unknown_names_are_refused(max_reporting):
    assert "max_reporting" in AGGREGATORS and AGGREGATORS[:3] == ("mean", "median", "trimmed_mean")
    cfg = make_config("fedavg", overrides={"run.aggregator": "max_reporting"})
    assert Server.from_run(cfg.run).aggregator == "max_reporting"
    with pytest.raises(ConfigError, match=r"run.aggregator='krum' is not allowed: choose one of \['mean', 'median', "
                                          r"'trimmed_mean', 'max_reporting'\].*--import"):
        RunConfig(aggregator="krum")
    with pytest.raises(ConfigError, match=r"choose one of \['mean', 'median', 'trimmed_mean', 'max_reporting'\]"):
        Server(aggregator="krum")
    with pytest.raises(ValueError, match="already registered"):
        register_aggregator("median", lambda x, w, v, s: x[0])
    with pytest.raises(ValueError, match="built-in"):
        aggregators.unregister_aggregator("mean")
    aggregators.unregister_aggregator("max_reporting")
    with pytest.raises(ConfigError, match="'max_reporting' is not allowed"):
        make_config("fedavg", overrides={"run.aggregator": "max_reporting"})


ROOT = Path(__file__).resolve().parents[3]


def docs_example() -> str:
    """The guide's "Adding an aggregator" block (real code: run here and by hand below)."""
    text = (ROOT / "docs" / "guides" / "writing_an_algorithm.md").read_text()
    return re.search(r"<!-- docs-aggregator -->\n```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def plugin_file(tmp_path):
    name = "mad_clipped_mean"
    path = tmp_path / "my_aggregators_for_test.py"
    path.write_text(docs_example())
    yield name, path
    aggregators.unregister_aggregator(name)
    sys.modules.pop(path.stem, None)


def test_the_guides_example_aggregator_by_hand(plugin_file):
    name, path = plugin_file
    cli.import_module_or_file(str(path))
    w = np.array([10., 1., 1., 1., 1., 1.], np.float32)
    got = np.asarray(Server(aggregator=name).aggregate({"x": CLIENTS}, jnp.asarray(w))["x"])
    for j in range(3):  # clip to median ± 3 MAD, then the n_k-weighted mean
        v = CLIENTS[:, j].astype(np.float64)
        med = np.median(v)
        mad = np.median(np.abs(v - med))
        want = (w * np.clip(v, med - 3 * mad, med + 3 * mad)).sum() / w.sum()
        np.testing.assert_allclose(got[j], want, rtol=1e-6)
    assert abs(got[0] - 25.5 / 15) < 1e-5  # column 0: 1000 clipped to 3 + 3 · 2.5


def test_cli_import_of_a_file_or_module_registers_the_aggregator_before_the_config(plugin_file, monkeypatch, capsys):
    import jaxfednas.experiment as experiment
    import jaxfednas.process as process

    name, path = plugin_file
    seen = []

    class Ran(Exception):
        pass

    def fake_run(cfg, out, **kw):  # the configuration the real run would get
        seen.append(cfg)
        raise Ran

    monkeypatch.setattr(experiment, "run_experiment", fake_run)
    monkeypatch.setattr(process, "enable_compilation_cache", lambda *a, **k: None)
    argv = ["run", "fedavg", "--dataset", "synthetic", "--set", f"run.aggregator={name}", "--out", "unused"]
    assert cli.main(argv) == 2  # not imported: refused, the registered ones listed
    err = capsys.readouterr().err
    assert f"run.aggregator='{name}' is not allowed: choose one of ['mean', 'median', 'trimmed_mean']" in err
    assert "--import" in err
    with pytest.raises(Ran):
        cli.main([*argv, "--import", str(path)])
    assert seen[-1].run.aggregator == name and name in AGGREGATORS
    # a dotted module name (here found on sys.path), and the same file again, are fine
    monkeypatch.syspath_prepend(str(path.parent))
    with pytest.raises(Ran):
        cli.main([*argv, "--import", path.stem, "--import", str(path)])
    assert seen[-1].run.aggregator == name
    # --help lists it among run.aggregator's choices
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "fedavg", "--import", str(path), "--help"])
    assert e.value.code == 0
    assert f"{{mean, median, trimmed_mean, {name}}}" in capsys.readouterr().out
    assert cli.main(["run", "fedavg", "--import", str(path.parent / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["run", "fedavg", "--import", "no_such_module_xyz"]) == 2
    assert "No module named 'no_such_module_xyz'" in capsys.readouterr().err


def test_cli_import_of_a_module_whose_registration_is_refused_is_one_line(tmp_path, capsys):
    import sys

    taken = tmp_path / "takes_fedavg.py"  # an algorithm name another module holds
    taken.write_text("from jaxfednas.registry import register_algorithm\n\n"
                     "@register_algorithm('fedavg')\ndef mine(cfg, info, **kw):\n    pass\n")
    bad_name = tmp_path / "bad_aggregator.py"
    bad_name.write_text("from jaxfednas.server import register_aggregator\n\n"
                        "register_aggregator('my mean', lambda *a, **k: None)\n")
    for path, said in [(taken, "algorithm 'fedavg' is already registered (module jaxfednas.algorithms.fedavg)"),
                       (bad_name, "aggregator name must be letters, digits")]:
        assert cli.main(["run", "fedavg", "--import", str(path), "--out", str(tmp_path / "unused")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --import {path}: {said}") and err.count("\n") == 1, err
        assert path.stem not in sys.modules  # a failed import leaves nothing half-registered to import again
    from jaxfednas.registry import ALGORITHMS

    assert ALGORITHMS["fedavg"] == "jaxfednas.algorithms.fedavg"
