"""docs/hosts.md as a user follows it: its two step-by-step guides (``graphdist serve`` on each
host and ``connect`` from a client; the same in TLS mode) run on a bed of namespaced hosts
(tests/hostbed.py), every command and script taken from the page's own code blocks.

The page's example addresses (10.0.0.1, 10.0.0.2), its port (2222) and host 10.0.0.1's alias
become the bed's; host 1 and host 2 serve, the plain client runs on host 1 (a member, as the
page says) and the TLS client on host 3 (no member). Every output the page shows is compared with
the real one (pids aside), so a command, an option or an output that changes without the page
turns this red. The copying steps (``ssh``, ``scp``) are left out: the hosts share a file system.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import QUIET_TF, REPO, wait_gone

pytestmark = [pytest.mark.promise]

PAGE = os.path.join(REPO, "docs", "hosts.md")
READY_S = 90.0
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _section(title: str) -> str:
    """The text of the page's ``## title...`` section, up to its first subsection."""
    text = Path(PAGE).read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    return re.split(r"\n##+ ", text[start + 1 :].split("\n", 1)[1], maxsplit=1)[0]


def _blocks(section: str) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced code block of ``section``, in order."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(section)]


def tls_runs() -> dict[str, str]:
    """The page's three ``graphdist run --tls`` commands (TLS mode's Ray and Slurm part), by
    where they run: ``ray``, ``slurm``, ``local`` (each under its own comment line)."""
    text = Path(PAGE).read_text(encoding="utf-8")
    part = text.split("A tf.distribute run takes the same mode on every backend", 1)[1]
    (language, block), *_ = _blocks(part)
    assert language == "sh", block
    runs = [c.strip() for c in re.split(r"^#.*$", block, flags=re.M) if c.strip()]
    assert len(runs) == 3, block
    return dict(zip(("ray", "slurm", "local"), runs, strict=True))


class Guide:
    """The page's examples made the bed's: a folder of the guide's files and the substitutions."""

    def __init__(self, hosts: Any, folder: str) -> None:
        from graphdist._net.gateway import alias

        self.hosts, self.folder = hosts, folder
        self.port = random.randint(20000, 40000)  # the namespaces are the test's own: all free
        self.swaps = {
            "10.0.0.1": hosts[0].address,
            "10.0.0.2": hosts[1].address,
            alias("10.0.0.1"): alias(hosts[0].address),
            "2222": str(self.port),
        }
        self.env = {
            **os.environ,
            **QUIET_TF,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        }
        self.procs: list[subprocess.Popen[Any]] = []

    def here(self, text: str) -> str:
        for page, bed in self.swaps.items():
            text = text.replace(page, bed)
        return text

    def run(self, host: Any, block: str, language: str) -> str:
        """Run ``block`` (a shell command or a Python script) on ``host`` in the guide's folder;
        its output."""
        argv = ["sh", "-c", self.here(block)] if language == "sh" else [sys.executable, "-c", block]
        done = host.run(argv, cwd=self.folder, env=self.env, capture_output=True, text=True,
                        timeout=180)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return done.stdout

    def serve(self, host: Any, block: str) -> str:
        """Start ``block`` (a ``graphdist serve`` command) on ``host``; its ready line."""
        log = os.path.join(self.folder, f"serve-{len(self.procs)}.log")
        with open(log, "wb") as out:
            proc = host.popen(["sh", "-c", "exec " + self.here(block)], cwd=self.folder,
                              env=self.env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append(proc)
        deadline = time.monotonic() + READY_S
        while "ready at" not in (said := Path(log).read_text(errors="replace")):
            assert proc.poll() is None, said[-3000:]
            assert time.monotonic() < deadline, said[-3000:]
            time.sleep(0.2)
        return next(line for line in said.splitlines() if "ready at" in line)

    def stop(self) -> None:
        """SIGTERM every server (and so its gateway), then check that nothing is left."""
        children = []
        for proc in self.procs:
            path = f"/proc/{proc.pid}/task/{proc.pid}/children"
            if proc.poll() is None and os.path.exists(path):
                children += [int(p) for p in Path(path).read_text().split()]
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        assert wait_gone([p.pid for p in self.procs] + children, 10) == []


def _pids_masked(text: str) -> str:
    return re.sub(r"pid \d+", "pid N", text.strip())


def _second_host(block: str) -> str:
    """Host 10.0.0.2's command, which the page gives as "the same with ``--task 1``"."""
    return block.replace("--task 0", "--task 1").replace("hosts/10.0.0.1", "hosts/10.0.0.2")


def _serve_both_then(
    guide: Guide, serve: str, ready: str, client_host: Any, client: str, output: str
) -> None:
    """Steps "on host 10.0.0.1" (its ready line as the page shows it) and "on host 10.0.0.2",
    then the client's script on ``client_host``, whose output must be the page's; the servers
    are stopped, and found gone, however it ends."""
    try:
        said = guide.serve(guide.hosts[0], serve)
        assert _pids_masked(said) == _pids_masked(guide.here(ready)), said
        guide.serve(guide.hosts[1], _second_host(serve))
        assert guide.run(client_host, client, "python").strip() == output.strip()
    finally:
        guide.stop()


@pytest.mark.timeout(300)
def test_the_serve_and_connect_guide_runs_as_the_page_writes_it(hosts: Any, tmp_path: Any) -> None:
    guide = Guide(hosts, str(tmp_path))
    blocks = _blocks(_section("Real hosts: `graphdist serve` on each"))
    assert [lang for lang, _ in blocks] == ["json", "sh", "text", "python", "text"], blocks
    (_, cluster), (_, serve), (_, ready), (_, client), (_, output) = blocks
    (tmp_path / "cluster.json").write_text(guide.here(cluster))
    _serve_both_then(guide, serve, ready, hosts[0], client, output)  # host 1: a member


@pytest.mark.timeout(300)
def test_the_tls_guide_runs_as_the_page_writes_it(hosts: Any, tmp_path: Any) -> None:
    guide = Guide(hosts, str(tmp_path))
    cluster = _blocks(_section("Real hosts: `graphdist serve` on each"))[0][1]
    blocks = _blocks(_section("TLS mode: servers that only certificate holders reach"))
    languages = [lang for lang, _ in blocks]
    assert languages == ["sh", "text", "sh", "sh", "text", "sh", "python", "text"], blocks
    (_, certs), (_, made), _, (_, serve), (_, ready), _, (_, client), (_, output) = blocks
    (tmp_path / "cluster.json").write_text(guide.here(cluster))
    assert guide.run(hosts[2], certs, "sh").strip() == guide.here(made).strip()
    _serve_both_then(guide, serve, ready, hosts[2], client, output)  # host 3: no member
