"""The kernel's OOM kills, read from its log (graphdist/_proc/oom.py): the records parsed as the
kernel writes them, and a real kill in a memory cgroup of this test's own, found by pid with
the cgroup and the limit it hit; a pid the killer did not touch is not called out of memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from graphdist._proc.oom import KMSG, OomKill, OomWatch, node_words, parse_records
from graphdist._proc.slurm import out_of_memory

pytestmark = [pytest.mark.timeout(60)]

# As this machine's kernel (6.x) wrote them for a kill in a memory cgroup, then a global one.
RECORDS = [
    "6,3312,12272280129,-;hierarchical_memory_limit 62914560",
    "6,3337,12272280158,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
    "mems_allowed=0,oom_memcg=/jobs/gd-x,task_memcg=/jobs/gd-x,task=python3,pid=15370,uid=0",
    "3,3338,12272280190,-;Memory cgroup out of memory: Killed process 15370 (python3) "
    "total-vm:78028kB, anon-rss:61184kB, file-rss:6616kB, shmem-rss:0kB, UID:0 pgtables:184kB",
    "6,3339,12272280200,-;oom_reaper: reaped process 15370 (python3), now anon-rss:0kB",
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
    "global_oom,task_memcg=/,task=train,pid=99,uid=1000",
    "Out of memory: Killed process 99 (train) total-vm:1kB, anon-rss:1kB",
    "6,3340,12272280300,-;Killed process 123 (x) by somebody else",  # not the OOM killer's
]


def test_the_kernels_records_give_each_kill_its_pid_and_cgroup() -> None:
    assert parse_records(RECORDS) == [
        OomKill(15370, "python3", "/jobs/gd-x", at_s=12272.28019),
        OomKill(99, "train", None),
    ]
    assert OomKill(1, "x", "/jobs/gd-x", 60 << 20).words() == (
        "out of memory (the kernel's OOM killer; limit 60 MiB of memory cgroup /jobs/gd-x)"
    )
    assert "the machine's memory ran out" in OomKill(1, "x").words()


def test_sruns_out_of_memory_line_names_the_node_and_no_other_line_does() -> None:
    """srun's own line (Slurm 22.05 under task/cgroup, as the site bed's srun wrote it) is read
    for the node it names, for one task or several, and a warm task's client's line for its
    words; a task's own words, srun's other errors and a line that only mentions it are not."""
    words = "out of memory (over its Slurm job's memory limit on node {})"
    assert out_of_memory(b"srun: error: sn-1: task 0: Out Of Memory\n") == words.format("sn-1")
    assert out_of_memory(b"srun: error: gdn3: tasks 0-1: Out Of Memory") == words.format("gdn3")
    node = "out of memory (the kernel's OOM killer; limit 1500 MiB of memory cgroup /slurm_sn-1)"
    assert out_of_memory(f"graphdist-node: {node}\n".encode()) is None  # a warm task's client:
    assert node_words(f"graphdist-node: {node}\n".encode()) == node  # its own words
    assert node_words(b"graphdist-node: ready") is None
    for line in (
        b"graphdist-node: ready",
        b"srun: error: sn-1: task 0: Exited with exit code 1",
        b"srun: error: Node failure on sn-1",
        b"MemoryError: Out Of Memory",
        b"  srun: error: sn-1: task 0: Out Of Memory",
    ):
        assert out_of_memory(line) is None, line


def test_a_watch_without_the_kernels_log_knows_nothing(tmp_path) -> None:
    watch = OomWatch(str(tmp_path / "no-such-log"))
    assert not watch.readable
    assert watch.killed(os.getpid()) is None


def _memory_cgroup() -> str | None:
    """This process's memory cgroup folder (cgroup v1), if there is one."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, str]]:
    """A memory cgroup of the caller's own, limited to ``limit`` bytes: (its folder, its path
    as the kernel names it); removed afterwards (its processes must be gone by then). Skips
    where it cannot be made."""
    parent = _memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK) or not os.access(KMSG, os.R_OK):
        pytest.skip("needs root, a cgroup v1 memory controller and the kernel's log (/dev/kmsg)")
    folder = os.path.join(parent, f"graphdist-oom-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)
    try:
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        yield folder, "/" + os.path.relpath(folder, "/sys/fs/cgroup/memory")
    finally:
        os.rmdir(folder)


@pytest.fixture
def small_cgroup() -> Iterator[tuple[str, str]]:
    with memory_cgroup(60 << 20) as made:
        yield made


@pytest.mark.promise
def test_a_process_the_oom_killer_ended_is_named_with_its_limit(small_cgroup) -> None:
    """A process over its cgroup's 60 MiB, killed by the kernel: its pid is found in the log
    with the cgroup and the limit; a process of the same cgroup that exited is not."""
    folder, path = small_cgroup
    watch = OomWatch()
    assert watch.readable
    procs = os.path.join(folder, "cgroup.procs")
    enter = f'echo $$ > {procs} && exec "$0" -c "$1"'
    hog = subprocess.Popen(
        ["sh", "-c", enter, sys.executable, "b = [bytearray(10 << 20) for _ in range(100)]"]
    )
    lean = subprocess.Popen(["sh", "-c", enter, sys.executable, "pass"])
    assert (hog.wait(50), lean.wait(50)) == (-signal.SIGKILL, 0)
    killed = watch.killed(hog.pid)  # the sh exec'd python: the kernel names its pid
    assert killed is not None and (killed.pid, killed.cgroup, killed.limit) == (
        hog.pid,
        path,
        60 << 20,
    )
    assert "limit 60 MiB of memory cgroup" in killed.words()
    assert killed.at_s is not None and abs(killed.at_s - time.monotonic()) < 30
    # a process started after the kill is not the one it killed (a reused pid)
    assert watch.killed(hog.pid, since_s=time.monotonic() + 5) is None
    assert watch.killed(hog.pid, since_s=killed.at_s - 0.5) == killed
    assert watch.killed(lean.pid) is None
    watch.close()
    assert watch.killed(hog.pid) is None  # closed: it knows nothing more
