"""Whether the kernel's out-of-memory killer ended a process: the kernel's own record, read.

A task killed for memory ends by SIGKILL like any other, so its exit status cannot say why. The
kernel logs every kill of its OOM killer (``/dev/kmsg``: an ``oom-kill:`` record with the
victim's pid and memory cgroup, then ``Killed process PID (NAME)``); :class:`OomWatch` opens
the log at its end when a fleet or a run starts and, asked about a pid that died by SIGKILL,
reads what the kernel wrote since. The memory limit that was hit is that of the cgroup the
record names (cgroup v1 ``memory.limit_in_bytes``, v2 ``memory.max``), read while it is still
there. Where the log cannot be read (a container without ``/dev/kmsg``, another user's
kernel log restricted), the watch knows nothing and says so: ``None``, never a guess.

The pids in the kernel's log are those of the first pid namespace: a watch in another one
finds none of its own (it knows nothing, again).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass

__all__ = [
    "KMSG",
    "NODE_OOM_PREFIX",
    "OomKill",
    "OomWatch",
    "node_words",
    "parse_records",
    "shared",
]

KMSG = "/dev/kmsg"
#: What a warm task's client writes before it dies of its task's SIGKILL when its node's kernel
#: says it killed the task for memory (the task ran in the node's warm agent, whose step says
#: nothing then): this, then ``out of memory (...)`` (:meth:`OomKill.words`).
NODE_OOM_PREFIX = "graphdist-node: "
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)")
_FIELDS = re.compile(r"(\w+)=([^,]*)")
# where a memory cgroup's limit is: cgroup v1's memory controller, then cgroup v2
_LIMIT_FILES = (
    ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
    ("/sys/fs/cgroup", "memory.max"),
)


@dataclass(frozen=True)
class OomKill:
    """One kill of the kernel's OOM killer: the victim's ``pid`` and ``name``; ``cgroup``: the
    memory cgroup whose limit was hit (``None``: the machine ran out); ``limit``: that limit in
    bytes, where it could be read; ``at_s``: when, on the kernel's clock (seconds since boot,
    as ``time.monotonic()``; None where the record had no time)."""

    pid: int
    name: str
    cgroup: str | None = None
    limit: int | None = None
    at_s: float | None = None

    def words(self) -> str:
        """``out of memory (the kernel's OOM killer; limit 512 MiB of memory cgroup /x)``."""
        if self.cgroup is None:
            return "out of memory (the kernel's OOM killer: the machine's memory ran out)"
        limit = f"limit {_mib(self.limit)} of " if self.limit is not None else ""
        return f"out of memory (the kernel's OOM killer; {limit}memory cgroup {self.cgroup})"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB" if size < 1 << 40 else f"{size / (1 << 30):.0f} GiB"


def cgroup_limit(cgroup: str) -> int | None:
    """The memory limit in bytes of ``cgroup`` (a path as the kernel's record gives it), or
    None where it is gone, unlimited or unreadable."""
    for root, name in _LIMIT_FILES:
        path = os.path.join(root, cgroup.lstrip("/"), name)
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            text = f.read().strip()
            if text == "max" or int(text) >= 1 << 62:  # v1 writes "unlimited" as ~2**63
                return None
            return int(text)
    return None


def parse_records(records: list[str]) -> list[OomKill]:
    """The OOM kills in ``records`` (``/dev/kmsg`` lines, ``PRIO,SEQ,TIME,FLAGS;TEXT``, or the
    bare texts): each ``Killed process`` with the memory cgroup of the ``oom-kill:`` record of
    the same pid before it, if any (a global OOM: ``constraint=CONSTRAINT_NONE``, no cgroup)."""
    kills: list[OomKill] = []
    memcg: dict[int, str | None] = {}
    for record in records:
        at_s = None
        if ";" in record.split(" ", 1)[0]:
            prefix, text = record.split(";", 1)
            with contextlib.suppress(IndexError, ValueError):
                at_s = int(prefix.split(",")[2]) / 1e6
        else:
            text = record
        if text.startswith("oom-kill:"):
            fields = dict(_FIELDS.findall(text[len("oom-kill:") :]))
            with contextlib.suppress(KeyError, ValueError):
                limited = fields.get("constraint") == "CONSTRAINT_MEMCG"
                memcg[int(fields["pid"])] = fields.get("oom_memcg") if limited else None
            continue
        found = _KILLED.search(text)
        if found and "out of memory" in text.lower():
            pid = int(found[1])
            kills.append(OomKill(pid, found[2], memcg.get(pid), at_s=at_s))
    return kills


class OomWatch:
    """The kernel's OOM kills since this watch was made (see the module docstring). Cheap to
    ask: the log is read only when :meth:`killed` is asked about a pid it has not seen yet."""

    def __init__(self, path: str = KMSG) -> None:
        self._lock = threading.Lock()
        self._kills: dict[int, OomKill] = {}
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._fd, 0, os.SEEK_END)  # only what the kernel writes from now on

    @property
    def readable(self) -> bool:
        """Whether the kernel's log could be opened (else every answer is None)."""
        return self._fd is not None

    @property
    def fd(self) -> int | None:
        """Its descriptor on the kernel's log (None: unreadable), which a process that forks
        without exec closes in its children (:func:`graphdist._distribute.zygote.serve`)."""
        return self._fd

    def _read(self) -> None:
        records = []
        while self._fd is not None:
            try:
                records.append(os.read(self._fd, 8192).decode("utf-8", "replace"))
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before they were read: go on
                continue
            except OSError:
                break
        for kill in parse_records(records):
            limit = cgroup_limit(kill.cgroup) if kill.cgroup else None
            self._kills[kill.pid] = OomKill(kill.pid, kill.name, kill.cgroup, limit, kill.at_s)

    def killed(self, pid: int | None, since_s: float | None = None) -> OomKill | None:
        """The OOM kill of ``pid`` since this watch was made (and, given ``since_s``, a
        ``time.monotonic()`` of when that process started: not before it, so that a reused pid
        is not another's death), or None (none logged, or the log unreadable)."""
        if pid is None or self._fd is None:
            return None
        with self._lock:
            kill = self._kills.get(pid)
            if kill is None or not _after(kill, since_s):
                self._read()
                kill = self._kills.get(pid)
        return kill if kill is not None and _after(kill, since_s) else None

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _after(kill: OomKill, since_s: float | None) -> bool:
    # the kernel's clock and CLOCK_MONOTONIC agree to well under a second (no suspend here)
    return since_s is None or kill.at_s is None or kill.at_s >= since_s - 1.0


_shared: OomWatch | None = None
_shared_lock = threading.Lock()


def shared() -> OomWatch:
    """This process's one watch, opened on first use (before the first process it is asked
    about starts: every fleet and run makes sure of that when it starts one)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = OomWatch()
        return _shared


def node_words(line: bytes) -> str | None:
    """A warm task's client's line (:data:`NODE_OOM_PREFIX`) that its node's kernel killed the
    task for memory, as those words (``out of memory (...)``); None for any other line."""
    said = line.rstrip().decode("utf-8", "replace")
    if said.startswith(NODE_OOM_PREFIX + "out of memory ("):
        return said.removeprefix(NODE_OOM_PREFIX)
    return None
