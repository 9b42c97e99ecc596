"""Servers serve their own user (and root) only: loopback is shared by every user of the machine.

The bind shim (``graphdist/_net/loopback.c``) also checks, at ``accept()``, who owns the peer's
socket and closes connections from other users' processes. Here a client run as ``nobody`` tries
to read a root-only file through a server (``tf.io.read_file`` runs in the server, with its
user's rights) and must fail, while the same client run as root succeeds; the servers are a
:class:`LocalFleet`, ``graphdist serve``, a detached fleet and a ``graphdist run`` task. The
accept() loop itself, the IPv6 bind rewrite and the shim's removal from ``LD_PRELOAD`` are tested
on the shim directly, with plain sockets.

These tests need root (to run a process as another user) and ``setpriv``. A checkout, an
interpreter or a virtual environment under a folder others cannot enter (CI's clean clone in a
``mktemp -d`` folder, pyenv under ``/root``) is no obstacle: the clients start as ``nobody``
holding CAP_DAC_READ_SEARCH only (to read the interpreter and its packages) and drop every
capability right after their imports, before they connect; each prints its credentials then,
and the tests check it was uid ``nobody`` with no capability. The shim's refusal is by the
socket owner's uid, which no capability changes. Without root or ``setpriv`` they skip, and as
``promise`` tests that skip fails unless GRAPHDIST_ALLOW_PROMISE_SKIPS=1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import graphdist
from graphdist._net.loopback import loopback_library
from graphdist._ports import pick_free_ports, release_ports
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, is_gone, processes_marked, wait_gone
from tests.nobody import AS_NOBODY, AS_PLAIN_NOBODY, nobody_code

# One worker runs them all: the module's probes of which Python user nobody can run (one imports
# TensorFlow as nobody) then run once, not once on each worker.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.promise,
    pytest.mark.timeout(180),
    pytest.mark.xdist_group("nobody"),
]

CLIENT_TIMEOUT_S = 90.0  # a TensorFlow import alone takes ~10 s on a loaded 2-core machine
OPERATION_TIMEOUT_MS = 5000
SECRET = "graphdist-same-user-secret-" + uuid.uuid4().hex
REFUSED = 3  # the client's exit status when the session failed with a TensorFlow error

# Reads PATH through the server's op on DEVICE; prints the contents or the error's class.
# (TensorFlow without Keras and SciPy, as the host tests' clients: see SPLIT_GRAPH there.)
CLIENT = nobody_code(
    """
    import sys
    from graphdist._proc import lean
    lean.install()
    import tensorflow as tf

    target, device, path, timeout_ms = sys.argv[1:5]
    tf.compat.v1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        data = tf.io.read_file(path)
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(timeout_ms))
    Session, OpError = tf.compat.v1.Session, tf.errors.OpError  # loaded before the drop
    """,
    """
    try:
        with Session(target, graph=graph, config=config) as sess:
            print("READ", sess.run(data).decode(), flush=True)
    except OpError as exc:
        print("REFUSED", type(exc).__name__, exc.message[:500], flush=True)
        sys.exit(3)
    """,
)


# -- who can run what ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Python:
    """An interpreter that ``nobody`` can run, and the environment it needs."""

    executable: str
    env: dict[str, str]


def _candidates() -> Iterator[str]:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    seen = set()
    for path in (
        sys.executable,
        os.path.realpath(sys.executable),
        f"/usr/bin/{version}",
        f"/usr/local/bin/{version}",
        shutil.which(version, path="/usr/local/bin:/usr/bin:/bin"),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"),
    ):
        if path and path not in seen and os.path.exists(path):
            seen.add(path)
            yield path


def _nobody_env() -> dict[str, str]:
    paths = sysconfig.get_paths()
    site = [paths["purelib"], paths["platlib"]]
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/",
        "PYTHONNOUSERSITE": "1",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(site)),
        **QUIET_TF,
    }


def _as_nobody_works(python: str, env: dict[str, str], code: str) -> bool:
    try:
        result = subprocess.run(
            [*AS_NOBODY, python, "-c", code],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and result.stdout.strip() == "ok"


def _require_root_and_setpriv() -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("running a client as another user (nobody) needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot run a client as nobody")


@pytest.fixture(scope="module")
def nobody_python() -> Python:
    """Any Python that nobody can run (clients that only open sockets)."""
    _require_root_and_setpriv()
    env = _nobody_env()
    for python in _candidates():
        if _as_nobody_works(python, env, "print('ok')"):
            return Python(python, env)
    pytest.skip(
        f"user nobody cannot run any Python here, even with CAP_DAC_READ_SEARCH (tried "
        f"{sys.executable}: see `namei -l {sys.executable}`; does setpriv know --ambient-caps?)"
    )


@pytest.fixture(scope="module")
def nobody_tf_python() -> Python:
    """A Python that nobody can run and that imports TensorFlow (this environment's)."""
    _require_root_and_setpriv()
    env = _nobody_env()
    probe = (
        "import sys, tensorflow; "
        f"print('ok' if sys.version_info[:2] == {tuple(sys.version_info[:2])} else 'other')"
    )
    for python in _candidates():
        if _as_nobody_works(python, env, probe):
            return Python(python, env)
    pytest.skip(
        f"user nobody cannot run a Python {sys.version_info.major}.{sys.version_info.minor} that "
        f"imports tensorflow, even with CAP_DAC_READ_SEARCH (tried {sys.executable}: see "
        f"`namei -l {sys.executable}`; does setpriv know --ambient-caps?)"
    )


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "root-only.txt"
    path.write_text(SECRET)
    path.chmod(0o600)
    return str(path)


# -- the clients --------------------------------------------------------------------------------


def _read_through(python: Python, target: str, device: str, path: str) -> dict[str, str]:
    """Run CLIENT as nobody and as root at the same time; returns each one's stdout + stderr,
    after checking their exit status: nobody refused (without the file's contents), root
    reading the file."""
    argv = [python.executable, "-c", CLIENT, target, device, path, str(OPERATION_TIMEOUT_MS)]
    procs = {
        "nobody": subprocess.Popen(
            [*AS_NOBODY, *argv],
            env=python.env,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        "root": subprocess.Popen(
            argv,
            env=python.env,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    }
    outputs = {}
    try:
        for who, proc in procs.items():
            outputs[who] = proc.communicate(timeout=CLIENT_TIMEOUT_S)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs["root"].returncode == 0, outputs["root"]
    assert f"READ {SECRET}" in outputs["root"]
    assert procs["nobody"].returncode == REFUSED, outputs["nobody"]
    assert AS_PLAIN_NOBODY in outputs["nobody"]  # refused as a plain nobody, capabilities gone
    assert SECRET not in outputs["nobody"]
    # Refused at connection time: the channel never works (Unavailable), or the operation times
    # out waiting for one that does (DeadlineExceeded), never a server-side error.
    refusal = outputs["nobody"].split("REFUSED ", 1)[1].split()[0]
    assert refusal in ("UnavailableError", "DeadlineExceededError"), outputs["nobody"]
    return outputs


def _refused_in_log(text: str) -> bool:
    return "graphdist: refused a connection from another user's process" in text


# -- the real servers ---------------------------------------------------------------------------


def test_local_fleet_serves_its_own_user_only(nobody_tf_python, secret_file):
    with graphdist.LocalFleet("local=2") as fleet:
        _read_through(nobody_tf_python, fleet.target("local", 0), "/job:local/task:0", secret_file)
        with open(fleet.tasks[0].log_path, encoding="utf-8", errors="replace") as f:
            assert _refused_in_log(f.read())
        pids = fleet.pids
    assert wait_gone(pids, EVENTUALLY_S) == []


BARE_SERVER = (
    "import sys, tensorflow as tf\n"
    "server = tf.distribute.Server({'local': ['localhost:' + sys.argv[1]]}, 'local', 0)\n"
    "print('ready', flush=True)\n"
    "server.join()\n"
)


def test_without_the_shim_nobody_reads_roots_file(nobody_tf_python, secret_file):
    """The control: the client as nobody is able to read the file through TensorFlow's own
    server (no shim: graphdist's exposed servers keep the same-user rule too), so its refusal
    elsewhere is the shim's doing."""
    (port,) = pick_free_ports(1)
    release_ports([port])
    server = subprocess.Popen(
        [sys.executable, "-c", BARE_SERVER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **QUIET_TF},
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        argv = [nobody_tf_python.executable, "-c", CLIENT, f"grpc://localhost:{port}"]
        argv += ["/job:local/task:0", secret_file, str(OPERATION_TIMEOUT_MS)]
        result = subprocess.run(
            [*AS_NOBODY, *argv],
            env=nobody_tf_python.env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert AS_PLAIN_NOBODY in result.stdout
        assert f"READ {SECRET}" in result.stdout
    finally:
        server.kill()
        server.wait(30)
    assert wait_gone([server.pid], EVENTUALLY_S) == []


def _wait_for_line(proc: subprocess.Popen[str], fragment: str, timeout_s: float) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    line = ""
    while fragment not in line:
        assert time.monotonic() < deadline, f"no {fragment!r} line within {timeout_s} s"
        line = proc.stderr.readline()
        assert line or proc.poll() is None, f"exited ({proc.poll()}) before {fragment!r}"
    return line


def test_graphdist_serve_serves_its_own_user_only(nobody_tf_python, secret_file):
    ports = pick_free_ports(1)
    release_ports(ports)
    cluster = json.dumps({"w": [f"127.0.0.1:{ports[0]}"]})
    serve_argv = [sys.executable, "-m", "graphdist", "serve", "--cluster", cluster]
    serve_argv += ["--job", "w", "--task", "0"]
    proc = subprocess.Popen(
        serve_argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
    )
    try:
        _wait_for_line(proc, "ready at", 90)
        _read_through(
            nobody_tf_python, f"grpc://127.0.0.1:{ports[0]}", "/job:w/task:0", secret_file
        )
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert _refused_in_log(err)
        assert wait_gone([proc.pid], EVENTUALLY_S) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert is_gone(proc.pid)


def _graphdist(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphdist", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **QUIET_TF, **env},
    )


def test_detached_fleet_serves_its_own_user_only(nobody_tf_python, secret_file, state_dir):
    mark = f"same-user-{uuid.uuid4().hex}"
    env = {"GRAPHDIST_TEST_MARK": mark}
    where = ["--state-dir", state_dir]
    up = _graphdist("up", "--detach", "--cluster", "local=2", *where, env=env)
    try:
        assert up.returncode == 0, up.stderr
        status = _graphdist("status", "--json", *where, env=env)
        assert status.returncode == 0, status.stderr
        rows = {(r["job"], r["task"]): r for r in json.loads(status.stdout)}
        target = "grpc://" + rows[("local", 0)]["address"]
        _read_through(nobody_tf_python, target, "/job:local/task:1", secret_file)
        with open(rows[("local", 1)]["log"], encoding="utf-8", errors="replace") as f:
            log = f.read()
        with open(rows[("local", 0)]["log"], encoding="utf-8", errors="replace") as f:
            log += f.read()
        assert _refused_in_log(log)
    finally:
        down = _graphdist("down", *where, env=env)
        assert down.returncode == 0, down.stderr
        assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


# A `graphdist run` task that starts its own server (as the strategies do) and keeps it until
# the test creates the file STOP.
RUN_TASK = textwrap.dedent(
    """
    import json, os, sys, time
    import tensorflow as tf

    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    server = tf.distribute.Server(
        tf.train.ClusterSpec(config["cluster"]), job_name=task["type"],
        task_index=task["index"], protocol="grpc", start=True,
    )
    print("SERVING", server.target, flush=True)
    deadline = time.monotonic() + 150
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    """
)


class _Lines(io.TextIOBase):
    """A text stream that keeps the lines written to it, for run_command's output."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines.extend(done)
        return len(text)


def test_graphdist_run_task_serves_its_own_user_only(nobody_tf_python, secret_file, tmp_path):
    stop = str(tmp_path / "STOP")
    out = _Lines()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["results"] = graphdist.run_command(
                [sys.executable, "-c", RUN_TASK, stop], workers=1, timeout_s=170, output=out
            )
        except BaseException as exc:  # reported by the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        serving = []
        while not serving and time.monotonic() < deadline and thread.is_alive():
            serving = [line for line in list(out.lines) if "SERVING grpc://" in line]
            time.sleep(0.1)
        assert serving, (outcome, out.lines)
        port = serving[0].rsplit(":", 1)[1].strip()
        _read_through(
            nobody_tf_python, f"grpc://127.0.0.1:{port}", "/job:worker/task:0", secret_file
        )
    finally:
        with open(stop, "w"):
            pass
        thread.join(60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome["error"]
    results = outcome["results"]
    assert isinstance(results, list) and [r.exitcode for r in results] == [0]
    assert any(_refused_in_log(line) for line in out.lines), out.lines
    assert wait_gone([r.pid for r in results], EVENTUALLY_S) == []


# -- the shim itself, with plain sockets ----------------------------------------------------------

# A server with the shim: listens on the wildcard of FAMILY, prints where it listens, waits for a
# line on stdin (the clients are connected by then), then accepts until EAGAIN with accept4
# (Python's own) or accept (through ctypes) and prints what each accepted peer sent.
ACCEPTOR = textwrap.dedent(
    """
    import ctypes, errno, json, socket, sys

    family, call = getattr(socket, sys.argv[1]), sys.argv[2]
    srv = socket.socket(family)
    if family == socket.AF_INET6:
        srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    srv.listen(16)
    print(json.dumps(srv.getsockname()[:2]), flush=True)
    sys.stdin.readline()
    srv.setblocking(False)
    libc = ctypes.CDLL(None, use_errno=True)
    got = []
    while True:
        if call == "accept":
            fd = libc.accept(srv.fileno(), None, None)
            if fd < 0:
                got.append(errno.errorcode[ctypes.get_errno()])
                break
            conn = socket.socket(fileno=fd)
        else:
            try:
                conn, _ = srv.accept()
            except BlockingIOError as exc:
                got.append(errno.errorcode[exc.errno])
                break
        conn.settimeout(5)
        got.append(conn.recv(64).decode())
        conn.close()
    print(json.dumps(got), flush=True)
    """
)

# A client: drops its capabilities, connects to HOST PORT from socket family FAMILY, sends NAME,
# then keeps the connection ("open": until the server closes it), closes it ("fin") or resets it
# ("rst"). "lo" is "open" from a socket bound to the loopback device, which the shim's sock_diag
# lookup does not find: it then reads /proc/net/tcp*, so that path is checked too (where
# unprivileged users may bind a device, Linux 5.7+; elsewhere the client says
# "connected-unbound" and is a plain "open").
CONNECTOR = nobody_code(
    """
    import socket, struct, sys
    """,
    """
    family, host, port, name, end = sys.argv[1:6]
    s = socket.socket(getattr(socket, family))
    bound = ""
    if end == "lo":
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        except OSError:
            bound = "-unbound"
    s.connect((host, int(port)))
    s.sendall(name.encode())
    print("connected" + bound, flush=True)
    if end == "rst":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if end in ("open", "lo"):
        s.settimeout(60)
        try:
            s.recv(1)
        except OSError:
            pass
    s.close()
    """,
)


@contextlib.contextmanager
def _acceptor(
    family: str, call: str, bind_addr: str
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    env = {**os.environ, "LD_PRELOAD": loopback_library(), "GRAPHDIST_BIND_ADDR": bind_addr}
    proc = subprocess.Popen(
        [sys.executable, "-c", ACCEPTOR, family, call],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        _host, port = json.loads(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        assert is_gone(proc.pid)


@pytest.mark.parametrize(
    ("server", "bind_addr", "client_family", "host"),
    [
        ("AF_INET", "127.0.0.1", "AF_INET", "127.0.0.1"),
        ("AF_INET6", "127.0.0.1", "AF_INET", "127.0.0.1"),
        ("AF_INET6", "127.0.0.1", "AF_INET6", "::ffff:127.0.0.1"),
        ("AF_INET6", "::1", "AF_INET6", "::1"),
    ],
)
@pytest.mark.parametrize("call", ["accept4", "accept"])
def test_accept_skips_other_users_connections(
    nobody_python, server, bind_addr, client_family, host, call
):
    """Refused connections are invisible: the server gets the root one, then EAGAIN, as if the
    others never came (including a client that sends and closes or resets before the accept)."""
    clients: list[subprocess.Popen[str]] = []
    with _acceptor(server, call, bind_addr) as (proc, port):
        try:
            plan = [
                ("nobody", "open"),
                ("root", "open"),
                ("nobody", "fin"),
                ("nobody", "rst"),
                ("nobody", "lo"),
                ("root", "lo"),
                ("nobody", "open"),
            ]
            for who, end in plan:
                argv = [nobody_python.executable, "-c", CONNECTOR, client_family, host]
                argv += [str(port), f"{who}-{end}", end]
                client = subprocess.Popen(
                    [*AS_NOBODY, *argv] if who == "nobody" else argv,
                    env=nobody_python.env,
                    cwd="/",
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                clients.append(client)
                assert client.stdout is not None
                credentials = client.stdout.readline().strip()
                if who == "nobody":
                    assert credentials == AS_PLAIN_NOBODY, client.communicate(10)
                said = client.stdout.readline().strip()
                assert said.startswith("connected"), client.communicate(10)
            time.sleep(0.2)  # the closing clients' FIN/RST reach the server
            out, err = proc.communicate("go\n", timeout=30)
            assert json.loads(out.splitlines()[-1]) == ["root-open", "root-lo", "EAGAIN"], err
            assert "refused a connection" in err
            for client in clients:  # the refused ones were closed by the server
                client.communicate(timeout=30)
                assert client.returncode == 0
        finally:
            for client in clients:
                if client.poll() is None:
                    client.kill()
                    client.wait()
    assert all(is_gone(c.pid) for c in clients)


def _shimmed(code: str, **env: str) -> dict[str, object]:
    """Run ``code`` (printing one JSON value) in a Python started with the shim preloaded."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    value: dict[str, object] = json.loads(result.stdout)
    return value


BINDS = textwrap.dedent(
    """
    import json, os, socket, subprocess
    six = socket.socket(socket.AF_INET6)
    six.bind(("::", 0))
    four = socket.socket(socket.AF_INET)
    four.bind(("0.0.0.0", 0))
    maps = open("/proc/self/maps").read()
    child = subprocess.run(["cat", "/proc/self/maps"], capture_output=True, text=True).stdout
    print(json.dumps({
        "six": six.getsockname()[0], "four": four.getsockname()[0],
        "preload": os.environ.get("LD_PRELOAD"), "loaded": os.environ["SHIM"] in maps,
        "child_loaded": os.environ["SHIM"] in child,
    }))
    """
)


@pytest.mark.parametrize(
    ("bind_addr", "six", "four"),
    [("::1", "::1", "127.0.0.1"), ("127.0.0.1", "::ffff:127.0.0.1", "127.0.0.1")],
)
def test_wildcard_binds_become_the_loopback_address(bind_addr, six, four):
    shim = os.path.realpath(loopback_library())
    got = _shimmed(BINDS, LD_PRELOAD=shim, GRAPHDIST_BIND_ADDR=bind_addr, SHIM=shim)
    assert (got["six"], got["four"]) == (six, four)


@pytest.mark.parametrize("separator", [":", " "])
def test_shim_leaves_ld_preload_but_keeps_the_users_entries(separator):
    shim = os.path.realpath(loopback_library())
    preload = separator.join(["libm.so.6", shim, "libc.so.6"])
    got = _shimmed(BINDS, LD_PRELOAD=preload, GRAPHDIST_BIND_ADDR="127.0.0.1", SHIM=shim)
    assert got["loaded"] and got["four"] == "127.0.0.1"
    assert got["preload"] == "libm.so.6:libc.so.6"
    assert not got["child_loaded"]  # what the shimmed process starts runs without it
    alone = _shimmed(BINDS, LD_PRELOAD=shim, GRAPHDIST_BIND_ADDR="127.0.0.1", SHIM=shim)
    assert alone["loaded"] and alone["preload"] is None and not alone["child_loaded"]


def test_shim_inherit_keeps_it_for_children():
    shim = os.path.realpath(loopback_library())
    got = _shimmed(
        BINDS,
        LD_PRELOAD=shim,
        GRAPHDIST_BIND_ADDR="127.0.0.1",
        GRAPHDIST_SHIM_INHERIT="1",
        SHIM=shim,
    )
    assert got["preload"] == shim and got["loaded"] and got["child_loaded"]
