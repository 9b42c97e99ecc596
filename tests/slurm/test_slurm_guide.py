"""docs/slurm.md as a user follows it, on the Slurm bed (tests/slurmbed.py): the interactive
allocation's commands and the fleet's script run from the login host as the page writes them
(the job id the page calls 42 is the one ``salloc`` granted, ``~/mwms`` a folder of the test's),
their output compared with what the page shows; the batch script's command the page quotes is
the example script's own (examples/slurm_mwms.sbatch, which tests/slurm/test_slurm_run.py
submits). A page that drifts from the code turns this red."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, wait_gone
from tests.net.test_hosts_guide import tls_runs

pytestmark = [pytest.mark.promise]

PAGE = Path(REPO, "docs", "slurm.md")
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(PAGE.read_text(encoding="utf-8"))]


def _commands(block: str) -> list[str]:
    """The shell commands of ``block``, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def test_the_batch_scripts_command_on_the_page_is_the_scripts_own() -> None:
    quoted = _blocks()[1][1]
    script = Path(REPO, "examples", "slurm_mwms.sbatch").read_text(encoding="utf-8")
    assert _commands(quoted) == _commands(script)[-len(_commands(quoted)) :], quoted


@pytest.mark.timeout(300)
def test_the_interactive_allocation_and_the_fleet_run_as_the_page_writes_them(
    slurm: Any, tmp_path: Any
) -> None:
    blocks = _blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "bash", "python", "text"], blocks
    salloc, run, scancel = _commands(blocks[2][1])
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "TF_CPP_MIN_LOG_LEVEL": "2"}  # fmt: skip

    def sh(command: str, timeout: float = 240) -> Any:
        return slurm.run(None, ["sh", "-c", command], env=env, cwd=REPO, timeout=timeout)

    granted = sh(salloc)
    jobid = re.search(r"Granted job allocation (\d+)", granted.stdout + granted.stderr)
    assert jobid and "# prints: Granted job allocation 42" in blocks[2][1], granted.stderr
    job = jobid.group(1)
    try:
        out = tmp_path / "mwms"
        ran = sh(run.replace("42", job).replace("~/mwms", str(out)))
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        assert "graphdist: the run succeeded: 2 task(s) exited 0" in ran.stdout, ran.stdout
        assert (out / "weights-worker-0.npz").exists()
        script = blocks[3][1].replace("jobid=42", f"jobid={job}")
        fleet = slurm.run(None, [sys.executable, "-c", script], env=env, cwd=REPO, timeout=240)
        assert fleet.returncode == 0, fleet.stderr[-3000:]
        assert fleet.stdout.strip() == blocks[4][1].strip(), fleet.stdout
        _hosts_md_slurm_tls(slurm, env, job)
    finally:
        pids = slurm.job_pids(int(job))
        cancelled = sh(scancel.replace("42", job))
    assert cancelled.returncode == 0, cancelled.stderr
    assert wait_gone(pids, 20) == []  # the allocation's processes, on every node


def _hosts_md_slurm_tls(slurm: Any, env: dict[str, str], job: str) -> None:
    """docs/hosts.md's Slurm fleet and run in TLS mode, in the same allocation (the page's
    4242): its script starts and closes the fleet; its run trains the seeds' MWMS script; its
    ``up --tls`` runs in the foreground until Ctrl-C (exit 130)."""
    hosts_md = Path(REPO, "docs", "hosts.md").read_text(encoding="utf-8")
    part = hosts_md.split("**Slurm**, from the login host", 1)[1].split("\n## ", 1)[0]
    blocks = [(m.group(1), m.group(2)) for m in _BLOCK.finditer(part)]
    assert [lang for lang, _ in blocks][:2] == ["python", "sh"], blocks
    script, up = (text.replace("4242", job) for _, text in blocks[:2])
    fleet = slurm.run(None, [sys.executable, "-c", script], env=env, cwd=REPO, timeout=240)
    assert fleet.returncode == 0, fleet.stderr[-3000:]
    out = Path(slurm.jobs_dir, f"mwms-tls-{job}")
    run = tls_runs()["slurm"].replace("4242", job).replace("/shared/mwms", str(out))
    ran = slurm.run(None, ["sh", "-c", run], env=env, cwd=REPO, timeout=240)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert (out / "weights-worker-0.npz").exists()
    log = Path(slurm.jobs_dir, f"up-tls-{job}.log")
    with open(log, "wb") as out:
        proc = slurm.popen(None, ["sh", "-c", "exec " + up], env=env, cwd=REPO, stdout=out,
                           stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "fleet running" not in (said := log.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, said[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
