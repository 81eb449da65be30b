"""State field names and the checkpoint schema: a checkpoint written under the former
names (schema 1, before :func:`jaxfednas.checkpoint.renamed_fields`) is read under
today's, and the former attribute still reads, with a deprecation warning."""
import dataclasses
import hashlib
import warnings

import flax.serialization
import flax.struct
import jax
import numpy as np
import pytest

from jaxfednas import checkpoint
from jaxfednas.checkpoint import CheckpointError, SCHEMA, migrate, read_checkpoint, renamed_fields, save_checkpoint
from jaxfednas.registry import algorithm_module, build_algorithm
from jaxfednas.rng import init_key
from conftest import tiny_federation

RENAMED = {  # algorithm: its state's former field names -> today's
    "perfedrlnas": {"policy": "policy_logits", "policy_opt": "opt_state"},
    "spider": {"arch": "arch_masks", "clock": "client_rounds"},
    "dp_fnas": {"w_opt_state": "opt_state.params", "a_opt_state": "opt_state.arch"},
}


def _former(state_dict: dict, renamed: dict) -> dict:
    """What the code before the renames wrote: today's state dict under the former names."""
    out = dict(state_dict)
    for old, new in renamed.items():
        field, *key = new.split(".")
        out[old] = out[field].pop(key[0]) if key else out.pop(field)
        if key and not out[field]:
            del out[field]
    return out


def _write_schema_1(path, state_dict: dict, round: int, config_sha256: str = "c") -> None:
    """A checkpoint file as the code before the renames wrote it (no "schema" key)."""
    payload = flax.serialization.msgpack_serialize(
        {"format": checkpoint.FORMAT, "round": round, "config_sha256": config_sha256, "state": state_dict})
    path.write_bytes(f"{checkpoint.HEADER} bytes={len(payload)} sha256={hashlib.sha256(payload).hexdigest()}\n"
                     .encode() + payload)


@pytest.fixture(scope="module", params=sorted(RENAMED))
def state(request):
    cfg, data = tiny_federation(request.param)
    return request.param, build_algorithm(cfg, data.info).init(init_key(0))


def test_each_renamed_state_class_lists_its_former_names(state):
    name, s = state
    assert type(s).RENAMED == RENAMED[name]
    assert getattr(algorithm_module(name), type(s).__name__) is type(s)


def test_a_schema_1_checkpoint_is_read_under_todays_names(state, tmp_path):
    name, s = state
    host = jax.tree.map(np.asarray, jax.device_get(s))
    # distinct values in every leaf, so that a field read into the wrong place shows
    leaves, tree = jax.tree.flatten(host)
    host = jax.tree.unflatten(tree, [np.full_like(x, i + 1) if x.dtype != bool else ~x for i, x in enumerate(leaves)])
    old = _former(flax.serialization.to_state_dict(host), RENAMED[name])
    assert not set(RENAMED[name]) - set(old)  # the former names are what is stored
    _write_schema_1(tmp_path / "checkpoint.msgpack", old, round=3)
    got, r = read_checkpoint(tmp_path / "checkpoint.msgpack", checkpoint.shape_template(s), config_sha256="c")
    assert r == 3
    assert jax.tree.structure(got) == jax.tree.structure(host)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(host)):
        np.testing.assert_array_equal(a, b)


def test_todays_checkpoint_carries_the_schema_and_reads_back(state, tmp_path):
    _, s = state
    save_checkpoint(tmp_path / "c.msgpack", s, round=1, config_sha256="c")
    raw = flax.serialization.msgpack_restore((tmp_path / "c.msgpack").read_bytes().split(b"\n", 1)[1])
    assert raw["schema"] == SCHEMA == 2
    assert not set(type(s).RENAMED) & set(raw["state"])
    got, _ = read_checkpoint(tmp_path / "c.msgpack", checkpoint.shape_template(s))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.device_get(s))):
        np.testing.assert_array_equal(a, b)


def test_the_former_attribute_reads_with_a_deprecation_warning(state):
    name, s = state
    for old, new in RENAMED[name].items():
        field, *key = new.split(".")
        want = getattr(s, field)[key[0]] if key else getattr(s, field)
        with pytest.warns(DeprecationWarning, match=f"{type(s).__name__}.{old} is now .{field}"):
            got = getattr(s, old)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(a is b for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(s, field)  # today's name: no warning


def test_a_newer_schema_is_refused_in_one_line(tmp_path):
    payload = flax.serialization.msgpack_serialize(
        {"format": checkpoint.FORMAT, "round": 1, "config_sha256": "c", "schema": SCHEMA + 1, "state": {"x": 1}})
    (tmp_path / "c.msgpack").write_bytes(payload)
    with pytest.raises(CheckpointError, match=f"state schema {SCHEMA + 1} > {SCHEMA}") as e:
        read_checkpoint(tmp_path / "c.msgpack", {"x": jax.ShapeDtypeStruct((), np.int64)})
    assert "\n" not in str(e.value)


def test_migrate_moves_only_former_names_of_an_older_schema():
    @renamed_fields(a="b.k")
    @flax.struct.dataclass
    class S:
        b: dict
        c: int

    template = S(b={"k": 0}, c=0)
    assert migrate(template, {"a": 1, "c": 2}, 1) == {"b": {"k": 1}, "c": 2}
    assert migrate(template, {"a": 1, "c": 2}, SCHEMA) == {"a": 1, "c": 2}  # today's schema: as written
    assert migrate({"a": 1}, {"a": 1}, 1) == {"a": 1}  # a plain tree has no former names
    with pytest.raises(TypeError, match="does not match"):
        renamed_fields(c="d")(S)  # today's name must be a field
    with pytest.raises(TypeError, match="does not match"):
        renamed_fields(c="b")(S)  # a former name cannot still be a field



@pytest.mark.slow  # a whole run (30-100 s cold): CI's slow tier
def test_a_dp_fnas_run_directory_from_before_both_renames_resumes_to_the_same_end(tmp_path):
    """Former config names in config.json (``algo.lr``, ``algo.arch_optimizer`` ...) and former
    state names in a schema-1 checkpoint (``w_opt_state`` / ``a_opt_state``): the run
    resumes and ends exactly where a run under today's names ends."""
    import json

    from jaxfednas.experiment import run_experiment
    from jaxfednas.resume import _dict_hash

    cfg, _ = tiny_federation("dp_fnas", **{"algo.server_lr": 0.05, "algo.arch_server_optimizer": "sgd"})
    cut = lambda r: dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=r))  # noqa: E731
    quiet = dict(progress=False, log=lambda s: None)
    run_experiment(cut(3), tmp_path / "straight", **quiet)
    old = tmp_path / "old"
    run_experiment(cut(2), old, **quiet)
    stored = json.loads((old / "config.json").read_text())
    former = {"server_lr": "lr", "server_lr_min": "lr_min", "arch_server_optimizer": "arch_optimizer",
              "arch_server_lr": "arch_lr", "server_momentum": "momentum"}
    stored["algo"] = {former.get(k, k): v for k, v in stored["algo"].items()}
    (old / "config.json").write_text(json.dumps(stored, indent=2))
    ckpt = old / "checkpoint.msgpack"
    raw = flax.serialization.msgpack_restore(ckpt.read_bytes().split(b"\n", 1)[1])
    assert raw["schema"] == SCHEMA
    _write_schema_1(ckpt, _former(raw["state"], RENAMED["dp_fnas"]), round=raw["round"],
                    config_sha256=_dict_hash(stored))  # as the library wrote it then

    run_experiment(cut(3), old, resume=True, **quiet)
    rows = lambda d: [{k: v for k, v in json.loads(line).items() if "time" not in k and "wall" not in k}  # noqa: E731
                      for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(rows(old)) == 3 and rows(old) == rows(tmp_path / "straight")
