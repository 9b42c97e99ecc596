"""The public namespace and the promise that ``import graphdist`` does not import TensorFlow."""

from __future__ import annotations

import glob
import importlib
import os
import pickle
import pkgutil
import re
import traceback
from pathlib import Path

import graphdist
import graphdist._exceptions
from tests.conftest import REPO, run_python


def test_all_names_exist_and_are_public():
    assert sorted(graphdist.__all__) == sorted(set(graphdist.__all__))
    for name in graphdist.__all__:
        assert hasattr(graphdist, name), name
    # Names that are not identifiers ("@py_builtins") are pytest's assertion rewriting, which
    # applies to an installed (non-editable) graphdist because its plugin lives in the package.
    public = {n for n in dir(graphdist) if not n.startswith("_") and n.isidentifier()}
    assert public <= set(graphdist.__all__) | {
        "pytest_plugin",  # submodule, loaded by pytest
    }


def test_lazy_names_match_the_type_checking_imports():
    """``graphdist.__getattr__`` loads each public name from where ``_LAZY`` says; type checkers
    read the ``TYPE_CHECKING`` imports instead: both must say the same, and every module must
    really provide its names."""
    import ast

    tree = ast.parse(Path(graphdist.__file__).read_text())
    guarded = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    )
    imported: dict[str, tuple[str, ...]] = {}
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.unparse(node)
        imported[node.module] = imported.get(node.module, ()) + tuple(a.name for a in node.names)
    assert imported == graphdist._LAZY
    for module, names in graphdist._LAZY.items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is getattr(graphdist, name)


def test_import_reads_only_the_exceptions():
    code = (
        "import sys, graphdist; print(sorted(m for m in sys.modules if m.startswith('graphdist')))"
    )
    out = run_python(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["graphdist", "graphdist._exceptions", "graphdist._version"])


def test_every_error_derives_from_graphdist_error():
    for name in graphdist.__all__:
        obj = getattr(graphdist, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, graphdist.GraphdistError), name


def test_import_does_not_import_tensorflow():
    code = "import sys, graphdist; print('tensorflow' in sys.modules, 'ray' in sys.modules)"
    out = run_python(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def _drawn_tree() -> dict[str, str | None]:
    """Class name -> parent name, read from the drawing in graphdist._exceptions' docstring."""
    import graphdist._exceptions as exceptions

    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in (exceptions.__doc__ or "").splitlines():
        match = re.match(r"^    ([│├└─ ]*)([A-Z][A-Za-z]*Error)\b", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        del stack[depth:]
        parents[match.group(2)] = stack[-1] if stack else None
        stack.append(match.group(2))
    return parents


def _all_error_classes() -> set[type]:
    skip = {"graphdist.__main__", "graphdist._proc.forkserver_exit"}  # one runs, one exits
    for info in pkgutil.walk_packages(graphdist.__path__, "graphdist."):
        if info.name not in skip:
            importlib.import_module(info.name)
    found: set[type] = set()
    pending = [graphdist.GraphdistError]
    while pending:
        cls = pending.pop()
        found.add(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_exception_tree_drawing_matches_the_classes():
    drawn = _drawn_tree()
    classes = _all_error_classes()
    assert {c.__name__ for c in classes} == set(drawn)
    for cls in classes:
        # one home for every error, shown under its public name (not graphdist._exceptions)
        assert cls.__module__ == "graphdist", cls
        assert getattr(graphdist._exceptions, cls.__name__) is cls, cls
        bases = [b for b in cls.__bases__ if issubclass(b, graphdist.GraphdistError)]
        parent = bases[0].__name__ if bases else None
        assert drawn[cls.__name__] == parent, cls
        assert cls.__name__ in graphdist.__all__, cls


def test_an_error_prints_and_pickles_under_its_public_name():
    """issue 39: errors printed as graphdist._exceptions.PlacementError, a private path."""
    error = graphdist.PlacementError("No task with index 5 in job 'local'", device="/job:local")
    shown = traceback.format_exception_only(type(error), error)[-1]
    assert shown.startswith("graphdist.PlacementError: No task with index 5"), shown
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is graphdist.PlacementError and str(again) == str(error)


def test_bad_values_are_value_errors_and_missing_tasks_key_errors():
    for cls in (graphdist.ArgumentError, graphdist.ClusterSpecError, graphdist.PlacementError):
        assert issubclass(cls, ValueError)
    assert issubclass(graphdist.TaskNotFoundError, KeyError)
    assert issubclass(graphdist.UnsupportedVersionError, ImportError)


def test_no_bare_graphdist_error_is_raised():
    for path in glob.glob(os.path.join(REPO, "graphdist", "**", "*.py"), recursive=True):
        text = Path(path).read_text(encoding="utf-8")
        assert "raise GraphdistError(" not in text, path


def test_every_name_readme_shows_is_public():
    readme = Path(REPO, "README.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"\bgraphdist\.([A-Za-z][A-Za-z0-9_]*)", readme))
    assert shown, "README shows no graphdist.NAME"
    assert shown - {"pytest_plugin"} <= set(graphdist.__all__), shown - set(graphdist.__all__)


def test_examples_use_only_public_names():
    for path in glob.glob(os.path.join(REPO, "examples", "*.py")):
        text = Path(path).read_text(encoding="utf-8")
        assert not re.search(r"\bgraphdist\._", text), path
