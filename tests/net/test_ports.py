"""Automatic ports never collide, even when many processes pick them at the same moment."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from graphdist._net.ports import is_port_free, pick_free_ports, release_ports
from tests.conftest import start_python

FLEETS = 8


def test_reserved_ports_are_not_handed_out_twice():
    first = pick_free_ports(20)
    second = pick_free_ports(20)
    try:
        assert len(set(first) | set(second)) == 40
        assert all(is_port_free(p) for p in first + second)
    finally:
        release_ports(first + second)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_eight_fleets_started_at_once_by_eight_processes_all_come_up(tmp_path):
    go = tmp_path / "go"
    code = textwrap.dedent(
        f"""
        import json, os, time, graphdist
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        with graphdist.LocalFleet("local=2", start_timeout_s=180) as fleet:
            print(json.dumps([t.address for t in fleet.tasks]), flush=True)
        """
    )
    procs = [start_python("-c", code) for _ in range(FLEETS)]
    try:
        time.sleep(0.5)  # let every process reach the starting line
        go.touch()
        outputs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * FLEETS, [err[-500:] for _, err in outputs]
    addresses = [a for out, _ in outputs for a in json.loads(out)]
    assert len(addresses) == 2 * FLEETS
    assert len(set(addresses)) == 2 * FLEETS
