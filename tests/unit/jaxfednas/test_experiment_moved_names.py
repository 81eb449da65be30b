"""The public names that moved out of ``jaxfednas.experiment`` (to rundir, process, resume,
memory_fit, reports and stages): reachable there for one release with a DeprecationWarning
naming the new module, and imported from their new homes everywhere in the repository."""
import ast
import importlib
import pathlib
import warnings

import pytest

import jaxfednas.experiment as experiment

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_a_moved_name_is_reachable_from_experiment_and_warns_naming_its_new_module():
    from jaxfednas.stages import StageRunner

    with pytest.warns(DeprecationWarning, match=r"jaxfednas\.experiment\.StageRunner has moved to "
                                                r"jaxfednas\.stages\.StageRunner"):
        from jaxfednas.experiment import StageRunner as former
    assert former is StageRunner
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        experiment.no_such_name  # noqa: B018


ADDED_SINCE = {"LAYOUT", "run_layout", "layout_changes",  # new in these modules after the move: never in experiment
               "read_metrics", "read_client_test_acc", "client_acc_summary", "shared_settings", "cached_json",
               "personalized_accuracy", "method_row", "stage_row", "read_json", "compare_clients", "describe_round",
               "ROUND_METRICS", "PartitionChangedError"}


def test_every_public_name_of_the_new_modules_is_reachable_from_experiment():
    listed: dict[str, set[str]] = {}
    for name, module in experiment._MOVED.items():
        listed.setdefault(module, set()).add(name)
    for module, names in listed.items():
        mod = importlib.import_module(module)
        tree = ast.parse(pathlib.Path(mod.__file__).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert {n for n in defined if not n.startswith("_")} - ADDED_SINCE == names, module
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for name in names:
                assert getattr(experiment, name) is getattr(mod, name), name


def test_the_repository_imports_no_moved_name_from_experiment():
    here = pathlib.Path(__file__).resolve()
    stale = []
    for folder in ("jaxfednas", "algorithms", "search_spaces", "examples", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.resolve() == here:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "jaxfednas.experiment":
                    stale += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names
                              if a.name in experiment._MOVED]
    assert not stale, "\n".join(stale)
