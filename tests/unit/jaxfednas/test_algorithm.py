"""jaxfednas.algorithm.checked_factory: every algorithm factory refuses an argument of the
wrong type before any work, naming the factory and the argument."""
import inspect

import pytest

from jaxfednas.registry import ALGORITHMS, algorithm_module
from jaxfednas.runtime import Placement


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_factory_names_the_wrong_argument(name, tiny_data):
    mod = algorithm_module(name)
    factory, cfg, info = mod.FACTORY, mod.CONFIG(), tiny_data.info
    params = inspect.signature(factory).parameters
    assert list(params)[:2] == ["cfg", "info"]  # the signature the runner reads is the factory's own
    other = algorithm_module("fednas" if name != "fednas" else "fedavg").CONFIG()
    required = {k: 3 for k, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty}  # rounds
    for args, kwargs, message in [
        (("x", info), {}, f"{factory.__name__}(): cfg must be a {mod.CONFIG.__name__}, got str"),
        ((other, info), {}, f"cfg must be a {mod.CONFIG.__name__}, got {type(other).__name__}"),
        ((cfg, {"num_clients": 4}), {}, "info must be a jaxfednas.data.DataInfo"),
        ((cfg, info), {"placement": "vmap"}, "placement must be a jaxfednas.runtime.Placement, got 'vmap'"),
    ]:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            factory(*args, **{**required, **kwargs})


def test_a_factory_with_the_right_types_builds(tiny_data):
    from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg

    assert callable(fedavg(FedAvgConfig(), tiny_data.info, placement=Placement("map")).round)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_refuses_data_it_was_not_built_for(name, tiny_data):
    """Data split over another number of clients would run (its client indices clamped by
    the gathers) and report wrong numbers; every data-taking function refuses it first."""
    import dataclasses

    import jax

    mod = algorithm_module(name)
    params = inspect.signature(mod.FACTORY).parameters
    required = {k: 3 for k, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    algo = mod.FACTORY(mod.CONFIG(), tiny_data.info, **required)
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
