"""Every paper example takes ``--dataset NAME`` (one of ``DATASETS``, e.g. the cluttered
digits) into the configuration of every stage it runs; a name that is not a dataset is a
one-line usage error."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# example -> the function main hands its overrides to (replaced here: nothing trains)
ENTRY = {"fednas": "global_search", "dfnas": "one_seed", "spider": "one_seed", "perfedrlnas": "run_one",
         "dp_fnas": "table1"}


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}_flags", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_dataset_flag_reaches_every_stage(name, tmp_path, monkeypatch, capsys):
    mod, seen = _example(name), []
    monkeypatch.setattr(mod, ENTRY[name], lambda args, overrides, *rest, **kw: seen.append(dict(overrides)) or {})
    assert mod.main(["--dataset", "cluttered_digits", "--out", str(tmp_path / "o")]) in (0, None)
    assert [o["data.dataset"] for o in seen] == ["cluttered_digits"]
    with pytest.raises(SystemExit) as e:
        mod.main(["--dataset", "cluttered", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'cluttered'" in err and "Traceback" not in err
