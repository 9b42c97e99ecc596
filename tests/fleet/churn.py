"""A long-lived process, compressed: seeded rounds of random fleet and session operations.

Run by ``test_long_lived.py`` in a subprocess (a crash is then a red test, not a dead worker)::

    python -m tests.fleet.churn SEED ROUNDS

Each round does one operation: start a fleet, open a session, run the seeds' split graph (238),
close a fleet, drop a session (``del`` + ``gc.collect()``, in a reference cycle or not),
restart or kill a task, run steps from a second thread while the main thread runs them too, or
make and call a callable (a round first starts a fleet and opens a session if there is
none). A session's result must be 238 while its fleet runs and none of its
tasks was killed or restarted since it opened; otherwise it must raise a graphdist error
(``TaskFailedError``, ``FleetClosedError``), never anything else. Every 15 rounds everything is
closed and dropped and the process's threads (less the guard's idle helpers) and file
descriptors are counted (a line
``COUNTS threads fds``); every server pid ever started is printed (``PIDS ...``) for the parent
to check they are gone; the last line is ``CHURN OK``.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time
from typing import Any

import tensorflow as tf

import graphdist
from graphdist._fleet import guard

RESULT = 238  # the seeds' split graph: (2 + 300) + (2 - 66)
MAX_FLEETS = 2
CHECKPOINT_EVERY = 15


class Tracked:
    """A session and what the script knows of it: its fleet and the fleet's change count."""

    def __init__(self, fleet: Any, sess: Any, changes: int) -> None:
        self.fleet = fleet
        self.sess = sess
        self.changes = changes


def main(seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(2)
        with tf.device("/job:local/task:0"):
            y2 = x - 66
        with tf.device("/job:local/task:1"):
            y = (x + 300) + y2
    fleets: list[Any] = []
    changes: dict[int, int] = {}  # id(fleet) -> kills and restarts so far
    dead: dict[int, set[int]] = {}  # id(fleet) -> indices of its killed tasks
    sessions: list[Tracked] = []
    pids: set[int] = set()
    counts: list[tuple[int, int]] = []

    def running() -> list[Any]:
        return [f for f in fleets if f.state is graphdist.FleetState.RUNNING]

    def valid(t: Tracked) -> bool:
        fleet = t.fleet
        return (
            fleet.state is graphdist.FleetState.RUNNING
            and changes[id(fleet)] == t.changes
            and not dead[id(fleet)]
        )

    def check(t: Tracked, call: Any) -> None:
        ok = valid(t)
        try:
            value = call()
        except graphdist.GraphdistError as exc:
            if ok:
                raise AssertionError(f"a healthy session failed: {exc!r}") from exc
            return
        if not ok and value == RESULT:
            return  # a kill may not have reached the run yet: a right answer is fine
        assert value == RESULT, value

    def start() -> None:
        if len(running()) >= MAX_FLEETS:
            return close()
        fleet = graphdist.LocalFleet("local=2").start()
        fleets.append(fleet)
        changes[id(fleet)] = 0
        dead[id(fleet)] = set()
        pids.update(fleet.pids)

    def open_session() -> None:
        live = running()
        if not live:
            return start()
        fleet = rng.choice(live)
        master = rng.randrange(2)
        try:
            sess = fleet.session("local", master, graph=graph)
        except graphdist.TaskFailedError:
            assert master in dead[id(fleet)], "a session on a live master was refused"
            return
        sessions.append(Tracked(fleet, sess, changes[id(fleet)]))

    def pick() -> Tracked | None:
        return rng.choice(sessions) if sessions else None

    def run() -> None:
        t = pick()
        if t is None:
            return open_session()
        check(t, lambda: t.sess.run(y))

    def close() -> None:
        if fleets:
            fleet = rng.choice(fleets)
            fleet.close()
            fleets.remove(fleet)

    def drop() -> None:
        t = pick()
        if t is None:
            return
        sessions.remove(t)
        if rng.random() < 0.5:
            cycle: list[Any] = [t]
            cycle.append(cycle)  # collected only by gc.collect()
            del cycle
        del t
        gc.collect()

    def fault(kind: str) -> None:
        live = running()
        if not live:
            return
        fleet = rng.choice(live)
        index = rng.randrange(2)
        getattr(fleet, kind)("local", index)  # fleet.restart or fleet.kill
        changes[id(fleet)] += 1
        if kind == "kill":
            dead[id(fleet)].add(index)
        else:
            dead[id(fleet)].discard(index)
            pids.update(fleet.pids)

    def restart() -> None:
        fault("restart")

    def kill() -> None:
        fault("kill")

    def two_threads() -> None:
        t = pick()
        if t is None:
            return open_session()
        errors: list[BaseException] = []

        def steps() -> None:
            try:
                for _ in range(20):
                    check(t, lambda: t.sess.run(y))
            except BaseException as exc:
                errors.append(exc)

        other = threading.Thread(target=steps)
        other.start()
        steps()
        other.join(120)
        assert not other.is_alive(), "a second thread's steps never ended"
        if errors:
            raise errors[0]

    def callable_() -> None:
        t = pick()
        if t is None:
            return open_session()

        def make_and_call() -> Any:
            return t.sess.make_callable(y)()

        check(t, make_and_call)

    ops = [start, open_session, run, run, close, drop, restart, kill, two_threads, callable_]
    for number in range(1, rounds + 1):
        if not running():
            start()
        if not sessions:
            open_session()
        op = rng.choice(ops)
        print(f"round {number}: {op.__name__}", flush=True)
        op()
        if number % CHECKPOINT_EVERY == 0:
            for fleet in fleets:
                fleet.close()
            fleets.clear()
            sessions.clear()
            gc.collect()
            time.sleep(0.5)  # closes that were handed to threads finish
            gc.collect()
            # Idle helper threads of the guard's pool are kept for reuse (as many as ever ran at
            # once); a busy one now would be a step that never ended.
            busy = threading.active_count() - guard._runner._idle
            counts.append((busy, len(os.listdir("/proc/self/fd"))))
            print("COUNTS", *counts[-1], flush=True)
            if os.environ.get("CHURN_DEBUG"):  # what a count that grew is made of
                print("THREADS", *[t.name for t in threading.enumerate()], flush=True)
    print("PIDS", *sorted(pids), flush=True)
    print("CHURN OK", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
