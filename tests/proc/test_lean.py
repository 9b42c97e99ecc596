"""Server processes import TensorFlow without Keras and SciPy (graphdist._proc.lean)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.conftest import QUIET_TF, run_python

pytestmark = pytest.mark.timeout(180)


def _mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "/" in line}


def test_refused_packages_fail_as_missing_and_tensorflow_still_imports():
    code = textwrap.dedent(
        """
        import sys
        from graphdist._proc import lean
        lean.install()
        lean.install()  # idempotent
        import tensorflow as tf
        assert tf.constant(2).numpy() + 1 == 3
        for name in ("keras", "tf_keras", "scipy", "scipy.sparse"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                assert exc.name == name.partition(".")[0], exc
                assert "server process" in str(exc), exc
            else:
                raise AssertionError(name + " was imported")
        print(sorted(m for m in sys.modules if m.partition(".")[0] in lean.REFUSED))
        """
    )
    result = run_python(["-c", code], env=QUIET_TF)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.integration
def test_fleet_servers_run_graphs_without_scipy_or_keras_loaded(graphdist_fleet):
    # where SciPy is installed (the test extras bring it), a plain `import tensorflow` maps its
    # libraries (through Keras and TensorFlow's legacy Keras)
    plain = run_python(
        ["-c", "import os, tensorflow; print(open(f'/proc/{os.getpid()}/maps').read())"],
        env=QUIET_TF,
    )
    assert plain.returncode == 0, plain.stderr
    if importlib.util.find_spec("scipy") is not None:  # the control: the check can fail
        assert "/scipy/" in plain.stdout
    for pid in graphdist_fleet.pids:
        files = _mapped_files(pid)
        assert any("tensorflow" in f for f in files)
        assert not [f for f in files if "/scipy/" in f or "/sklearn/" in f], pid
