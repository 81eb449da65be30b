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
