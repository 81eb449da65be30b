"""jaxfednas.algorithm.checked_factory: every algorithm factory refuses an argument of the
wrong type before any work, naming the factory and the argument."""
import inspect

import pytest

from jaxfednas.registry import ALGORITHMS, algorithm_module
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_factory_names_the_wrong_argument(name, tiny_data):
    mod = algorithm_module(name)
    factory, cfg, info = mod.FACTORY, mod.CONFIG(), tiny_data.info
    params = inspect.signature(factory).parameters
    assert list(params)[:3] == ["cfg", "info", "run"]  # every factory's one shape
    assert params["run"].kind is params["run"].KEYWORD_ONLY
    other = algorithm_module("fednas" if name != "fednas" else "fedavg").CONFIG()
    run = RunOptions(rounds=3)
    for args, kwargs, message in [
        (("x", info), {}, f"{factory.__name__}(): cfg must be a {mod.CONFIG.__name__}, got str"),
        ((other, info), {}, f"cfg must be a {mod.CONFIG.__name__}, got {type(other).__name__}"),
        ((cfg, {"num_clients": 4}), {}, "info must be a jaxfednas.data.DataInfo"),
        ((cfg, info), {"run": "vmap"}, "run must be a jaxfednas.run_options.RunOptions, got 'vmap'"),
    ]:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            factory(*args, **{"run": run, **kwargs})


@pytest.mark.parametrize("name", ["fedavg", "dfnas"])
def test_the_former_keywords_fold_into_run_with_a_warning(name, tiny_data):
    """The run's options as separate keywords (the former signature) still build, for one
    release, warned; a wrong type among them is still named."""
    mod = algorithm_module(name)
    with pytest.warns(DeprecationWarning, match=rf"{name}\(rounds=, placement=\.\.\.\) is deprecated: pass "
                                                rf"run=RunOptions\(rounds=, placement=\.\.\.\)"):
        assert callable(mod.FACTORY(mod.CONFIG(), tiny_data.info, rounds=3, placement=Placement("map")).round)
    with pytest.raises(TypeError, match=rf"{name}\(\): placement must be a jaxfednas.runtime.Placement, got 'vmap'"):
        mod.FACTORY(mod.CONFIG(), tiny_data.info, rounds=3, placement="vmap")


def test_run_options_check_their_fields():
    from jaxfednas.errors import ConfigError

    with pytest.raises(TypeError, match=r"RunOptions: placement must be a jaxfednas.runtime.Placement, got 'map'"):
        RunOptions(placement="map")
    for field, value in (("rounds", 0), ("rounds", "10"), ("dropout_rate", 5), ("clients_per_round", -1)):
        with pytest.raises(ConfigError, match=rf"RunOptions: {field} must be"):
            RunOptions(**{field: value})


def test_a_factory_with_the_right_types_builds(tiny_data):
    from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg

    assert callable(fedavg(FedAvgConfig(), tiny_data.info, run=RunOptions(placement=Placement("map"))).round)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_refuses_data_it_was_not_built_for(name, tiny_data):
    """Data split over another number of clients would run (its client indices clamped by
    the gathers) and report wrong numbers; every data-taking function refuses it first."""
    import dataclasses

    import jax

    mod = algorithm_module(name)
    algo = mod.FACTORY(mod.CONFIG(), tiny_data.info, run=RunOptions(rounds=3))
    info = tiny_data.info
    other = tiny_data.replace(info=dataclasses.replace(info, num_clients=info.num_clients + 2))
    key = jax.random.key(0)
    calls = {"round": (None, other, key), "evaluate": (None, other), "personalize": (None, other, key),
             "host_metrics": (None, other)}
    checked = [f for f in calls if getattr(algo, f) is not None]
    assert "round" in checked and "evaluate" in checked
    for f in checked:
        fn = getattr(algo, f)
        with pytest.raises(ValueError, match=rf"{algo.name}\.{f}\(\): the data is not the data the algorithm was "
                                             rf"built for \(num_clients: {info.num_clients} built, "
                                             rf"{info.num_clients + 2} given\)"):
            fn(*calls[f])
    with pytest.raises(ValueError, match="num_clients"):
        algo.round.lower(*calls["round"])


def test_a_factory_called_directly_refuses_the_run_options_it_does_not_honour(tiny_data):
    """As the runner does: DP-FNAS samples no clients (every party in every iteration)."""
    from jaxfednas.algorithms.dp_fnas import DPFNASConfig, dp_fnas
    from jaxfednas.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^run\.dropout_rate=0\.5 does not apply to dp_fnas: it honours only precision"):
        dp_fnas(DPFNASConfig(), tiny_data.info, run=RunOptions(dropout_rate=0.5))
