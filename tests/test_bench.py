"""The benchmark suite's report: tables, plots, the warnings of an untrustworthy run and the
README section it rewrites only on request.

The figures themselves are measured by ``make bench``; this checks how they are reported, on
small made-up results (the measuring functions are replaced), without timing anything.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
# A real import: a benchmark that no longer imports must fail here, not skip. Importing the
# benchmarks does not import TensorFlow.
import _common
import startup
import suite


def fake_results():
    def startup(seconds, pss):
        return {"seconds": seconds, "pss_mib": pss, "rss_mib": pss * 2}

    rows = [
        {
            "servers": n,
            "local_fleet": startup(2.5 + 0.05 * n, 100 * n),
            "seed_style": startup(2.5 * n, 300 * n),
            "create_local_cluster": startup(3.0, 400),
        }
        for n in (1, 2, 4)
    ]
    latency = {"median_ms": 1.0, "p99_ms": 2.0, "mean_ms": 1.1, "steps": 1000}
    return {
        "mode": "quick",
        "date": "2026-11-29",
        "machine": "2 CPU cores",
        "tensorflow": "2.21.0",
        "python": "3.11",
        "bare_import": {"seconds": 2.5, "pss_mib": 300, "rss_mib": 500, "runs_s": [2.4, 2.5, 2.6]},
        "startup": rows,
        "step_latency": {"raw TF, master 0": latency, "graphdist, master 1": latency},
        "scale_latency": [{"tasks": 2, **latency}, {"tasks": 4, **latency}],
        "transfer": [{"mb": 1, "gb_per_s": 0.7, "in_process_gb_per_s": 10.0}],
        "slopes": {"latency_ms_per_task": 0.1, "startup_s_per_server[seed_style]": 2.5},
        "elapsed_s": 100.0,
    }


def test_slope_is_least_squares():
    assert suite.slope([1, 2, 4], [2.5, 5.0, 10.0]) == pytest.approx(2.5)
    assert suite.slope([3, 3], [1, 2]) == 0.0


def test_markdown_names_the_machine_date_and_ratios_against_the_floor():
    text = suite.markdown(fake_results())
    assert "Measured on 2026-11-29, 2 CPU cores" in text
    assert "| 4 | 2.70 s (1.08x) | 10.00 s (4.00x) | 3.00 s (1.20x) |" in text
    assert "| latency_ms_per_task | 0.100 ms/task |" in text


def test_plots_and_readme_section(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the 'bench' extra)")
    paths = suite.plots(fake_results(), str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "startup.png",
        "memory.png",
        "latency.png",
        "bandwidth.png",
    ]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{suite.START}\nold\n{suite.END}\noutro\n")
    suite.update_readme(str(readme), "new table\n", paths[0])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n")
    assert "new table" in text and "old" not in text and "![fleet start-up](startup.png)" in text


def noisy(results, runs_s):
    results["bare_import"]["runs_s"] = runs_s
    return results


def test_a_clean_run_has_no_warning():
    results = fake_results()
    assert _common.spread(results["bare_import"]["runs_s"]) < _common.FLOOR_SPREAD_LIMIT
    assert suite.run_warnings(results) == []
    assert "Warning" not in suite.markdown(results)


def test_a_noisy_floor_is_a_warning_in_the_markdown():
    text = suite.markdown(noisy(fake_results(), [2.0, 2.5, 3.1]))
    assert text.startswith(
        "> **Warning:** noisy run: the floor (bare `import tensorflow`) varied 44% between its 3 "
        "repeats (2.00 s to 3.10 s; limit 25% of their median); the ratios against it are "
        "unreliable.\n\nMeasured on"
    )
    assert "beat its own floor" not in text


def test_a_spread_at_the_limit_is_not_noisy():
    limit = _common.FLOOR_SPREAD_LIMIT
    assert suite.run_warnings(noisy(fake_results(), [2.0, 2.0 + 2.0 * limit / 2, 2.0])) == []
    assert suite.run_warnings(noisy(fake_results(), [2.0])) == []  # one repeat: no spread


def test_a_figure_under_its_floor_is_a_warning():
    results = fake_results()
    results["startup"][2]["create_local_cluster"]["seconds"] = 2.1  # 4 servers, floor 2.5 s
    (warning,) = suite.run_warnings(results)
    assert warning == (
        "Warning: tf.test.create_local_cluster, 4 servers: 2.10 s beat its own floor (bare "
        "`import tensorflow`, 2.50 s), which no start that imports TensorFlow whole can do: the "
        "machine's load changed during the run; the ratios against the floor are unreliable."
    )
    assert "> **Warning:** tf.test.create_local_cluster, 4 servers: 2.10 s beat its own" in (
        suite.markdown(results)
    )


def test_a_local_fleet_under_the_bare_import_is_no_warning():
    # its servers import TensorFlow without Keras and SciPy: the bare import does not bound it
    results = fake_results()
    results["startup"][2]["local_fleet"]["seconds"] = 2.1
    assert suite.run_warnings(results) == []


def test_floor_points_spread_the_floor_over_the_startup_rows():
    assert suite.floor_points(3, 4) == [0, 2, 4]
    assert suite.floor_points(3, 5) == [0, 2, 5]
    assert suite.floor_points(1, 4) == [0]


def fake_side(key, servers, warm_sizes):
    """A made-up measurement of the side-by-side: floor 2.5 s; cold LocalFleet ready at 2.6 s +
    0.01 s/server and gone 0.1 s later; cold create_local_cluster 3.0 s + 0.02 s/server; a warm
    start 0.1 s + 0.005 s/server, its close 0.05 s; TensorFlow's warm floor 0.01 s/server."""
    if key == "floor":
        return {"ready_s": 2.5}
    if key == "warm_tf":
        return {f"start_s[{n}]": 0.01 * n for n in warm_sizes}
    if key == "warm":
        return {
            **{f"start_s[{n}]": 0.1 + 0.005 * n for n in warm_sizes},
            **{f"close_s[{n}]": 0.05 for n in warm_sizes},
        }
    ready = 2.6 + 0.01 * servers if key == "local_fleet" else 3.0 + 0.02 * servers
    return {"ready_s": ready, "exit_s": ready + 0.1}


def fake_measurements(monkeypatch, floor_s):
    """Replace every measuring function of the suite: the floor's repeats take ``floor_s`` in
    turn, every fleet start 3.0 s, the side-by-side ``fake_side``. Returns the log of start-ups
    in the order measured."""
    log = []
    floors = iter([2.5, *floor_s])  # the first is the warm-up

    def once(method, servers):
        log.append((method, servers))
        seconds = next(floors) if method == "bare_import" else 3.0
        return seconds, {"pss_mib": 100.0, "rss_mib": 200.0}

    monkeypatch.setattr(startup, "measure_side", fake_side)

    latency = {"median_ms": 1.0, "p99_ms": 2.0, "mean_ms": 1.1, "steps": 10}
    monkeypatch.setattr(startup, "once", once)
    monkeypatch.setattr(suite.master_choice, "measure", lambda steps, rounds: {"raw": latency})
    monkeypatch.setattr(
        suite, "scale_latency", lambda ns, steps: [{"tasks": n, **latency} for n in ns]
    )
    monkeypatch.setattr(
        suite.transfer,
        "measure",
        lambda mbs, repeats: [{"mb": 1, "gb_per_s": 1.0, "in_process_gb_per_s": 2.0}],
    )
    monkeypatch.setattr(suite, "machine", lambda: "a made-up machine")
    monkeypatch.setattr(suite, "tensorflow_version", lambda: "0.0")
    monkeypatch.setattr(
        suite, "plots", lambda r, out: [os.path.join(out, n) for n in ("startup.png", "memory.png")]
    )
    return log


def test_the_floor_is_measured_three_times_around_the_startup_figures(monkeypatch):
    log = fake_measurements(monkeypatch, [2.0, 2.5, 3.1])
    results = suite.run("quick")
    floor = [i for i, (method, _) in enumerate(log) if method == "bare_import"]
    methods = len(suite.LABELS)
    assert floor == [0, 1, 1 + 2 * methods + 1, len(log) - 1]  # warm-up, before, between, after
    assert results["bare_import"]["runs_s"] == [2.0, 2.5, 3.1]
    assert results["bare_import"]["seconds"] == 2.5
    assert [w.split(":")[1] for w in results["warnings"]] == [" noisy run"]


def test_without_readme_the_suite_writes_the_scratch_folder_and_no_readme(
    monkeypatch, tmp_path, capsys
):
    fake_measurements(monkeypatch, [2.5, 2.5, 2.5])
    monkeypatch.setattr(suite, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(suite, "RECORD", str(tmp_path / "record"))
    monkeypatch.chdir(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{suite.START}\nold\n{suite.END}\n")

    def update_readme(*args):
        raise AssertionError("README rewritten without --readme")

    monkeypatch.setattr(suite, "update_readme", update_readme)
    args = suite.parse_args([])
    assert args.readme is None and args.out == suite.SCRATCH
    suite.main([])
    assert readme.read_text() == f"intro\n{suite.START}\nold\n{suite.END}\n"
    assert not (tmp_path / "record").exists()
    written = json.loads((tmp_path / "scratch" / "results.json").read_text())
    assert written["bare_import"]["runs_s"] == [2.5, 2.5, 2.5] and written["warnings"] == []
    assert "Measured on" in (tmp_path / "scratch" / "results.md").read_text()
    assert "Measured on" in capsys.readouterr().out


def test_readme_is_rewritten_only_with_the_flag_and_shows_the_warnings(
    monkeypatch, tmp_path, capsys
):
    fake_measurements(monkeypatch, [2.0, 2.5, 3.1])
    monkeypatch.setattr(suite, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(suite, "RECORD", str(tmp_path / "record"))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{suite.START}\nthe previous section\n{suite.END}\n")
    assert suite.parse_args(["--readme", str(readme)]).out == suite.RECORD
    assert suite.parse_args(["--readme", str(readme), "--out", "x"]).out == "x"
    suite.main(["--readme", str(readme)])
    text = readme.read_text()
    assert "the previous section" not in text and "> **Warning:** noisy run: the floor" in text
    assert "![fleet start-up](record/startup.png)" in text
    assert not (tmp_path / "scratch").exists()
    record = tmp_path / "record"
    assert "> **Warning:** noisy run" in (record / "results.md").read_text()
    assert "Warning: noisy run" in capsys.readouterr().err


def test_help_names_readme_as_the_explicit_way_to_rewrite_readme(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Without --readme no README is read or written" in text
    assert "--readme PATH explicitly rewrite this README's benchmark section" in text


def test_importing_every_benchmark_does_not_import_tensorflow():
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "import _common, master_choice, mwms_throughput, seed_style_fleet, startup, suite\n"
        "import accept_check, fast_failure, restart, transfer\n"
        "assert 'tensorflow' not in sys.modules, 'a benchmark imports TensorFlow at import time'\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr


def test_side_by_side_interleaves_its_rounds_with_the_floor(monkeypatch):
    log = []

    def measure_side(key, servers, warm_sizes):
        log.append((key, servers))
        return fake_side(key, servers, warm_sizes)

    monkeypatch.setattr(startup, "measure_side", measure_side)
    result = startup.side_by_side([8, 16], [8, 16], repeats=3)
    plan = [("floor", 0), ("local_fleet", 8), ("create_local_cluster", 8)]
    plan += [("local_fleet", 16), ("create_local_cluster", 16), ("warm", 0), ("warm_tf", 0)]
    rounds = [log[i : i + len(plan)] for i in range(0, len(log), len(plan))]
    assert len(rounds) == 3 and all(sorted(r) == sorted(plan) for r in rounds)
    assert [r[0] for r in rounds] == plan[:3]  # each round starts one later in the plan
    assert result["floor"]["runs_s"] == [2.5, 2.5, 2.5]
    (cold8, cold16) = result["cold"]
    assert cold8["local_fleet"]["seconds"] == pytest.approx(2.78)
    assert cold8["local_fleet"]["ratio"] == pytest.approx(2.78 / 2.5)
    assert cold8["local_fleet_ready"]["seconds"] == pytest.approx(2.68)
    assert cold16["create_local_cluster"]["seconds"] == pytest.approx(3.42)
    assert [w["start"]["seconds"] for w in result["warm"]] == pytest.approx([0.14, 0.18])
    assert [w["tf_in_process"]["seconds"] for w in result["warm"]] == pytest.approx([0.08, 0.16])
    assert result["slopes"] == pytest.approx(
        {
            "cold_s_per_server[local_fleet]": 0.01,
            "cold_s_per_server[create_local_cluster]": 0.02,
            "warm_s_per_server[local_fleet]": 0.005,
        }
    )
    # A warm start is far under the floor by design: that is no warning; a cold one would be.
    assert result["warnings"] == []


def test_side_by_side_is_one_table_in_the_markdown(monkeypatch):
    monkeypatch.setattr(startup, "measure_side", fake_side)
    results = fake_results()
    results["side_by_side"] = startup.side_by_side([8, 16], [8, 16], repeats=3)
    text = suite.markdown(results)
    assert "**Start-up side by side** (3 interleaved rounds, medians; floor: bare" in text
    assert (
        "| cold LocalFleet (launch, start, close, exit) | 2.78 s (1.11x) | 2.86 s (1.14x) | 0.010 |"
        in text
    )
    assert "| cold LocalFleet / create_local_cluster | 0.85x | 0.84x | |" in text
    assert "| warm LocalFleet `start()` (fork server up) | 0.14 s (0.06x) | 0.18 s (0.07x)" in text
    assert "in one process that imported it | 0.08 s (0.03x) | 0.16 s (0.06x) | |" in text
    assert suite.run_warnings(results) == []


def test_side_by_side_warnings_join_the_run_warnings(monkeypatch):
    floors = iter([2.0, 2.5, 3.1])

    def measure_side(key, servers, warm_sizes):
        return {"ready_s": next(floors)} if key == "floor" else fake_side(key, servers, warm_sizes)

    monkeypatch.setattr(startup, "measure_side", measure_side)
    results = fake_results()
    results["side_by_side"] = startup.side_by_side([8, 16], [16], repeats=3)
    (warning,) = suite.run_warnings(results)
    assert warning.startswith("Warning: side by side: noisy run: the floor")


def test_benchmarks_run_as_modules_of_the_package():
    proc = run_python(["-m", "benchmarks.startup", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--side-by-side" in proc.stdout
