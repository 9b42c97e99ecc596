"""The benchmark suite's report: tables, plots and the README section it rewrites.

The figures themselves are measured by ``make bench``; this checks how they are reported, on a
small made-up result, without timing anything.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
suite = pytest.importorskip("suite")


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
        "bare_import": {"seconds": 2.5, "pss_mib": 300, "rss_mib": 500},
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
    pytest.importorskip("matplotlib")
    paths = suite.plots(fake_results(), str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "startup.png",
        "memory.png",
        "latency.png",
        "bandwidth.png",
    ]
    from pathlib import Path

    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{suite.START}\nold\n{suite.END}\noutro\n")
    suite.update_readme(str(readme), "new table\n", paths[0])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n")
    assert "new table" in text and "old" not in text and "![fleet start-up](startup.png)" in text
