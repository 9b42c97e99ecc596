"""A guard's report, read: the lines :func:`graphdist._proc.process.guard` writes to its
``report_fd`` (``pid PID``: its command's; ``exit CODE WALL_TIME``: its end, on the guard's wall
clock, which hosts agree on). Read by the launcher (a task's guard) and by a warm session (the
pid of a command its node's kernel may have killed for memory)."""

from __future__ import annotations

__all__ = ["parse_report"]


def parse_report(text: bytes) -> tuple[int | None, tuple[int, float] | None]:
    """The command's pid (the last said) and its end ``(code, wall time)`` (the first said) in
    the whole lines of ``text``; None for what it does not say yet."""
    pid: int | None = None
    end: tuple[int, float] | None = None
    for words in (line.split() for line in text.decode("ascii", "replace").splitlines()):
        if words[:1] == ["pid"] and len(words) == 2 and words[1].isdigit():
            pid = int(words[1])
        elif words[:1] == ["exit"] and len(words) == 3 and end is None:
            end = (int(words[1]), float(words[2]))
    return pid, end
