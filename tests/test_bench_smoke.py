"""Smoke runs of the benchmarks that print README's fault, latency, restart and shim figures: each
runs its real measuring code at its smallest size (one case, one repeat, a few steps, tiny
tensors) and the test checks the shape of what it printed, wrote as JSON and wrote into a README
(keys, types, positive figures, a ``met``/``MISSED`` line per target), never the figures: a run
this small on a loaded machine may miss a target, so each runs with ``--no-check`` (targets
printed, exit 0) where it has targets.

The benchmarks that use TensorFlow in their own process run in this one (it has imported
TensorFlow already), those that launch training runs in a child marked with
``GRAPHDIST_TEST_MARK``; either way every process a run started must be gone after it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from graphdist._proc.forkserver_pool import SPARE_TITLE
from tests.conftest import EVENTUALLY_S, REPO, processes_marked, run_python, wait_gone

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import accept_check
import fast_failure
import master_choice
import transfer

pytestmark = pytest.mark.integration

STAMP = "<sub>Printed by `python benchmarks/"


def positive(value: Any) -> bool:
    return isinstance(value, float | int) and math.isfinite(value) and value > 0


def readme_with(tmp_path: Path, *names: str, inline: tuple[str, ...] = ()) -> Path:
    """A README holding an old section for each of ``names`` and an old sentence for each of
    ``inline``, between the benchmarks' markers."""
    parts = ["intro"]
    for name in names:
        parts += [f"<!-- bench:{name}:start -->", "old figures", f"<!-- bench:{name}:end -->"]
    for name in inline:
        parts.append(f"About <!-- bench:{name}:start -->old<!-- bench:{name}:end -->, said.")
    path = tmp_path / "README.md"
    path.write_text("\n".join([*parts, "outro", ""]), encoding="utf-8")
    return path


def section(text: str, name: str) -> str:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, text
    return text.split(start, 1)[1].split(end, 1)[0]


def _is_spare(proc: psutil.Process, parent: psutil.Process) -> bool:
    """A spare of fork server ``parent``: titled so, or just forked (its parent's command line
    still, before it titles itself)."""
    with contextlib.suppress(psutil.Error):
        line = proc.cmdline()
        return " ".join(line).startswith(SPARE_TITLE) or line == parent.cmdline()
    return False


@pytest.fixture
def no_process_left() -> Iterator[None]:
    """Every process this test starts under this one is gone once it ends, but for the
    helpers every fleet of this process shares and keeps: graphdist's fork servers (and the
    spares of their pools) and multiprocess's resource tracker."""
    from multiprocess import resource_tracker

    from graphdist._proc import forkserver

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # The test's processes are listed before the spares: a fork server refills its pool once it
    # is idle, as when a test ends, and a spare forked between the two listings was counted as
    # left (a red clean-clone CI run: one child outlived EVENTUALLY_S, as only a spare does).
    now = {p.pid for p in me.children(recursive=True)}
    keep = {getattr(s, "_forkserver_pid", None) for s in forkserver._servers.values()}
    keep.add(getattr(resource_tracker._resource_tracker, "_pid", None))
    for pid in [p for p in keep if p]:  # a fork server's spares wait for the next fleet
        with contextlib.suppress(psutil.Error):
            server = psutil.Process(pid)
            keep |= {c.pid for c in server.children() if _is_spare(c, server)}
    left = now - before - keep
    assert wait_gone(left, EVENTUALLY_S) == []


def run_marked(argv: list[str], timeout: float) -> Any:
    """``python ARGV`` with a fresh ``GRAPHDIST_TEST_MARK``; checks that nothing it started is
    left once it exited."""
    mark = f"bench-smoke-{uuid.uuid4().hex}"
    proc = run_python(argv, timeout=timeout, env={"GRAPHDIST_TEST_MARK": mark})
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []
    return proc


def in_process(main: Callable[[list[str]], Any], argv: list[str]) -> Any:
    """``main(argv)``: the figures it returned; a benchmark under test must not exit."""
    try:
        return main(argv)
    except SystemExit as exc:  # pragma: no cover - the failure message
        raise AssertionError(f"{argv} exited with {exc.code}") from exc


@pytest.mark.timeout(120)
def test_fast_failure_measures_graphdist_and_raw_tensorflow(tmp_path, capsys, no_process_left):
    case = "worker killed during a transfer"
    readme = readme_with(tmp_path, "fast_failure")
    out = tmp_path / "ff.json"
    argv = ["--repeats", "1", "--case", case, "--raw-timeout-s", "2", "--no-check"]
    in_process(fast_failure.main, [*argv, "--json", str(out), "--readme", str(readme)])
    [row] = json.loads(out.read_text())
    assert row["case"] == case and row["raw_timeout_s"] == 2.0
    for key in ("seconds", "raw_s", "vs_raw", "timeout_s", "fraction_of_timeout"):
        assert positive(row[key]), (key, row)
    assert row["close_s"] >= 0 and row["raw_close_s"] >= 0  # nan: a close that never ended
    # graphdist names the task; the raw session ends with TensorFlow's own error, or its timeout
    assert row["error"] == "local-1 dead"
    assert row["raw_error"] == "timeout" or row["raw_error"].endswith("Error"), row["raw_error"]
    printed = capsys.readouterr().out
    targets = [line for line in printed.splitlines() if line.startswith(("met ", "MISSED "))]
    assert [t[len("MISSED  ") :].split(": ")[0] for t in targets] == [case, case]
    assert "target <= 1.0 s" in targets[0] and "close" in targets[1]
    text = section(readme.read_text(), "fast_failure")
    assert "graphdist   raw TF" in text and targets[0] in text
    block = text.split("  ```\n")[1]  # inside README's bullet: every line indented
    assert len(block.splitlines()) == 4 and all(x.startswith("  ") for x in block.splitlines())
    assert STAMP + "fast_failure.py --repeats 1" in text


@pytest.mark.timeout(90)
def test_master_choice_times_every_session_kind(tmp_path, capsys, no_process_left):
    readme = readme_with(tmp_path, "master_choice", inline=("master_choice_line",))
    out = tmp_path / "mc.json"
    argv = ["--steps", "10", "--rounds", "2", "--warmup", "2", "--no-check"]
    in_process(master_choice.main, [*argv, "--json", str(out), "--readme", str(readme)])
    figures = json.loads(out.read_text())
    assert sorted(figures) == [
        "graphdist device check, per step",
        "graphdist, master 0 (the seed's)",
        "graphdist, master 1 (graphdist's choice)",
        "raw TF, master 0",
        "raw TF, master 1",
    ]
    for latency in figures.values():
        assert latency["steps"] == 10
        assert all(positive(latency[k]) for k in ("median_ms", "p99_ms", "mean_ms"))
    printed = capsys.readouterr().out
    targets = [line for line in printed.splitlines() if line.startswith(("met ", "MISSED "))]
    assert (
        len(targets) == 4 and "(target <= 1.05)" in targets[0] and "(target >= 1.8)" in targets[2]
    )
    assert targets[3].split(maxsplit=1)[1].startswith("device check per step: ")
    assert targets[3].endswith("a raw step (target <= 1.02)")
    text = readme.read_text()
    assert "local fleet" in section(text, "master_choice") and targets[2] in text
    line = section(text, "master_choice_line")
    assert (
        " ms a step instead of " in line and "`python benchmarks/master_choice.py --steps" in line
    )


@pytest.mark.timeout(90)
def test_transfer_measures_a_tiny_tensor(tmp_path, capsys, no_process_left):
    out = tmp_path / "tr.json"
    in_process(transfer.main, ["--sizes-mb", "1", "--repeats", "1", "--json", str(out)])
    [row] = json.loads(out.read_text())
    assert row["mb"] == 1 and positive(row["gb_per_s"]) and positive(row["in_process_gb_per_s"])
    assert "task->task GB/s" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_accept_check_times_connections_with_and_without_the_shim(tmp_path, no_process_left):
    readme = readme_with(tmp_path, inline=("accept_check",))
    out = tmp_path / "ac.json"
    argv = ["--connections", "5", "--repeats", "1", "--extra", "0", "3"]
    in_process(accept_check.main, [*argv, "--json", str(out), "--readme", str(readme)])
    rows = json.loads(out.read_text())
    assert [r["extra_connections"] for r in rows] == [0, 3]
    for r in rows:
        assert positive(r["baseline_us"]) and positive(r["shim_us"]) and positive(r["ratio"])
    line = section(readme.read_text(), "accept_check")
    assert " µs per accepted connection here, connect + accept + close " in line
    assert "µs with 3 more connections open (`python benchmarks/accept_check.py" in line


@pytest.mark.timeout(180)
def test_mwms_throughput_trains_on_one_and_two_workers(tmp_path):
    out = tmp_path / "mw.json"
    proc = run_marked(["benchmarks/mwms_throughput.py", "--epochs", "2", "--json", str(out)], 170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert list(figures) == ["1 worker(s)", "2 worker(s)"] and all(map(positive, figures.values()))
    assert "2 workers / 1 worker: " in proc.stdout


@pytest.mark.timeout(240)
def test_restart_measures_one_kill_and_its_recovery(tmp_path):
    """The cheapest case (``mwms-kill``), one run, one kill; the other cases share its code but
    cost more than the suite's time allows (the full benchmark runs them)."""
    readme = readme_with(tmp_path, "restart")
    out = tmp_path / "rs.json"
    argv = ["--steps", "40", "--save-every", "10", "--kill-at", "15", "--repeats", "1"]
    argv += ["--case", "mwms-kill", "--no-check", "--json", str(out), "--readme", str(readme)]
    png = tmp_path / "restart.png"
    proc = run_marked(["benchmarks/restart.py", *argv, "--plot", str(png)], 230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    case = json.loads(out.read_text())["cases"]["mwms-kill"]
    assert case["case"] == "mwms-kill" and case["save_every"] == 10
    [run] = case["runs"]
    assert positive(run["cold_s"]) and run["recovery_s"] > run["stop_s"] > 0
    assert run["last_step"] >= 15 and 0 <= run["resumed_after"] <= run["last_step"]
    assert set(case["median"]) >= {"cold_s", "recovery_s", "stop_s", "ratio", "redone"}
    targets = [line for line in proc.stdout.splitlines() if line.startswith(("met ", "MISSED "))]
    assert len(targets) == 2 and "recovery / cold start:" in targets[0]
    assert "steps redone per failure, worst:" in targets[1]
    text = section(readme.read_text(), "restart")
    assert "[mwms-kill]" in text and targets[1] in text and STAMP + "restart.py --steps" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](restart.png)" in text


@pytest.mark.timeout(150)
def test_tls_measures_both_sides_on_a_bed_of_hosts(tmp_path):
    """One round, ten steps, two reads of 4 MB a side (``--smoke``): TLS mode and plain members
    only, both served on hosts 1 and 2 of a bed, a client on host 3. Needs root."""
    from tests.hostbed import require_hostbed

    require_hostbed()
    readme = readme_with(tmp_path, "tls")
    out, png = tmp_path / "tls.json", tmp_path / "tls.png"
    argv = ["--smoke", "--no-check", "--json", str(out), "--readme", str(readme)]
    proc = run_marked(["benchmarks/tls.py", *argv, "--plot", str(png)], 140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["mb"] == 4 and figures["rounds"] == 1 and figures["steps"] == 10
    for key in ("step_ms", "mb_per_s", "serve_s", "connect_s"):
        assert all(positive(figures[key][k]) for k in ("plain", "tls", "ratio")), key
    cores = figures["cpu_cores"]  # whole clock ticks: two short reads may show none
    assert all(cores[k][s] >= 0 for k in ("servers", "gateways") for s in ("plain", "tls"))
    targets = [line for line in proc.stdout.splitlines() if line.startswith(("met ", "MISSED "))]
    assert [t.split()[2] for t in targets] == ["step", "transfer", "serve"]
    text = section(readme.read_text(), "tls")
    assert "| split graph step, host 3 client (ms) |" in text and "not a network" in text
    assert "![TLS against plain, as ratios to plain](tls.png)" in text
    assert STAMP + "tls.py --smoke" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(90)
def test_relay_measures_the_gateway_pair_against_stunnel_and_direct(tmp_path):
    """One round, 100 round trips, one 4 MB transfer a side (``--smoke``): graphdist's gateway
    pair, stunnel's (where installed) and no relay, on loopback; every relay and the echo server
    gone after it."""
    import shutil

    readme = readme_with(tmp_path, "relay")
    out = tmp_path / "relay.json"
    argv = ["--smoke", "--no-check", "--json", str(out), "--readme", str(readme)]
    proc = run_marked(["benchmarks/relay.py", *argv], 80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    sides = ["direct", "gateway"] + (["stunnel"] if shutil.which("stunnel") else [])
    assert sorted(figures["round_trip_us"]) == sorted(sides)
    assert all(positive(figures[k][s]) for k in ("round_trip_us", "mb_per_s") for s in sides)
    assert sorted(figures["added_us"]) == sorted(sides[1:])  # may be < 0 on a noisy machine
    text = section(readme.read_text(), "relay")
    assert "| graphdist's gateways (Python ssl, uvloop) |" in text
    assert STAMP + "relay.py --smoke" in text
    targets = [line for line in proc.stdout.splitlines() if line.startswith(("met ", "MISSED "))]
    assert len(targets) == (2 if "stunnel" in sides else 0)
