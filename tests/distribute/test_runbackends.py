"""``graphdist run``'s backends by contract: looked up by name, each checking only its own
options, a new one one module that registers itself, and every backend's events the same typed
fields (issue 37, point 5)."""

from __future__ import annotations

import io
import json
import sys
from typing import Any, ClassVar

import pytest

from graphdist._distribute import runbackends
from graphdist._distribute.events import (
    KINDS,
    AttemptStarted,
    Cause,
    Event,
    GaveUp,
    Restarting,
    TaskExited,
)
from graphdist._distribute.launcher import run_command
from graphdist._exceptions import ArgumentError
from graphdist._local.run import LocalRun
from graphdist._ray.run import RayRun

PRINT = "import os; print(os.environ['GRAPHDIST_TASK'], os.environ['GRAPHDIST_COPY'])"


def test_the_built_in_run_backends_are_registered_by_name():
    assert runbackends.names()[:2] == ("local", "ray")
    assert runbackends.run_backend("local") is LocalRun
    assert runbackends.run_backend("ray", check=False) is RayRun
    with pytest.raises(ArgumentError, match="No run backend is named 'nope'; the run backends"):
        runbackends.run_backend("nope")


def test_a_backend_refuses_another_backends_option_before_anything_starts():
    with pytest.raises(ArgumentError, match="address is an option of the ray run backend, not"):
        run_command([sys.executable, "-c", "pass"], address="127.0.0.1:1")
    with pytest.raises(ArgumentError, match="nope is no run backend's"):
        run_command([sys.executable, "-c", "pass"], nope=1)
    with pytest.raises(ArgumentError, match="working_dir must be an existing folder"):
        run_command([sys.executable, "-c", "pass"], backend="ray", working_dir="/no/such/folder")


@pytest.mark.timeout(60)
def test_a_fourth_backend_is_one_class_that_registers_itself(monkeypatch):
    """A backend outside graphdist: registered, found by name, given its own option, and the
    whole loop (events, env, supervision) runs its placement."""
    monkeypatch.setattr(runbackends._registry, "_classes", runbackends._registry.classes())
    from graphdist._registry import Option

    class CopyRun(LocalRun):
        name: ClassVar[str] = "copy"
        summary: ClassVar[str] = "the local backend, with an env of its own"
        options: ClassVar[tuple[Option, ...]] = (Option("tag", "a word for every task"),)
        tls: ClassVar[bool] = False  # a backend that builds no TLS mode says so

        @classmethod
        def check_options(cls, spec: Any, options: Any) -> dict[str, Any]:
            if not isinstance(options.get("tag", ""), str):
                raise ArgumentError("tag must be a word", name="tag", value=options["tag"])
            return dict(options)

        def place(self, attempt: int, signals: Any) -> Any:
            placement = super().place(attempt, signals)
            tag = self.spec.options["tag"]
            plain = placement.task_env
            placement.task_env = lambda task: {**plain(task), "GRAPHDIST_COPY": tag}  # type: ignore[method-assign]
            return placement

    runbackends.register(CopyRun)
    assert runbackends.describe("copy") == "copy: the local backend, with an env of its own"
    with pytest.raises(ArgumentError, match="tag must be a word"):
        run_command([sys.executable, "-c", PRINT], backend="copy", tag=3)
    with pytest.raises(ArgumentError, match="tls is not built for the copy run backend"):
        run_command([sys.executable, "-c", PRINT], backend="copy", tag="hi", tls=True)
    out = io.StringIO()
    results = run_command(
        [sys.executable, "-c", PRINT], backend="copy", tag="hi", output=out, output_format="jsonl"
    )
    assert sorted(r.exitcode for r in results) == [0, 0]
    events = [Event.from_json(line) for line in out.getvalue().splitlines()]
    lines = sorted(e.data["text"] for e in events if e.kind == "line")
    assert lines == ["worker-0 hi", "worker-1 hi"]
    started = next(e.payload for e in events if e.kind == "attempt-started")
    assert isinstance(started, AttemptStarted) and started.backend == "copy"


@pytest.mark.timeout(60)
def test_every_event_of_a_run_is_its_kinds_dataclass():
    """A failing local run's jsonl: every line parses to its kind's payload, with the fields
    every backend emits (the same dataclass for all)."""
    out = io.StringIO()
    with pytest.raises(Exception, match="worker-1 exited with code 3"):
        run_command(
            [
                sys.executable,
                "-c",
                "import os,sys; sys.exit(3 * (os.environ['GRAPHDIST_TASK'] == 'worker-1'))",
            ],
            output=out,
            output_format="jsonl",
        )
    events = [Event.from_json(line) for line in out.getvalue().splitlines()]
    kinds = [e.kind for e in events]
    assert {"attempt-started", "task-exited", "gave-up", "run-ended"} <= set(kinds) <= set(KINDS)
    started = events[kinds.index("attempt-started")].payload
    assert started.backend == "local" and started.tasks == ["worker-0", "worker-1"]
    assert set(started.nodes) == {"worker-0", "worker-1"}
    assert len(started.cluster["worker"]) == 2
    exited = [e.payload for e in events if e.kind == "task-exited"]
    assert all(isinstance(x, TaskExited) and x.ended_at_s is not None for x in exited)
    gave_up = events[kinds.index("gave-up")].payload
    assert isinstance(gave_up, GaveUp) and isinstance(gave_up.cause, Cause)
    assert gave_up.cause.task == "worker-1" and gave_up.cause.exitcode == 3


def test_an_event_with_other_fields_than_its_kinds_is_refused():
    cause = Cause("worker-1", 7, -9, "was killed by SIGKILL", 1.5)
    event = Event.of(Restarting(cause, 0.5, "run", "restart 1 of at most 2"), 2.0, 1)
    back = Event.from_json(event.to_json())
    assert back.payload == Restarting(cause, 0.5, "run", "restart 1 of at most 2")
    row = json.loads(event.to_json())
    del row["scope"]
    with pytest.raises(ValueError, match="a restarting event with other fields"):
        Event.from_json(json.dumps(row))
    row = {"event": "preempted", "at_s": 1, "attempt": 1, "code": 42, "decision": "x", "more": 1}
    with pytest.raises(ValueError, match="a preempted event with other fields"):
        Event.from_json(json.dumps(row))
