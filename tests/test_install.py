"""What a user installs: the sdist and the wheel hold every file graphdist reads, and a regular
(non-editable) install of the wheel runs from a folder outside the checkout.

The package is built from a copy of the checkout's tracked files (so a file that exists here but
is not tracked cannot make the build look complete), first as an sdist, then as a wheel built
from that sdist, as ``python -m build`` does. The fresh virtual environment gets graphdist from
the wheel alone; TensorFlow and the other dependencies come from the running environment
through a ``.pth`` line (installing TensorFlow again would cost a minute and 2 GB, and is what the
nox cells do), after the new environment's own site-packages, so they cannot shadow the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import uuid
import zipfile
from pathlib import Path

import pytest

from graphdist._version import (
    PYTHON_RANGE,
    TENSORFLOW_RANGE,
    __version__,
    python_problem,
    tensorflow_problem,
)
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, processes_marked, wait_gone

# A promise (the wheel holds what graphdist reads): without git and .git to list the tracked files
# the tests skip, which fails unless GRAPHDIST_ALLOW_PROMISE_SKIPS=1 (CI always has a checkout).
# One worker runs them all: the module's sdist, wheel and fresh virtual environment are then
# built once, not once on each worker.
pytestmark = [pytest.mark.timeout(300), pytest.mark.promise, pytest.mark.xdist_group("wheel")]


def _tracked(prefix: str = "") -> list[str]:
    # .git is a folder in a clone, a file in a worktree (``git worktree add``): both are checkouts
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip(f"needs git and a git checkout ({REPO}/.git) to know the tracked files")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", prefix or "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [p for p in out.stdout.split("\0") if p and os.path.isfile(os.path.join(REPO, p))]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build the sdist, then the wheel from it; returns {"sdist": path, "wheel": path}."""
    work = tmp_path_factory.mktemp("dist")
    src = work / "src"
    for rel in _tracked():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), dest)
    out = work / "out"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    sdists = list(out.glob("graphdist-*.tar.gz"))
    wheels = list(out.glob("graphdist-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, os.listdir(out)
    return {"sdist": sdists[0], "wheel": wheels[0]}


def test_wheel_holds_every_tracked_file_of_the_package(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    missing = [p for p in _tracked("graphdist") if p not in names]
    assert missing == [], f"tracked under graphdist/ but not in the wheel: {missing}"
    assert "graphdist/_net/loopback.c" in names  # the file that was once forgotten


def test_sdist_holds_the_package_tests_examples_and_deploy_files(dists):
    with tarfile.open(dists["sdist"]) as tar:
        root = f"graphdist-{__version__}/"
        names = {n[len(root) :] for n in tar.getnames() if n.startswith(root)}
    wanted = [
        p
        for p in _tracked()
        if p.split("/")[0] in ("graphdist", "tests", "examples", "servers", "benchmarks")
        and not p.startswith("benchmarks/results/")
    ]
    missing = [p for p in wanted if p not in names]
    assert missing == [], f"tracked but not in the sdist: {missing}"


def test_wheel_declares_the_supported_versions(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = whl.read(meta_name).decode()
    low, high = TENSORFLOW_RANGE
    assert f"Requires-Python: >={PYTHON_RANGE[0][0]}.{PYTHON_RANGE[0][1]}" in meta
    assert f"Requires-Dist: tensorflow<{high[0]}.{high[1] + 1},>={low[0]}.{low[1]}" in meta
    for minor in range(PYTHON_RANGE[0][1], PYTHON_RANGE[1][1] + 1):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}" in meta
    assert f"Version: {__version__}" in meta


@pytest.fixture(scope="module")
def installed(dists: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (not editable); returns its folder."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            str(dists["wheel"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pip.returncode == 0, pip.stderr
    # Only now (pip would otherwise find a graphdist there and keep it): the running
    # environment's packages (TensorFlow, numpy, ...), after the venv's own.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "zz_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return venv


def _run_outside(venv: Path, tmp_path: Path, args: list[str], mark: str):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(QUIET_TF)
    # A fresh cache: the bind shim must be built from the C source inside the installed package.
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["GRAPHDIST_TEST_MARK"] = mark
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.integration
def test_installed_wheel_runs_the_demo_from_outside_the_checkout(installed, tmp_path):
    mark = uuid.uuid4().hex
    result = _run_outside(installed, tmp_path, [str(installed / "bin" / "graphdist"), "demo"], mark)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "238" in result.stdout
    shims = list((tmp_path / "cache" / "graphdist").glob("loopback-bind-*.so"))
    assert len(shims) == 1, "the bind shim was not built from the installed package"
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


@pytest.mark.integration
def test_installed_wheel_runs_a_local_fleet_session(installed, tmp_path):
    code = textwrap.dedent(
        """
        import graphdist
        import tensorflow.compat.v1 as tf
        tf.disable_eager_execution()
        print(graphdist.__file__)
        with graphdist.LocalFleet("local=2") as fleet:
            x = tf.constant(2)
            with tf.device(fleet.device("local", 0)):
                y2 = x - 66
            with tf.device(fleet.device("local", 1)):
                y = x + 300 + y2
            with fleet.session("local", 0) as sess:
                print(sess.run(y))
        """
    )
    mark = uuid.uuid4().hex
    python = str(installed / "bin" / "python")
    result = _run_outside(installed, tmp_path, [python, "-c", code], mark)
    assert result.returncode == 0, result.stderr[-3000:]
    module_file, value = result.stdout.split()[-2:]
    assert module_file.startswith(str(installed)), module_file  # the wheel's copy, not the checkout
    assert value == "238"
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


@pytest.mark.integration
def test_installed_command_prints_its_version(installed, tmp_path):
    result = _run_outside(
        installed, tmp_path, [str(installed / "bin" / "graphdist"), "--version"], ""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"graphdist {__version__} (Python ")


def test_setup_cfg_declares_the_ranges_of_the_version_module():
    text = Path(REPO, "setup.cfg").read_text()
    low, high = TENSORFLOW_RANGE
    assert f"python_requires = >={PYTHON_RANGE[0][0]}.{PYTHON_RANGE[0][1]}" in text
    assert f"tensorflow>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}" in text
    assert f"tf-keras>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}" in text


@pytest.mark.parametrize(
    ("version", "supported"),
    [("2.15.1", False), ("2.16.2", True), ("2.21.0", True), ("2.22.0rc0", False), ("3.0", False)],
)
def test_tensorflow_range_check(version, supported):
    problem = tensorflow_problem(version)
    assert (problem is None) is supported
    if problem is not None:
        assert "\n" not in problem
        assert f"found TensorFlow {version}" in problem and "2.16 to 2.21" in problem


def test_old_python_gets_one_line():
    assert python_problem((3, 9, 18)) == "graphdist needs Python 3.10 to 3.13; this is Python 3.9."
    assert python_problem((3, 10, 0)) is None


def test_unsupported_tensorflow_is_refused_at_import_in_one_line(tmp_path):
    # A fake tensorflow 2.15 distribution (metadata only) first on the path.
    dist = tmp_path / "tensorflow-2.15.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.15.1\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    env.pop("GRAPHDIST_ALLOW_ANY_TENSORFLOW", None)
    result = subprocess.run(
        [sys.executable, "-c", "import graphdist"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("graphdist.UnsupportedVersionError: graphdist 0")
    assert "found TensorFlow 2.15.1" in last
    env["GRAPHDIST_ALLOW_ANY_TENSORFLOW"] = "1"
    allowed = subprocess.run(
        [sys.executable, "-c", "import graphdist"], env=env, capture_output=True, text=True
    )
    assert allowed.returncode == 0, allowed.stderr
