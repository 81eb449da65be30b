"""The one seam between the runner and the algorithms (jaxfednas.run_options): every
algorithm in the registry honours the run options it lists in RUN_OPTIONS and is refused,
in one line naming the option, every other one."""
import pytest

from conftest import tiny_federation
from jaxfednas.config import ConfigError, RunConfig
from jaxfednas.registry import ALGORITHMS, algorithm_module, build_algorithm, make_config
from jaxfednas.run_options import OPTIONS, RunOptions, asked_options, refuse_unsupported
from jaxfednas.runtime import Placement
from jaxfednas.server import Server

ASK = {"clients_per_round": 2, "dropout_rate": 0.25, "precision": "bf16", "sampler": "proportional",
       "aggregator": "median", "server_optimizer": "avgm", "arch_server_optimizer": "adam"}
# where an option is honoured only with some algorithm setting
WITH = {("dp_fnas", "precision"): {"algo.arch_gradient": "first"}}  # not bf16 finite differences
LIBRARY = sorted(n for n, m in ALGORITHMS.items() if m.startswith("jaxfednas.algorithms."))


def test_every_option_has_a_non_default_value_here():
    assert set(ASK) == set(OPTIONS)
    assert set(asked_options(RunConfig(**ASK), num_clients=4)) == set(OPTIONS)
    assert asked_options(RunConfig(), num_clients=4) == {}
    assert asked_options(RunConfig(clients_per_round=4), num_clients=4) == {}  # every client: the default


@pytest.mark.parametrize("name", LIBRARY)
def test_an_algorithm_builds_with_what_it_lists_and_refuses_the_rest_in_one_line(name):
    mod = algorithm_module(name)
    assert set(mod.RUN_OPTIONS) <= set(OPTIONS)
    _, data = tiny_federation(name)
    for option, value in ASK.items():
        cfg = make_config(name, overrides={**_tiny_overrides(name), **WITH.get((name, option), {}),
                                           f"run.{option}": value})
        if option in mod.RUN_OPTIONS:
            build_algorithm(cfg, data.info)
        else:
            with pytest.raises(ConfigError) as e:
                build_algorithm(cfg, data.info)
            message = str(e.value)
            assert message.startswith(f"run.{option}=") and "\n" not in message, (name, option, message)


def _tiny_overrides(name):
    from conftest import TINY

    return {"data.dataset": "synthetic", "data.num_clients": 4, **TINY.get(name, {})}


def test_refusal_names_the_option_the_algorithm_and_what_it_honours():
    with pytest.raises(ConfigError, match=r"^run\.aggregator='median' does not apply to mine: it honours only "
                                          r"dropout_rate, sampler \(how the server combines"):
        refuse_unsupported("mine", RunConfig(aggregator="median"), num_clients=4, supported=("sampler", "dropout_rate"))
    with pytest.raises(ConfigError, match="^run.precision='bf16' does not apply to mine: because"):
        refuse_unsupported("mine", RunConfig(precision="bf16"), num_clients=4, supported=(), why={"precision": "because"})
    with pytest.raises(ConfigError, match="unknown run option"):
        refuse_unsupported("mine", RunConfig(), num_clients=4, supported=("aggregtor",))
    refuse_unsupported("mine", RunConfig(aggregator="median"), num_clients=4, supported=("aggregator",))


def test_run_options_of_a_run_config():
    run = RunOptions.from_run(RunConfig(rounds=7, clients_per_round=0.5, placement="map", aggregator="median",
                                        dropout_rate=0.1, precision="bf16"))
    assert (run.rounds, run.clients(8), run.placement, run.dropout_rate, run.precision) == (7, 4, Placement("map"), 0.1,
                                                                                            "bf16")
    assert run.server == Server(aggregator="median")
    assert asked_options(run, num_clients=8) == asked_options(RunConfig(rounds=7, clients_per_round=0.5,
                                                                        aggregator="median", dropout_rate=0.1,
                                                                        precision="bf16"), num_clients=8)


def test_a_factory_without_run_is_refused_at_registration():
    from jaxfednas.errors import RegistrationError
    from jaxfednas.registry import register_algorithm

    def old_style(cfg, info, *, clients_per_round=1.0, server=Server()):
        pass

    with pytest.raises(RegistrationError, match=r"takes no run: every factory has the shape f\(cfg, info, \*, run"):
        register_algorithm("old_style_factory")(old_style)
