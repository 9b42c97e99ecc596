"""The graphdist command, run as a user runs it: a separate process, real fleets; a user mistake,
refused before anything starts, in this process (``run_cli``: the same ``main``, no fresh import
of graphdist each)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from graphdist._cli.main import EXIT_USAGE
from graphdist._cli.parser import build_parser
from graphdist._exceptions import UsageError
from tests.conftest import (
    EVENTUALLY_S,
    QUIET_TF,
    read_json,
    read_json_rows,
    run_python,
    seed_ports_free,
    start_graphdist,
    wait_gone,
)

pytestmark = pytest.mark.timeout(180)


def gd(*args: str, state_dir: str | None = None, timeout: float = 120):
    env = {"GRAPHDIST_STATE_DIR": state_dir} if state_dir else None
    return run_python(["-m", "graphdist", *args], timeout=timeout, env=env)


def assert_user_error(result, fragment: str) -> None:
    assert result.returncode == EXIT_USAGE, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


def test_parser_is_separate_from_running():
    args = build_parser().parse_args(["up", "--cluster", "local=2", "--detach"])
    assert (args.command, args.cluster, args.detach) == ("up", "local=2", True)
    with pytest.raises(UsageError, match="--cluster"):
        build_parser().parse_args(["up"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["up", "--cluster", "local=-1"], "Job 'local' asks for -1 tasks"),
        (["up", "--cluster", "{bad"], "not valid JSON"),
        (["up", "--cluster", "/nope/cluster.json"], "/nope/cluster.json"),
        (["up", "--cluster", '{"local": ["localhost:70000"]}'], "has port 70000, outside 1-65535"),
        (["up"], "--cluster"),
        (["frobnicate"], "frobnicate"),
        (["up", "--cluster", "local=1", "--start-timeout", "0"], "--start-timeout"),
        (["demo", "--master", "x"], "--master"),
        # each checked before anything starts (the demo used to run, then fail on its picture)
        (["up", "--cluster", '{"local": ["localhost:\u0662\u0660"]}'], "'\u0662\u0660'"),
        (["tf-config", "--cluster", "w=2", "--task", "w:\uff11"], "'w:\uff11'"),
        (["run", "--workers", "\u0663", "--", "true"], "'\u0663'"),
        (["up", "--cluster", "[" * 10_000], "nests deeper than 32"),
        (["up", "--cluster", "/dev/zero"], "'/dev/zero': it is not a regular file"),
        (["up", "--cluster", ",".join(f"j{i}=1000" for i in range(10))], "10000 tasks in all"),
        (["up", "--cluster", "local=1", "--detach", "--state-dir", "/proc/x"], "/proc/x"),
        (["run", "--", "/nonexistent"], "'/nonexistent'"),
        (["demo", "--picture", "/nonexistent/dir/x.svg"], "'/nonexistent/dir' does not exist"),
        (["demo", "--picture", "x.jpg"], "'x.jpg'"),
        (["demo", "--master", "7"], "--master 7"),
        (
            ["up", "--cluster", '{"local": ["localhost:1"], "local": ["localhost:2"]}'],
            "names key 'local' twice",
        ),
        (["up", "--cluster", '{"local": {"0": "localhost:1", "00": "localhost:2"}}'], "'00'"),
        (["up", "--cluster", '{"local": ["[zz]:2020"]}'], "'[zz]'"),
        (["up", "--cluster", "local=1", "--start-timeout", "nan"], "not nan"),
        (["run", "--timeout", "inf", "--", "true"], "not inf"),
        (["run", "--tls", "--expose", "--", "true"], "--expose does nothing with --tls"),
        (["run", "--backend", "ray", "--tls", "--expose", "--", "true"], "drop --expose"),
    ],
)
def test_user_mistakes_print_one_line_and_exit_2(argv, fragment, run_cli):
    assert_user_error(run_cli(*argv), fragment)


def test_cluster_files_that_are_not_utf8_json_text_are_one_line(tmp_path, run_cli):
    latin = tmp_path / "latin1.json"
    latin.write_bytes('{"local": ["h\u00f4te:2020"]}'.encode("latin-1"))
    assert_user_error(run_cli("up", "--cluster", str(latin)), "is not UTF-8 text (byte 0xf4")
    assert_user_error(run_cli("up", "--cluster", str(tmp_path)), "it is a folder")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a plain open() would wait for one forever (the test's timeout)
    assert_user_error(run_cli("up", "--cluster", str(fifo)), "not a regular file")


def test_serve_slurm_outside_slurm_says_to_use_srun(monkeypatch, run_cli):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    result = run_cli("serve", "--slurm", "ps=1,worker=2")
    assert_user_error(result, "SLURM_PROCID")
    assert "srun" in result.stderr


def test_no_fleet_running(state_dir, run_cli):
    env = {"GRAPHDIST_STATE_DIR": state_dir}
    assert_user_error(run_cli("status", env=env), "No detached fleet")
    assert_user_error(run_cli("down", env=env), "No detached fleet")


def test_port_in_use_is_a_one_line_error(state_dir):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        spec = json.dumps({"local": [f"localhost:{port}"]})
        assert_user_error(
            gd("up", "--cluster", spec, "--detach", state_dir=state_dir),
            f"Port {port} of task local-0 (localhost:{port}) is already in use by pid "
            f"{os.getpid()}",
        )
        assert not os.path.exists(os.path.join(state_dir, "fleet.json"))
    finally:
        holder.close()


def test_detached_fleet_up_status_down(state_dir):
    up = gd("up", "--cluster", "local=2,ps=1", "--detach", state_dir=state_dir)
    assert up.returncode == 0, up.stderr
    assert len([ln for ln in up.stdout.splitlines() if "grpc://" in ln]) == 3
    status = gd("status", "--json", state_dir=state_dir)
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)
    assert [(r["job"], r["task"]) for r in rows] == [("local", 0), ("local", 1), ("ps", 0)]
    assert all({"job", "task", "address", "pid", "alive"} <= set(r) for r in rows)
    assert all(r["alive"] for r in rows)
    pids = [r["pid"] for r in rows]
    record = read_json(os.path.join(state_dir, "fleet.json"))
    supervisor = record["supervisor"]["pid"]

    # A second fleet in the same folder is refused; another folder runs side by side.
    assert_user_error(
        gd("up", "--cluster", "local=1", "--detach", state_dir=state_dir), "already running"
    )
    other = state_dir + "-2"
    assert gd("up", "--cluster", "local=1", "--detach", state_dir=other).returncode == 0
    other_pids = [r["pid"] for r in json.loads(gd("status", "--json", state_dir=other).stdout)]
    assert gd("down", state_dir=other).returncode == 0
    assert wait_gone(other_pids, EVENTUALLY_S) == []

    down = gd("down", state_dir=state_dir)
    assert down.returncode == 0, down.stderr
    assert wait_gone([*pids, supervisor], EVENTUALLY_S) == []
    assert not os.path.exists(state_dir)


def test_stale_state_is_detected_and_cleaned(state_dir):
    assert gd("up", "--cluster", "local=1", "--detach", state_dir=state_dir).returncode == 0
    record = read_json(os.path.join(state_dir, "fleet.json"))
    os.kill(record["supervisor"]["pid"], signal.SIGKILL)
    assert wait_gone([record["supervisor"]["pid"]], EVENTUALLY_S) == []
    result = gd("status", state_dir=state_dir)
    assert result.returncode == EXIT_USAGE and "stale" in result.stderr
    assert wait_gone([t["pid"] for t in record["tasks"]], EVENTUALLY_S) == []
    assert not os.path.exists(os.path.join(state_dir, "fleet.json"))


def test_foreground_up_reports_a_death_and_stops_everything_on_ctrl_c(state_dir):
    proc = start_graphdist("up", "--cluster", "local=2", "--json")
    try:
        rows = read_json_rows(proc)
        pids = [r["pid"] for r in rows]
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)  # the fleet's watcher reports it, worded by health
        assert proc.stderr is not None
        lines = iter(proc.stderr.readline, "")
        death = next(line for line in lines if "local-1" in line)
        assert death.startswith(
            "graphdist: task local-1 was killed by SIGKILL (exit status 137) (log: "
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # interrupted, as a shell expects (issue 29)
        assert wait_gone(pids, EVENTUALLY_S) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_prints_238_and_where_each_op_ran(tmp_path):
    picture, logdir = tmp_path / "placed.dot", tmp_path / "tb"
    result = gd("demo", "--picture", str(picture), "--tensorboard", str(logdir))
    assert result.returncode == 0, result.stderr
    assert "fillcolor" in picture.read_text()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(logdir))
    lines = result.stdout.splitlines()
    assert lines[0] == "238"
    placed = {ln.split()[0]: ln.split()[-1] for ln in lines if ln.startswith(("y ", "y1 ", "y2 "))}
    assert placed["y2"].startswith("/job:local/replica:0/task:0/")
    assert placed["y1"].startswith("/job:local/replica:0/task:1/")
    assert placed["y"].startswith("/job:local/replica:0/task:1/")


SEED_WORKERS = ["worker0.example.com:12345", "worker1.example.com:12345"]  # the seeds' TF_CONFIG


@pytest.mark.parametrize("index", [0, 1])
def test_tf_config_prints_the_tasks_tf_config_as_json(index, run_cli):
    result = run_cli(
        "tf-config", "--cluster", json.dumps({"worker": SEED_WORKERS}), "--task", f"worker:{index}"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "cluster": {"worker": SEED_WORKERS},
        "task": {"type": "worker", "index": index},
    }
    assert result.stdout.count("\n") == 1  # one line: `export TF_CONFIG=$(graphdist tf-config ...)`


SEED_PORTS = (2020, 2021)


def _demo_pids(stderr: str) -> list[int]:
    """The server pids the demo names on its first line: 'local-0 at ADDRESS (pid N), ...'."""
    [line] = [ln for ln in stderr.splitlines() if ln.startswith("graphdist demo: ")]
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", line)]


@pytest.mark.timeout(180)
@pytest.mark.xdist_group("seed_ports")  # one at a time: they all listen on 2020
def test_demo_on_the_seed_ports_through_task_1_prints_238():
    if not seed_ports_free(SEED_PORTS):
        pytest.skip("ports 2020 and 2021 are taken on this machine: the seed ports cannot be used")
    result = gd("demo", "--seed-ports", "--master", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "238"
    assert "where each op ran (master: grpc://localhost:2021):" in lines
    assert "local-0 at localhost:2020 (pid " in result.stderr
    assert "local-1 at localhost:2021 (pid " in result.stderr
    pids = _demo_pids(result.stderr)
    assert len(pids) == 2 and wait_gone(pids, EVENTUALLY_S) == []


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("seed_ports")  # one at a time: they all listen on 2020
def test_demo_on_a_taken_seed_port_fails_at_once_naming_the_port_and_its_holder():
    if not seed_ports_free(SEED_PORTS[:1]):
        pytest.skip("port 2020 is taken by another process: this test holds it itself")
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", SEED_PORTS[0]))
        holder.listen()
        result = gd("demo", "--seed-ports", timeout=60)  # a hang fails here, not at the mark
    # TensorFlow, imported while the fleet starts, may log to stderr first: graphdist's own
    # output is the one Error line, last.
    assert result.returncode == EXIT_USAGE, result
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("Error: ")]
    assert errors == result.stderr.strip().splitlines()[-1:], result.stderr
    assert (
        "Port 2020 of task local-0 (localhost:2020) is already in use by pid "
        f"{os.getpid()}; stop that process or choose another port"
    ) in errors[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # a required option missing was said before the unknown one next to it (issue 39)
        (["up", "--clusters", "local=2"], "--clusters (did you mean --cluster?)"),
        (["up", "--cluster", "local=2", "--exposed"], "--exposed (did you mean --expose?)"),
        (["status", "--jsn"], "--jsn (did you mean --json?)"),
        (["up", "--cluster", "local=1", "--bogus"], "--bogus"),
    ],
)
def test_a_mistyped_option_is_named_with_the_closest_one(argv, said, run_cli):
    result = run_cli(*argv)
    assert result.returncode == EXIT_USAGE, result.stderr
    expected = f"Error: unrecognized argument {said} (see `graphdist {argv[0]} --help`)"
    assert result.stderr.splitlines() == [expected], result.stderr


@pytest.mark.timeout(120)
def test_status_names_a_foreground_up_instead_of_saying_only_no_fleet(tmp_path):
    """issue 39: `status` while `graphdist up` ran in another terminal said no fleet runs."""
    state = str(tmp_path / "state")
    up = subprocess.Popen(
        [sys.executable, "-m", "graphdist", "up", "--cluster", "local=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **QUIET_TF},
    )
    assert up.stdout is not None
    try:
        for line in up.stdout:
            if "fleet running" in line:
                break
        status = gd("status", state_dir=state)
        assert status.returncode == 2, status.stderr
        # other tests (xdist workers) may run a foreground up of their own meanwhile
        pids = re.search(r"a foreground `graphdist up` runs as pid ([\d, ]+):", status.stderr)
        assert pids and str(up.pid) in pids[1].split(", "), status.stderr
        assert len(status.stderr.splitlines()) == 1, status.stderr
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 130
    after = gd("status", state_dir=state).stderr  # it is gone now
    assert not re.search(rf"\b{up.pid}\b", after.split("runs as pid", 1)[-1]), after


@pytest.mark.integration
def test_the_stop_hint_of_a_detached_fleet_works_when_followed(state_dir):
    """`up --detach --state-dir X` said "stop it with `graphdist down`", which answered "No
    detached fleet" and left the fleet running (issue 57). The printed command, run as printed
    in a shell that has no GRAPHDIST_STATE_DIR, stops the fleet."""
    import shlex

    up = run_python(["-m", "graphdist", "up", "--cluster", "local=1", "--detach", "--state-dir",
                     state_dir])  # fmt: skip
    assert up.returncode == 0, up.stderr
    hint = re.search(r"stop it with `([^`]+)`", up.stderr)
    assert hint is not None, up.stderr
    pids = [r["pid"] for r in json.loads(gd("status", "--json", state_dir=state_dir).stdout)]
    record = read_json(os.path.join(state_dir, "fleet.json"))
    argv = shlex.split(hint.group(1))
    assert argv[:2] == ["graphdist", "down"], argv
    down = run_python(["-m", "graphdist", *argv[1:]])
    assert down.returncode == 0, down.stderr
    assert wait_gone([*pids, record["supervisor"]["pid"]], EVENTUALLY_S) == []


def _follow(hint: str) -> subprocess.CompletedProcess[str]:
    """The command a hint printed, run as printed (``graphdist ...``: this Python's)."""
    import shlex

    argv = shlex.split(hint)
    assert argv[0] == "graphdist", hint
    return run_python(["-m", "graphdist", *argv[1:]])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_detached_fleets_restarts_logs_and_hints_work_when_followed(state_dir):
    """`status` shows each task's restarts; a dead task's error names `graphdist restart TASK`
    with the fleet's --state-dir, which brings it back; `graphdist logs` prints its log; a
    dead supervisor's fleet is cleaned up with its logs kept, and the hints of that line (`logs`,
    then `down`) read them and remove them (issue 57)."""
    fleet = ["--state-dir", state_dir]
    none = run_python(["-m", "graphdist", "status", *fleet])
    start = re.search(r"start one with `([^`]+)`", none.stderr)
    assert none.returncode == EXIT_USAGE and start is not None, none.stderr
    up = _follow(start.group(1))  # the fleet it names is the one status was asked about
    assert up.returncode == 0, up.stderr
    record = read_json(os.path.join(state_dir, "fleet.json"))
    pids = [t["pid"] for t in record["tasks"]]
    try:
        table = run_python(["-m", "graphdist", "status", *fleet])
        header, *rows = table.stdout.splitlines()
        assert header.split() == ["JOB", "TASK", "ADDRESS", "PID", "ALIVE", "RESTARTS", "TARGET"]
        assert [r.split()[5] for r in rows] == ["0", "0"], table.stdout

        os.kill(pids[1], signal.SIGKILL)  # --restart no: dead for good
        assert wait_gone([pids[1]], EVENTUALLY_S) == []
        dead = run_python(["-m", "graphdist", "status", *fleet])
        assert dead.returncode == 1, dead.stderr
        hint = re.search(r"`(graphdist restart [^`]+)` starts it again", dead.stderr)
        assert hint is not None, dead.stderr
        restarted = _follow(hint.group(1))
        assert restarted.returncode == 0, restarted.stderr
        assert "task local-1 restarted" in restarted.stdout, restarted.stdout
        table = run_python(["-m", "graphdist", "status", *fleet])
        assert table.returncode == 0, table.stderr
        assert [r.split()[5] for r in table.stdout.splitlines()[1:]] == ["0", "1"], table.stdout
        record = read_json(os.path.join(state_dir, "fleet.json"))
        pids.append(record["tasks"][1]["pid"])

        logs = run_python(["-m", "graphdist", "logs", "local:1", "-n", "3", *fleet])
        assert logs.returncode == 0, logs.stderr
        path = record["tasks"][1]["log"]
        assert logs.stdout.splitlines()[0] == f"==> {path} <==", logs.stdout
        assert len(logs.stdout.splitlines()) <= 4
        for argv, fragment in [
            (["restart", "local-7", *fleet], "local-7: no such task in this fleet; its tasks are"),
            (["logs", "local-7", *fleet], "local-7: no log of that task in"),
            (["logs", "-n", "-1", *fleet], "-n must be 0 to 100000 lines, not -1"),
        ]:
            assert_user_error(run_python(["-m", "graphdist", *argv]), fragment)

        os.kill(record["supervisor"]["pid"], signal.SIGKILL)
        assert wait_gone([record["supervisor"]["pid"]], EVENTUALLY_S) == []
        stale = run_python(["-m", "graphdist", "status", *fleet])
        assert stale.returncode == EXIT_USAGE and "stale" in stale.stderr, stale.stderr
        assert wait_gone(pids, EVENTUALLY_S) == []
        said = r"its logs are kept in .*\(`([^`]+)`; `([^`]+)` removes them\)"
        kept = re.search(said, stale.stderr)
        assert kept is not None, stale.stderr
        read = _follow(kept.group(1))
        assert read.returncode == 0, read.stderr
        headers = [ln for ln in read.stdout.splitlines() if ln.startswith("==> ")]
        assert [h.rsplit("/", 1)[-1] for h in headers] == [
            "supervisor.log <==",
            "local-0.log <==",
            "local-1.log <==",
        ], read.stdout
        removed = _follow(kept.group(2))
        assert removed.returncode == 0, removed.stderr
        assert not os.path.exists(state_dir)
    finally:
        run_python(["-m", "graphdist", "down", *fleet])
        assert wait_gone([*pids, record["supervisor"]["pid"]], EVENTUALLY_S) == []


def test_the_stop_hint_names_the_state_folder_unless_it_is_the_default(monkeypatch, tmp_path):
    from graphdist._detached.state import default_state_dir, down_command

    monkeypatch.delenv("GRAPHDIST_STATE_DIR", raising=False)
    assert down_command(default_state_dir()) == "graphdist down"
    odd = str(tmp_path / "my fleet")
    assert down_command(odd) == f"graphdist down --state-dir '{odd}'"
    monkeypatch.setenv("GRAPHDIST_STATE_DIR", odd)  # the default of this environment
    assert down_command(odd) == "graphdist down"


@pytest.mark.parametrize("folder", ["my fleet", "it's", "two\nlines", "tab\there", "bell\x07é"])
def test_a_hints_command_is_one_line_that_a_shell_reads_back_as_the_folder(tmp_path, folder):
    from graphdist._detached.state import fleet_command

    path = str(tmp_path / folder)
    command = fleet_command(path, "restart", "worker-1")
    assert "\n" not in command and command.startswith("graphdist restart worker-1 --state-dir ")
    words = subprocess.run(
        ["bash", "-c", f"set -- {command}; printf '%s\\0' \"$@\""],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split("\0")[:-1]
    assert words == ["graphdist", "restart", "worker-1", "--state-dir", path]
