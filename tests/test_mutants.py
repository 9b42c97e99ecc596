"""``make mutants`` works (tests/mutants.py, mutmut): a smoke run on one small function. Nine
mutants of ``exit_status`` (graphdist/_failures.py) against one test that uses it only for two
signals: the tool must report both kinds, the mutants that test kills (a wrong condition) and
those it cannot see (the cap at 255, which only test_failures' own cases reach), each survivor
with its diff, and leave the checkout as it was."""

from __future__ import annotations

import pytest

from tests import mutants

pytestmark = [pytest.mark.needs("mutmut")]


# 8 to 14 s here (6 to 12 s of CPU); the bound leaves room for a machine whose two cores other
# tests' TensorFlow servers share (it took 50 s once beside a host bed's fleet)
@pytest.mark.timeout(90)
def test_a_small_mutation_run_reports_killed_and_surviving_mutants(tmp_path):
    weak = mutants.Module(
        "failures", "graphdist/_failures.py", ("tests/test_failures.py", "-k", "how_a_process")
    )
    only = ["graphdist._failures.x_exit_status__mutmut_[1-9]"]  # the first nine, fewer seconds
    result = mutants.run_module(weak, tmp_path, only=only)
    assert result.total == 9, mutants.report([result])
    assert 0 < result.killed < result.total, mutants.report([result])
    survived = [s for s in result.survivors if s.status == "survived"]
    assert survived and all(s.function == "exit_status" for s in survived)
    assert any("256" in s.line for s in survived), mutants.report([result])  # the cap
    text = mutants.report([result])
    assert f"{result.killed}/{result.total} killed" in text
    assert "SURVIVED: a test is missing" in text and "+++ " in text  # with its diff
    assert not (mutants.REPO / "mutants").exists()  # mutmut worked in the scratch copy only
