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
exclude_patterns = ["_build", "**/__pycache__", "README.md", "results/*.md"]

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
]

# `sphinx-build -b doctest docs docs/_build/doctest` runs the pages' {doctest} blocks.
# Docstring examples run with their module's namespace under
# `python -m pytest --doctest-modules`, not here (Sphinx's doctest builder would run
# them without their module's globals).
doctest_test_doctest_blocks = ""

html_theme = "furo"
html_title = "jaxfednas"
html_static_path: list[str] = []
