"""Server processes import TensorFlow without the client libraries it pulls in by itself.

``import tensorflow`` imports Keras eagerly when Keras is installed (``keras.src.optimizers``, for
its SavedModel registrations), and Keras imports scikit-learn, matplotlib and pandas where they are
installed; TensorFlow's own legacy Keras imports SciPy. A TensorFlow *server* runs none of that:
it executes the graphs its clients send, in C++. TensorFlow guards each of these imports
(``except ImportError``), so a server process that refuses them loses nothing and imports
TensorFlow in about half the time with 115 MB less memory (measured with this project's test
environment: 5.4 s -> 2.6 s, 639 -> 523 MB peak RSS; see ``benchmarks/startup.py``).

:func:`install` puts a finder first on ``sys.meta_path`` that answers for :data:`REFUSED`
packages with a spec whose loader raises :class:`ModuleNotFoundError` (a finder that raised
instead would break ``importlib.util.find_spec``, which TensorFlow calls unguarded). It is
installed by a fork server before it imports TensorFlow (this module is its second preload), by
``graphdist serve``, by a RayFleet's server actors (each has its process to itself) and by
``graphdist demo``, whose client only builds and runs a graph; never in a library user's
process, a ``graphdist run`` task or a fleet's owner, which may well need Keras.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

from graphdist._proc.forkserver_exit import IN_FORK_SERVER

__all__ = ["REFUSED", "install"]

#: Top-level packages a server process does not import.
REFUSED = frozenset({"keras", "tf_keras", "scipy"})


class _Refuse(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        raise ModuleNotFoundError(
            f"{spec.name} is not imported in a TensorFlow server process started by graphdist "
            "(servers run graphs, not Keras or SciPy code)",
            name=spec.name,
        )

    def exec_module(self, module: types.ModuleType) -> None:  # never reached
        raise ModuleNotFoundError(module.__name__)


class _RefuseFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in REFUSED:
            return importlib.machinery.ModuleSpec(fullname, _Refuse(), origin=None)
        return None


def install() -> None:
    """Refuse :data:`REFUSED` in this process from now on (idempotent). Call before TensorFlow
    is imported; modules already imported stay."""
    if not any(isinstance(finder, _RefuseFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseFinder())


if IN_FORK_SERVER:  # preloaded by a fork server, before TensorFlow
    install()
