"""A Ray run's warm agents (:mod:`graphdist._distribute.nodewarm`'s agent and client, on Ray):
one :class:`AgentActor` per node, a process of a Ray actor pinned to its node (no CPU of its own)
under graphdist's guard tied to the actor, so it ends with the actor however the actor ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from graphdist._distribute.nodewarm import AGENT_CODE, run_cold_because
from graphdist._distribute.warm import READY_TIMEOUT_S
from graphdist._net.policy import NetPolicy

__all__ = ["AgentActor", "RayAgents"]


class AgentActor:
    """A Ray actor on one node: the run's agent there, under a guard started by a thread of the
    actor that lives as long as the agent (the guard's death signal is tied to that thread)."""

    def __init__(self, tag: str, preload: list[str], env: dict[str, str]) -> None:
        self._line: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._said = threading.Event()
        threading.Thread(target=self._run, args=(tag, preload, env), daemon=True).start()

    def _run(self, tag: str, preload: list[str], env: dict[str, str]) -> None:
        from graphdist._proc.process import guarded_argv

        argv = guarded_argv([sys.executable, "-c", AGENT_CODE, tag, *preload], name="warm-agent")
        try:
            self._proc = proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            self._line = f"cold: {exc}"
            self._said.set()
            return
        assert proc.stdout is not None
        self._line = proc.stdout.readline().decode("utf-8", "replace").strip()
        self._said.set()
        proc.wait()
        proc.stdout.close()

    def ready(self, timeout_s: float) -> str:
        """The agent's first line (``ready @NAME``, or why it serves no task), once said."""
        self._said.wait(timeout_s)
        return self._line or ""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


class RayAgents:
    """A Ray run's warm agents: one :class:`AgentActor` per node, started when an attempt first
    places a task there (or again if it ended), kept across attempts, killed with the run."""

    def __init__(self, command: Sequence[str], base_env: Mapping[str, str], preload: Sequence[str]):
        import secrets

        self.command, self.preload = list(command), tuple(preload)
        self.tag = secrets.token_hex(4)
        self.actors: dict[str, Any] = {}  # node id -> its AgentActor
        self.paths: dict[str, str] = {}  # node id -> its agent's socket
        self.why: dict[str, str] = {}  # node id -> why its agent serves no task
        self.cold = run_cold_because(self.command, base_env, self.preload)
        # as a task's on its node (run.py's _CommandActor) in what is read at import
        self.env: dict[str, str] = {}
        if self.cold is None:
            shim = NetPolicy().env("127.0.0.1", base_env.get("LD_PRELOAD"), inherit=True)
            self.env = {**base_env, **shim}

    def why_cold(self, node: str) -> str | None:
        if self.cold is not None:
            return self.cold
        if node not in self.paths:
            return self.why.get(node, f"the warm agent on Ray node {node[:8]} is not running")
        return None

    def ensure(self, nodes: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the agents of ``nodes`` that are not running, and wait for their first line
        (bounded: one that says nothing in time serves no task, which then runs cold)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.cold is not None:
            return
        for node in [n for n in nodes if n in self.actors]:  # up from an earlier attempt?
            try:
                if ray.get(self.actors[node].alive.remote(), timeout=10.0):
                    continue
            except Exception:  # its node was lost, or Ray cannot tell: a new one
                pass
            self._drop(node)
        started = [n for n in dict.fromkeys(nodes) if n not in self.actors]
        actor_class = ray.remote(AgentActor)
        for node in started:
            self.why.pop(node, None)
            self.actors[node] = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                num_cpus=0,
                max_restarts=0,
            ).remote(self.tag, list(self.preload), self.env)
        deadline = time.monotonic() + timeout_s
        for node in started:
            left = max(0.0, deadline - time.monotonic())
            try:
                line = str(ray.get(self.actors[node].ready.remote(left), timeout=left + 10.0))
            except Exception as exc:
                line = f"{type(exc).__name__}"
            if line.startswith("ready "):
                self.paths[node] = line.split(" ", 1)[1]
            else:
                self.why[node] = (
                    f"the warm agent on Ray node {node[:8]} did not start ({line or 'no word'})"
                )

    def _drop(self, node: str) -> None:
        import ray

        self.paths.pop(node, None)
        actor = self.actors.pop(node, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for node in list(self.actors):
            self._drop(node)
