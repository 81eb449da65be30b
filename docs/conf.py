"""Sphinx configuration of the jaxfednas documentation.

Build (strict: every warning, broken cross-reference included, is an error)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -n -b html docs docs/_build/html

Pages are Markdown (MyST); the API reference is generated from the docstrings, whose
``:func:`` / ``:class:`` / ``:mod:`` roles autodoc resolves and nitpicky mode checks.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # build from a checkout without installing it

project = "jaxfednas"
author = "jaxfednas authors"
copyright = "jaxfednas authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# docs/results/*.md are written by the examples' commands and included into the paper
# pages with {include}; they are not pages of their own.
exclude_patterns = ["_build", "**/__pycache__", "README.md", "results/*.md", "_generated"]

# The metrics glossary page includes the table jaxfednas.metrics holds (the contract test
# checks every algorithm's metric names against it): generated here, never edited by hand.
os.makedirs(os.path.join(ROOT, "docs", "_generated"), exist_ok=True)
with open(os.path.join(ROOT, "docs", "_generated", "metrics_glossary.md"), "w") as _f:
    from jaxfednas.metrics import glossary_markdown

    _f.write(glossary_markdown() + "\n")

# MyST: ::: fences, $math$, definition lists; headings up to ### get anchors so that
# README.md and other pages can link to sections (page.md#section-title).
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# autodoc: members in source order, type hints in the description, not the signature.
# Module-level constants without a docstring (DATASETS, SPACES, ...) are documented too,
# so that docstrings can point at them; inherited docstrings (Flax's Module.setup) are not.
autodoc_default_options = {"members": True, "undoc-members": True, "member-order": "bysource"}
autodoc_inherit_docstrings = False
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = True
napoleon_use_ivar = True  # "Attributes:" as fields, not a second description of each field

# Strict references. Ignored only: types of other libraries (no intersphinx: the docs
# build offline) and builtins Sphinx cannot link without it.
nitpicky = True
_EXTERNAL_PREFIXES = (
    "jax.", "jnp.", "jaxlib.", "np.", "numpy.", "flax.", "nn.", "optax.", "chex.",
    "scipy.", "dp_accounting.", "matplotlib.", "msgpack.", "collections.abc.",
    "typing.", "types.", "os.", "pathlib.", "argparse.", "dataclasses.", "concurrent.",
)
nitpick_ignore_regex = [
    (r"py:.*", prefix.replace(".", r"\.") + r".*") for prefix in _EXTERNAL_PREFIXES
] + [
    (r"py:.*", r"(Array|ArrayLike|PRNGKey|PyTree|Pytree|Module|GradientTransformation"
               r"|Path|Callable|Any|Sequence|Mapping|Iterable|Iterator|Literal|Optional"
               r"|NamedTuple|ndarray|dtype|Mesh|NamedSharding|PartitionSpec)"),
    # Flax modules' `parent` field: its annotation is a Union Sphinx cannot split.
    (r"py:class", r"Union\[flax\..*"),
    # Type variables (`A` in `matched(...) -> A`) and private helper classes in annotations.
    (r"py:class", r"(.*\.)?[A-Z]"),
    (r"py:class", r".*\._\w+"),
]

# `sphinx-build -b doctest docs docs/_build/doctest` runs the pages' {doctest} blocks.
# Docstring examples run with their module's namespace under
# `python -m pytest --doctest-modules`, not here (Sphinx's doctest builder would run
# them without their module's globals).
doctest_test_doctest_blocks = ""


def _namespace_target(env, modname: str, target: str) -> str | None:
    """The documented full name of ``target`` as module ``modname`` sees it.

    A docstring may name an object the module imports (``:class:`Genotype``` in a module
    that does ``from ...darts import Genotype``); Python resolves that name in the module's
    namespace, Sphinx only among the module's own members. Look the first component up in
    the module and link the documented object that *is* it (same Python object), if any.
    """
    import importlib

    head, _, rest = target.partition(".")
    try:
        mod = importlib.import_module(modname)
    except Exception:  # noqa: BLE001 (a module autodoc could not import either)
        return None
    if not hasattr(mod, head):
        return None
    obj = getattr(mod, head)
    objects = env.get_domain("py").objects
    candidates = []
    for name in objects:
        parent, _, last = name.rpartition(".")
        if last != head or not parent:
            continue
        try:
            owner = importlib.import_module(parent)
        except Exception:  # noqa: BLE001 (a class, not a module: not an import target)
            continue
        if getattr(owner, head, None) is obj:
            candidates.append(name)
    for name in sorted(candidates, key=len):
        full = f"{name}.{rest}" if rest else name
        if full in objects:
            return full
    return None


def _namespaces(node) -> list[str]:
    """Modules whose namespace a docstring reference is read in: the current module and,
    for an object re-exported by a package, the module that defines the object (from the
    node's source, "...:docstring of jaxfednas.runtime.weighted_mean")."""
    names = [node["py:module"]] if node.get("py:module") else []
    source = node.source or ""
    if "docstring of " in source:
        parts = source.rsplit("docstring of ", 1)[1].split(".")
        names += [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    return names


def _resolve_in_module_namespace(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    full = None
    for modname in _namespaces(node):
        full = _namespace_target(env, modname, target)
        if full is not None:
            break
    if full is None:
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                             full, node, contnode)


def setup(app):
    app.connect("missing-reference", _resolve_in_module_namespace)


html_theme = "furo"
html_title = "jaxfednas"
html_static_path: list[str] = []
