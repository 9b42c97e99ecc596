"""The ``graphdist`` console script: Ctrl-C while the command is still importing ends it with
one line, as it does later, not with a traceback."""

from __future__ import annotations

import contextlib
import sys


def main() -> int:
    try:
        from graphdist._cli.main import main as run
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # a stderr gone too: the status says it
            print("Error: interrupted", file=sys.stderr)
        return 130
    return run()
