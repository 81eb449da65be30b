"""The installed package: one top-level name, every subpackage listed, every algorithm exported."""
import pathlib
import tomllib

import jaxfednas.algorithms as algorithms
from jaxfednas import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def _library_references(path: pathlib.Path):
    """(line, what, module, name) for each ``from jaxfednas... import name`` and each
    ``algorithm_module("x").name`` in one script's source."""
    import ast

    def module_call(node):  # algorithm_module(...), or a name bound to one in this file
        if isinstance(node, ast.Name) and node.id in bound:
            return bound[node.id]
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "algorithm_module":
            return node
        return None

    tree = ast.parse(path.read_text(), str(path))
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (call := module_call(node.value)) is not None:
                bound[node.targets[0].id] = call
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxfednas":
            for alias in node.names:
                yield node.lineno, "import", node.module, alias.name
        elif isinstance(node, ast.Attribute) and (call := module_call(node.value)) is not None:
            arg = call.args[0] if call.args else None
            names = [arg.value] if isinstance(arg, ast.Constant) else list(registry.ALGORITHMS)
            for name in names:
                yield node.lineno, "attribute", registry.ALGORITHMS[name], node.attr


def test_scripts_outside_the_fast_suite_name_only_what_the_library_has():
    """The benchmarks and examples run in CI's later steps or by hand: a name the library
    dropped (``algorithm_module(name).build`` once) must fail here, in the README's command."""
    import importlib

    scripts = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])
    assert len(scripts) > 10
    missing, checked = [], 0
    for script in scripts:
        for line, what, module, name in _library_references(script):
            mod = importlib.import_module(module)
            checked += 1
            if not (hasattr(mod, name) or (what == "import" and importlib.util.find_spec(f"{module}.{name}"))):
                missing.append(f"{script.relative_to(ROOT)}:{line}: {module} has no {name!r}")
    assert checked > 50
    assert not missing, "\n".join(missing)
