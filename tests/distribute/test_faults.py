"""Fault injection's arguments (graphdist/_distribute/faults.py): every bad value is refused with
an ArgumentError naming the argument, before anything starts. The runs themselves are tested
through the pytest plugin (tests/test_plugin.py) and on real training
(tests/distribute/test_restarts.py)."""

from __future__ import annotations

import math
import re
import sys

import pytest

from graphdist._distribute.faults import freeze, kill
from graphdist._distribute.injector import FaultInjector
from graphdist._exceptions import ArgumentError

TRAIN = [sys.executable, "train.py"]


def test_a_fault_says_what_it_is():
    assert repr(kill("worker-1", after=r"epoch 2/\d+")) == r"kill('worker-1', after='epoch 2/\\d+')"
    fault = freeze("chief-0", after_s=5, attempt=1, for_s=2, of=None)
    assert repr(fault) == "freeze('chief-0', after_s=5, attempt=1, for_s=2)"
    assert fault.after_s == 5.0 and fault.watched == "chief-0"
    assert kill("worker-1", after="x", of="worker-0").watched == "worker-0"
    assert kill("worker-0", after=re.compile("x")).after == re.compile("x")


@pytest.mark.parametrize(
    ("make", "name", "match"),
    [
        (lambda: kill("worker1", after="x"), "task", "task name such as 'worker-1'"),
        (lambda: kill("boss-0", after="x"), "task", "not 'boss-0'"),
        (lambda: kill(1, after="x"), "task", "not 1"),
        (lambda: kill("worker-1", after="x", of="w0"), "of", "of must be a task name"),
        (lambda: kill("worker-1"), "after", "exactly one of them"),
        (lambda: kill("worker-1", after="x", after_s=1), "after", "not both"),
        (lambda: kill("worker-1", after="("), "after", "is not: missing"),
        (lambda: kill("worker-1", after=3), "after", "a str or re.Pattern"),
        (lambda: kill("worker-1", after_s=-1), "after_s", ">= 0, not -1"),
        (lambda: kill("worker-1", after_s=math.nan), "after_s", ">= 0, not nan"),
        (lambda: kill("worker-1", after_s="5"), "after_s", "number of seconds, not '5'"),
        (lambda: kill("worker-1", after_s=True), "after_s", "number of seconds"),
        (lambda: kill("worker-1", after_s=1, attempt=-1), "attempt", "attempt"),
        (lambda: freeze("worker-1", after_s=1, for_s=0), "for_s", "for_s"),
    ],
)
def test_bad_faults_are_refused(make, name, match):
    with pytest.raises(ArgumentError, match=match) as err:
        make()
    assert err.value.name == name


@pytest.mark.parametrize(
    ("kwargs", "name", "match"),
    [
        ({"command": "python train.py"}, "command", "a list of arguments"),
        ({"command": []}, "command", "non-empty list"),
        ({"workers": 0}, "workers", "workers"),
        ({"timeout_s": 0}, "timeout_s", "> 0"),
        ({"wait_s": -1}, "wait_s", "> 0"),
        ({"max_restarts": -1}, "max_restarts", "max_restarts"),
        ({"restart_window_s": math.inf}, "restart_window_s", "finite"),
        ({"ps": 1}, "chief", "chief=True"),
        ({"launcher_args": "--expose"}, "launcher_args", "a list of arguments"),
        ({"cwd": "/no/such/folder"}, "cwd", "an existing folder, not '/no/such/folder'"),
        ({"faults": ["kill worker-1"]}, "faults", "made by kill"),
        ({"faults": kill("worker-2", after_s=1)}, "task", "no task 'worker-2' in a run of"),
        ({"faults": [kill("chief-0", after_s=1)]}, "task", "its tasks: worker-0, worker-1"),
        ({"faults": [kill("worker-1", after="x", of="worker-5")]}, "of", "no task 'worker-5'"),
        ({"faults": [kill("worker-1", after_s=1, attempt=1)]}, "attempt", "max_restarts=None"),
        (
            {"faults": [kill("worker-1", after_s=1, attempt=2)], "max_restarts": 1},
            "attempt",
            r"attempts are 0 to 1\); raise max_restarts",
        ),
        (
            {"faults": [kill("ps-0", after="x")], "ps": 1, "chief": True},
            "of",
            "ps-0 runs no command .* with of= \\(chief-0\\)",
        ),
    ],
)
def test_bad_runs_are_refused_before_anything_starts(kwargs, name, match):
    injector = FaultInjector()
    kwargs = {"command": TRAIN, **kwargs}
    with pytest.raises(ArgumentError, match=match) as err:
        injector.run(**kwargs)
    assert err.value.name == name
    assert injector.close() == []
    with pytest.raises(ArgumentError, match="closed"):
        injector.run(TRAIN)
    assert injector.close() == []  # twice is fine
