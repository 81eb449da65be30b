"""The installed package: one top-level name, every subpackage listed, every algorithm exported."""
import pathlib
import tomllib

import jaxfednas.algorithms as algorithms
from jaxfednas import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _source_packages():
    roots = {"jaxfednas": ROOT / "jaxfednas", "jaxfednas.algorithms": ROOT / "algorithms",
             "jaxfednas.search_spaces": ROOT / "search_spaces"}
    found = set()
    for name, path in roots.items():
        for init in path.rglob("__init__.py"):
            rel = init.parent.relative_to(path).parts
            found.add(".".join((name, *rel)))
    return found


def test_pyproject_lists_every_package_and_installs_one_top_level_name():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["packages"]) == _source_packages()
    assert {p.split(".")[0] for p in tool["packages"]} == {"jaxfednas"}
    assert tool["package-dir"] == {"jaxfednas.algorithms": "algorithms", "jaxfednas.search_spaces": "search_spaces"}


def test_every_registered_algorithm_is_exported_as_its_module_with_its_config():
    import types
    for name in registry.ALGORITHMS:
        module = getattr(algorithms, name)
        assert isinstance(module, types.ModuleType) and module.__name__ == registry.ALGORITHMS[name]
        assert callable(getattr(module, name)), name    # the factory has the module's name
        assert any(getattr(module, c, None) is getattr(algorithms, c) for c in algorithms.__all__ if c.endswith("Config"))
    for name in algorithms.__all__:
        obj = getattr(algorithms, name)
        assert getattr(obj, "__module__", getattr(obj, "__name__", "")).startswith("jaxfednas.algorithms"), name


def test_one_version_in_pyproject_the_package_and_the_citation():
    import jaxfednas

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    cited = next(line.split(":", 1)[1].strip() for line in (ROOT / "CITATION.cff").read_text().splitlines()
                 if line.startswith("version:"))
    assert project == jaxfednas.__version__ == cited
