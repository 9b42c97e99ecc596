"""The Slurm port step's ports (graphdist._proc.slurm.free_ports runs this script on each node,
graphdist's own picker there):
below the node's ephemeral range, where no outgoing connection takes them between the step and
the task's server, distinct, free and as many as asked. A port-0 bind (the step before) gave an
ephemeral one, and a requeued run's server could not bind it seconds later."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from graphdist._ports import is_port_free
from graphdist._proc.slurm import _PORTS

pytestmark = pytest.mark.timeout(30)


def test_the_port_step_draws_free_ports_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    done = subprocess.run(
        [sys.executable, "-I", "-c", _PORTS.format(k=6)],
        env={**os.environ, "SLURMD_NODENAME": "node-a"},
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    name, *ports = done.stdout.split()
    assert name == "node-a"
    got = [int(p) for p in ports]
    assert len(got) == len(set(got)) == 6
    assert all(1024 < p < low for p in got), (got, low)
    assert all(is_port_free(p) for p in got)


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("gdn9 2001 2002", "answered as node(s) gdn9, which job 7 (2 node(s): gdn1,gdn2)"),
        ("gdn1 2001", "Slurm could not run graphdist's port step on gdn2"),
    ],
)
def test_a_port_step_that_answers_for_another_node_is_refused_naming_it(
    tmp_path, monkeypatch, answer, words
):
    """A node whose step reports a name outside the allocation (its SLURMD_NODENAME is not
    its Slurm name), or a node that gives no answer, is one typed error naming it."""
    from graphdist._exceptions import ArgumentError
    from graphdist._proc.slurm import Allocation, free_ports

    srun = tmp_path / "srun"
    srun.write_text(f"#!/bin/sh\necho '{answer}'\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    alloc = Allocation("7", ("gdn1", "gdn2"), {"gdn1": "10.0.0.1", "gdn2": "10.0.0.2"})
    with pytest.raises(ArgumentError, match=re.escape(words)):
        free_ports(alloc, {"gdn1": 1, "gdn2": 1}, "graphdist-test-ports")
