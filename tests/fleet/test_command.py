"""The engine-free halves' decisions over a fake engine, in process (issue 53 point 1, issue 54's
fast tier): where a fleet's and a run's tasks go when nodes are lost, what a lost node or a
memory kill makes of a task's end, and what the engine is asked. The end-to-end proof is
tests/distribute/test_engines.py (a real engine by entry point) and tests/slurm/."""

from __future__ import annotations

import io
import signal
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from graphdist._cluster import Task
from graphdist._distribute.commandrun import _StepPlacement, _StepTask, run_for
from graphdist._distribute.runspec import RunSpec
from graphdist._exceptions import ArgumentError, ClusterSpecError, LaunchError
from graphdist._failures import DEAD, NOT_ANSWERING
from graphdist._fleet.command import CommandFleet, fleet_for
from graphdist._registry import Option


class FakeEngine:
    """Two nodes; ``LOST`` says which are lost; records what it is asked."""

    name: ClassVar[str] = "fake"
    summary: ClassVar[str] = "a fake engine"
    requires: ClassVar[tuple[str, str] | None] = None
    options: ClassVar[tuple[Option, ...]] = (Option("zone", "a word"),)
    node_word: ClassVar[str] = "fake node"
    DEFAULT_START_TIMEOUT_S: ClassVar[float] = 30.0
    tls: ClassVar[bool] = True
    more_nodes: ClassVar[str] = "ask for more fake nodes"
    LOST: ClassVar[dict[str, str]] = {}
    kill_wait_s = 0.5

    def __init__(self) -> None:
        self.asked: list[tuple[Any, ...]] = []

    @classmethod
    def join(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> FakeEngine:
        if options.get("zone", "z") == "bad":
            raise ArgumentError("zone bad", name="zone", value="bad")
        return cls()

    def describe(self) -> str:
        return "fake pair"

    def addresses(self) -> Mapping[str, str]:
        return {"a": "10.0.0.1", "b": "10.0.0.2"}

    def lost(self, nodes: Sequence[str]) -> dict[str, str]:
        return {n: why for n, why in self.LOST.items() if n in nodes}

    def free_ports(self, per_node: Mapping[str, int], tag: str) -> dict[str, list[int]]:
        self.asked.append(("free_ports", dict(per_node)))
        return {node: [7000 + i for i in range(count)] for node, count in per_node.items()}

    def command(
        self, node: str, step: str, argv: Sequence[str], *, stdin: bool, grace_s: float
    ) -> list[str]:
        return ["on", node, step, *argv]

    def signal(self, step: str, sig: int, local: Any) -> None:
        self.asked.append(("signal", step, sig))

    def cancel(self, prefix: str, lost: Collection[str] = ()) -> list[str]:
        self.asked.append(("cancel", prefix))
        return []

    def lost_line(self, line: bytes) -> str | None:
        return line.decode().strip() if line.startswith(b"node gone") else None

    def out_of_memory(self, line: bytes) -> str | None:
        return "out of memory (fake)" if line.startswith(b"OOM") else None


@pytest.fixture(autouse=True)
def no_lost_nodes(monkeypatch):
    monkeypatch.setattr(FakeEngine, "LOST", {})


def test_an_engines_fleet_and_run_classes_take_its_declarations():
    fleet, run = fleet_for(FakeEngine), run_for(FakeEngine)
    assert fleet_for(FakeEngine) is fleet and issubclass(fleet, CommandFleet)
    assert (fleet.backend_name, fleet.summary, fleet.DEFAULT_START_TIMEOUT_S) == (
        "fake",
        "a fake engine",
        30.0,
    )
    assert [o.name for o in fleet.options] == ["zone"]
    assert [o.name for o in run.options] == ["zone", "ntasks_per_node", "preload"]
    assert (run.name, run.tls) == ("fake", True)


def test_a_fleet_goes_round_the_nodes_alive_and_asks_the_engine_for_ports():
    FakeEngine.LOST = {"b": "down"}
    fleet = fleet_for(FakeEngine)("worker=2,ps=1")
    assert fleet.real_cluster.as_dict() == {
        "ps": ["10.0.0.1:7000"],
        "worker": ["10.0.0.1:7001", "10.0.0.1:7002"],
    }
    FakeEngine.LOST = {}
    fleet = fleet_for(FakeEngine)("worker=3")
    assert fleet.real_cluster.as_dict() == {
        "worker": ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.1:7001"]
    }
    assert fleet.engine.asked == [("free_ports", {"a": 2, "b": 1})]


def test_a_fleet_refuses_when_every_node_is_lost_or_a_host_is_no_node():
    FakeEngine.LOST = {"a": "down", "b": "its daemon refuses"}
    with pytest.raises(ClusterSpecError, match="Every node of fake pair is down"):
        fleet_for(FakeEngine)("worker=1")
    FakeEngine.LOST = {}
    with pytest.raises(ClusterSpecError, match=r"10\.9\.9\.9:1, which is not a node of fake pair"):
        fleet_for(FakeEngine)({"local": ["10.9.9.9:1"]})
    with pytest.raises(TypeError, match="unexpected keyword 'zoen'"):
        fleet_for(FakeEngine)("worker=1", zoen="x")
    with pytest.raises(ArgumentError, match="zone bad"):
        fleet_for(FakeEngine)("worker=1", zone="bad")


def test_a_fleets_server_is_the_engines_command_line_of_graphdist_serve():
    fleet = fleet_for(FakeEngine)({"local": ["10.0.0.2:7100"]}, step_prefix="p-")
    fleet._launch = lambda: None  # type: ignore[method-assign]
    from graphdist._fleet.command import CommandTask

    task = CommandTask(fleet.cluster.task("local", 0), "b", "p-local-0", "/dev/null", fleet.engine)
    argv = fleet._serve_argv(task)
    assert argv[:3] == ["on", "b", "p-local-0"]
    assert argv[3:7] == [sys.executable, "-m", "graphdist", "serve"]
    assert "--allow" in argv  # members only: the engine's nodes and this host


def test_a_failed_task_on_a_lost_node_is_dead_and_names_the_node_and_its_tasks():
    fleet = fleet_for(FakeEngine)("worker=2")
    from graphdist._fleet.command import CommandTask

    for i, node in enumerate(["a", "b"]):
        task = fleet.cluster.task("worker", i)
        fleet._tasks[("worker", i)] = CommandTask(task, node, f"s-{i}", "/dev/null", fleet.engine)
    one = fleet._tasks[("worker", 1)]
    assert fleet._explain(one, NOT_ANSWERING, "no answer") == (
        NOT_ANSWERING,
        "no answer; on fake node b",
    )
    FakeEngine.LOST = {"b": "its daemon refuses"}
    assert fleet._explain(one, NOT_ANSWERING, "no answer") == (
        DEAD,
        "fake node b is lost (its daemon refuses); tasks on it: worker-1",
    )


def _spec(**options: Any) -> RunSpec:
    spec = RunSpec.check(
        [sys.executable, "-c", "pass"], workers=3, output=io.StringIO(), backend="fake"
    )
    return spec.with_options(run_for(FakeEngine).check_options(spec, options))


def test_a_run_that_does_not_fit_the_engines_nodes_is_refused_before_anything_starts():
    with pytest.raises(ArgumentError, match=r"needs 3 task.*ask for more fake nodes"):
        _spec()
    spec = _spec(ntasks_per_node=2, preload="none")
    assert isinstance(spec.options["engine"], FakeEngine)


class _NoAgents:
    preload = ()

    def ensure(self, nodes: Sequence[str]) -> None:
        self.nodes = list(nodes)

    def why_cold(self, node: str) -> str:
        return "no agent here"


def test_an_attempt_goes_on_the_nodes_alive_or_ends_the_run_when_too_few_are_left():
    spec = _spec(ntasks_per_node=2, preload="none")
    engine = spec.options["engine"]
    placed = _StepPlacement(spec, engine, 1, "t", _NoAgents())  # type: ignore[arg-type]
    assert placed.nodes == {"worker-0": "a", "worker-1": "b", "worker-2": "a"}
    FakeEngine.LOST = {"a": "down"}
    with pytest.raises(LaunchError, match=r"Attempt 2 cannot be placed.*lost: a \(down\)"):
        _StepPlacement(spec, engine, 2, "t", _NoAgents())  # type: ignore[arg-type]


class _Sink:
    """A run's side of a task: its lines and events kept (RunSink)."""

    def __init__(self) -> None:
        import time

        self.started = time.monotonic()
        self.lines: list[str] = []
        self.events: list[Any] = []

    def line(self, task: str, text: str) -> None:
        self.lines.append(text)

    def emit(self, payload: Any, task: str | None = None) -> Any:
        self.events.append(payload)

    def progress(self, task: str, record: Any) -> None:
        self.events.append(record)


@pytest.mark.parametrize(
    ("script", "code", "lost", "oom"),
    [
        ("print('node gone: n1', flush=True)", -signal.SIGKILL, "node gone: n1", None),
        ("import sys; print('OOM', flush=True); sys.exit(1)", 1, None, "out of memory (fake)"),
        ("import os; os.kill(os.getpid(), 9)", -signal.SIGKILL, None, None),
        ("import sys; sys.exit(137)", -signal.SIGKILL, None, None),  # a guard's word: 128 + 9
        ("import sys; sys.exit(3)", 3, None, None),
    ],
)
def test_a_steps_end_is_read_from_the_engines_lines_and_its_exit_status(script, code, lost, oom):
    """srun says a node failed and exits 0: the task was killed with its node. Its memory line
    names the kill. An exit status 128+N is signal N (srun's and the guards' way to say it)."""
    engine = FakeEngine()
    task = Task("worker", 0, "10.0.0.1:7000")
    proc = _StepTask(
        task,
        [sys.executable, "-c", script],
        {"PATH": "/usr/bin:/bin"},
        _Sink(),  # type: ignore[arg-type]
        None,
        engine=engine,  # type: ignore[arg-type]
        step="s-worker-0",
    )
    proc.proc.wait(30)
    assert proc.ended() == code
    assert (proc.result.lost, proc.result.oom) == (lost, oom)
