"""A network of the test's own: code run in a new network namespace that has a non-loopback
IPv4 address (:data:`OUTSIDE_IP`, on a veth pair the namespace holds), so that "loopback only"
and ``expose=True`` are checked against a real network address on any machine, with or without
a network. The namespace is made by ``unshare --net`` for one command and disappears with its
last process: nothing is left to delete, and the caller checks every process it started gone.
Making one needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), ``unshare`` (util-linux) and ``ip``
(iproute2); without them :func:`require_netns` skips, which fails a ``promise`` test unless
GRAPHDIST_ALLOW_PROMISE_SKIPS=1.

Also the tests' oracle for "who can connect where": :func:`non_loopback_addresses` and
:func:`connects`, read from the OS, independent of graphdist's own checks.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import QUIET_TF, REPO, forbid_in_unit_tier

OUTSIDE_IP = "10.254.0.1"  # private (RFC 1918), and only ever inside the test's namespace
CONNECT_TIMEOUT_S = 2.0
# Inside the new namespace, before the command: loopback up, the veth pair up with OUTSIDE_IP,
# and a default route through it (Ray picks its node address from the route to the internet).
_SETUP = " && ".join(
    [
        "ip link set lo up",
        "ip link add gd0 type veth peer name gd1",
        f"ip addr add {OUTSIDE_IP}/24 dev gd0",
        "ip link set gd0 up",
        "ip link set gd1 up",
        "ip route add default dev gd0",
    ]
)


def non_loopback_addresses() -> list[str]:
    """This network namespace's IPv4 addresses outside 127.0.0.0/8."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                found.append(a.address)
    return found


def connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect((host, port))
        except OSError:
            return False
    return True


def require_netns() -> None:
    """Skip (with what is missing) unless this process can make a network namespace with a
    veth pair in it."""
    forbid_in_unit_tier("a network namespace")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a network namespace of the test's own needs root (CAP_SYS_ADMIN)")
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} ({package}) is not installed: cannot make a test network")
    probe = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", _SETUP],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace with a veth pair: {probe.stderr.strip()}")


def run_python_in_netns(
    code: str, *args: str, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` in a network namespace of its own (see the module's docstring),
    from the checkout, with this environment plus ``env``."""
    require_netns()
    argv = ["unshare", "--net", "--", "sh", "-c", f'{_SETUP} && exec "$0" "$@"']
    return subprocess.run(
        [*argv, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, **QUIET_TF, **env},
    )
