"""Test set-up: 8 fake CPU devices (for shard_map) and JAX's persistent compilation cache.

XLA_FLAGS must be set before jax is imported, hence here at the top.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import contextlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
_CACHE = os.environ.get("JAXFEDNAS_TEST_CACHE", _CACHE)
os.environ["JAXFEDNAS_CACHE"] = _CACHE  # the CLI and examples, called from tests, use the same cache
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@contextlib.contextmanager
def _count_traces():
    """Inside the block, the names of the functions JAX traced to compile them (JAX's
    public ``jax.monitoring`` events; a cached program is not traced again)."""
    seen = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            seen.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def count_traces():
    """``with count_traces() as traced: ...`` then ``traced == []`` means nothing compiled."""
    return _count_traces


@pytest.fixture(scope="session")
def tiny_data():
    """4 clients of a synthetic 8x8x1, 10-class dataset (Dirichlet 0.5, 0.75/0/0.25 splits)."""
    from jaxfednas.data import make_federated_data
    from jaxfednas.data import partition as part
    from jaxfednas.experiment import make_partition
    from jaxfednas.data.datasets import load_dataset
    from jaxfednas.registry import make_config

    cfg = make_config("fedavg", overrides={"data.dataset": "synthetic", "data.num_clients": 4})
    ds = load_dataset("synthetic", num_train=256, num_test=64)
    manifest = make_partition(cfg, ds)
    return make_federated_data(ds, part.manifest_splits(manifest))
