"""The small process that owns a detached fleet (``graphdist up --detach``).

It runs in its own session (so the terminal's Ctrl-C does not reach it), starts a
:class:`LocalFleet` whose logs live in the state folder, records the fleet in ``fleet.json`` and
waits for SIGTERM/SIGINT/SIGHUP; then it stops the fleet and removes ``fleet.json``. Because the
servers watch their owner, killing the supervisor outright still takes every server down.

Run as ``python -m graphdist._supervisor --state-dir DIR --cluster JSON [--start-timeout S]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time

from graphdist._cluster import Cluster
from graphdist._exceptions import GraphdistError
from graphdist._fleet import LocalFleet
from graphdist._state import (
    STATE_FILE,
    FleetRecord,
    ProcessRef,
    TaskRecord,
    write_error,
    write_state,
)

log = logging.getLogger("graphdist.supervisor")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphdist-supervisor")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--cluster", required=True, help="cluster as JSON text")
    parser.add_argument("--start-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    state_dir = args.state_dir
    try:
        fleet = LocalFleet(
            Cluster.parse(args.cluster),
            start_timeout_s=args.start_timeout,
            log_dir=os.path.join(state_dir, "logs"),
        ).start()
    except GraphdistError as exc:
        write_error(state_dir, type(exc).__name__, str(exc))
        return 1
    except Exception as exc:  # an unexpected failure must still reach the waiting CLI
        write_error(state_dir, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        raise
    try:
        write_state(
            state_dir,
            FleetRecord(
                supervisor=ProcessRef.of(os.getpid()),
                cluster=fleet.cluster.as_dict(),
                tasks=[
                    TaskRecord(
                        t.job,
                        t.index,
                        t.address,
                        t.pid,
                        ProcessRef.of(t.pid).create_time,
                        t.log_path,
                    )
                    for t in fleet.tasks
                    if t.pid is not None
                ],
                started_at=time.time(),
            ),
        )
        log.info("fleet ready: %r", fleet)
        sig = signal.sigwait(_STOP_SIGNALS)
        log.info("got signal %d; stopping the fleet", sig)
    finally:
        fleet.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(state_dir, STATE_FILE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
