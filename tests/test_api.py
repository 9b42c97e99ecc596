"""The public namespace and the promise that ``import graphdist`` does not import TensorFlow."""

from __future__ import annotations

import graphdist
from tests.conftest import run_python


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
