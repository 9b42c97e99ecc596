"""The unit tier's tripwire (``make check``: ``pytest -m "not integration"``, tests/conftest.py).

While a unit-tier test runs, this folder is first on the ``PYTHONPATH`` of every process it
starts, so Python imports this module at start-up in each of them. The first import of
TensorFlow in such a process is written down (a file in ``$GRAPHDIST_UNIT_TIER_RECORDS``: the
test, this pid, its command line), and the conftest fails the test that started it: a test that
starts a process which imports TensorFlow (a fleet's servers, ``graphdist run``, a script) is an
integration test and must say so, or the tier stops being fast without anyone noticing. Then
another ``sitecustomize`` further on the path, if any, runs as it would have."""

from __future__ import annotations

import importlib
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS = "GRAPHDIST_UNIT_TIER_RECORDS"
TEST = "GRAPHDIST_UNIT_TIER_TEST"


class _Tripwire:
    """A meta path finder that finds nothing: it notes the first ``import tensorflow``."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name != "tensorflow" and not name.startswith("tensorflow."):
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        folder = os.environ.get(RECORDS)
        if folder:
            record = {"test": os.environ.get(TEST, "?"), "pid": os.getpid(), "argv": sys.argv}
            try:
                with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
                    json.dump(record, f)
            except OSError:
                pass
        return None


if os.environ.get(RECORDS):
    sys.meta_path.insert(0, _Tripwire())

# another sitecustomize (a distribution's, a virtual environment's) runs as without this one
_me = sys.modules.pop(__name__)
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
finally:
    sys.path[:] = _path
    sys.modules.setdefault(__name__, _me)
