"""Sphinx configuration of graphdist's documentation (``make docs``).

The build is offline and strict: ``-W --keep-going`` (every warning fails it), no intersphinx
(nothing is fetched), and the tutorial notebook is executed on every build, so a cell that fails
fails the build (MyST-NB, ``nb_execution_mode = "force"``). The API reference is autodoc over
``graphdist.__all__`` (``api.md``; ``tests/test_docs.py`` checks that it names every public name)
and the CLI reference is generated from the parser itself (sphinx-argparse over
``graphdist._cli.parser.build_parser``, one section per subcommand, checked by the same test).
"""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
sys.path.insert(0, REPO)  # the checkout's graphdist, whatever is installed

import graphdist  # noqa: E402

project = "graphdist"
author = "the graphdist authors"
copyright = "the graphdist authors, Apache-2.0"
release = version = graphdist.__version__

extensions = [
    "myst_nb",  # Markdown pages (MyST) and executed notebooks
    "sphinx.ext.autodoc",
    "sphinxarg.ext",
    "sphinx_copybutton",  # a copy button on every code block; prompts and outputs not copied
]

exclude_patterns = ["_build", "jupyter_execute", ".jupyter_cache"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# MyST: heading anchors, so that guides can link to each other's sections (page.md#section)
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The tutorial runs on every build, in a real kernel, on a real fleet: a failing cell fails the
# build (nb_execution_raise_on_error), a cell that hangs fails it after nb_execution_timeout.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 180
nb_execution_show_tb = True
nb_merge_streams = True
# TensorFlow's C++ start-up lines (absl, CUDA probing) go to the kernel's stderr whatever
# TF_CPP_MIN_LOG_LEVEL says; they are not the tutorial's output.
nb_output_stderr = "remove"

# autodoc: members in source order, as the modules tell them; the signatures say the types.
# api.md wraps each autodoc directive in {eval-rst}: docstrings are reStructuredText (``code``,
# :class:`...`), and so is what autodoc writes for members.
autodoc_default_options = {"members": True, "member-order": "bysource", "undoc-members": False}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
add_module_names = False
# a code block that names no language is output (the benchmarks' figures), never Python
highlight_language = "text"
smartquotes = False  # help texts say --flag: no en dashes, no curly quotes in commands

# Furo: a theme made for API docs, wide enough for code and outputs, with an "on this page"
# contents beside every page and a search box; no fonts or scripts fetched at build time.
html_theme = "furo"
html_title = f"graphdist {release}"
html_static_path: list[str] = []
html_theme_options = {"navigation_with_keys": True}
# copy what a user types, not the "$ " prompt or a ">>> " doctest prompt
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True

# The kernel that runs the tutorial: quiet TensorFlow, as `make demo` does.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _data_docstring(app, what, name, obj, options, lines):
    """A public constant (``graphdist.X``, :data:`graphdist._WHERE` says where it lives) gets the
    ``#:`` comment of the module that defines it, never the docstring of its type (``int``'s):
    autodoc would look for that comment in ``graphdist/__init__.py``, which only re-exports it."""
    if what != "data" or not name.startswith("graphdist."):
        return
    short = name.split(".", 1)[1]
    module = "graphdist._version" if short == "__version__" else graphdist._WHERE.get(short)
    comment: list[str] = []
    if module:
        from sphinx.pycode import ModuleAnalyzer

        comment = list(ModuleAnalyzer.for_module(module).find_attr_docs().get(("", short), []))
    lines[:] = [ln for ln in comment if ln.strip()]


def setup(app):
    app.connect("autodoc-process-docstring", _data_docstring)
