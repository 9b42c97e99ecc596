"""The benchmark suite's report: tables, plots, targets, the warnings of an untrustworthy run
and the README section it rewrites only on request; and smoke runs of the real measuring code.

The report tests use small made-up results (the measuring functions are replaced). The smoke
tests run ``startup.py`` and ``suite.py`` for real at their smallest sizes (one server, one
round) and check the shape of what they print and write, never their figures: those are
``make bench``'s.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, processes_marked, run_python, wait_gone

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
        "repeats": 3,
        "bare_import": {"seconds": 2.5, "pss_mib": 300, "rss_mib": 500, "runs_s": [2.4, 2.5, 2.6]},
        "lean_import": {"seconds": 2.0, "pss_mib": 250, "rss_mib": 400, "runs_s": [2.0, 2.0, 2.1]},
        "startup": rows,
        "targets": [("a target met", True), ("a target missed", False)],
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
    # LocalFleet against the lean floor (2.0 s), the others against the bare one (2.5 s)
    assert "| 4 | 2.70 s (1.35x) | 10.00 s (4.00x) | 3.00 s (1.20x) |" in text
    assert "| latency_ms_per_task | 0.100 ms/task |" in text


def test_markdown_names_each_benchmark_beside_its_figures_and_every_target():
    text = suite.markdown(fake_results())
    for heading, benchmark in [
        ("**Start-up**", "benchmarks/startup.py"),
        ("**Memory of every process", "benchmarks/startup.py"),
        ("**Step latency**", "benchmarks/master_choice.py"),
        ("**Transfer**", "benchmarks/transfer.py"),
        ("**Scale**", "benchmarks/suite.py"),
    ]:
        (line,) = [line for line in text.splitlines() if line.startswith(heading)]
        assert f"(`{benchmark}`" in line, line
    assert "- met: a target met\n- **MISSED**: a target missed\n" in text
    assert "| lean `import tensorflow` (as a LocalFleet server) | 250 / 400 (?) | | |" in text


def test_plots(tmp_path):
    paths = suite.plots(fake_results(), str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "startup.png",
        "memory.png",
        "latency.png",
        "bandwidth.png",
    ]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


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


def test_a_floor_measured_fewer_than_three_times_is_a_warning():
    (warning,) = suite.run_warnings(noisy(fake_results(), [2.0]))
    assert warning == (
        "Warning: the floors were measured 1 time, fewer than 3: how much the machine's load "
        "moved during the run is unknown."
    )


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


def test_a_local_fleet_is_held_to_the_lean_floor_not_the_bare_one():
    results = fake_results()
    results["startup"][2]["local_fleet"]["seconds"] = 2.1  # under the bare floor, over the lean
    assert suite.run_warnings(results) == []
    results["startup"][2]["local_fleet"]["seconds"] = 1.9  # under the lean floor (2.0 s)
    (warning,) = suite.run_warnings(results)
    assert warning == (
        "Warning: graphdist LocalFleet, 4 servers: 1.90 s beat its own floor (lean `import "
        "tensorflow` (without Keras and SciPy, as a LocalFleet server), 2.00 s), which no start "
        "that imports TensorFlow as a LocalFleet server does can do: the machine's load changed "
        "during the run; the ratios against the floor are unreliable."
    )


def test_interleaved_rounds_rotate_the_plan():
    log = []
    out = _common.interleaved(["a", "b", "c"], 4, lambda key: log.append(key) or len(log))
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert out == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}


def test_parse_targets_reads_back_what_report_targets_printed(capsys):
    lines = [("one within 1.05x", True), ("two within 1.25x", False)]
    assert _common.report_targets(lines) == ["two within 1.25x"]
    assert _common.parse_targets(capsys.readouterr().out) == lines


def fake_side(key, servers, warm_sizes):
    """A made-up measurement of the side-by-side: floors 2.5 s (bare) and 2.0 s (lean); cold
    LocalFleet ready at 2.6 s + 0.01 s/server and gone 0.1 s later; cold create_local_cluster
    3.0 s + 0.02 s/server; a warm start 0.1 s + 0.005 s/server, its close 0.05 s; TensorFlow's
    warm floor 0.01 s/server to answering, of which 0.005 s/server until it returned."""
    if key in ("bare_import", "lean_import"):
        return {"ready_s": 2.5 if key == "bare_import" else 2.0}
    if key == "warm_tf":
        return {
            **{f"start_s[{n}]": 0.01 * n for n in warm_sizes},
            **{f"return_s[{n}]": 0.005 * n for n in warm_sizes},
        }
    if key == "warm":
        return {
            **{f"start_s[{n}]": 0.1 + 0.005 * n for n in warm_sizes},
            **{f"close_s[{n}]": 0.05 for n in warm_sizes},
        }
    ready = 2.6 + 0.01 * servers if key == "local_fleet" else 3.0 + 0.02 * servers
    return {"ready_s": ready, "exit_s": ready + 0.1}


def fake_measurements(monkeypatch, floor_s):
    """Replace every measuring function of the suite: the bare floor's rounds take ``floor_s``
    in turn (after a warm-up of 2.5 s), the lean floor 2.0 s, every fleet start 3.0 s, the
    side-by-side ``fake_side``. Returns the log of start-ups in the order measured."""
    log = []
    floors = iter([2.5, *floor_s])

    def once(method, servers):
        log.append((method, servers))
        seconds = {"bare_import": None, "lean_import": 2.0}.get(method, 3.0) or next(floors)
        return seconds, {"pss_mib": 100.0, "rss_mib": 200.0, "processes": servers + 1}

    monkeypatch.setattr(startup, "measure_side", fake_side)

    latency = {"median_ms": 1.0, "p99_ms": 2.0, "mean_ms": 1.1, "steps": 10}
    sessions = [
        "raw TF, master 0",
        "graphdist, master 0",
        "raw TF, master 1",
        "graphdist, master 1",
    ]
    monkeypatch.setattr(startup, "once", once)
    monkeypatch.setattr(
        suite.master_choice, "measure", lambda steps, rounds: {s: latency for s in sessions}
    )
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


def test_the_startup_figures_are_interleaved_rounds_with_both_floors(monkeypatch):
    log = fake_measurements(monkeypatch, [2.0, 2.5, 3.1])
    results = suite.run("quick")
    sizes = suite.MODES["quick"]["sizes"]
    plan = [("bare_import", 0), ("lean_import", 0)]
    plan += [(m, n) for n in sizes for m in startup.METHODS]
    assert log[0] == ("bare_import", 0)  # the warm-up, not counted
    rounds = [log[1 + i * len(plan) : 1 + (i + 1) * len(plan)] for i in range(3)]
    assert len(log) == 1 + 3 * len(plan)
    assert [r[0] for r in rounds] == plan[:3]  # each round starts one later in the plan
    assert all(sorted(r) == sorted(plan) for r in rounds)
    assert results["bare_import"]["runs_s"] == [2.0, 2.5, 3.1]
    assert results["bare_import"]["seconds"] == 2.5
    assert results["lean_import"]["seconds"] == 2.0
    assert results["startup"][0]["local_fleet"]["processes"] == 2
    assert [w.split(":")[1] for w in results["warnings"]] == [" noisy run"]


def test_the_suite_checks_every_target(monkeypatch):
    fake_measurements(monkeypatch, [2.5, 2.5, 2.5])
    results = suite.run("quick")
    texts = [text for text, _ in results["targets"]]
    # the side by side's warm start: 0.14 s vs 0.08 s at 8 servers, 0.18 s vs 0.16 s at 16
    assert texts[0].startswith("warm LocalFleet start(), 8 servers: 1.75x TensorFlow's warm")
    assert texts[1].startswith("warm LocalFleet start(), 16 servers: 1.12x TensorFlow's warm")
    assert [met for _, met in results["targets"][:2]] == [False, True]
    # master_choice's own targets, read back from its check: equal medians meet the 1.05x ones
    assert texts[2:] == [
        "graphdist / raw TF, master 0: 1.000x (target <= 1.05) (benchmarks/master_choice.py)",
        "graphdist / raw TF, master 1: 1.000x (target <= 1.05) (benchmarks/master_choice.py)",
        "seed's master / chosen master: 1.00x faster (target >= 1.8) (benchmarks/master_choice.py)",
    ]
    assert [met for _, met in results["targets"][2:]] == [True, True, False]


def test_a_missed_target_is_printed_and_the_script_exits_1(monkeypatch, tmp_path, capsys):
    fake_measurements(monkeypatch, [2.5, 2.5, 2.5])
    results = suite.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "MISSED  warm LocalFleet start(), 8 servers: 1.75x" in out
    assert "met     warm LocalFleet start(), 16 servers: 1.12x" in out
    assert len(results["missed"]) == 2
    with pytest.raises(SystemExit) as exit_:
        _common.finish(None, None, results["missed"])
    assert exit_.value.code == 1


START, END = _common.section_markers("suite")


def test_without_readme_the_suite_writes_the_scratch_folder_and_no_readme(
    monkeypatch, tmp_path, capsys
):
    fake_measurements(monkeypatch, [2.5, 2.5, 2.5])
    monkeypatch.setattr(suite, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(suite, "RECORD", str(tmp_path / "record"))
    monkeypatch.chdir(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\n")

    def update_readme_section(*args):
        raise AssertionError("README rewritten without --readme")

    monkeypatch.setattr(suite, "update_readme_section", update_readme_section)
    args = suite.parse_args([])
    assert args.readme is None and args.out == suite.SCRATCH and args.mode == "quick"
    suite.main([])
    assert readme.read_text() == f"intro\n{START}\nold\n{END}\n"
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
    readme.write_text(f"intro\n{START}\nthe previous section\n{END}\noutro\n")
    assert suite.parse_args(["--readme", str(readme)]).out == suite.RECORD
    assert suite.parse_args(["--readme", str(readme), "--out", "x"]).out == "x"
    suite.main(["--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith(f"intro\n{START}\n") and text.endswith(f"{END}\noutro\n")
    assert "the previous section" not in text and "> **Warning:** noisy run: the floor" in text
    assert "![fleet start-up](record/startup.png)" in text
    assert "![fleet memory](record/memory.png)" in text  # every curve the suite plots
    assert f"Printed by `python benchmarks/suite.py --readme {readme}` on " in text
    assert not (tmp_path / "scratch").exists()
    record = tmp_path / "record"
    assert "> **Warning:** noisy run" in (record / "results.md").read_text()
    assert "Warning: noisy run" in capsys.readouterr().err


def test_help_names_readme_as_the_explicit_way_to_rewrite_the_record(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Without --readme no page is read or written" in text
    assert "--readme PATH explicitly rewrite this page's benchmark section" in text
    assert _common.RECORD_PAGE in text


# Every section or sentence a benchmark rewrites with --readme, and the page that holds them all
# (the docs' benchmarks page): a run with --readme docs/benchmarks.md finds each exactly once.
RECORD_SECTIONS = (
    "suite",
    "hosts",
    "fast_failure",
    "master_choice",
    "master_choice_ray",
    "restart",
    "soak",
    "tls",
    "suite-cost",
    "progress",
)
RECORD_SENTENCES = ("master_choice_line", "accept_check")


def test_the_record_page_holds_every_benchmark_section_once():
    page = Path(REPO, _common.RECORD_PAGE).read_text(encoding="utf-8")
    for name in RECORD_SECTIONS + RECORD_SENTENCES:
        start, end = _common.section_markers(name)
        assert page.count(start) == 1 and page.count(end) == 1, name
        assert page.index(start) < page.index(end), name
        body = page[page.index(start) + len(start) : page.index(end)]
        assert "Printed by `python benchmarks/" in body or "(`python benchmarks/" in body, name
    for name in RECORD_SENTENCES:  # update_readme_inline replaces within one line
        start, end = _common.section_markers(name)
        [line] = [ln for ln in page.splitlines() if start in ln]
        assert end in line, name
    readme = Path(REPO, "README.md").read_text(encoding="utf-8")
    assert "<!-- bench:" not in readme  # the front page holds no record


def test_importing_every_benchmark_does_not_import_tensorflow():
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "import _common, master_choice, mwms_throughput, seed_style_fleet, startup, suite\n"
        "import accept_check, fast_failure, hosts, restart, soak, tls, transfer\n"
        "assert 'tensorflow' not in sys.modules, 'a benchmark imports TensorFlow at import time'\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr


def test_side_by_side_interleaves_its_rounds_with_both_floors(monkeypatch):
    log = []

    def measure_side(key, servers, warm_sizes):
        log.append((key, servers))
        return fake_side(key, servers, warm_sizes)

    monkeypatch.setattr(startup, "measure_side", measure_side)
    result = startup.side_by_side([8, 16], [8, 16], repeats=3)
    plan = [("bare_import", 0), ("lean_import", 0), ("local_fleet", 8)]
    plan += [("create_local_cluster", 8), ("local_fleet", 16), ("create_local_cluster", 16)]
    plan += [("warm", 0), ("warm_tf", 0)]
    rounds = [log[i : i + len(plan)] for i in range(0, len(log), len(plan))]
    assert len(rounds) == 3 and all(sorted(r) == sorted(plan) for r in rounds)
    assert [r[0] for r in rounds] == plan[:3]  # each round starts one later in the plan
    assert result["floor"]["runs_s"] == [2.5, 2.5, 2.5]
    assert result["lean_floor"]["runs_s"] == [2.0, 2.0, 2.0]
    (cold8, cold16) = result["cold"]
    assert cold8["local_fleet"]["seconds"] == pytest.approx(2.78)
    assert cold8["local_fleet"]["ratio"] == pytest.approx(2.78 / 2.0)  # the lean floor
    assert cold8["local_fleet_ready"]["seconds"] == pytest.approx(2.68)
    assert cold16["create_local_cluster"]["seconds"] == pytest.approx(3.42)
    assert cold16["create_local_cluster"]["ratio"] == pytest.approx(3.42 / 2.5)  # the bare one
    assert [w["start"]["seconds"] for w in result["warm"]] == pytest.approx([0.14, 0.18])
    assert [w["tf_in_process"]["seconds"] for w in result["warm"]] == pytest.approx([0.08, 0.16])
    assert [w["start"]["ratio"] for w in result["warm"]] == pytest.approx([1.75, 1.125])
    # the floor is TensorFlow's servers answering; its return is printed beside it
    assert [w["tf_returned"]["seconds"] for w in result["warm"]] == pytest.approx([0.04, 0.08])
    assert (
        "1.75x TensorFlow's warm floor (0.14 s vs 0.08 s; 3.50x its return"
        in (result["targets"][0][0])
    )
    assert [met for _, met in result["targets"]] == [False, True]  # 1.75x and 1.12x vs 1.25x
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
    assert (
        "**Start-up side by side** (`benchmarks/startup.py --side-by-side`, 3 interleaved" in text
    )
    assert (
        "| cold LocalFleet (launch, start, close, exit), x the lean floor | 2.78 s (1.39x) | "
        "2.86 s (1.43x) | 0.010 |" in text
    )
    assert "| cold LocalFleet / create_local_cluster | 0.85x | 0.84x | |" in text
    assert (
        "| warm LocalFleet `start()` (fork server up), x TensorFlow's warm floor | 0.14 s (1.75x) "
        "| 0.18 s (1.12x) | 0.005 |" in text
    )
    assert "already, until every server answered | 0.08 s | 0.16 s | |" in text
    returned = "(its servers not answering yet), x the floor | 0.04 s (0.50x) | 0.08 s (0.50x) |"
    assert returned in text
    assert suite.run_warnings(results) == []


def test_a_cold_local_fleet_under_the_lean_floor_is_a_side_by_side_warning(monkeypatch):
    def measure_side(key, servers, warm_sizes):
        if key == "lean_import":
            return {"ready_s": 2.9}  # over the cold LocalFleet's 2.78 s at 8 servers
        return fake_side(key, servers, warm_sizes)

    monkeypatch.setattr(startup, "measure_side", measure_side)
    results = fake_results()
    results["side_by_side"] = startup.side_by_side([8], [8], repeats=3)
    (warning,) = suite.run_warnings(results)
    assert warning.startswith(
        "Warning: side by side: cold LocalFleet (launch, start, close, exit), 8 servers: 2.78 s "
        "beat its own floor (lean `import tensorflow`"
    )


def test_side_by_side_warnings_join_the_run_warnings(monkeypatch):
    floors = iter([2.0, 2.5, 3.1])

    def measure_side(key, servers, warm_sizes):
        if key == "bare_import":
            return {"ready_s": next(floors)}
        return fake_side(key, servers, warm_sizes)

    monkeypatch.setattr(startup, "measure_side", measure_side)
    results = fake_results()
    results["side_by_side"] = startup.side_by_side([8, 16], [16], repeats=3)
    (warning,) = suite.run_warnings(results)
    assert warning.startswith("Warning: side by side: noisy run: the floor (bare")


def test_the_hosts_report_says_a_veth_pair_is_no_network_and_checks_both_targets():
    import hosts

    table, targets = hosts.report(
        {"across_ms": 3.3, "one_host_ms": 3.0, "ratio": 1.1},
        {"two_nodes_s": 20.0, "one_node_s": 10.0, "ratio": 2.0},
    )
    assert "a veth pair is not a network" in table and "| 1.10x |" in table and "| 2.00x |" in table
    assert [met for _, met in targets] == [True, False]  # 1.1 <= 2.0; 2.0 > 1.5


def test_the_tls_report_says_a_veth_pair_is_no_network_and_checks_its_targets():
    import tls

    def figures(step_ratio, bandwidth_ratio):
        def side(plain, ratio):
            return {"plain": plain, "tls": plain * ratio, "ratio": ratio}

        cpu = {"plain": 0.5, "tls": 0.6}
        return {
            "step_ms": side(2.0, step_ratio),
            "mb_per_s": side(600.0, bandwidth_ratio),
            "serve_s": side(6.0, 1.1),
            "connect_s": side(0.05, 4.0),
            "cpu_cores": {"servers": cpu, "gateways": cpu},
            "mb": 64, "steps": 50, "rounds": 3, "transfers": 5, "cores": 2,
        }  # fmt: skip

    table, targets = tls.report(figures(1.29, 0.51))
    assert "a veth pair is not a network" in table
    assert "| 1.29x | <= 1.3x |" in table and "| 0.51x | >= 0.5x |" in table
    assert "| 64 MB task 1 -> task 0, host 2 -> host 1 (MB/s) | 600 | 306 |" in table
    assert "| 0.050 | 0.200 | 4.0x | none |" in table  # connect: seconds, no target
    assert [met for _, met in targets] == [True, True, True]
    _, targets = tls.report(figures(1.31, 0.49))
    assert [met for _, met in targets] == [False, False, True]  # 1.31 > 1.3; 0.49 < 0.5


def test_benchmarks_run_as_modules_of_the_package():
    proc = run_python(["-m", "benchmarks.startup", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--side-by-side" in proc.stdout


# -- smoke runs: the real measuring code at its smallest size; shapes, never figures -------------


def run_marked(args, timeout_s):
    """Run ``python ARGS`` with a mark in its environment; after it exits, check that nothing it
    started (a fork server, a spawned server, however deep) is left. The finished process."""
    mark = f"bench-smoke-{uuid.uuid4().hex}"
    proc = run_python(args, timeout=timeout_s, env={"GRAPHDIST_TEST_MARK": mark})
    assert wait_gone(processes_marked(mark), 30) == [], "a benchmark left processes behind"
    return proc


def assert_timing(figures, runs):
    """A start-up figure: positive seconds, one per round."""
    assert figures["seconds"] > 0 and len(figures["runs_s"]) == runs
    assert all(isinstance(t, float) and t > 0 for t in figures["runs_s"])


def assert_memory(figures, processes):
    """Memory of every process a method ran, read after its READY: positive, and counted over
    at least ``processes`` processes."""
    assert figures["pss_mib"] > 0 and figures["rss_mib"] >= figures["pss_mib"] * 0.5
    assert figures["processes"] >= processes


@pytest.mark.timeout(360)
def test_suite_smoke_run(tmp_path):
    proc = run_marked(["benchmarks/suite.py", "--smoke", "--out", str(tmp_path)], timeout_s=340)
    r = json.loads((tmp_path / "results.json").read_text())
    # a missed target exits 1 and says MISSED: figures of a smoke run may miss, nothing else may
    missed = [text for text, met in r["targets"] if not met]
    assert proc.returncode == (1 if missed else 0), proc.stderr
    assert all(f"MISSED  {text}" in proc.stdout for text in missed)
    assert r["mode"] == "smoke" and r["elapsed_s"] > 0
    # the suite runs startup.py's own measuring code (its children, floors, memory of every
    # process): this is startup.py's smoke run too
    for kind in ("bare_import", "lean_import"):
        assert_timing(r[kind], 1)
        assert_memory(r[kind], 1)
        assert r[kind]["processes"] == 1
    (row,) = r["startup"]
    for method in startup.METHODS:
        assert_timing(row[method], 1)
    assert_memory(row["local_fleet"], 3)  # the owner, its fork server and the server
    assert_memory(row["seed_style"], 2)  # the parent and its spawned server
    assert_memory(row["create_local_cluster"], 1)
    assert row["create_local_cluster"]["processes"] == 1
    side = r["side_by_side"]
    for key in ("floor", "lean_floor"):
        assert_timing(side[key], 1)
    (cold,) = side["cold"]
    for key in ("local_fleet", "local_fleet_ready", "create_local_cluster"):
        assert_timing(cold[key], 1)
        assert cold[key]["ratio"] > 0
    (warm,) = side["warm"]
    for key in ("start", "close", "tf_in_process"):
        assert_timing(warm[key], 1)
    # the warm target, the restart() target, then master_choice's four (the device check's
    # own cost among them), each a text and whether it was met
    assert len(r["targets"]) == 6 and all(isinstance(met, bool) for _, met in r["targets"])
    assert r["targets"][0][0].startswith("warm LocalFleet start(), 1 servers: ")
    assert set(r["step_latency"]) == {
        "raw TF, master 0",
        "graphdist, master 0 (the seed's)",
        "raw TF, master 1",
        "graphdist, master 1 (graphdist's choice)",
        "graphdist device check, per step",
    }
    assert all(f["median_ms"] > 0 and f["steps"] > 0 for f in r["step_latency"].values())
    (scale,) = r["scale_latency"]
    assert scale["tasks"] == 2 and scale["median_ms"] > 0
    (moved,) = r["transfer"]
    assert moved["mb"] == 1 and moved["gb_per_s"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "**Targets**" in md and "(`benchmarks/startup.py --side-by-side`, 1 interleaved" in md
    for name in ("startup.png", "memory.png", "latency.png", "bandwidth.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_restart_report_holds_recovery_to_1_1x_a_cold_start_plus_5_s_when_frozen(capsys):
    import restart

    def figures(case, **median):
        return {"case": case, "median": median, "worst_redone": 3, "save_every": 25}

    def verdicts(fig):
        lines, missed = restart.check(fig)
        return [line.split()[0] for line in lines], missed

    assert restart.RECOVERY_TARGET == 1.1 and restart.FREEZE_NOTICE_S == 5.0
    assert verdicts(figures("mwms-kill", ratio=1.09, cold_s=10))[0] == ["met", "met"]
    kept, missed = verdicts(figures("mwms-kill", ratio=1.12, cold_s=10))
    assert kept == ["MISSED", "met"] and "target <= 1.10" in missed[0]
    # frozen: 1.1 + 5 s / cold start (10 s: 1.6x)
    assert verdicts(figures("mwms-hang", ratio=1.59, cold_s=10))[0] == ["met", "met"]
    kept, missed = verdicts(figures("ps-freeze", ratio=1.61, cold_s=10))
    assert kept[0] == "MISSED" and "target <= 1.60" in missed[0]
    # a server restarted in place: no ratio, the freeze to its restart line within 5 s
    kept, _ = verdicts(figures("ps-worker-freeze", restart_line_s=4.9, cold_s=10))
    assert kept == ["met", "met"]
    kept, missed = verdicts(figures("ps-worker-freeze", restart_line_s=5.2, cold_s=10))
    assert kept == ["MISSED", "met"] and "freeze to the restart line: 5.20 s" in missed[0]
    assert set(restart.CASES) >= {"mwms-hang", "ps-freeze", "ps-worker-freeze"}


def test_the_restart_plot_draws_every_case_run_restarted_or_in_place(tmp_path):
    import restart

    results = {
        "mwms-kill": {"median": {"cold_s": 8.8, "recovery_s": 7.8, "stop_s": 0.2}},
        "mwms-freeze": {"median": {"cold_s": 12.5, "recovery_s": 16.2, "stop_s": 3.5}},
        "ps-worker-kill": {"median": {"cold_s": 16.4, "restart_line_s": 0.02, "next_step_s": 0.2}},
    }
    restart.plot(results, str(tmp_path / "restart.png"))
    assert (tmp_path / "restart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_soak_report_fails_on_any_restart(capsys):
    import soak

    healthy = {"minutes": 10.2, "returncode": 0, "restarts": 0, "attempts": 1, "steps": 15}
    healthy |= {"step_median_s": 40.0, "heartbeat_s": 3.0, "burners": 4}
    lines, missed = soak.report(healthy)
    assert missed == [] and "steps done (worker-0):" in lines[1]
    _, missed = soak.report({**healthy, "restarts": 1, "attempts": 2})
    assert [m.split(":")[1].strip() for m in missed] == ["false restarts", "attempts"]


def test_the_suite_cost_charges_each_process_to_its_kind_and_its_workers_test():
    """A made-up sample: a worker ran test a, then test b; a fork server its test a started,
    a task under that, and a process re-parented to init; CPU used before the run is not
    charged."""
    import suite_cost
    from suite_cost import Proc, Samples

    worker = Proc(10, 1, "python", "[pytest-xdist running] tests/b.py::t", 0.0, 5.0, 0.0)
    procs = [
        worker,
        Proc(11, 10, "python", "python -c from graphdist._proc.forkserver import main", 1.0, 3.0),
        Proc(12, 11, "python", "graphdist local:0 (fleet of pid 10)", 1.5, 0.5),
        Proc(13, 10, "python", "python -c import tensorflow", 20.0, 6.0),
        Proc(14, 1, "python", "python daemon.py", 2.0, 1.0),
        Proc(15, 1, "kdamond.0", "", 0.0, 100.0, 99.0),  # 99 CPU s before the run
    ]
    samples = Samples(
        procs={f"{p.pid}:0": p for p in procs},
        titles={10: [(0.0, "tests/a.py::x"), (10.0, "tests/b.py::t")]},
        busy_s=20.0,
        idle_s=20.0,
        wall_s=20.0,
    )
    result = suite_cost.report(samples, top=5)
    kinds = {name: (cpu, n) for name, cpu, n, _ in result["kinds"]}
    assert kinds["fleet fork servers (one per process that owns a fleet)"] == (3.0, 1)
    assert kinds["tests' helper scripts (python -c)"] == (6.0, 1)
    assert kinds["fleet servers, spares, guards (forked: no import)"] == (0.5, 1)
    assert kinds["other"] == (1.0, 1)  # kdamond: only its CPU during the run
    files = {name: cpu for name, cpu, _, _ in result["files"]}
    assert files["tests/a.py"] == 3.5 and files["tests/b.py"] == 6.0
    assert result["busy_share"] == 0.5 and result["unsampled_cpu_s"] == 20.0 - 16.5
    assert "| tests/b.py | 6 | 1 | 30% |" in suite_cost.render(result)
    # the floor: the busy CPU spread over the run's cores, whatever machine renders it later
    result["cores"] = 4
    assert (
        "floor, the same work with every core busy throughout: 5 s (0.1 min); the rest, 15 s"
        in (suite_cost.render(result))
    )


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_progress_smoke_run(tmp_path):
    out = tmp_path / "progress.json"
    proc = run_marked(["benchmarks/progress.py", "--smoke", "--no-check", "--json", str(out)], 110)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["warm"] is True and r["records"] > 0 and len(r["rows"]) == 2
    assert all(set(row) == {"with", "without"} for row in r["rows"])
    assert r["ratio"] > 0 and r["cpu_ratio"] > 0
