"""Ready notices (graphdist._net.ready): a server process tells its owner it serves; the owner's
start probes its servers once all have said so, and never takes a notice for an answer."""

from __future__ import annotations

import gc
import os
import socket
import stat

import pytest

from graphdist._local import fleet as local
from graphdist._net import probe
from graphdist._net.probe import wait_answering
from graphdist._net.ready import ReadyNotices, notify
from tests.conftest import EVENTUALLY_S, wait_gone

pytestmark = pytest.mark.timeout(120)


def test_a_notice_names_its_task_and_its_sender(tmp_path):
    notices = ReadyNotices(str(tmp_path))
    try:
        assert stat.S_IMODE(os.stat(notices.path).st_mode) == 0o600
        assert notices.wait(0) == []
        assert notify(notices.path, "local-1")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"garbage", notices.path)  # no pid: dropped
        assert notify(notices.path, "ps-0")
        assert notices.wait(5.0) == [("local-1", os.getpid()), ("ps-0", os.getpid())]
    finally:
        notices.close()
    assert not os.path.exists(notices.path)  # the socket file goes with it
    assert notices.wait(0) == []  # closed: nothing, never an error
    notices.close()  # twice: harmless


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_notify_never_raises_where_there_is_nobody_to_tell(tmp_path):
    assert notify(None, "local-0") is False  # a spec without a notice socket
    assert notify(str(tmp_path / "gone"), "local-0") is False
    with pytest.raises(ValueError, match="too long"):
        ReadyNotices(str(tmp_path / ("x" * 120)))
    gc.collect()  # the half-made one is dropped without an error of its own (its __del__)


def record_rounds(monkeypatch):
    rounds: list[int] = []
    real = probe.probe_many

    def probe_many(probers, timeout_s=probe.PROBE_TIMEOUT_S):
        rounds.append(len(probers))
        return real(probers, timeout_s)

    monkeypatch.setattr(probe, "probe_many", probe_many)
    return rounds


@pytest.mark.integration
def test_with_notices_the_servers_are_probed_once_all_said_they_serve(graphdist_fleet, monkeypatch):
    live = [t.address for t in graphdist_fleet.tasks]
    rounds = record_rounds(monkeypatch)
    calls = iter([[], [0], [], [1]])  # server 0 says it serves, later server 1

    def hints(wait_s):
        return next(calls, [])

    assert wait_answering(live, 30.0, hints=hints, fallback_s=30.0) is None
    assert rounds == [2]  # no probe before both said so, then one round of both


@pytest.mark.integration
def test_without_notices_the_fallback_rounds_still_find_the_servers(graphdist_fleet, monkeypatch):
    live = [t.address for t in graphdist_fleet.tasks]
    rounds = record_rounds(monkeypatch)
    assert wait_answering(live, 30.0, hints=lambda wait_s: [], fallback_s=0.2) is None
    assert rounds == [2]  # the round after 0.2 s: nobody said anything, both answered


def test_a_notice_is_never_taken_for_an_answer(monkeypatch):
    rounds = record_rounds(monkeypatch)
    with socket.socket() as silent:  # bound, never listening: refused
        silent.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{silent.getsockname()[1]}"
        outcome = wait_answering([refused], 0.5, hints=lambda wait_s: [0], fallback_s=10.0)
    assert outcome is not None and outcome.answered == 0
    assert outcome.last_error and outcome.last_error.startswith("UNAVAILABLE")
    assert rounds[0] == 1  # probed because it said it serves; silent all the same


@pytest.mark.integration
def test_a_start_finds_its_servers_by_their_notices(graphdist_fleet_factory, monkeypatch):
    heard: list[tuple[str, int]] = []
    real = ReadyNotices.wait

    def wait(self, timeout_s):
        got = real(self, timeout_s)
        heard.extend(got)
        return got

    monkeypatch.setattr(ReadyNotices, "wait", wait)
    fleet = graphdist_fleet_factory("local=3")
    assert sorted(heard) == sorted((ft.name, ft.pid) for ft in fleet.tasks)
    path = fleet._notices.path
    fleet.close()
    assert not os.path.exists(path)
    assert wait_gone([ft.pid for ft in fleet.tasks], EVENTUALLY_S) == []


@pytest.mark.integration
def test_a_start_without_a_notice_socket_still_starts(graphdist_fleet_factory, monkeypatch):
    monkeypatch.setattr(local, "ready_notices", lambda: None)
    fleet = graphdist_fleet_factory("local=2")
    assert fleet._notices is None
    assert all(h.ok for h in fleet.health())
    fleet.close()
    assert wait_gone([ft.pid for ft in fleet.tasks], EVENTUALLY_S) == []


def test_a_notice_from_a_process_a_task_no_longer_has_is_not_its_own():
    class Task:
        pid = 41

        def forked(self):
            return self.pid is not None

    task = Task()
    assert local.pid_may_be(task, 41)
    assert not local.pid_may_be(task, 40)  # the process it had before a restart
    task.pid = None
    assert local.pid_may_be(task, 40)  # its pid is still to come: any may be


@pytest.mark.timeout(10)
def test_a_start_takes_no_hint_from_a_notice_whose_pid_its_task_no_longer_has(tmp_path):
    """The start's own hints (LocalFleet._wait_ready, with a stand-in for the fleet and its
    probes): a notice naming a task but sent by a process that task no longer has (its process
    before a restart) is no hint; its current pid's is, and any pid is while the task's pid is
    still to come. Red if the start stopped checking the pid (or pid_may_be always said yes)."""

    class Task:
        def __init__(self, name, pid):
            self.name, self.pid = name, pid

        def forked(self):
            return self.pid is not None

    class Fleet:
        def __init__(self, notices):
            self._notices, self.hints = notices, None

        def _confirm_started(self, ft):
            pass

        def _wait_answering(self, pending, timeout_s, *, each_round, may_answer, hints):
            self.hints = hints

    notices = ReadyNotices(str(tmp_path))
    try:
        fleet = Fleet(notices)
        pending = [Task("local-0", 41), Task("local-1", None)]
        local.LocalFleet._wait_ready(fleet, pending, 5.0)
        assert fleet.hints is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"local-0 40", notices.path)  # local-0's process before a restart
            raw.sendto(b"local-1 7", notices.path)  # local-1's pid is not read yet: may be
            raw.sendto(b"ps-0 41", notices.path)  # no such task in this start
        assert fleet.hints(5.0) == [1]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"local-0 41", notices.path)
        assert fleet.hints(5.0) == [0]
    finally:
        notices.close()
