"""The processes of a detached fleet found by its marker (``GRAPHDIST_FLEET_MARK``, see
:mod:`graphdist._detached.state`), whatever its ``fleet.json`` says, and stopping them."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from graphdist._detached.state import MARK_ENV, SUPERVISOR_MODULE, ProcessRef, fleet_mark
from graphdist._proc.process import STOP_GRACE_S, stop_all
from graphdist._proc.server import PROCESS_TITLE_PREFIX

__all__ = ["MarkedProcess", "marked_processes", "stop_processes"]


@dataclass(frozen=True)
class MarkedProcess:
    """A process found by the marker: its reference and whether it is the supervisor."""

    ref: ProcessRef
    supervisor: bool


def _ancestors() -> set[int]:
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in psutil.Process().parents())
    return pids


def _is_supervisor_of(cmdline: list[str], mark: str) -> bool:
    """``cmdline`` runs ``python -m graphdist._detached.supervisor SPEC`` for the folder
    ``mark``."""
    if SUPERVISOR_MODULE not in cmdline[:-1]:
        return False
    try:
        spec = json.loads(cmdline[-1])
        return isinstance(spec, dict) and fleet_mark(str(spec.get("state_dir"))) == mark
    except (ValueError, TypeError):
        return False


def marked_processes(state_dir: str) -> list[MarkedProcess]:
    """The live processes of the fleet in ``state_dir``, whatever its ``fleet.json`` says: this
    user's processes that carry the folder's marker (:data:`MARK_ENV`, inherited by every
    process the supervisor starts) and run either the supervisor (a
    ``graphdist._detached.supervisor`` command line, whose spec may name the folder instead) or the
    ``multiprocess`` fork server that the servers are forked from, or a server (named
    ``graphdist JOB:INDEX ...``, :data:`~graphdist._proc.server.PROCESS_TITLE_PREFIX`). This
    process and its ancestors are never listed."""
    mark = fleet_mark(state_dir)
    uid = os.getuid()
    skip = _ancestors()
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            info = proc.info
            if info["pid"] in skip or info["uids"] is None or info["uids"].real != uid:
                continue
            cmdline = info["cmdline"] or []
            supervisor = _is_supervisor_of(cmdline, mark)
            if not supervisor:
                if not any(
                    "multiprocess" in arg or arg.startswith(PROCESS_TITLE_PREFIX) for arg in cmdline
                ):
                    continue
                if proc.environ().get(MARK_ENV) != mark:
                    continue
            found.append(MarkedProcess(ProcessRef.of(info["pid"]), supervisor))
        except (psutil.Error, OSError):  # gone (ProcessLookupError) or not ours to read
            continue
    return [p for p in found if p.ref.alive()]


def stop_processes(refs: Iterable[ProcessRef], grace_s: float = STOP_GRACE_S) -> list[ProcessRef]:
    """SIGTERM each live process, wait up to ``grace_s``, SIGKILL the rest; return survivors
    (see :func:`graphdist._proc.process.stop_all`)."""
    return stop_all(refs, grace_s)
