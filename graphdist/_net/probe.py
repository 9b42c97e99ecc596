"""Ask a TensorFlow server over gRPC whether it is really serving, or alive, without importing
TensorFlow. Raw bytes travel both ways, so only ``grpcio`` (a TensorFlow dependency, 0.1 s to
import) is needed.

Two questions, two calls (and a third, for what is no TensorFlow server: a Slurm node's
slurmd, a Ray raylet or GCS; :func:`tcp_connect_error`, whether the port takes a TCP connection):

- **serving** (a start's readiness, a connect): an open port is not enough (gRPC may be
  listening while the server is still being built), so it is a real call,
  ``WorkerService/GetStatus`` with an empty request, which every TensorFlow gRPC server answers
  with the devices it owns.
- **alive** (``fleet.health()``, a session guard's and a run's heartbeat): a call of a method no
  server registers (:data:`_ALIVE`), which gRPC's own polling threads answer ``UNIMPLEMENTED``
  in a millisecond however busy the server is, and which a frozen process (stopped, or hung
  whole) leaves unanswered. Not GetStatus: TensorFlow answers it on the server's compute pool
  (as many threads as CPUs), so a healthy task whose pool is taken by kernels that block (two
  here: a file op waiting on a pipe, a slow ``py_func``) left it unanswered for as long as they
  ran (``tests/busypool.py``), and the heartbeat killed a busy ParameterServerStrategy
  worker as frozen (CI, 2026-12-06).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from graphdist._net.loopback import bind_address_for
from graphdist._net.ready import FALLBACK_ROUND_S

__all__ = [
    "DIAGNOSE_PROBE_S",
    "GCS_CONNECT_S",
    "GCS_PROBE_S",
    "PROBE_TIMEOUT_S",
    "RAYLET_PROBE_S",
    "READY_PROBE_S",
    "RECHECK_PROBE_S",
    "REFUSED_WAIT_S",
    "RUN_PROBE_TIMEOUT_S",
    "SLURMD_PROBE_S",
    "Prober",
    "Silent",
    "dial_address",
    "probe_many",
    "probers",
    "tcp_connect_error",
    "wait_answering",
]

# Every probe timeout graphdist uses, in seconds, here and nowhere else.
PROBE_TIMEOUT_S = 1.0
"""``fleet.health()``'s default: how long a task has to answer a health probe (and, at a
connect, the liveness call of a server whose GetStatus timed out: busy, or frozen)."""
READY_PROBE_S = 0.5
"""One round of a start's readiness probes (a server still starting misses it; the next round
follows at once)."""
DIAGNOSE_PROBE_S = 0.5
"""The first probe of every task when a run failed, to name the task that made it fail."""
RECHECK_PROBE_S = 2.0
"""The second probe, of the tasks that missed the first when several did: a task busy on a
loaded machine answers it, a frozen one does not."""
RUN_PROBE_TIMEOUT_S = 1.5
"""A session guard's probe of a long run's tasks (every ``guard.PROBE_INTERVAL_S``): a busy task
on a loaded machine still answers, a frozen task misses every probe."""
REFUSED_WAIT_S = 1.0
"""How long a connection a server accepted may stay silent before it is taken for a slow server
rather than a refusal: a gRPC server sends its HTTP/2 settings at once, and graphdist's members
filter closes a non-member's connection as soon as it is accepted. Also how long a server's
port has to take (or refuse) a connection when a failed task's port is asked whether anything
still listens there."""
SLURMD_PROBE_S = 1.0
"""How long a node's slurmd has to take a TCP connection before the node counts as lost (Slurm
itself says so only once its pings time out, many seconds later)."""
RAYLET_PROBE_S = 1.0
"""How long a Ray node's raylet has to take a TCP connection before the node counts as lost."""
GCS_PROBE_S = 1.0
"""How long the Ray head's GCS port has to take a TCP connection in a run's watch of the head
(``graphdist._ray.run.HEAD_PROBE_S`` apart)."""
GCS_CONNECT_S = 5.0
"""How long a Ray cluster's address has to take a TCP connection before it is called
unreachable, before Ray is asked to connect (Ray itself retries for minutes)."""
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"
_ALIVE = "/graphdist.Liveness/Alive"
"""No server registers it: its ``UNIMPLEMENTED`` comes from gRPC itself, not TensorFlow's pool."""
# Short reconnect back-off, so a server that starts a moment after a failed probe is seen at once
# instead of after gRPC's default 1 s back-off: a channel whose server was not listening yet
# fails every call at once until its next connection attempt, so the longest back-off is how
# late a start can see its last server (measured with /tmp/warm/backoff.py, a server listening
# 1 s into the wait: seen a median 83-128 ms after it listened at 200 ms, 43-57 ms at 50 ms).
# A refused attempt on loopback costs microseconds. Not grpc.min_reconnect_backoff_ms: gRPC
# also takes it as the time a connection attempt may last, so at 50 ms any server that took
# longer to answer the HTTP/2 handshake (a busy one on a loaded machine) failed the probe in
# ~0.1 s whatever its timeout; without it a probe waits its full timeout for a slow server.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 50),
    ("grpc.enable_retries", 0),
]


def dial_address(address: str) -> str:
    """The address a probe dials for a server at ``address``: ``localhost:PORT`` is the address
    graphdist's servers for ``localhost`` listen on (``127.0.0.1``, :func:`bind_address_for`;
    TensorFlow's own, on every interface, too), not the name: a client resolving it tries
    ``[::1]:PORT`` first, where another process may listen on the same port (a gRPC server on
    ``[::1]`` answered the health probe of a SIGSTOPped task: read ``alive``). Other addresses
    are dialled as they are."""
    host, _, port = address.rpartition(":")
    if host.lower() == "localhost":
        return f"{bind_address_for(host)}:{port}"
    return address


def tcp_connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """None where ``host:port`` takes a TCP connection within ``timeout_s`` seconds (closed at
    once, nothing sent: whether anything listens), else why not: the error, a
    :class:`ConnectionRefusedError` where nothing listens, :class:`TimeoutError` where nothing
    answered. ``host`` may be an IPv6 address in brackets (``[::1]``)."""
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except OSError as exc:
        return exc
    return None


class Prober:
    """One gRPC channel to one server's address; :meth:`probe` returns whether it answered:
    GetStatus (it serves), or with ``alive=True`` the liveness call (it is not frozen)."""

    def __init__(self, address: str, *, alive: bool = False) -> None:
        import grpc

        self.address = address
        self.alive = alive
        self._grpc = grpc
        self._channel: Any = grpc.insecure_channel(dial_address(address), options=_CHANNEL_OPTIONS)
        self._call = self._channel.unary_unary(_ALIVE if alive else _GET_STATUS)
        self.last_error: str | None = None

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """True if the server answered within ``timeout_s`` seconds."""
        return self._outcome(self._call.future(b"", timeout=timeout_s))

    def _outcome(self, future: Any) -> bool:
        """Whether ``future`` (this prober's call) was answered; keeps the error otherwise."""
        try:
            future.result()
        except self._grpc.RpcError as exc:
            if self.alive and exc.code() == self._grpc.StatusCode.UNIMPLEMENTED:
                self.last_error = None  # the liveness call's answer
                return True
            self.last_error = f"{exc.code().name}: {exc.details()}"
            return False
        self.last_error = None
        return True

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def probers(addresses: Sequence[str], *, alive: bool = False) -> Iterator[list[Prober]]:
    """One :class:`Prober` per address (``alive``: liveness calls), all closed at the end (also
    those built before one failed to be)."""
    opened: list[Prober] = []
    try:
        opened += (Prober(address, alive=alive) for address in addresses)
        yield opened
    finally:
        for prober in opened:
            prober.close()


def probe_many(probers: list[Prober], timeout_s: float = PROBE_TIMEOUT_S) -> list[bool]:
    """Probe every server at once (one call each, all in flight together); whether each
    answered within ``timeout_s`` seconds, in the order of ``probers``."""
    futures = [p._call.future(b"", timeout=timeout_s) for p in probers]
    return [p._outcome(f) for p, f in zip(probers, futures, strict=True)]


class Silent:
    """The first server still silent when :func:`wait_answering` gave up: its place in the
    list, how many had answered, and its last gRPC error."""

    __slots__ = ("answered", "index", "last_error")

    def __init__(self, index: int, answered: int, last_error: str | None) -> None:
        self.index = index
        self.answered = answered
        self.last_error = last_error


def wait_answering(
    addresses: Sequence[str],
    timeout_s: float,
    *,
    each_round: Callable[[list[int]], None] | None = None,
    may_answer: Callable[[int], bool] | None = None,
    probe_s: float = READY_PROBE_S,
    poll_s: float = 0.02,
    hints: Callable[[float], Iterable[int]] | None = None,
    fallback_s: float = FALLBACK_ROUND_S,
) -> Silent | None:
    """Probe every server until all have answered (each round probes the silent ones at once,
    so one slow server holds up none of the others); ``None`` once they have, else the first
    one still silent after ``timeout_s`` seconds. ``each_round(silent)`` runs before every
    round with the places of the servers not yet answering, and may raise (a server process
    that died while starting is a failure to report, not a wait to sit out).

    ``may_answer(i)`` (default: always) says whether server ``i`` can answer yet (its process
    exists): one that cannot is not probed that round, and its channel is opened only when it
    first can. A fleet's servers are forked one after another; probing the ones not forked yet
    would only take CPU from the forks. Where the deadline passes first, the first server never
    probed is reported with ``last_error`` None.

    ``hints(wait_s)`` (:mod:`graphdist._net.ready`) waits up to ``wait_s`` seconds for
    servers that said they serve and returns their places. With it, nothing is probed while
    some are still being built: one round probes them all once every silent server has said it
    serves, so that no probe takes CPU from a build (on 2 CPUs, a probe of a server that served
    took 75-250 ms while 14 others were being built, 2-5 ms after), and a round every
    ``fallback_s`` seconds still probes all, for a notice lost or never sent. A notice is never
    taken for an answer."""
    start = time.monotonic()
    deadline = start + timeout_s
    each: dict[int, Prober] = {}
    try:
        pending = list(range(len(addresses)))
        hinted: set[int] = set()
        gap = fallback_s if hints is not None else 0.0  # between rounds: with notices, fallback
        next_round = start + gap
        while True:
            if each_round is not None:
                each_round(pending)
            if hints is not None:
                hinted.update(hints(poll_s))
            if time.monotonic() >= next_round or (hints is not None and hinted.issuperset(pending)):
                now = [i for i in pending if may_answer is None or may_answer(i)]
                for i in now:
                    if i not in each:
                        each[i] = Prober(addresses[i])
                answered = dict(zip(now, probe_many([each[i] for i in now], probe_s), strict=True))
                pending = [i for i in pending if not answered.get(i, False)]
                hinted.difference_update(now)  # one that failed waits for the next round
                next_round = time.monotonic() + gap
            if not pending:
                return None
            if time.monotonic() > deadline:
                first = pending[0]
                error = each[first].last_error if first in each else None
                return Silent(first, len(addresses) - len(pending), error)
            if hints is None:
                time.sleep(poll_s)
    finally:
        for prober in each.values():
            prober.close()
