"""TLS mode's relay against stunnel's, side by side in one run: whether a C relay would take
TLS mode's step under its target (issue 38: a step across hosts at most 1.3x plain).

In TLS mode a step of the seeds' split graph between hosts crosses the gateways about three
and a half times there and back (benchmarks/tls.py: the step's added time over one pair's
added round trip), each time through two relays (the caller's host's gateway, plain in and TLS
out, then the task's host's, TLS in and plain out). What a pair of relays adds to one round
trip is what decides the step's ratio, so this measures just that, on loopback, with no
TensorFlow: a client and an echo server (two processes of plain Python), and between them

- ``direct``: nothing (the baseline both relays' added time is taken from);
- ``gateway``: graphdist's pair (:mod:`graphdist._net.gateway`: Python's ``ssl`` over memory
  buffers on uvloop, the bind shim loaded), an outbound route to an inbound one, with
  credentials from :func:`graphdist._net.tlscerts.make_credentials`;
- ``stunnel``: a pair of stunnel processes with the same credentials and the same checks
  (mutual TLS 1.3, the cluster's CA only, the server's certificate checked for its address,
  ``TCP_NODELAY`` both ways); skipped with a line where ``stunnel`` is not installed.

Figures, medians over ``--rounds`` interleaved rounds: the round trip of a ``--size``-byte
message (``--trips`` of them a side a round) and the rate of one ``--mb`` MB transfer
(client to server, acknowledged). Targets (met / MISSED, exit 1 on a miss; only with stunnel):
the gateway pair adds at most ``LATENCY_TARGET`` x the time stunnel's adds to a round trip, and
moves at least ``BANDWIDTH_TARGET`` x stunnel's MB/s: graphdist's relay is not what a well-kept
C relay would do much better. What the step would be with each is printed too: the plain step
of the TLS record (docs/benchmarks.md, section tls) plus its relay passes at this run's added
round trip.

    python benchmarks/relay.py [--rounds 5] [--trips 2000] [--size 256] [--mb 64] [--smoke]
        [--json FILE] [--readme docs/benchmarks.md] [--no-check]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script
    import _common

sys.path.insert(0, _common.REPO)

NAME = "relay"
LATENCY_TARGET = 1.5
BANDWIDTH_TARGET = 0.7
HOST = "127.0.0.5"  # the "task's host" of the credentials: an address the inbound relay binds
ALIAS = "127.130.0.1"  # where the client dials, as a TensorFlow server dials a task's alias
SERVER = "127.0.0.6"  # the echo server: the task's server
SIDES = ("direct", "gateway", "stunnel")
READY_S = 15.0

# The echo server: a line "PORT" on stdout once it listens; a connection whose first byte is b"p"
# echoes what it reads, one whose first byte is b"s" reads an 8-byte length and that many bytes,
# then answers b"k".
ECHO = r"""
import socket, struct, sys, threading
ls = socket.socket()
ls.bind((sys.argv[1], 0))
ls.listen(16)
print(ls.getsockname()[1], flush=True)
def recv_exact(c, n):
    got = bytearray()
    while len(got) < n:
        chunk = c.recv(min(n - len(got), 1 << 20))
        if not chunk:
            raise EOFError
        got += chunk
    return bytes(got)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if recv_exact(c, 1) == b"p":
            while True:
                data = c.recv(1 << 16)
                if not data:
                    return
                c.sendall(data)
        (n,) = struct.unpack("!Q", recv_exact(c, 8))
        left = n
        while left:
            chunk = c.recv(min(left, 1 << 20))
            if not chunk:
                return
            left -= len(chunk)
        c.sendall(b"k")
    except (EOFError, OSError):
        pass
    finally:
        c.close()
while True:
    conn, _ = ls.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def round_trips(entry: tuple[str, int], trips: int, size: int) -> list[float]:
    """``trips`` round trips of a ``size``-byte message through ``entry`` (seconds each)."""
    sock = _dial_entry(entry)
    msg, out = b"x" * size, []
    try:
        for _ in range(trips):
            t = time.perf_counter()
            sock.sendall(msg)
            got = 0
            while got < size:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise RuntimeError("the echo server left")
                got += len(chunk)
            out.append(time.perf_counter() - t)
    finally:
        sock.close()
    return out


def transfer(entry: tuple[str, int], mb: int) -> float:
    """Seconds to send ``mb`` MB through ``entry`` until the server acknowledges them all."""
    import struct

    sock = socket.create_connection(entry, timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = b"\0" * (1 << 20)
    try:
        t = time.perf_counter()
        sock.sendall(b"s" + struct.pack("!Q", mb << 20))
        for _ in range(mb):
            sock.sendall(block)
        if sock.recv(1) != b"k":
            raise RuntimeError("the echo server did not acknowledge the transfer")
        return time.perf_counter() - t
    finally:
        sock.close()


def _dial_entry(entry: tuple[str, int]) -> socket.socket:
    """A ping connection through ``entry``, once the path answers (a relay just started may
    reset the first connections while its far end is not up yet)."""
    deadline = time.monotonic() + READY_S
    while True:
        try:
            sock = socket.create_connection(entry, timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"px")
            if sock.recv(1) == b"x":
                return sock
            sock.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answers through {entry[0]}:{entry[1]}")
        time.sleep(0.1)


class Bed:
    """The echo server and, per side, the relay pair in front of it; :meth:`close` ends them
    all and checks each is gone."""

    def __init__(self, folder: str, with_stunnel: bool) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.gateways: list[subprocess.Popen[bytes]] = []
        self.entries: dict[str, tuple[str, int]] = {}
        try:
            self._start(folder, with_stunnel)
        except BaseException:  # nothing started is left running
            self.close()
            raise

    def _start(self, folder: str, with_stunnel: bool) -> None:
        from graphdist._net.gateway import Route, start_gateway
        from graphdist._net.tlscerts import client_folder, host_folder, make_credentials

        echo = subprocess.Popen(
            [sys.executable, "-I", "-c", ECHO, SERVER], stdout=subprocess.PIPE, text=True
        )
        self.procs.append(echo)
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        self.entries["direct"] = (SERVER, port)
        make_credentials([HOST], os.path.join(folder, "creds"))
        creds = os.path.join(folder, "creds")
        host, client = host_folder(creds, HOST), client_folder(creds)
        inner, outer = _free_port(HOST), _free_port(ALIAS)
        self.gateways.append(
            start_gateway([Route("t", HOST, (HOST, inner), (SERVER, port), True)], host)
        )
        self.gateways.append(
            start_gateway([Route("t", HOST, (ALIAS, outer), (HOST, inner), False)], client)
        )
        self.entries["gateway"] = (ALIAS, outer)
        if with_stunnel:
            inner, outer = _free_port(HOST), _free_port(ALIAS)
            common = "foreground = yes\npid =\ndebug = 3\nsocket = l:TCP_NODELAY=1\n"
            common += "socket = r:TCP_NODELAY=1\n"
            server = (
                f"{common}[in]\naccept = {HOST}:{inner}\nconnect = {SERVER}:{port}\n"
                f"{_tls(host)}requireCert = yes\n"
            )
            client_conf = (
                f"{common}[out]\nclient = yes\naccept = {ALIAS}:{outer}\n"
                f"connect = {HOST}:{inner}\n{_tls(client)}checkIP = {HOST}\n"
            )
            for name, text in (("in.conf", server), ("out.conf", client_conf)):
                path = os.path.join(folder, name)
                with open(path, "w") as f:
                    f.write(text)
                log = open(path + ".log", "wb")  # noqa: SIM115 - handed to the child
                self.procs.append(subprocess.Popen(["stunnel", path], stderr=log))
                log.close()
            self.entries["stunnel"] = (ALIAS, outer)
        for side in self.entries:  # every path answers before anything is measured
            _dial_entry(self.entries[side]).close()

    def close(self) -> None:
        from graphdist._net.gateway import stop_gateway  # SIGTERM, then SIGKILL; reaped

        for proc in [*self.gateways, *self.procs]:
            stop_gateway(proc)


def _tls(folder: str) -> str:
    """stunnel's lines for the identity in ``folder``: its key and certificate, the cluster's
    CA only, TLS 1.3 only."""
    return (
        f"cert = {folder}/cert.pem\nkey = {folder}/key.pem\nCAfile = {folder}/ca.pem\n"
        "verifyChain = yes\nsslVersionMin = TLSv1.3\n"
    )


def measure(rounds: int, trips: int, size: int, mb: int, with_stunnel: bool) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="gdbench-relay-")
    bed = Bed(folder, with_stunnel)
    try:
        sides = [s for s in SIDES if s in bed.entries]
        got = _common.interleaved(
            sides,
            rounds,
            lambda side: (
                statistics.median(round_trips(bed.entries[side], trips, size)),
                transfer(bed.entries[side], mb),
            ),
        )
    finally:
        bed.close()
        shutil.rmtree(folder, ignore_errors=True)
    rtt = {s: statistics.median(r[0] for r in got[s]) * 1e6 for s in sides}
    rate = {s: mb / statistics.median(r[1] for r in got[s]) for s in sides}
    added = {s: rtt[s] - rtt["direct"] for s in sides if s != "direct"}
    return {
        "round_trip_us": rtt, "added_us": added, "mb_per_s": rate,
        "rounds": rounds, "trips": trips, "size": size, "mb": mb, "cores": os.cpu_count(),
    }  # fmt: skip


def _tls_record() -> tuple[float, float, float] | None:
    """The plain and TLS step (ms) and the TLS transfer's ratio to plain of the TLS record in
    docs/benchmarks.md, or None."""
    import re

    try:
        with open(os.path.join(_common.REPO, _common.RECORD_PAGE), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    start, end = _common.section_markers("tls")
    if start not in text or end not in text:
        return None
    tls_section = text.split(start, 1)[1].split(end, 1)[0]
    step = re.search(r"\| split graph step[^|]*\| ([0-9.]+) \| ([0-9.]+) \|", tls_section)
    rate = re.search(r"\| [0-9]+ MB task 1[^|]*\|[^|]*\|[^|]*\| ([0-9.]+)x \|", tls_section)
    if step is None or rate is None:
        return None
    return float(step.group(1)), float(step.group(2)), float(rate.group(1))


def report(f: dict[str, Any]) -> tuple[str, list[tuple[str, bool]]]:
    """The record's table, what the TLS step would be with each relay, and the targets."""
    rtt, added, rate = f["round_trip_us"], f["added_us"], f["mb_per_s"]
    lines = [
        f"| path | {f['size']} B round trip (us) | added by the relay pair (us) | "
        f"{f['mb']} MB (MB/s) |",
        "|---|---:|---:|---:|",
        f"| direct (no relay) | {rtt['direct']:.0f} | | {rate['direct']:.0f} |",
    ]
    names = {"gateway": "graphdist's gateways (Python ssl, uvloop)", "stunnel": "stunnel (C)"}
    for side in ("gateway", "stunnel"):
        if side in rtt:
            lines.append(
                f"| {names[side]} | {rtt[side]:.0f} | {added[side]:.0f} | {rate[side]:.0f} |"
            )
    text = "\n".join(lines) + (
        f"\n\nMedians of {f['rounds']} interleaved rounds ({f['trips']} round trips and one "
        f"{f['mb']} MB transfer a side a round), on loopback, {f['cores']} cores."
    )
    targets: list[tuple[str, bool]] = []
    if "stunnel" not in rtt:
        return text + " stunnel is not installed here: no comparison, no target.", targets
    lat = added["gateway"] / added["stunnel"]
    bw = rate["gateway"] / rate["stunnel"]
    record = _tls_record()
    if record is not None:
        plain, tls, transfer_ratio = record
        passes = (tls - plain) * 1e3 / added["gateway"]  # relay pairs a step crosses
        with_stunnel = plain + passes * added["stunnel"] / 1e3
        text += (
            f" The TLS record's step, {plain:.2f} ms plain and {tls:.2f} ms in TLS mode, "
            f"crosses about {passes:.1f} relay pairs at this run's gateway figure; with "
            f"stunnel's, it would be {with_stunnel:.2f} ms, {with_stunnel / plain:.2f}x plain; "
            f"and its transfer, {transfer_ratio:.2f}x plain, would be about "
            f"{transfer_ratio / bw:.2f}x plain at stunnel's rate (estimates from one bed's "
            "figures applied to another's: the TLS record's hosts are namespaces on a bridge)."
        )
    targets = [
        (f"gateway pair adds {lat:.2f}x stunnel's round trip time <= {LATENCY_TARGET}x",
         lat <= LATENCY_TARGET),
        (f"gateway pair moves {bw:.2f}x stunnel's MB/s >= {BANDWIDTH_TARGET}x",
         bw >= BANDWIDTH_TARGET),
    ]  # fmt: skip
    return text, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="1 round, 100 trips, 4 MB")
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.trips, args.mb = 1, 100, 4
    with_stunnel = shutil.which("stunnel") is not None
    figures = measure(args.rounds, args.trips, args.size, args.mb, with_stunnel)
    _common.publish(args, NAME, "relay.py", argv, report(figures), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
