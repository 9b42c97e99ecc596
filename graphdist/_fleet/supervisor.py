"""The small process that owns a detached fleet (``graphdist up --detach``).

It runs in its own session (so the terminal's Ctrl-C does not reach it), starts a
:class:`LocalFleet` whose logs live in the state folder, records the fleet in ``fleet.json`` and
waits for SIGTERM/SIGINT/SIGHUP; then it stops the fleet and removes ``fleet.json``. Because the
servers watch their owner, killing the supervisor outright still takes every server down.

Run as ``python -m graphdist._fleet.supervisor --state-dir DIR --cluster JSON [--start-timeout S]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import psutil

from graphdist._cluster import Cluster
from graphdist._exceptions import GraphdistError
from graphdist._fleet.local import LocalFleet
from graphdist._fleet.signals import stop_on_signals
from graphdist._fleet.state import (
    STATE_FILE,
    FleetRecord,
    ProcessRef,
    TaskRecord,
    write_error,
    write_state,
)

log = logging.getLogger("graphdist.supervisor")
RESTART_POLICIES = ("no", "on-failure")
DEFAULT_MAX_RESTARTS = 3
MONITOR_INTERVAL_S = 0.5


def _record(fleet: LocalFleet, started_at: float, policy: str) -> FleetRecord:
    tasks = []
    for t in fleet.tasks:
        if t.pid is None:
            continue
        try:
            ref = ProcessRef.of(t.pid)
        except psutil.Error:
            ref = ProcessRef(t.pid, 0.0)  # already gone: recorded, and seen as not alive
        tasks.append(TaskRecord(t.job, t.index, t.address, t.pid, ref.create_time, t.log_path))
    return FleetRecord(
        supervisor=ProcessRef.of(os.getpid()),
        cluster=fleet.cluster.as_dict(),
        tasks=tasks,
        started_at=started_at,
        restart_policy=policy,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphdist-supervisor")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--cluster", required=True, help="cluster as JSON text")
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--expose", action="store_true")
    parser.add_argument("--restart", choices=RESTART_POLICIES, default="no")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    stop = stop_on_signals()
    state_dir = args.state_dir
    try:
        fleet = LocalFleet(
            Cluster.parse(args.cluster),
            start_timeout_s=args.start_timeout,
            log_dir=os.path.join(state_dir, "logs"),
            expose=args.expose,
        ).start()
    except GraphdistError as exc:
        write_error(state_dir, type(exc).__name__, str(exc))
        return 1
    except Exception as exc:  # an unexpected failure must still reach the waiting CLI
        write_error(state_dir, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        raise
    try:
        started_at = time.time()
        write_state(state_dir, _record(fleet, started_at, args.restart))
        log.info("fleet ready: %r (restart policy %s)", fleet, args.restart)
        given_up: set[str] = set()
        while not stop.wait(MONITOR_INTERVAL_S):
            if args.restart != "on-failure":
                continue
            for task in fleet.dead_tasks():
                if task.restarts >= args.max_restarts:
                    if task.name not in given_up:
                        given_up.add(task.name)
                        log.error(
                            "%r died %d times; not restarting it again", task, task.restarts + 1
                        )
                    continue
                log.warning("%r died (exit code %s); restarting it", task, task.exitcode)
                try:
                    fleet.restart(task.job, task.index)
                except GraphdistError as exc:
                    log.error("restart of %s failed: %s", task.name, exc)
                write_state(state_dir, _record(fleet, started_at, args.restart))
        log.info("got a stop signal; stopping the fleet")
    finally:
        fleet.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(state_dir, STATE_FILE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
