"""The tutorial notebook in a real Jupyter kernel, as a user runs it: all cells, then all cells
again in the same kernel (users re-run cells), then "interrupt kernel" during a blocked step;
then the kernel is shut down and every server it started must be gone."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from tests.conftest import EVENTUALLY_S, REPO, wait_gone

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(400),
    pytest.mark.needs("nbformat"),
    pytest.mark.needs("nbclient"),
]

NOTEBOOK = os.path.join(REPO, "examples", "tutorial.ipynb")

BLOCKED_STEP = """
with tf.device(fleet.device("local", 1)):
    q = tf.FIFOQueue(10, tf.float32, shared_name="interrupted")
    kept = tf.Variable(7.0, name="kept")
    value = tf.placeholder_with_default(0.0, [])
    enqueue, dequeue, size = q.enqueue(value), q.dequeue(), q.size()
blocked = fleet.session("local", 0)
blocked.run(kept.initializer)
print("blocking", flush=True)
blocked.run(dequeue)
"""
AFTER_INTERRUPT = """
print("health:", *[h.status for h in fleet.health()])
with fleet.session("local", 1) as other:
    other.run(enqueue, {value: 1.0})
    other.run(enqueue, {value: 2.0})
    print("queue:", other.run(size), other.run(dequeue), other.run(kept))
fleet.close()
"""


def text_of(cell) -> str:
    out = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            out.append(output.get("text", ""))
        elif "data" in output:
            out.append(output["data"].get("text/plain", ""))
    return "".join(out)


def html_of(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.get("outputs", []))


def interrupt_kernel(client) -> None:
    """What Jupyter's "interrupt kernel" does (jupyter_client's local provisioner): SIGINT to
    the kernel's process group, the kernel's own (it is started in a new session)."""
    pid = client.km.provisioner.pid
    group = os.getpgid(pid)
    assert group != os.getpgid(0), "the kernel shares this process group"
    os.killpg(group, signal.SIGINT)


def test_the_tutorial_runs_twice_in_one_kernel_and_an_interrupt_spares_the_servers():
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": REPO}}
    )
    servers: list[int] = []
    runs: list[list[str]] = []
    with client.setup_kernel(env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}):
        for _ in range(2):
            texts = []
            for index, cell in enumerate(nb.cells):
                if cell.cell_type == "code":
                    client.execute_cell(cell, index)
                    texts.append(text_of(cell))
                    for line in text_of(cell).splitlines():
                        if line.startswith("servers:"):
                            servers += [int(p) for p in line.split()[1:]]
            runs.append(texts)
            whole = "\n".join(texts)
            # the seed's results, each time
            assert "Value of var (Session 1): 1.0\nValue of var (Session 2): 0.0" in whole
            assert "Value of var (Session 1): 1.0\nValue of var (Session 2): 1.0" in whole
            assert "result: 238" in whole and "after the restart: 238" in whole
            assert "TaskFailedError: Task local-1" in whole and "is dead" in whole
            assert "PlacementError:" in whole
        # rich output: the fleet, the placement and the health report are HTML tables
        htmls = [html_of(c) for c in nb.cells if c.cell_type == "code"]
        assert any("<table>" in h and "LocalFleet" in h for h in htmls)
        assert any("ran on" in h and "<svg" in h for h in htmls)
        assert any("health" in h and "dead" in h for h in htmls)
        # "interrupt kernel" (SIGINT to the kernel's process group) during a blocked step
        restart = nbformat.v4.new_code_cell(
            "fleet = graphdist.LocalFleet('local=2').start(); print('servers:', *fleet.pids)"
        )
        blocked = nbformat.v4.new_code_cell(BLOCKED_STEP)
        after = nbformat.v4.new_code_cell(AFTER_INTERRUPT)
        nb.cells += [restart, blocked, after]
        base = len(nb.cells) - 3
        client.execute_cell(restart, base)
        servers += [int(p) for p in text_of(restart).split()[1:]]
        timer = threading.Timer(3.0, interrupt_kernel, args=(client,))
        timer.start()
        with pytest.raises(nbclient.exceptions.CellExecutionError, match="KeyboardInterrupt"):
            client.execute_cell(blocked, base + 1)
        timer.join()
        client.execute_cell(after, base + 2)
        out = text_of(after)
        assert "health: alive alive" in out, out  # the servers lived on
        # the interrupted dequeue consumed nothing: both values are there, the first comes out
        # first, and the variable on the same server kept its value
        assert re.search(r"queue: 2 1\.0 7\.0", out), out
    assert len(servers) == 6  # three fleets of two
    assert wait_gone(servers, EVENTUALLY_S) == [], "servers outlived the kernel"
