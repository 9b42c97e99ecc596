"""Runs one task of :func:`graphdist.run_function`:
``python -m graphdist._distribute.taskfn PAYLOAD DIR``.

Loads ``(fn, args, kwargs)`` from the dill file PAYLOAD, calls it, and writes the return value to
``DIR/<task>.pkl`` (the task name comes from ``GRAPHDIST_TASK``). An exception propagates, so the
task exits non-zero with its traceback in its output.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    import dill

    payload, out_dir = argv
    with open(payload, "rb") as f:
        fn, args, kwargs = dill.load(f)
    value = fn(*args, **kwargs)
    with open(os.path.join(out_dir, f"{os.environ['GRAPHDIST_TASK']}.pkl"), "wb") as f:
        dill.dump(value, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
