"""What a new user meets first (issue 29): quiet output, help that describes and shows, one
cluster per spec for tf-config and serve, a hint for a missing tf-keras, and the rough edges
(HTML tables, `local:2`, a fleet used before it started, what an interrupted `up --detach` left)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import types

import pytest

import graphdist
from graphdist._cli import main as cli_main
from graphdist._cli.helptext import EXAMPLES
from graphdist._cli.parser import build_parser
from graphdist._distribute.taskproc import GRAPHDIST_PYTHON, interpreter_hint
from graphdist._exceptions import FleetClosedError, TaskExitError
from graphdist._fleet.health import HealthReport, TaskHealth
from graphdist._graph.trace import Placement
from graphdist._local.fleet import LocalFleet
from graphdist._proc.signals import Interrupted
from graphdist._tflog import TF_LOGS_ENV, is_tf_log
from tests.cli.test_cli import assert_user_error
from tests.conftest import EVENTUALLY_S, REPO, wait_gone

COMMANDS = ["up", "status", "down", "run", "serve", "tf-config", "demo", "warm"]


def _bare_env(**extra: str) -> dict[str, str]:
    """The environment a user has: no TF_CPP_MIN_LOG_LEVEL, no switch (unless given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", TF_LOGS_ENV)}
    return {**env, **extra}


# -- help -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_examples_and_the_switch(command):
    sub = build_parser().commands[command]
    text = sub.format_help()
    assert sub.description and len(sub.description) > 40, command
    assert "examples" in text and f"graphdist {command}" in text.replace("srun ", "")
    assert f"{TF_LOGS_ENV}=1" in text
    assert command in EXAMPLES


def test_the_top_help_says_what_graphdist_is_with_examples():
    result = subprocess.run(
        [sys.executable, "-m", "graphdist", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "thin layer" not in result.stdout
    assert result.stdout.count("graphdist ") >= 6 and "examples:" in result.stdout
    assert f"{TF_LOGS_ENV}=1" in result.stdout


# -- one cluster per spec ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["tf-config", "--cluster", "worker=2", "--task", "worker:0"],
        ["tf-config", "--cluster", "chief=1,worker=2,ps=1", "--task", "worker:1"],
        ["serve", "--cluster", "worker=2", "--job", "worker", "--task", "0"],
    ],
)
def test_tf_config_and_serve_refuse_job_n_asking_for_addresses(argv, run_cli):
    result = run_cli(*argv)
    assert_user_error(result, "picks new free ports on every call")
    assert "pass JSON text or a JSON file path" in result.stderr
    assert result.stdout == ""


def test_the_library_tf_config_refuses_job_n_too():
    with pytest.raises(graphdist.ClusterSpecError, match="must name every task's address"):
        graphdist.tf_config("worker=2", "worker:0")
    cluster = {"worker": ["h1:2222", "h2:2222"]}
    one, two = graphdist.tf_config(cluster, "worker:0"), graphdist.tf_config(cluster, "worker:1")
    assert one.cluster == two.cluster  # one cluster, whichever task asks


@pytest.mark.parametrize(
    ("spec", "meant"), [("local:2", "local=2"), ("worker:2, ps:1", "worker=2,ps=1")]
)
def test_counts_written_with_a_colon_suggest_the_equals_sign(spec, meant, run_cli):
    assert_user_error(run_cli("up", "--cluster", spec), f"did you mean {meant!r}?")


def test_an_address_is_not_taken_for_counts():
    with pytest.raises(graphdist.ClusterSpecError) as caught:
        graphdist.Cluster.parse("host.example:2222")
    assert "did you mean" not in str(caught.value)


# -- tf-keras -------------------------------------------------------------------------------------


def test_a_missing_tf_keras_gets_the_extra_to_install():
    tail = [
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "ImportError: Keras cannot be imported. Check that it is installed.",
    ]
    hint = interpreter_hint(tail)
    assert "no tf-keras" in hint and "pip install 'tf-keras==2." in hint  # on PyPI
    assert "'graphdist[distribute]'" not in hint  # graphdist is on no package index
    assert "pip install '.[distribute]'" in hint
    assert "TF_USE_LEGACY_KERAS=1" in hint
    assert "no tf-keras" in interpreter_hint(["ModuleNotFoundError: No module named 'tf_keras'"])
    assert "no tensorflow" in interpreter_hint(["No module named 'tensorflow'"])
    # a script that imports numpy first fails there, in a Python without graphdist's packages
    numpy = interpreter_hint(["ModuleNotFoundError: No module named 'numpy'"])
    assert "the task's Python has no numpy: is the command's `python` another" in numpy
    assert interpreter_hint(["epoch 1 done"]) == ""


def test_the_wrong_python_hint_gives_the_task_command_to_copy(monkeypatch, capsys):
    """The hint is the task's own command with graphdist's Python in its place (no ``...``);
    the CLI makes it the whole ``graphdist run``, with the options the user gave."""
    tail = ["ModuleNotFoundError: No module named 'tensorflow'"]
    hint = interpreter_hint(tail, ["python3", "train.py", "--epochs", "3", "--name", "a b"])
    assert f"`{sys.executable} train.py --epochs 3 --name 'a b'`" in hint
    assert "..." not in hint
    assert GRAPHDIST_PYTHON not in interpreter_hint(tail, ["bash", "train.sh"])  # none to copy
    argv = ["run", "--workers", "2", "--log-dir", "/tmp/x y", "--", "python3", "train.py"]
    said = "Task worker-0 exited with code 1" + interpreter_hint(tail, argv[6:])
    error = TaskExitError(said, [], types.SimpleNamespace(exitcode=1))  # type: ignore[arg-type]

    def failed(args):
        raise error

    monkeypatch.setitem(cli_main._COMMANDS, "run", failed)
    assert cli_main.main(argv) == 1
    text = capsys.readouterr().err
    want = f"Run `graphdist run --workers 2 --log-dir '/tmp/x y' -- {sys.executable} train.py`"
    assert want in text, text


# -- a fleet before it started, HTML tables -------------------------------------------------------


def test_a_fleet_used_before_it_started_says_so():
    fleet = LocalFleet({"local": ["localhost:1"]})
    with pytest.raises(FleetClosedError) as caught:
        fleet.kill("local", 0)
    assert str(caught.value) == (
        "The fleet has not been started yet; call start() first, or use it in a `with` block"
    )
    fleet.close()
    with pytest.raises(FleetClosedError, match="The fleet is closed; start a new fleet"):
        fleet.kill("local", 0)


def _backgrounds_have_text_colours(page: str) -> None:
    styles = re.findall(r'style="([^"]*)"', page)
    assert styles
    for style in styles:
        if "background" in style:
            assert re.search(r"(?:^|;)color:#", style), style


@pytest.mark.timeout(120)
def test_a_closed_fleets_table_shows_stopped_and_a_killed_task_as_killed():
    fleet = LocalFleet("local=3")
    with fleet:
        running = fleet._repr_html_()
        assert running.count(">running<") == 3
        _backgrounds_have_text_colours(running)
        pids = [t.pid for t in fleet.tasks]
        fleet.kill("local", 2)
    page = fleet._repr_html_()
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert page.count(">stopped<") == 2, page
    assert "was killed by SIGKILL" in page and "-15" not in page
    _backgrounds_have_text_colours(page)


def test_health_and_placement_tables_set_a_text_colour():
    report = HealthReport(
        [
            TaskHealth("local", 0, "localhost:1", 10, "alive"),
            TaskHealth("local", 1, "localhost:2", 11, "dead", "exited with code 3"),
            TaskHealth("local", 2, "localhost:3", 12, "not answering"),
        ]
    )
    _backgrounds_have_text_colours(report._repr_html_())
    placed = Placement(
        executed={"y": "/job:local/replica:0/task:1/device:CPU:0"},
        requested={"y": "/job:local/task:1"},
    )
    page = placed._repr_html_()
    _backgrounds_have_text_colours(page)
    assert all('fill="' in text for text in re.findall(r"<text[^>]*>", page))


# -- what an interrupted `up --detach` left -------------------------------------------------------


def test_down_removes_what_an_interrupted_up_detach_left(tmp_path, run_cli):
    state_dir = tmp_path / "fleet"
    (state_dir / "logs").mkdir(parents=True)
    (state_dir / "lock").write_text("12345")
    (state_dir / "supervisor.log").write_text("")
    result = run_cli("down", "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    assert "no fleet was running; removed what an earlier one left (supervisor.log, logs)" in (
        result.stdout
    )
    assert not state_dir.exists()


# -- quiet by default ------------------------------------------------------------------------------


def _demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`graphdist demo` as a user runs it (``make demo`` sets TF_CPP_MIN_LOG_LEVEL=2)."""
    result = subprocess.run(
        [sys.executable, "-m", "graphdist", "demo"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize("level", [None, "2"])
def test_the_demo_shows_no_tensorflow_line(level):
    result = _demo(_bare_env() if level is None else _bare_env(TF_CPP_MIN_LOG_LEVEL=level))
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    assert [line for line in lines if is_tf_log(line)] == [], lines
    assert result.stderr.splitlines()[0].startswith("graphdist demo: local-0 at ")
    assert result.stdout.splitlines()[0] == "238"


@pytest.mark.timeout(180)
def test_the_demo_shows_tensorflows_lines_with_the_switch():
    result = _demo(_bare_env(**{TF_LOGS_ENV: "1"}))
    assert any(is_tf_log(line) for line in result.stderr.splitlines()), result.stderr


def test_a_bad_switch_value_is_one_line(run_cli):
    result = run_cli("tf-config", "--cluster", "{}", "--task", "w:0", env={TF_LOGS_ENV: "yes"})
    assert_user_error(result, "GRAPHDIST_TF_LOGS must be 1")


RUN = [sys.executable, "-m", "graphdist", "run", "--workers", "1"]
RUN_SCRIPT = (
    "import tensorflow as tf; print('mine: before'); "
    "tf.constant(1).numpy(); print('mine: after', flush=True)"
)


@pytest.mark.timeout(180)
def test_run_console_leaves_out_tensorflows_lines_and_the_logs_keep_them(tmp_path):
    result = subprocess.run(
        [*RUN, "--log-dir", str(tmp_path), "--", sys.executable, "-c", RUN_SCRIPT],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env=_bare_env(),
    )
    assert result.returncode == 0, result.stderr
    console = result.stdout.splitlines()
    assert "[worker-0] mine: before" in console and "[worker-0] mine: after" in console
    shown = [line.removeprefix("[worker-0] ") for line in console if line.startswith("[worker")]
    assert [line for line in shown if is_tf_log(line)] == [], console
    log = (tmp_path / "run-1" / "attempt-1" / "worker-0.log").read_text()
    assert any(is_tf_log(line) for line in log.splitlines()), log


@pytest.mark.parametrize(("signum", "said"), [(signal.SIGINT, ""), (signal.SIGTERM, " by SIGTERM")])
def test_a_stop_signal_from_the_library_ends_the_command_in_one_line(
    signum, said, monkeypatch, capsys
):
    """One Interrupted for the library's signal scopes and the CLI's own starts (issue 57):
    whichever raised it, the command ends with one line and 128 + N, no traceback."""

    def stopped(args):
        raise Interrupted(signum)

    monkeypatch.setitem(cli_main._COMMANDS, "status", stopped)
    assert cli_main.main(["status"]) == 128 + signum
    assert capsys.readouterr().err == f"Error: interrupted{said}\n"
