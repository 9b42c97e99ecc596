"""The command a run prints when it passes a warm agent over (:func:`graphdist._distribute.
warmagent.agent_command`): the rule over given environments (the e2e test that follows it is
tests/distribute/test_warmagent.py)."""

from __future__ import annotations

from graphdist._distribute.warm import check_preload, env_differences
from graphdist._distribute.warmagent import agent_command


def test_every_differing_variable_read_at_import_is_listed_and_nothing_else():
    run = {
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": "/a",
        "HOME": "/h",
        "CUDA_VISIBLE_DEVICES": "",
    }
    agent = {"PYTHONPATH": "/b", "PYTHONHASHSEED": "0", "HOME": "/other"}
    assert env_differences(run, agent) == ["PYTHONHASHSEED", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"]
    assert env_differences(agent, agent) == []


def test_the_command_stops_the_agent_and_starts_one_with_the_runs_values():
    preload = check_preload("auto")
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    assert agent_command(preload, env, ["TF_CPP_MIN_LOG_LEVEL"]) == (
        "graphdist warm stop && TF_CPP_MIN_LOG_LEVEL=2 graphdist warm start"
    )


def test_a_variable_the_run_does_not_set_is_unset_and_values_are_quoted():
    env = {"PYTHONPATH": "/my dir"}
    assert agent_command(["numpy"], env, ["PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"]) == (
        "graphdist warm stop --preload numpy && env -u TF_CPP_MIN_LOG_LEVEL "
        "PYTHONPATH='/my dir' graphdist warm start --preload numpy"
    )
