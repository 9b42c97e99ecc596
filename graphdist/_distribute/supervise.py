"""The attempts of a run and their supervision, for every run backend.

:func:`run_attempts` loops over attempts until one succeeds or the restart policy gives up:
each :func:`attempt` asks the backend to place it (:mod:`graphdist._distribute.runbackends`),
tells it (``attempt-started``), starts a parameter-server run's servers, then one process per
command task with its environment and log, and supervises them (:func:`supervise`) until every
one exits 0. Nothing here knows a backend: the placement starts what runs where.

- **The policy decides** (:mod:`graphdist._proc.restarts`): the loop, the ps-worker restarts
  (:func:`check_servers`) and the detached supervisor only act on its decisions.
- **Events tell** (:mod:`graphdist._distribute.events`): :class:`RunState` renders each for the
  console, records it in the log folder and, with ``--output-format jsonl``, prints it.
- **The heartbeat finds frozen tasks** (:mod:`graphdist._distribute.heartbeat`): a frozen
  command task is killed and fails as a killed one; a frozen server is killed, then handled
  as a dead one.
- **A broken attempt stops at once** (:func:`stop_broken`); a stop someone asked for (a signal,
  the deadline, the run's end, a preemption) keeps the grace.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from graphdist._distribute.events import (
    AttemptStarted,
    GaveUp,
    Preempted,
    PreemptionNotice,
    Restarting,
    Stopping,
    TaskExited,
)
from graphdist._distribute.heartbeat import Heartbeat
from graphdist._distribute.runstate import RunState
from graphdist._distribute.taskproc import (
    TaskProcess,
    TaskResult,
    describe,
    unfixable_error,
)
from graphdist._exceptions import (
    GraphdistError,
    LaunchError,
    TaskExitError,
)
from graphdist._failures import how_ended
from graphdist._proc.process import NOW_SIGNAL, TASK_STOP_GRACE_S, stop_all
from graphdist._proc.restarts import Decision
from graphdist._proc.signals import Interrupted, SignalScope
from graphdist._verdicts import TaskEnd, restart_cause

if TYPE_CHECKING:
    from graphdist._distribute.runbackends import RunBackend, ServerGroup

__all__ = ["PREEMPTION_WAIT_S", "RunState", "attempt", "run_attempts", "supervise"]

#: Seconds the other tasks get to exit with the preemption code once one has (they save a
#: checkpoint at a step they agree on first); past it, the first one's exit is a failure.
PREEMPTION_WAIT_S = 30.0

#: Seconds the launcher waits, once a task failed, for the news of its peers' ends before it
#: names the cause: which exit reaches the launcher first is a race it cannot see (two srun
#: steps on Slurm, under load: CI, 2026-12-05), so the cause is decided by a rule over the ends
#: recorded where they happened (graphdist._verdicts.restart_cause), never by that order.
CAUSE_WINDOW_S = 1.0


def _stop(procs: Sequence[TaskProcess], grace_s: float) -> None:
    stop_all(procs, grace_s)


def stop_broken(procs: Sequence[TaskProcess]) -> None:
    """Stop an attempt that a failed or frozen task broke, at once: its survivors cannot go on
    (a MultiWorkerMirroredStrategy collective without one of its workers) and some ignore SIGTERM
    (MWMS installs its own handler), so a grace period would only delay the restart. Each guard
    is told to end its tree with SIGKILL (:data:`graphdist._proc.process.NOW_SIGNAL`); the usual
    escalation follows for a guard that does not. A stop someone asked for (a signal, the
    timeout, the run's end) keeps the grace."""
    for proc in procs:
        if proc.running():
            proc.signal(NOW_SIGNAL)
    _stop(procs, TASK_STOP_GRACE_S)


#: Seconds a task gets to end after a Ctrl-C (SIGINT, passed on to its tree as a terminal would
#: pass it) before its guard kills it: a user's Ctrl-C ends a run within about 2 s, where a
#: MultiWorkerMirroredStrategy task, which ignores SIGTERM, sat out the whole grace before. A
#: SIGTERM or SIGHUP (a preemption, a service manager) keeps the grace: a checkpoint to save.
INTERRUPT_GRACE_S = 1.0


def _stop_grace_s(procs: Sequence[TaskProcess]) -> float:
    """The grace a stop gives the tasks: the longest a task asks for (``stop_grace_s``: a Slurm
    step gets Slurm's KillWait to save a checkpoint), at least TASK_STOP_GRACE_S."""
    return max([TASK_STOP_GRACE_S, *(getattr(p, "stop_grace_s", 0.0) for p in procs)])


def stop_interrupted(
    procs: Sequence[TaskProcess], signals: SignalScope, run: RunState, signum: int
) -> None:
    """A stop signal came: said at once (``stopping``) and every task still running told. A
    SIGINT (a user's Ctrl-C) goes on to each task's tree; those not ended after
    :data:`INTERRUPT_GRACE_S`, or at once at a second signal, are killed (NOW_SIGNAL). SIGTERM
    and SIGHUP keep the grace (:func:`end_tasks` stops the tasks with it)."""
    live = [p for p in procs if p.running()]
    interrupt = signum == signal.SIGINT
    name = signal.Signals(signum).name
    run.fallout.broke("Ctrl-C" if interrupt else name)  # what the tasks print now is its fall
    grace = INTERRUPT_GRACE_S if interrupt else _stop_grace_s(procs)
    run.emit(Stopping(name, [p.result.name for p in live], grace, again=interrupt))
    if not interrupt:
        return
    for proc in live:
        proc.signal(signal.SIGINT)
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while live and time.monotonic() < deadline and len(signals.received) < 2:
        time.sleep(0.02)  # a second signal's handler runs here (or ran already): no more wait
        live = [p for p in live if p.running()]
    for proc in live:
        proc.signal(NOW_SIGNAL)


class _Preempted(Exception):
    """Every command task of an attempt exited with the preemption code."""

    def __init__(self, code: int, results: Sequence[TaskResult]) -> None:
        super().__init__(code)
        self.code = code
        self.results = list(results)


def run_attempts(
    backend: RunBackend, procs: list[TaskProcess], signals: SignalScope, run: RunState
) -> list[TaskResult]:
    """The attempts of a run, until one succeeds or the restart policy gives up; ``procs``
    holds the attempt's command tasks as they start (for the caller's stop on a signal)."""
    policy = run.policy
    run.procs = procs  # its readers look at them: a death is known at once
    signals.deadline = run.deadline  # what the backends' own waits may take (SignalScope.budget)
    while True:
        procs.clear()
        try:
            results = attempt(backend, procs, signals, run)
        except _Preempted as exc:
            decision = policy.failed(preempted=True)
            run.emit(Preempted(exc.code, decision.words()))
            policy.restarted(decision)
            run.attempt += 1
            continue
        except TaskExitError as exc:
            ended_at = getattr(exc, "ended_at_s", time.monotonic() - run.started)
            cause = run.cause(exc.failed, ended_at)
            gone = _gone(backend)
            if gone is not None:  # no attempt can be placed: no restart is spent on one
                run.emit(GaveUp(cause, "gone", gone))
                run.end(f"failed: {gone}", show=True)
                raise LaunchError(f"{gone}; the run ends here", exc.results) from None
            decision = policy.failed(
                error=unfixable_error(exc.failed.tail), oom=getattr(exc.failed, "oom", None)
            )
            if not decision.restart:
                reason = decision.reason if policy.max_restarts else "failed"
                run.emit(GaveUp(cause, reason, decision.words()))
                if not policy.max_restarts:
                    run.end("failed", show=run.logs is not None)
                    raise
                run.end("failed", show=True)
                gave_up = f" in attempt {run.attempt}; {decision.words()}"
                if decision.reason == "budget":
                    hint = "; raise max_restarts or restart_window_s to allow more"
                elif decision.error is not None or decision.oom is not None:  # it says what
                    hint = ""
                else:
                    hint = "; read its last lines, or raise min_uptime_s if its start takes longer"
                said = describe(exc.failed, gave_up + hint, run.spec.command)
                raise TaskExitError(
                    f"Task {said}\n  the other tasks were stopped",
                    exc.results,
                    exc.failed,
                ) from None
            run.emit(Restarting(cause, decision.wait_s, "run", decision.words()))
            try:
                run.backoff(decision.wait_s, signals, f"the run after attempt {run.attempt} failed")
            except Interrupted as stop:  # no task runs: said all the same
                stop_interrupted([], signals, run, stop.signum)
                raise
            policy.restarted(decision)
            run.attempt += 1
            continue
        ran = [r.name for r in results]
        run.end("every task exited 0", show=run.attempt > 1 or run.logs is not None, ran=ran)
        return results


def _gone(backend: RunBackend) -> str | None:
    """What the backend says is gone for good (Ray's head, and its cluster with it), if
    anything: a backend may have ``gone()``; one that has not never is."""
    gone = getattr(backend, "gone", None)
    return None if gone is None else gone()


def attempt(
    backend: RunBackend, procs: list[TaskProcess], signals: SignalScope, run: RunState
) -> list[TaskResult]:
    """One attempt of a run: placed by the backend, its servers (a ps run's), one process per
    command task (appended to ``procs``), supervised until every one exits. Its ports,
    processes and files are all given back when it ends, however it ends."""
    from graphdist._distribute.tfconfig import tf_config

    spec = run.spec
    try:
        placement = backend.place(run.attempt, signals)
    except GraphdistError:  # its waits end by the run's deadline: then the run timed out
        _raise_past_deadline(run, f"placing attempt {run.attempt}")
        raise
    servers: ServerGroup | None = None
    results: list[TaskResult] = []
    try:
        cluster = placement.cluster
        served = spec.served
        runners = [t for t in cluster if t.job not in served]
        run.emit(
            AttemptStarted(
                tasks=[t.name for t in runners],
                servers=[t.name for t in cluster if t.job in served],
                restarts=run.attempt - 1,
                backend=spec.backend,
                nodes=dict(placement.nodes),
                cluster=cluster.as_dict(),
            )
        )
        folder = None if run.logs is None else run.logs.attempt(run.attempt)
        if served:
            try:
                servers = placement.start_servers(served, folder, signals)
            except GraphdistError:
                _raise_past_deadline(run, "starting the servers")
                raise
        for task in runners:
            signals.check()
            env = {
                **spec.base_env,
                **placement.task_env(task),
                "TF_CONFIG": tf_config(cluster, task.job, task.index).to_json(),
                "GRAPHDIST_TASK": task.name,
                "GRAPHDIST_RESTART": str(run.attempt - 1),
            }
            log_path = None if folder is None else os.path.join(folder, f"{task.name}.log")
            procs.append(placement.start_task(task, env, run, log_path))
        run.policy.started()
        _prepare_next(placement, procs, run)  # while this attempt runs: off a restart's path
        return supervise(procs, signals, run, servers)
    except (TaskExitError, _Preempted):  # a restart may follow: what it needs, made now
        _prepare_next(placement, procs, run)
        raise
    except Interrupted as exc:
        stop_interrupted(procs, signals, run, exc.signum)
        raise
    finally:  # no signal interrupts this: it is deferred to the end of the scope
        results = end_tasks(procs, run)
        if servers is not None:
            servers.close()
            for server in servers.tasks:
                run.emit(
                    TaskExited(
                        server.pid, server.exitcode, how_ended(server.exitcode), server=True
                    ),
                    server.name,
                )
        placement.close()
        if run.logs is not None:
            run.logs.record_exits(run.attempt, exit_rows(results, servers))


def _raise_past_deadline(run: RunState, doing: str) -> None:
    """Raise the run's timeout (from the error being handled) where the run's deadline has
    passed: a placement or server start whose wait the deadline cut short failed by it."""
    deadline = run.deadline
    if deadline is not None and time.monotonic() >= deadline - 0.05:
        raise run.timed_out([], doing)


def _prepare_next(placement: Any, procs: Sequence[TaskProcess], run: RunState) -> None:
    """Have the placement ready the next attempt's tasks (``prepare_next``, where it has one:
    the local backend's spare guards), where the policy may restart."""
    prepare_next = getattr(placement, "prepare_next", None)
    if prepare_next is not None and run.policy.max_restarts:
        prepare_next(len(procs))


def end_tasks(procs: Sequence[TaskProcess], run: RunState) -> list[TaskResult]:
    """The end of an attempt's command tasks, whatever ended it: those still running stopped
    (with the grace a task asks for, ``stop_grace_s``: a Slurm step gets Slurm's KillWait to
    save a checkpoint), every one finished, and its exit told (``task-exited``)."""
    _stop([p for p in procs if p.running()], _stop_grace_s(procs))
    results = [proc.finish() for proc in procs]
    for proc in procs:
        result = proc.result
        run.emit(
            TaskExited(
                result.pid,
                result.exitcode,
                how_ended(result.exitcode),
                ended_at_s=round(proc.ended_at_s(), 3),
            ),
            result.name,
        )
    return results


def exit_rows(results: Sequence[TaskResult], servers: ServerGroup | None) -> list[dict[str, Any]]:
    """How every task of an attempt ended, for the log folder's ``exits.json``."""
    tasks: list[Any] = [*results, *([] if servers is None else servers.tasks)]
    return [
        {"task": t.name, "pid": t.pid, "exitcode": t.exitcode, "how": how_ended(t.exitcode)}
        for t in tasks
    ]


def _heartbeat(
    procs: Sequence[TaskProcess], run: RunState, fleet: ServerGroup | None
) -> Heartbeat | None:
    """The attempt's heartbeat (None when the run has none): every command task at its
    TF_CONFIG address, and a ps run's servers."""
    if run.heartbeat_s is None:
        return None
    heartbeat = Heartbeat(run.heartbeat_s)
    for proc in procs:
        heartbeat.watch(proc.result.name, proc.result.task.address, proc.processes)
    for server in [] if fleet is None else fleet.tasks:
        heartbeat.watch(server.name, server.address, _server_processes(fleet, server))
    return heartbeat


def _server_processes(fleet: ServerGroup | None, server: Any) -> Callable[[], list[int] | None]:
    """What the heartbeat may know of ``server``'s processes: its pid, on this machine; None
    (its server's answers alone tell) where the pid is on another one (a Slurm node's: a
    process of the same pid here says nothing of it)."""
    if fleet is None or not fleet.pids_here:
        return lambda: None
    return lambda: [server.pid] if server.pid is not None and server.alive else []


def supervise(
    procs: list[TaskProcess],
    signals: SignalScope,
    run: RunState,
    fleet: ServerGroup | None = None,
) -> list[TaskResult]:
    """Wait for every task to exit 0; stop the others when one fails or the time is up. With a
    fleet of ps/worker servers and restarts allowed: a dead worker is restarted on its address
    (within the restart budget: the coordinator carries on), a dead ps task fails the attempt
    (the next one starts the ps tasks and the coordinator again, which resumes). A task that
    exits with the preemption code waits for the others to do the same (a preemption). A task
    the heartbeat finds frozen is killed, and counts as failed."""
    heartbeat = _heartbeat(procs, run, fleet)
    try:
        return _watch(procs, signals, run, fleet, heartbeat)
    finally:
        if heartbeat is not None:
            heartbeat.close()


def _kill(procs: Sequence[TaskProcess], why: Mapping[str, str], reason: str) -> None:
    """Kill the command tasks named in ``why`` (SIGKILL reaches a stopped process; its guard may
    be stopped too) and remember why on their result's ``reason`` field: ``frozen`` (the
    heartbeat's), or ``straggler`` (``--restart-stragglers``). Their end is then the attempt's
    cause, and the restart resumes from the last backup."""
    for proc in procs:
        said = why.get(proc.result.name)
        if said is not None and getattr(proc.result, reason) is None and proc.ended() is None:
            setattr(proc.result, reason, said)
            proc.signal(signal.SIGKILL)


def _watch(
    procs: list[TaskProcess],
    signals: SignalScope,
    run: RunState,
    fleet: ServerGroup | None,
    heartbeat: Heartbeat | None,
) -> list[TaskResult]:
    deadline = run.deadline
    while True:
        notice = signals.take_notice()
        if notice is not None:
            _forward_notice(procs, notice, run)
        frozen = {} if heartbeat is None else heartbeat.frozen()
        if fleet is not None:
            killed = _kill_frozen_servers(fleet, frozen)
            if run.policy.max_restarts:  # else as TensorFlow has it: the coordinator carries
                try:  # on without a worker
                    check_servers(fleet, signals, run, heartbeat, killed)
                except TaskExitError:
                    run.fallout.broke()  # a server's death: known now
                    stop_broken(procs)
                    raise
        _kill(procs, frozen, "frozen")
        _kill(procs, run.take_stragglers(), "straggler")
        codes = [p.ended() for p in procs]
        failed = next((p for p, c in zip(procs, codes, strict=True) if c not in (None, 0)), None)
        if failed is not None:
            code = failed.ended()
            if (
                code is not None
                and code == run.preemption_code
                and _all_preempted(procs, signals, run)
            ):
                _stop(procs, TASK_STOP_GRACE_S)
                raise _Preempted(code, [p.finish() for p in procs])
            run.fallout.broke(at=run.death_at(procs))  # what the others print is their fall
            failed = _cause(procs, signals)
            ended_at = failed.ended_at_s()
            stop_broken(procs)  # the failed one's guard may still be ending its tree
            results = [p.finish() for p in procs]
            said = describe(failed.result, command=run.spec.command)
            error = TaskExitError(
                f"Task {said}\n  the other tasks were stopped",
                results,
                failed.result,
            )
            error.ended_at_s = ended_at  # type: ignore[attr-defined]
            raise error
        if all(c == 0 for c in codes):
            _stop(procs, TASK_STOP_GRACE_S)  # the guards end what the commands left behind
            return [p.finish() for p in procs]
        if deadline is not None and time.monotonic() > deadline:
            running = [p.result.name for p, c in zip(procs, codes, strict=True) if c is None]
            _stop(procs, TASK_STOP_GRACE_S)
            raise run.timed_out([p.finish() for p in procs], f"still running: {', '.join(running)}")
        with signals.interruptible():
            _nap(procs, 0.05)


def _nap(procs: Sequence[TaskProcess], seconds: float) -> None:
    """Wait up to ``seconds``, waking at once when a task's guard reports (``report_fd``, where
    a backend's task has one): its command ended, so the attempt is broken from that moment
    (:class:`graphdist._distribute.fallout.Fallout`), not up to a poll later."""
    fds = [fd for p in procs if (fd := getattr(p, "report_fd", None)) is not None]
    if fds:
        select.select(fds, [], [], seconds)
    else:
        time.sleep(seconds)


def _end(proc: TaskProcess) -> TaskEnd:
    """A task's end as the rule reads it: when it ended where it ran, how, and whether it was
    killed as frozen or lost with its node."""
    result = proc.result
    return TaskEnd(
        result.name,
        proc.ended_at_s(),
        proc.ended(),
        frozen=getattr(result, "frozen", None) is not None
        or getattr(result, "straggler", None) is not None,
        lost=getattr(result, "lost", None) is not None,
        oom=getattr(result, "oom", None) is not None,
    )


def _cause(procs: Sequence[TaskProcess], signals: SignalScope) -> TaskProcess:
    """The task that broke the attempt, of those that failed: once every task ended, or
    :data:`CAUSE_WINDOW_S` after the first failure was seen, by the rule over their recorded
    ends (:func:`graphdist._verdicts.restart_cause`)."""
    deadline = time.monotonic() + CAUSE_WINDOW_S
    while time.monotonic() < deadline and any(p.ended() is None for p in procs):
        with signals.interruptible():
            time.sleep(0.05)
    failed = {p.result.name: p for p in procs if p.ended() not in (None, 0)}
    return failed[restart_cause([_end(p) for p in failed.values()]).name]


def _forward_notice(procs: Sequence[TaskProcess], notice: int, run: RunState) -> None:
    """A preemption notice (Slurm's warning signal): SIGTERM to every task still running, as
    TensorFlow's ``PreemptionCheckpointHandler`` expects it (it saves at a step the workers
    agree on and exits with the preemption code: a preemption, restarted at once)."""
    running = [p for p in procs if p.running()]
    run.emit(PreemptionNotice(signal.Signals(notice).name, [p.result.name for p in running]))
    for proc in running:
        proc.preempt()


def _all_preempted(procs: Sequence[TaskProcess], signals: SignalScope, run: RunState) -> bool:
    """Whether every task exits with the preemption code, waiting up to PREEMPTION_WAIT_S (and
    the run's deadline) for the others to save their checkpoint and exit."""
    wait_until = time.monotonic() + PREEMPTION_WAIT_S
    if run.deadline is not None:
        wait_until = min(wait_until, run.deadline)
    while True:
        codes = [p.ended() for p in procs]
        if any(c is not None and c != run.preemption_code for c in codes):
            return False
        if all(c == run.preemption_code for c in codes):
            return True
        if time.monotonic() > wait_until:
            return False
        with signals.interruptible():
            time.sleep(0.05)


def _kill_frozen_servers(fleet: ServerGroup, frozen: Mapping[str, str]) -> dict[str, str]:
    """Kill a ps run's frozen servers: a dead one is what the coordinator and the restarts
    know how to handle (a frozen one holds the coordinator's steps until their timeout).
    ``{server: why}`` for those killed now."""
    killed = {}
    for server in fleet.tasks:
        if server.name in frozen and server.alive:
            killed[server.name] = frozen[server.name]
            fleet.kill(server.job, server.index)
    return killed


def check_servers(
    fleet: ServerGroup,
    signals: SignalScope,
    run: RunState,
    heartbeat: Heartbeat | None = None,
    frozen: Mapping[str, str] | None = None,
) -> None:
    """A parameter-server run's dead servers: restart a worker on its address (the coordinator
    re-schedules its work and uses it again once back) while the policy allows; a dead ps task,
    or a worker beyond the budget, fails the attempt (TaskExitError). ``frozen``: the servers
    just killed because they were frozen, and why."""
    frozen = frozen or {}
    for server in fleet.dead_tasks():
        result = TaskResult(server.task, pid=server.pid, exitcode=server.exitcode)
        result.tail = server.log_tail()
        result.frozen = frozen.get(server.name)
        decision: Decision | None = None
        if server.job == "worker":
            decision = run.policy.failed(what=f"the server of {server.name}", startup=False)
        if decision is None or not decision.restart:
            why = (
                " (its server)"
                if server.job == "worker"
                else " (its server: its variables are lost)"
            )
            raise TaskExitError(
                f"Task {describe(result, why)}\n  the other tasks were stopped",
                [result],
                result,
            )
        cause = run.cause(result, time.monotonic() - run.started)
        run.emit(Restarting(cause, decision.wait_s, "server", decision.words()))
        run.backoff(decision.wait_s, signals, f"the server of {server.name}")
        fleet.restart(server.job, server.index)
        if heartbeat is not None:
            heartbeat.watch(server.name, server.address, _server_processes(fleet, server))
        run.policy.restarted(decision)
