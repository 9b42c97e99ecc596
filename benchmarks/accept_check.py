"""The cost of the bind shim's same-user check at ``accept()``: connection set-up with and without
the shim, measured in the same run.

With the shim (``graphdist/_net/loopback.c``), every accepted TCP connection costs a few more
system calls and a read of the kernel's socket table (``/proc/net/tcp``, sometimes
``/proc/net/tcp6`` too), whose size grows with the sockets open on the machine. Each figure is
the time of one loopback ``connect()`` + ``accept()`` + close, the median over ``--repeats`` runs
of ``--connections`` each in a fresh process, with the table padded by ``--extra`` established
connections (2 rows each) held open by that process. The baseline is the same process without
``LD_PRELOAD``; the shim's bind rewrite only runs at ``bind()``, so the difference is the check.
Runs of the two alternate, so a change in the machine's load hits both. README states no target
for this cost (only that connections are long-lived), so none is checked; with ``--readme`` the
figures become the sentence ``accept_check`` of docs/benchmarks.md.

    python benchmarks/accept_check.py [--connections 200] [--repeats 5] [--extra 0 500]
        [--json FILE] [--readme docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap

try:
    from . import _common
except ImportError:  # run as a script
    import _common

NAME = "accept_check"
"""This benchmark's sentence in docs/benchmarks.md (``<!-- bench:accept_check:start -->``)."""

WORKER = textwrap.dedent(
    """
    import resource, socket, struct, sys, time

    n, extra = int(sys.argv[1]), int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2 * extra + 64)), hard))
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(128)
    addr = ("127.0.0.1", srv.getsockname()[1])
    held = []
    for _ in range(extra):
        client = socket.create_connection(addr)
        held += [client, srv.accept()[0]]
    rst = struct.pack("ii", 1, 0)  # close with a reset: no TIME_WAIT rows pile up between runs
    start = time.perf_counter()
    for _ in range(n):
        client = socket.create_connection(addr)
        conn, _ = srv.accept()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst)
        client.close()
        conn.close()
    print(time.perf_counter() - start)
    """
)


def one_run(connections: int, extra: int, preload: str | None) -> float:
    """Seconds per connection of one fresh process (``preload``: the shim, or ``None``)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env.update({"LD_PRELOAD": preload, "GRAPHDIST_BIND_ADDR": "127.0.0.1"})
    out = subprocess.run(
        [sys.executable, "-S", "-c", WORKER, str(connections), str(extra)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return float(out.split()[-1]) / connections


def measure(connections: int, repeats: int, extras: list[int]) -> list[dict[str, float]]:
    sys.path.insert(0, _common.REPO)
    from graphdist._net.loopback import loopback_library

    shim = loopback_library()
    rows = []
    for extra in extras:
        runs: dict[str, list[float]] = {"baseline": [], "shim": []}
        for _ in range(repeats):
            runs["baseline"].append(one_run(connections, extra, None))
            runs["shim"].append(one_run(connections, extra, shim))
        base, with_shim = (statistics.median(runs[k]) for k in ("baseline", "shim"))
        rows.append(
            {
                "extra_connections": extra,
                "baseline_us": base * 1e6,
                "shim_us": with_shim * 1e6,
                "added_us": (with_shim - base) * 1e6,
                "ratio": with_shim / base,
            }
        )
    return rows


def sentence(rows: list[dict[str, float]]) -> str:
    """README's words for ``rows``: the cost with the fewest extra connections, then the others."""
    first, *more = sorted(rows, key=lambda r: r["extra_connections"])
    text = (
        f"{first['added_us']:.0f} µs per accepted connection here, connect + accept + close "
        f"{first['baseline_us']:.0f} → {first['shim_us']:.0f} µs"
    )
    for r in more:
        text += f"; {r['added_us']:.0f} µs with {r['extra_connections']:.0f} more connections open"
    return text


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--extra", type=int, nargs="+", default=[0, 500])
    _common.add_json_option(parser)
    _common.add_readme_option(parser)
    args = parser.parse_args(argv)
    rows = measure(args.connections, args.repeats, args.extra)
    print("extra conns  baseline us/conn  shim us/conn  added us  ratio")
    for r in rows:
        print(
            f"{r['extra_connections']:>11}  {r['baseline_us']:>16.1f}  {r['shim_us']:>12.1f}"
            f"  {r['added_us']:>8.1f}  {r['ratio']:>5.2f}"
        )
    command = _common.command_line("accept_check.py", argv)
    _common.update_readme_inline(args.readme, NAME, sentence(rows), command)
    _common.write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
