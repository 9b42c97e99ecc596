"""TLS mode on real hosts: ``graphdist serve --tls`` on two hosts of a bed of network namespaces
(tests/hostbed.py), clients on the third host, which is no member of the cluster by address.

What TLS mode promises (graphdist/_net/gateway.py): no TensorFlow server listens on a host
address; the gateways let in only holders of the cluster's credentials, from any machine; every
byte between hosts is encrypted; other users of a member host get in neither at its address nor
on loopback; a killed server is named with its host.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import QUIET_TF, on_loopback
from tests.net.test_hosts import SPLIT_GRAPH, Served
from tests.nobody import AS_NOBODY, AS_PLAIN_NOBODY, nobody_code

pytestmark = [pytest.mark.promise]

SECRET = "graphdist-wire-secret-7f3a"

# A client of the served cluster on a host, one JSON line per step. argv: the cluster file, the
# credentials folder ("" for none), then optionally "then-kill PID".
CLIENT = (
    SPLIT_GRAPH
    + r"""
with graph.as_default():
    with tf.device("/job:local/task:1"):
        secret = tf.strings.join([tf.constant("SECRET"), tf.as_string(y2)])
    with tf.device("/job:local/task:0"):
        moved = tf.strings.length(tf.identity(secret))
t = time.monotonic()
try:
    fleet = graphdist.connect(sys.argv[1], timeout_s=8, tls=sys.argv[2] or None)
except graphdist.GraphdistError as exc:
    say(step="connect", error=type(exc).__name__, text=str(exc), seconds=time.monotonic() - t)
    sys.exit(0)
with fleet, fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
    say(step="run", result=int(sess.run(y)), moved=int(sess.run(moved)))
    if len(sys.argv) > 4:
        os.kill(int(sys.argv[4]), signal.SIGKILL)
        t = time.monotonic()
        try:
            sess.run(y)
            say(step="again", error=None)
        except graphdist.GraphdistError as exc:
            say(step="again", error=type(exc).__name__, text=str(exc),
                seconds=time.monotonic() - t)
"""
).replace("SECRET", SECRET)

# Captures every frame on eth0 of the host it runs on (AF_PACKET) until its stdin closes, then
# says whether SECRET was in any of them and how many bytes it saw.
CAPTURE = textwrap.dedent(
    """
    import socket, sys, threading
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    s.bind(("eth0", 0))
    s.settimeout(0.2)
    frames, done = [], threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("capturing", flush=True)
    while not done.is_set():
        try:
            frames.append(s.recv(65536))
        except TimeoutError:
            pass
    data = b"".join(frames)
    print(f"{int(SECRET.encode() in data)} {len(data)}", flush=True)
    """
).replace("SECRET", repr(SECRET))


def _client(host: Any, served: Served, creds: str, *extra: str) -> list[dict[str, Any]]:
    result = host.run(
        [sys.executable, "-c", CLIENT, served.path, creds, *extra],
        env={**os.environ, **QUIET_TF},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _listening(host: Any) -> str:
    """Every listening TCP socket on ``host``, as ``ss`` shows them."""
    return host.run(["ss", "-Hltn"], capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def tls_served(hosts: Any, tmp_path: Any) -> Iterator[Served]:
    fleet = Served(hosts, str(tmp_path), tls=True)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.timeout(300)
def test_a_client_with_the_credentials_runs_from_any_host_and_no_server_is_on_a_host_address(
    hosts: Any, tls_served: Served
) -> None:
    """Host 3 is no member by address; holding the client credentials it runs the split graph
    (238) and moves a string tensor from host 2 to host 1. On the member hosts, only the TLS
    gateway listens on the host address: TensorFlow's server is on a loopback alias."""
    # the whole folder `graphdist certs` made, as handed out: connect picks its client/
    ran = _client(hosts[2], tls_served, tls_served.creds)
    assert ran == [{"step": "run", "result": 238, "moved": len(SECRET) + 3}], ran
    for i in range(2):
        port = tls_served.cluster["local"][i].rsplit(":", 1)[1]
        rows = [line.split() for line in _listening(hosts[i]).splitlines()]
        on_port = [row[3] for row in rows if row[3].endswith(f":{port}")]
        loopback = [a for a in on_port if on_loopback(a)]
        host_address = [a for a in on_port if a not in loopback]
        assert host_address == [tls_served.cluster["local"][i]], on_port  # the gateway only
        assert len(loopback) == 2, on_port  # the server on its alias, the gateway on the other


@pytest.mark.timeout(300)
def test_without_credentials_or_with_another_clusters_everyone_is_refused(
    hosts: Any, tls_served: Served, tmp_path: Any
) -> None:
    """A plain TensorFlow client (no credentials) on host 3 is refused by the gateway's
    handshake, logged with its address; a client holding another cluster's credentials is told
    at once that the cluster refused them (CredentialsError), without waiting out a timeout."""
    plain = _client(hosts[2], tls_served, "")
    assert plain[0]["step"] == "connect" and plain[0]["error"] in (
        "StartTimeoutError",
        "FleetStartError",
    ), plain
    assert f"refused a connection from {hosts[2].address}" in tls_served.log(0)

    other = os.path.join(str(tmp_path), "other-creds")
    made = subprocess.run(
        [sys.executable, "-m", "graphdist", "certs", "--cluster", tls_served.path, "--out", other],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    (wrong,) = _client(hosts[2], tls_served, os.path.join(other, "client"))
    assert wrong["error"] == "CredentialsError", wrong
    assert "refused TLS" in wrong["text"] and wrong["seconds"] < 5.0, wrong


PROBE_IMPORTS = "import encodings.idna, json, socket, sys\n"  # idna: read before the drop
# Connects to each address given, speaks first as a gRPC client does, and says what came back.
PROBE = """
out = {}
for address in sys.argv[1:]:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as s:
            s.settimeout(3)
            s.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
            out[address] = "answered" if s.recv(64) else "closed"
    except OSError as exc:
        out[address] = type(exc).__name__
print(json.dumps(out), flush=True)
"""
NOBODY_PROBE = nobody_code(PROBE_IMPORTS, PROBE)


@pytest.mark.timeout(300)
def test_another_user_of_a_member_host_gets_in_neither_at_its_address_nor_on_loopback(
    hosts: Any, tls_served: Served
) -> None:
    """``nobody`` on host 1 connects to host 1's gateway (its address), to its own server (the
    loopback alias) and to the gateway's listener for host 2's task (another alias): every
    connection is closed unanswered, where root's plain probe of the alias gets an answer."""
    from graphdist._net.gateway import alias

    port = tls_served.cluster["local"][0].rsplit(":", 1)[1]
    targets = [
        tls_served.cluster["local"][0],
        f"{alias(hosts[0].address)}:{port}",
        f"{alias(hosts[1].address)}:{port}",
    ]
    result = hosts[0].run(
        [*AS_NOBODY, sys.executable, "-c", NOBODY_PROBE, *targets],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert AS_PLAIN_NOBODY in result.stdout, result.stdout + result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert all(seen[t] != "answered" for t in targets), seen
    own = hosts[0].run(
        [sys.executable, "-c", PROBE_IMPORTS + PROBE, targets[1]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert json.loads(own.stdout.splitlines()[-1]) == {targets[1]: "answered"}, own.stdout


@pytest.mark.timeout(400)
def test_a_string_tensor_between_hosts_is_in_clear_without_tls_and_never_with_it(
    hosts: Any, tmp_path: Any
) -> None:
    """A capture on host 2's link while a client on host 3 moves a string tensor from host 2's
    task to host 1's: members only, the string is on the wire; in TLS mode, it never is."""
    seen = {}
    for tls in (False, True):
        served = Served(hosts, str(tmp_path), tls=tls, allow=None if tls else hosts[2].address)
        try:
            capture = hosts[1].popen(
                [sys.executable, "-c", CAPTURE],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert capture.stdout is not None and capture.stdin is not None
            assert capture.stdout.readline().strip() == "capturing"
            ran = _client(hosts[2], served, served.client_creds if tls else "")
            assert ran[0]["result"] == 238, ran
            capture.stdin.close()
            found, size = capture.stdout.readline().split()
            capture.wait(10)
            seen[tls] = (found == "1", int(size))
        finally:
            served.stop()
    assert seen[False][0], seen  # the capture works: the string is there without TLS
    assert not seen[True][0] and seen[True][1] > 10_000, seen


@pytest.mark.timeout(300)
def test_a_killed_server_is_named_with_its_host_in_tls_mode(hosts: Any, tls_served: Served) -> None:
    """The server on host 2 is killed (SIGKILL): its gateway ends with it, and the next run of
    the client on host 3 fails within seconds with TaskFailedError naming local-1 and host 2."""
    gateway = tls_served.gateway_pids(1)
    steps = _client(
        hosts[2], tls_served, tls_served.client_creds, "then-kill", str(tls_served.procs[1].pid)
    )
    assert steps[0]["result"] == 238, steps
    again = steps[1]
    assert again["error"] == "TaskFailedError", again
    assert "local-1 at" in again["text"] and hosts[1].address in again["text"], again
    assert "is dead" in again["text"], again
    assert again["seconds"] < 5.0, again
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in gateway) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in gateway), gateway


# A TLS LocalFleet on host 1 whose cluster names host 1's address: its own process runs the
# split graph, prints the cluster, the client's credentials folder and its pids, and keeps the
# fleet until its stdin closes. argv: host 1's address.
TLS_FLEET = (
    SPLIT_GRAPH
    + r"""
ports = __import__("random").sample(range(20000, 40000), 2)
cluster = {"local": [f"{sys.argv[1]}:{p}" for p in ports]}
with graphdist.LocalFleet(cluster, tls=True) as fleet:
    with fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
        own = int(sess.run(y))
    say(cluster=cluster, client=fleet.tls_client, own=own, tls_dir=fleet.tls_dir,
        pids=fleet.pids, gateway=fleet._tls.gateway.pid)
    sys.stdin.read()
"""
)


@pytest.mark.timeout(300)
def test_a_tls_local_fleet_is_reached_with_its_own_credentials_only_and_leaves_nothing(
    hosts: Any, tmp_path: Any
) -> None:
    """``LocalFleet(cluster, tls=True)`` on host 1 makes credentials of its own: its process
    runs 238 through the aliases, a client on host 3 holding ``fleet.tls_client`` runs 238 from
    outside, a plain client there is refused; only the gateway listens on host 1's address; at
    close the servers, the gateway and the credentials are gone."""
    fleet = hosts[0].popen(
        [sys.executable, "-c", TLS_FLEET, hosts[0].address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **QUIET_TF},
    )  # fmt: skip
    assert fleet.stdout is not None and fleet.stdin is not None
    info = json.loads(fleet.stdout.readline())
    try:
        assert info["own"] == 238, info
        served = type("S", (), {"path": os.path.join(str(tmp_path), "cluster.json")})()
        with open(served.path, "w") as f:
            json.dump(info["cluster"], f)
        ran = _client(hosts[2], served, info["client"])  # type: ignore[arg-type]
        assert ran[0]["result"] == 238, ran
        plain = _client(hosts[2], served, "")  # type: ignore[arg-type]
        assert plain[0]["step"] == "connect", plain
        on_host = [
            line.split()[3]
            for line in _listening(hosts[0]).splitlines()
            if not on_loopback(line.split()[3])
        ]
        assert sorted(on_host) == sorted(info["cluster"]["local"]), on_host
    finally:
        fleet.stdin.close()
        fleet.wait(60)
    deadline = time.monotonic() + 10
    left = [pid for pid in [*info["pids"], info["gateway"]] if os.path.exists(f"/proc/{pid}")]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if os.path.exists(f"/proc/{pid}")]
    assert not left, left
    assert not os.path.exists(info["tls_dir"]), info["tls_dir"]


@pytest.mark.timeout(300)
def test_up_tls_detached_is_reached_with_its_printed_credentials_and_down_leaves_nothing(
    hosts: Any, tmp_path: Any
) -> None:
    """``graphdist up --tls --detach`` on host 1 prints the client's credentials folder; a
    client on host 3 holding it runs 238; ``down`` leaves no process of the fleet (servers,
    gateway, supervisor) and no credentials."""
    state = os.path.join(str(tmp_path), "state")
    ports = random.sample(range(20000, 40000), 2)
    cluster = {"local": [f"{hosts[0].address}:{p}" for p in ports]}
    graphdist = [sys.executable, "-m", "graphdist"]
    up = hosts[0].run(
        [*graphdist, "up", "--cluster", json.dumps(cluster), "--tls", "--detach",
         "--state-dir", state, "--json"],
        capture_output=True, text=True, timeout=180, env={**os.environ, **QUIET_TF},
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    client = os.path.join(state, "tls", "credentials", "client")
    assert f"the client's credentials are in {client}" in up.stderr, up.stderr
    before = set(hosts[0].pids())
    try:
        served = type("S", (), {"path": os.path.join(str(tmp_path), "cluster.json")})()
        with open(served.path, "w") as f:
            json.dump(cluster, f)
        ran = _client(hosts[2], served, client)  # type: ignore[arg-type]
        assert ran[0]["result"] == 238, ran
    finally:
        down = hosts[0].run(
            [*graphdist, "down", "--state-dir", state], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while (before & set(hosts[0].pids())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not before & set(hosts[0].pids()), before & set(hosts[0].pids())
    assert not os.path.exists(os.path.join(state, "tls")), os.listdir(state)


# A task of `graphdist run --tls`: an MWMS strategy (its server, on the alias TF_CONFIG names),
# then it waits for the file argv[1] and exits 0.
RUN_TASK = """
import os, sys, time
import tensorflow as tf
tf.distribute.MultiWorkerMirroredStrategy()
print("serving", flush=True)
deadline = time.monotonic() + 200
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
"""

# A client of a run's worker-1 through the run's gateway: argv: the cluster file, the
# credentials folder ("" for none); one JSON line.
RUN_CLIENT = r"""
import json, sys, time
import graphdist
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default(), tf.device("/job:worker/task:1"):
    y = tf.constant(2) + 236
try:
    fleet = graphdist.connect(sys.argv[1], timeout_s=8, tls=sys.argv[2] or None)
except graphdist.GraphdistError as exc:
    print(json.dumps({"step": "connect", "error": type(exc).__name__}), flush=True)
    sys.exit(0)
with fleet, fleet.session("worker", 1, graph) as sess:
    print(json.dumps({"step": "run", "result": int(sess.run(y))}), flush=True)
"""


@pytest.mark.timeout(300)
def test_a_local_tls_run_is_reached_only_through_its_gateway_and_leaves_nothing(
    hosts: Any, tmp_path: Any
) -> None:
    """``graphdist run --tls`` (local backend) on host 1: each TF_CONFIG names the tasks at
    host 1's loopback alias; the attempt's client credentials, said on stderr, let a client on
    host 3 reach worker-1's MWMS server (238) while a plain client there is refused; only the
    gateway listens on host 1's address at the tasks' ports. The run exits 0, and then neither
    the gateway nor the credentials are left."""
    from graphdist._net.gateway import alias

    flag, errors = tmp_path / "done", tmp_path / "run.err"
    before = set(hosts[0].pids())
    with open(errors, "w") as err:
        run = hosts[0].popen(
            [sys.executable, "-m", "graphdist", "run", "--tls", "--workers", "2",
             "--output-format", "jsonl", "--", sys.executable, "-c", RUN_TASK, str(flag)],
            stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **QUIET_TF},
        )  # fmt: skip
    assert run.stdout is not None
    events: list[dict[str, Any]] = []
    try:
        while sum(e.get("text") == "serving" for e in events) < 2:
            line = run.stdout.readline()
            assert line, errors.read_text()[-3000:]
            events.append(json.loads(line))
        said = errors.read_text()
        client = said.split("the client's credentials are in ", 1)[1].split()[0]
        real = json.loads(said.split("CLUSTER being ", 1)[1].split(")\n", 1)[0])
        workers = next(e for e in events if e["event"] == "attempt-started")["cluster"]["worker"]
        assert {a.rsplit(":", 1)[0] for a in workers} == {alias(hosts[0].address)}, workers
        ports = [a.rsplit(":", 1)[1] for a in workers]
        assert real == {"worker": [f"{hosts[0].address}:{p}" for p in ports]}, (real, workers)
        path = tmp_path / "cluster.json"
        path.write_text(json.dumps(real))
        served = type("S", (), {"path": str(path)})()
        assert _client_of(hosts[2], served, client) == {"step": "run", "result": 238}
        plain = _client_of(hosts[2], served, "")
        assert plain["step"] == "connect" and plain["error"] in (
            "StartTimeoutError",
            "FleetStartError",
        ), plain
        assert f"refused a connection from {hosts[2].address}" in errors.read_text()
        rows = [line.split()[3] for line in _listening(hosts[0]).splitlines()]
        outside = [a for a in rows if not on_loopback(a) and a.rsplit(":", 1)[1] in ports]
        assert sorted(outside) == sorted(real["worker"]), rows  # the gateway's, nothing else
    finally:
        flag.touch()
        try:
            code = run.wait(60)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(10)
    assert code == 0, errors.read_text()[-3000:]
    assert not os.path.exists(client), client
    deadline = time.monotonic() + 10
    while set(hosts[0].pids()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(hosts[0].pids()) - before, set(hosts[0].pids()) - before


def _client_of(host: Any, served: Any, creds: str) -> dict[str, Any]:
    result = host.run(
        [sys.executable, "-c", RUN_CLIENT, served.path, creds],
        env={**os.environ, **QUIET_TF}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


TASK_UP = "import time; print('up', flush=True); time.sleep(120)"


@pytest.mark.timeout(120)
def test_a_tasks_gateway_in_its_step_outlives_slurms_stop_and_notice_and_ends_with_it(
    hosts: Any,
) -> None:
    """The wrapper of a TLS run's task step on Slurm (``tls_exec_argv``): Slurm sends its stop
    (SIGTERM) and the preemption notice (PREEMPT_SIGNAL) to every process of the step, and the
    task then saves its checkpoint through its gateway, which must still relay. The gateway
    ignores both and ends with the task (within a second)."""
    import signal

    import psutil

    from graphdist._cluster import Cluster
    from graphdist._net.tlsmode import TlsMode
    from graphdist._proc.process import PREEMPT_SIGNAL
    from graphdist._proc.tlsexec import tls_exec_argv
    from tests.conftest import wait_gone

    host = hosts[0]
    real = Cluster({"worker": [f"{host.address}:{random.randint(20000, 40000)}"]})
    task = real.task("worker", 0)
    mode = TlsMode(real, start=False)
    argv = tls_exec_argv(real, task, [sys.executable, "-c", TASK_UP])
    proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                      env={**os.environ, **QUIET_TF})  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(mode.host_json(task.host).decode())
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "up"
        (gateway,) = [
            psutil.Process(p)
            for p in host.pids()
            if "graphdist._net.gateway" in " ".join(psutil.Process(p).cmdline())
        ]
        assert gateway.ppid() == proc.pid  # the task's: the wrapper executed it in its place
        for sig in (PREEMPT_SIGNAL, signal.SIGTERM):
            os.kill(gateway.pid, sig)
        time.sleep(1.0)
        assert gateway.is_running() and gateway.status() != psutil.STATUS_ZOMBIE
        proc.kill()
        proc.wait(30)
        assert wait_gone([gateway.pid], 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        mode.close()
