"""Automatic ports never collide, even when many processes pick them at the same moment."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from graphdist import _ports as ports
from graphdist._exceptions import NoFreePortsError
from graphdist._ports import is_port_free, pick_free_ports, release_ports
from graphdist._private import runtime_dir
from tests.conftest import REPO, start_python, wait_gone

FLEETS = 8


def test_reserved_ports_are_not_handed_out_twice():
    first = pick_free_ports(20)
    second = pick_free_ports(20)
    try:
        assert len(set(first) | set(second)) == 40
        assert all(is_port_free(p) for p in first + second)
    finally:
        release_ports(first + second)


# Process B: tries to reserve exactly port P (argv[1]) while process A holds it, both through
# the internal reserve and through pick_free_ports with a random draw that always gives P;
# then, once A says on stdin that it let go, picks P again the same way.
ALWAYS_P = textwrap.dedent(
    """
    import json, sys
    from graphdist._exceptions import NoFreePortsError
    from graphdist import _ports as ports

    port = int(sys.argv[1])

    class AlwaysP:
        def randint(self, low, high):
            return port

    ports.random.SystemRandom = AlwaysP
    held = {"reserve": ports._reserve(port)}
    try:
        held["pick"] = ports.pick_free_ports(1)
    except NoFreePortsError:
        held["pick"] = "refused"
    print(json.dumps(held), flush=True)
    sys.stdin.readline()  # A released P
    print(json.dumps({"pick": ports.pick_free_ports(1)}), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_port_another_process_holds_is_refused_until_it_lets_go():
    # Deterministic: B draws exactly the port A holds (a shared lock would let it through).
    (port,) = pick_free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-c", ALWAYS_P, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"process B said nothing: {proc.communicate(timeout=30)[1]}")
        assert json.loads(line) == {"reserve": False, "pick": "refused"}
        release_ports([port])
        out, err = proc.communicate("released\n", timeout=30)
        assert proc.returncode == 0, err
        assert json.loads(out) == {"pick": [port]}
    finally:
        release_ports([port])
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert wait_gone([proc.pid], 10) == []


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_eight_fleets_started_at_once_by_eight_processes_all_come_up(tmp_path):
    go = tmp_path / "go"
    code = textwrap.dedent(
        f"""
        import json, os, time, graphdist
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        with graphdist.LocalFleet("local=2", start_timeout_s=180) as fleet:
            print(json.dumps([t.address for t in fleet.tasks]), flush=True)
        """
    )
    procs = [start_python("-c", code) for _ in range(FLEETS)]
    try:
        time.sleep(0.5)  # let every process reach the starting line
        go.touch()
        outputs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * FLEETS, [err[-500:] for _, err in outputs]
    addresses = [a for out, _ in outputs for a in json.loads(out)]
    assert len(addresses) == 2 * FLEETS
    assert len(set(addresses)) == 2 * FLEETS


# -- the reservation machinery, unit by unit (what mutation testing found unpinned: make mutants,
# docs/mutants.md). A lock held "by another process" is a second open file of the same lock:
# flock refuses it to the first file's holder too, so no child process is needed. ------------------


def _one_port() -> int:
    """A port that is free now, not reserved by this process."""
    (port,) = _free_ports(1)
    return port


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now, not reserved by this process."""
    picked = pick_free_ports(n)
    release_ports(picked)
    return picked


def _lock_path(port: int) -> str:
    return ports._lock_path(port)


def _foreign_lock(port: int, text: str) -> int:
    """Hold ``port``'s lock through a file of its own, with ``text`` written in it."""
    fd = os.open(_lock_path(port), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    return fd


def _lockable(port: int) -> bool:
    """Nobody holds ``port``'s lock: no lock file (released ones are removed), or one unlocked."""
    try:
        fd = os.open(_lock_path(port), os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, int]]:
    """A socket listening on every interface, on a port that was free."""
    sock = socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET)
    sock.bind(("", _one_port()))
    sock.listen()
    try:
        yield sock, sock.getsockname()[1]
    finally:
        sock.close()


def test_the_candidates_lie_below_the_ephemeral_range(monkeypatch):
    read: list[str] = []

    def fake_open(text):
        def opener(path, *args, **kwargs):
            read.append(path)
            return io.StringIO(text)

        return opener

    for text, expected in [
        ("32768\t60999\n", (10000, 32767)),
        ("12001 60999", (10000, 12000)),
        ("12000 60999", ports._FALLBACK_RANGE),  # too little room below it
        ("garbage", ports._FALLBACK_RANGE),
    ]:
        monkeypatch.setattr(ports, "open", fake_open(text), raising=False)
        assert ports._candidate_range() == expected, text
    assert set(read) == {"/proc/sys/net/ipv4/ip_local_port_range"}

    def unreadable(path, *args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    monkeypatch.setattr(ports, "open", unreadable, raising=False)
    assert ports._candidate_range() == (20000, 32000)


def test_the_lock_folder_is_the_users_private_ports_folder(monkeypatch):
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(ports, "private_dir", lambda path, what: asked.append((path, what)) or path)
    assert ports._lock_dir() == os.path.join(runtime_dir(), "ports")
    assert asked == [(os.path.join(runtime_dir(), "ports"), "graphdist's port-lock folder")]


def test_a_reservation_is_a_private_lock_file_naming_its_holder_removed_when_released():
    port = _one_port()
    fd, holder = ports._lock_file(port, "picked")
    try:
        assert fd is not None and holder == (None, None)
        info = os.stat(_lock_path(port))
        assert stat.S_IMODE(info.st_mode) == 0o600
        with open(_lock_path(port)) as f:
            assert f.read() == f"{os.getpid()} picked\n"
        assert ports._lock_file(port, "picked") == (None, (os.getpid(), "picked"))
    finally:
        ports._unlock(fd, port)
    assert not os.path.lexists(_lock_path(port))  # nothing accumulates, one file per port picked


def test_picking_and_releasing_ports_leaves_no_lock_file():
    picked = pick_free_ports(5)
    assert all(os.path.exists(_lock_path(p)) for p in picked)
    release_ports(picked)
    assert not [p for p in picked if os.path.lexists(_lock_path(p))]


def test_a_lock_on_a_file_its_holder_removed_meanwhile_is_not_the_ports_lock(monkeypatch):
    """The race the removal opens: this process opens the lock file, its holder releases it
    (removes it) and another locks a new file at that path, then this process's flock succeeds
    on the removed one. It must not take that for the port's lock: two holders of one port."""
    port = _one_port()
    first, _ = ports._lock_file(port, "picked")
    assert first is not None
    real_flock = fcntl.flock
    other: list[int] = []
    monkeypatch.setattr(ports.fcntl, "flock", real_flock)  # undone first, whatever happens

    def flock_after_a_release(fd, op):
        if not other:  # between this open and this flock: released, and locked anew elsewhere
            other.append(-1)
            ports._unlock(first, port)
            new = os.open(_lock_path(port), os.O_CREAT | os.O_RDWR, 0o600)
            other.append(new)
            real_flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(new, f"{os.getpid()} starting\n".encode(), 0)
        return real_flock(fd, op)

    monkeypatch.setattr(ports.fcntl, "flock", flock_after_a_release)
    try:
        assert ports._lock_file(port, "starting") == (None, (os.getpid(), "starting"))
    finally:
        monkeypatch.undo()
        for fd in other[1:]:
            ports._unlock(fd, port)


def test_a_lock_whose_holder_wrote_nothing_is_read_briefly_then_named_nobody():
    port = _one_port()
    fd = _foreign_lock(port, "")
    try:
        start = time.monotonic()
        assert ports._lock_file(port, "picked") == (None, (None, None))
        assert time.monotonic() - start < 1.0  # 20 reads 1 ms apart, not seconds
    finally:
        ports._unlock(fd, port)


@pytest.mark.parametrize(
    ("text", "holder"),
    [
        ("", (None, None)),
        ("garbage picked", (None, None)),
        ("0 picked", (None, None)),
        ("-5 picked", (None, None)),
        ("999999999 picked", (None, None)),  # no such process
        ("{pid}", ("{pid}", None)),
        ("{pid} starting\n", ("{pid}", "starting")),
        ("1 picked", (1, "picked")),  # init is a live process (a container's first one)
    ],
)
def test_what_a_holder_wrote_is_read_only_for_a_live_process(tmp_path, text, holder):
    pid = str(os.getpid())
    path = tmp_path / "lock"
    path.write_text(text.format(pid=pid))
    fd = os.open(path, os.O_RDONLY)
    try:
        expected = tuple(int(pid) if h == "{pid}" else h for h in holder)
        assert ports._written(fd) == expected
    finally:
        os.close(fd)


def test_marking_and_unlocking_a_file_that_cannot_be_written_is_no_error(tmp_path):
    path = tmp_path / "lock"
    path.write_text("1 picked\n")
    fd = os.open(path, os.O_RDONLY)
    ports._mark(fd, "picked")  # ftruncate fails on a read-only file: only the holder's name lost
    ports._unlock(fd, 1)  # and closes it (a file that is not port 1's lock stays)
    assert path.exists()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_port_held_or_claimed_here_is_never_reserved_again(monkeypatch):
    (port,) = pick_free_ports(1)
    try:
        assert not ports._reserve(port)

        class AlwaysP:
            def randint(self, low, high):
                return port

        monkeypatch.setattr(ports.random, "SystemRandom", AlwaysP)
        with pytest.raises(NoFreePortsError) as info:
            pick_free_ports(1)
        low, high = ports._candidate_range()
        assert str(info.value) == (
            f"Could not find 1 free ports in {low}-{high} after 2000 tries; ask for fewer tasks, "
            "or name the ports in the cluster spec"
        )
        assert (info.value.count, info.value.low, info.value.high) == (1, low, high)
    finally:
        release_ports([port])


def test_a_port_in_use_is_not_reserved_and_its_lock_is_given_back(listener):
    _sock, port = listener
    assert not is_port_free(port)
    assert not ports._reserve(port)
    assert port not in ports._held and _lockable(port)
    assert ports.port_holder(port) == os.getpid()
    assert ports.port_holder(_one_port()) is None


def test_a_failing_check_gives_the_lock_back(monkeypatch):
    port = _one_port()

    def broken(port):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(ports, "is_port_free", broken)
    with pytest.raises(OSError):
        ports._reserve(port)
    assert port not in ports._held and _lockable(port)


def test_running_out_of_lock_files_midway_releases_what_was_reserved(monkeypatch):
    real = ports._reserve
    got: list[int] = []

    def reserve(port):
        if got:
            raise OSError(errno.EMFILE, "Too many open files")
        reserved = real(port)
        if reserved:
            got.append(port)
        return reserved

    monkeypatch.setattr(ports, "_reserve", reserve)
    with pytest.raises(NoFreePortsError) as info:
        pick_free_ports(3)
    low, high = ports._candidate_range()
    assert str(info.value) == (
        "Could not reserve 3 free ports: after 1, Too many open files; ask for fewer tasks, raise "
        "the open-file limit (ulimit -n), or name the ports in the cluster spec"
    )
    assert (info.value.count, info.value.low, info.value.high) == (3, low, high)
    assert got and got[0] not in ports._held and _lockable(got[0])


class _Family:
    """socket.socket as a machine without one address family, or whose bind fails, sees it."""

    def __init__(self, real, refuse: dict[int, int], bind_errors: dict[int, int]) -> None:
        self.real, self.refuse, self.bind_errors = real, refuse, bind_errors

    def __call__(self, family, *args):
        if family in self.refuse:
            raise OSError(self.refuse[family], "refused")
        if family in self.bind_errors:
            return _Unbindable(self.bind_errors[family])
        return self.real(family, *args)


class _Unbindable:
    def __init__(self, error: int) -> None:
        self.error = error

    def setsockopt(self, *args: object) -> None:
        pass

    def bind(self, address: object) -> None:
        raise OSError(self.error, "bind")

    def close(self) -> None:
        pass


@pytest.mark.skipif(not socket.has_ipv6, reason="needs IPv6")
def test_a_missing_family_is_skipped_and_a_missing_address_is_no_conflict(monkeypatch, listener):
    _sock, busy = listener  # listening on IPv6 (and v4-mapped IPv4)
    free = _one_port()
    real = socket.socket
    v4, v6 = socket.AF_INET, socket.AF_INET6
    monkeypatch.setattr(socket, "socket", _Family(real, {v4: errno.EAFNOSUPPORT}, {}))
    assert not is_port_free(busy)  # the IPv6 check still runs after the missing IPv4
    assert is_port_free(free)
    monkeypatch.setattr(socket, "socket", _Family(real, {v4: errno.EMFILE}, {}))
    with pytest.raises(OSError):
        is_port_free(free)  # out of file descriptors: not checked, not free
    monkeypatch.setattr(socket, "socket", _Family(real, {}, {v6: errno.EADDRNOTAVAIL}))
    assert is_port_free(free)  # no IPv6 address here: nothing can conflict there
    monkeypatch.setattr(socket, "socket", _Family(real, {}, {v4: errno.EACCES}))
    assert not is_port_free(free)
    monkeypatch.setattr(socket, "socket", _Family(real, {}, {v4: errno.EINVAL}))
    with pytest.raises(OSError):
        is_port_free(free)


def test_a_claim_takes_over_this_processs_reservation_and_locks_any_other_port():
    a, b = object(), object()
    fresh, picked = _free_ports(2)
    assert ports._reserve(picked)  # as pick_free_ports does
    try:
        assert ports.claim_ports([fresh, picked, fresh], a) is None
        assert ports._claims[fresh] == (a, "locked") and ports._claims[picked] == (a, "held")
        for port in (fresh, picked):
            with open(_lock_path(port)) as f:
                assert f.read() == f"{os.getpid()} starting\n"
        assert ports.claim_ports([picked], a) is None  # its own claim: nothing to do
        assert ports.claim_ports([picked], b) == ports.PortTaken(picked, os.getpid(), True)
        release_ports([fresh], owner=b)  # another fleet's claim: left to it
        assert ports._claims[fresh][0] is a
        ports.release_claims(a)  # a failed start: the lock it took is given back, the rest kept
        assert fresh not in ports._claims and fresh not in ports._held and _lockable(fresh)
        assert picked not in ports._claims and picked in ports._held
        with open(_lock_path(picked)) as f:
            assert f.read() == f"{os.getpid()} picked\n"
        assert ports.claim_ports([picked], b) is None
        release_ports([picked], owner=b)
        assert picked not in ports._held and _lockable(picked)
    finally:
        release_ports([fresh, picked], owner=a)
        release_ports([fresh, picked], owner=b)


def test_a_claim_refuses_a_port_in_use_or_another_fleets_start_and_keeps_nothing(listener):
    _sock, busy = listener
    owner = object()
    free = _one_port()
    assert ports.claim_ports([free, busy], owner) == ports.PortTaken(busy, os.getpid(), False)
    assert free not in ports._claims and busy not in ports._claims and _lockable(free)
    starting = _one_port()
    fd = _foreign_lock(starting, f"{os.getpid()} starting\n")
    try:
        assert ports.claim_ports([starting], owner) == ports.PortTaken(starting, os.getpid(), True)
        assert starting not in ports._claims
    finally:
        ports._unlock(fd, starting)


def test_a_port_another_process_only_picked_is_this_fleets_to_serve():
    owner = object()
    port = _one_port()
    fd = _foreign_lock(port, f"{os.getpid()} picked\n")  # a parent that picked it for us
    try:
        assert ports.claim_ports([port], owner) is None
        assert ports._claims[port] == (owner, "handed") and port not in ports._held
        ports.release_claims(owner)
        assert port not in ports._claims
        assert not _lockable(port)  # still the other process's
    finally:
        ports._unlock(fd, port)


def test_a_garbled_kind_still_names_the_holder(tmp_path):
    path = tmp_path / "lock"
    path.write_bytes(f"{os.getpid()} pi\xffcked\n".encode("latin-1"))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert ports._written(fd) == (os.getpid(), "pi\ufffdcked")
    finally:
        os.close(fd)


def test_a_new_lock_file_is_private(tmp_path, monkeypatch):
    folder = tmp_path / "ports"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(ports, "_lock_dir", lambda: str(folder))
    fd, _holder = ports._lock_file(4242, "picked")
    try:
        assert stat.S_IMODE(os.stat(folder / "4242.lock").st_mode) == 0o600
    finally:
        assert fd is not None
        ports._unlock(fd, 4242)


def test_a_picked_port_is_marked_picked_and_a_release_drops_only_the_owners_claims():
    (port,) = pick_free_ports(1)
    try:
        with open(_lock_path(port)) as f:
            assert f.read() == f"{os.getpid()} picked\n"
    finally:
        release_ports([port])
    a, b = object(), object()
    theirs, mine = _free_ports(2)
    try:
        assert ports.claim_ports([theirs], b) is None
        assert ports.claim_ports([mine], a) is None
        release_ports([theirs, mine], owner=a)  # theirs first: skipped, and mine still released
        assert mine not in ports._claims and mine not in ports._held and _lockable(mine)
        assert ports._claims[theirs][0] is b
    finally:
        release_ports([theirs, mine], owner=a)
        release_ports([theirs, mine], owner=b)


def test_a_claim_that_fails_midway_keeps_nothing_and_raises(monkeypatch):
    owner = object()
    first, second = sorted(_free_ports(2))
    checked: list[int] = []

    def check(port):
        checked.append(port)
        if len(checked) > 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return True

    monkeypatch.setattr(ports, "is_port_free", check)
    with pytest.raises(OSError):
        ports.claim_ports([second, first], owner)
    assert checked == [first, second]  # in increasing order
    assert first not in ports._claims and second not in ports._claims
    assert _lockable(first) and _lockable(second)


def test_a_processs_first_pick_removes_lock_files_nobody_holds_and_keeps_held_ones(
    tmp_path, monkeypatch
):
    """Issue 57: a holder killed (or gone without releasing) leaves its lock file; they piled
    up in the ports folder by the thousand. The first pick of a process removes those nobody
    holds; a held one (another open file's lock: another process's, as far as flock goes)
    stays, and so does what is not a port's lock file."""
    monkeypatch.setattr(ports, "_lock_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ports, "_swept", False)
    stale = [tmp_path / f"{port}.lock" for port in (20001, 20003)]
    for path in stale:
        path.write_text("999999 picked\n")  # its holder is gone: no lock on it
    held = _foreign_lock(20002, f"{os.getpid()} starting\n")
    (tmp_path / "notes.txt").write_text("not a lock")
    monkeypatch.setattr(ports, "SWEEP_ABOVE", 2)  # the folder is "full" at 3 files here
    try:
        picked = pick_free_ports(1)
        release_ports(picked)
        assert not any(path.exists() for path in stale)
        assert (tmp_path / "20002.lock").exists() and (tmp_path / "notes.txt").exists()
        (tmp_path / "20005.lock").write_text("")  # once per process: a later pick sweeps not
        release_ports(pick_free_ports(1))
        assert (tmp_path / "20005.lock").exists()
    finally:
        os.close(held)
