"""Automatic ports never collide, even when many processes pick them at the same moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from graphdist._net.ports import is_port_free, pick_free_ports, release_ports
from tests.conftest import REPO, start_python, wait_gone

FLEETS = 8


def test_reserved_ports_are_not_handed_out_twice():
    first = pick_free_ports(20)
    second = pick_free_ports(20)
    try:
        assert len(set(first) | set(second)) == 40
        assert all(is_port_free(p) for p in first + second)
    finally:
        release_ports(first + second)


# Process B: tries to reserve exactly port P (argv[1]) while process A holds it, both through
# the internal reserve and through pick_free_ports with a random draw that always gives P;
# then, once A says on stdin that it let go, picks P again the same way.
ALWAYS_P = textwrap.dedent(
    """
    import json, sys
    from graphdist._exceptions import NoFreePortsError
    from graphdist._net import ports

    port = int(sys.argv[1])

    class AlwaysP:
        def randint(self, low, high):
            return port

    ports.random.SystemRandom = AlwaysP
    held = {"reserve": ports._reserve(port)}
    try:
        held["pick"] = ports.pick_free_ports(1)
    except NoFreePortsError:
        held["pick"] = "refused"
    print(json.dumps(held), flush=True)
    sys.stdin.readline()  # A released P
    print(json.dumps({"pick": ports.pick_free_ports(1)}), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_port_another_process_holds_is_refused_until_it_lets_go():
    # Deterministic: B draws exactly the port A holds (a shared lock would let it through).
    (port,) = pick_free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-c", ALWAYS_P, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"process B said nothing: {proc.communicate(timeout=30)[1]}")
        assert json.loads(line) == {"reserve": False, "pick": "refused"}
        release_ports([port])
        out, err = proc.communicate("released\n", timeout=30)
        assert proc.returncode == 0, err
        assert json.loads(out) == {"pick": [port]}
    finally:
        release_ports([port])
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert wait_gone([proc.pid], 10) == []


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
