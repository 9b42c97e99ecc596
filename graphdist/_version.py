"""graphdist's version and the Python and TensorFlow versions it supports: the one source of both.

``setup.cfg`` reads ``__version__`` from here; ``python_requires`` and the ``tensorflow`` range in
``setup.cfg`` say the same as :data:`PYTHON_RANGE` and :data:`TENSORFLOW_RANGE`, and a test keeps
them in step. ``graphdist/__init__.py`` calls :func:`check_versions` before anything else, so an
old interpreter hears that it is too old before it trips over newer syntax elsewhere.
"""

from __future__ import annotations

import os
import re
import sys

__version__ = "0.2.0"

#: Lowest and highest supported (major, minor), both included.
PYTHON_RANGE = ((3, 10), (3, 13))
TENSORFLOW_RANGE = ((2, 16), (2, 21))
#: TensorFlow has Python 3.13 wheels from 2.20 on.
TENSORFLOW_FOR_PYTHON_313 = (2, 20)
#: Set to 1 to use graphdist with a TensorFlow outside TENSORFLOW_RANGE (e.g. a nightly).
ALLOW_ANY_TENSORFLOW_ENV = "GRAPHDIST_ALLOW_ANY_TENSORFLOW"


def _text(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


def python_problem(version_info: tuple[int, ...] | None = None) -> str | None:
    """A one-line reason why this Python is unsupported, or ``None`` when it is supported."""
    major, minor = tuple(version_info or sys.version_info)[:2]
    current = (int(major), int(minor))
    if current < PYTHON_RANGE[0]:
        low, high = (_text(pair) for pair in PYTHON_RANGE)
        return f"graphdist needs Python {low} to {high}; this is Python {_text(current)}."
    return None


def tensorflow_problem(version: str | None = None) -> str | None:
    """A one-line reason why the installed TensorFlow is unsupported, or ``None``.

    ``version`` is a version string (default: the installed ``tensorflow`` distribution's,
    read from its metadata without importing it). No TensorFlow installed is not a problem here:
    ``import graphdist`` does not need it, and the parts that do say so when used.
    """
    if version is None:
        version = installed_version("tensorflow")
        if version is None:  # not installed, or broken metadata: nothing to check
            return None
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return None
    found = (int(match.group(1)), int(match.group(2)))
    low, high = TENSORFLOW_RANGE
    if low <= found <= high:
        return None
    return (
        f"graphdist {__version__} supports TensorFlow {_text(low)} to {_text(high)}; found "
        f"TensorFlow {version}. Install a supported one (pip install "
        f"'tensorflow>={_text(low)},<{high[0]}.{high[1] + 1}'), or set "
        f"{ALLOW_ANY_TENSORFLOW_ENV}=1 to try this one at your own risk."
    )


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None``.

    Read from the name of its ``NAME-VERSION.dist-info`` folder on ``sys.path`` (what pip
    installs), the first one found, as the import system would; only where there is none does
    ``importlib.metadata`` look (eggs, odd layouts): importing it costs 40-50 ms, most of
    ``import graphdist`` otherwise.
    """
    prefix = distribution.lower().replace("-", "_") + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and name.lower().startswith(prefix):
                return name[len(prefix) : -len(".dist-info")]
    try:
        from importlib import metadata

        return metadata.version(distribution)
    except Exception:
        return None


def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` (an ``ImportError``) with a one-line message for an
    unsupported Python or TensorFlow."""
    problem = python_problem()
    if problem is None and os.environ.get(ALLOW_ANY_TENSORFLOW_ENV) != "1":
        problem = tensorflow_problem()
    if problem is not None:
        from graphdist._exceptions import UnsupportedVersionError

        raise UnsupportedVersionError(problem)
