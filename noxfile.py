"""The support matrix: one nox session per (Python, TensorFlow) cell.

    nox -l                                   # every cell
    nox -s "cell(py3.10-tf2.16)"             # one cell: the core subset
    nox -s "cell(py3.13-tf2.21)" -- --full   # one cell: the whole suite
    nox -t corners                           # the two corners CI runs (oldest, newest)

Each cell builds its own virtual environment under ``.nox/`` with that Python, TensorFlow
``X.Y.*`` and the tf-keras of the same minor version, installs graphdist from this checkout
(a regular, non-editable install, as a user would), and runs :data:`CORE` (or the whole suite
with ``--full``). Interpreters are found on PATH (``python3.10``) or under pyenv
(``$(pyenv root)/versions/3.10.*``); a cell whose Python is missing fails, saying which (as nox's
``error_on_missing_interpreters`` would): ``make corners`` with an interpreter missing is a
corner untested, never a pass. Run the cells this machine has by name (``nox -s``). TensorFlow
ships no Python 3.13 wheels before 2.20, so those cells do not exist.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import nox

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphdist._version import (
    PYTHON_RANGE,
    TENSORFLOW_FOR_PYTHON_313,
    TENSORFLOW_RANGE,
)

nox.options.sessions = ["cell"]
nox.options.default_venv_backend = "none"
# The cells find their interpreter themselves (python=False: nox's own check never runs), and
# fail where it is missing (cell); this says the same for any session nox would make a venv for.
nox.options.error_on_missing_interpreters = True

PYTHONS = [f"3.{m}" for m in range(PYTHON_RANGE[0][1], PYTHON_RANGE[1][1] + 1)]
TENSORFLOWS = [f"2.{m}" for m in range(TENSORFLOW_RANGE[0][1], TENSORFLOW_RANGE[1][1] + 1)]
CORNERS = {("3.10", "2.16"), ("3.13", "2.21")}

#: The tests that touch what changes between TensorFlow and Python versions: the compat.v1
#: graph runtime (servers, sessions, variables, tracing, splitting), tf.distribute's TF_CONFIG
#: and strategies, the seeds' examples and a real wheel install. About 3 minutes here.
CORE = [
    "tests/test_api.py",
    "tests/test_cluster.py",
    "tests/graph/test_placement.py",
    "tests/fleet/test_fleet.py",
    "tests/graph/test_session.py",
    "tests/graph/test_variables.py",
    "tests/graph/test_split.py",
    "tests/distribute/test_tfconfig.py",
    "tests/distribute/test_strategy.py",
    "tests/test_examples.py",
    "tests/test_install.py",
]


def _cells() -> list[nox.param]:
    cells = []
    for tf in TENSORFLOWS:
        for py in PYTHONS:
            if py == "3.13" and tuple(map(int, tf.split("."))) < TENSORFLOW_FOR_PYTHON_313:
                continue
            tags = ["corners"] if (py, tf) in CORNERS else []
            cells.append(nox.param(py, tf, id=f"py{py}-tf{tf}", tags=tags))
    return cells


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (e.g. ``"3.10"``) from PATH or pyenv, or ``None``."""
    candidates = [shutil.which(f"python{version}")]
    root = os.environ.get("PYENV_ROOT") or _pyenv_root()
    if root:
        found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))
        candidates += sorted(found, reverse=True)
    for path in candidates:
        if path and _reports(path, version):
            return path
    return None


def _pyenv_root() -> str | None:
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    out = subprocess.run([pyenv, "root"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def _reports(python: str, version: str) -> bool:
    """True if ``python`` runs and is ``version`` (a pyenv shim may exist but refuse to run)."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip() == version


@nox.session(python=False)
@nox.parametrize(("python", "tensorflow"), _cells())
def cell(session: nox.Session, python: str, tensorflow: str) -> None:
    """Install graphdist with TensorFlow ``tensorflow`` on Python ``python`` and run the tests."""
    interpreter = find_python(python)
    if interpreter is None:
        session.error(
            f"no Python {python} on PATH or under pyenv: cell py{python}-tf{tensorflow} cannot "
            f"run (install it, e.g. `pyenv install {python}`)"
        )
    venv = os.path.join(".nox", f"py{python}-tf{tensorflow}")
    bin_dir = os.path.join(os.path.abspath(venv), "bin")
    if not os.path.exists(os.path.join(bin_dir, "python")):
        session.run(interpreter, "-m", "venv", "--clear", venv, external=True)
    pip = [os.path.join(bin_dir, "python"), "-m", "pip", "install", "-q"]
    session.run(*pip, "--upgrade", "pip", external=True)
    session.run(
        *pip,
        f"tensorflow=={tensorflow}.*",
        f"tf-keras=={tensorflow}.*",
        ".[test]",
        external=True,
    )
    # pip keeps an installed graphdist of the same version: reinstall this checkout's.
    session.run(*pip, "--no-deps", "--force-reinstall", ".", external=True)
    tests = ["tests"] if "--full" in session.posargs else CORE
    extra = [a for a in session.posargs if a != "--full"]
    # bin/pytest, not python -m pytest: the latter puts the checkout first on sys.path, and the
    # tests would import graphdist from there instead of from the installed copy.
    session.run(
        os.path.join(bin_dir, "pytest"),
        "-p",
        "no:cacheprovider",
        *tests,
        *extra,
        external=True,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
