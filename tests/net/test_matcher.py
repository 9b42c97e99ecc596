"""The bind shim's members matcher (graphdist/_net/loopback.c), tested as C: whether a peer from
another machine is in ``GRAPHDIST_ALLOW``, which the shim asks at every ``accept()`` of a server
on a host address. Prefixes of every length (0..32 for IPv4, 0..128 for IPv6), the bits on both
sides of each prefix's end (so a matcher one bit short, or one that skips a prefix's partial
byte, is caught), IPv4 peers as an IPv6 socket sees them (``::ffff:a.b.c.d``) against IPv4
entries, and the list as the shim reads it: an empty list lets in no other machine, an
unparsable entry matches nothing.

The matcher is ``static`` in the shim (a preloaded library must export nothing but what it
interposes, and ``graphdist_members``), so it cannot be called through ctypes. The test compiles
a small C driver that ``#include``s the very ``loopback.c`` the shim is built from (the same
translation unit: the static functions are in scope) and feeds it cases on stdin; Python's
:mod:`ipaddress` is the oracle. The driver builds each peer as the shim's ``accept()`` does for
an IPv4 socket (the address v4-mapped) or an IPv6 one (as the kernel gives it), and asks both
the matcher of one entry (``in_entry``) and the shim's decision for a peer from another machine
(``member``, which walks the whole list). A compiler is what the shim needs anyway: without one
the shim does not exist, and this test skips, which fails it as a ``promise`` in CI.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

pytestmark = [pytest.mark.promise, pytest.mark.timeout(60)]

DRIVER = r"""
#define _GNU_SOURCE
#include <time.h>

/* The shim's clock, the driver's to move ("T SECONDS"): the refusal log's intervals are tested
 * without waiting for them. */
static time_t fake_seconds = 1000;
static int fake_clock_gettime(clockid_t clock, struct timespec *t) {
    (void)clock;
    t->tv_sec = fake_seconds, t->tv_nsec = 0;
    return 0;
}
#define clock_gettime fake_clock_gettime
#include "loopback.c"

/* A peer as permitted() sees it: an IPv4 socket's peer (v4 set, v4-mapped in peer6), or an
 * IPv6 socket's (peer6 as given; v4 where it is v4-mapped, as both ends then are). */
static int peer_ends(const char *text, struct ends *e) {
    memset(e, 0, sizeof *e);
    if (inet_pton(AF_INET, text, &e->peer4) == 1) {
        e->v4 = 1;
        map_v4(&e->peer6, &e->peer4);
        return 1;
    }
    if (inet_pton(AF_INET6, text, &e->peer6) == 1) {
        e->v4 = IN6_IS_ADDR_V4MAPPED(&e->peer6);
        memcpy(&e->peer4, &e->peer6.s6_addr[12], 4);
        return 1;
    }
    return 0;
}

/* One case a line: "E ENTRY PEER" (in_entry: 1, 0, -1), "M PEER" (member: 1 let in, 0
 * refused), "R N PEER..." (member N times, the peers in turn: how many were let in), "T S"
 * (the clock S seconds on), "S LIST" (set GRAPHDIST_ALLOW; "S" alone: the empty list), "U"
 * (unset it), "C" (graphdist_members); the dial list: "D LIST" (set GRAPHDIST_DIAL), "N"
 * (unset it), "K" (graphdist_dial), "P ADDRESS PORT [udp]" (dialable, for a fresh TCP or UDP
 * socket of the address's family: 1 may connect, 0 refused). Answers one line each; "?" for a
 * line it cannot read. */
int main(void) {
    char line[1024];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char *arg = line[1] == ' ' ? line + 2 : line + 1;
        struct ends e;
        if (line[0] == 'E') {
            char *space = strrchr(arg, ' '); /* a peer has no space; an entry may */
            if (space == NULL || !peer_ends(space + 1, &e)) { puts("?"); continue; }
            printf("%d\n", in_entry(arg, (size_t)(space - arg), &e.peer6));
        } else if (line[0] == 'M') {
            if (!peer_ends(arg, &e)) { puts("?"); continue; }
            printf("%d\n", member(&e));
        } else if (line[0] == 'R') {
            char *rest;
            long n = strtol(arg, &rest, 10), in = 0;
            char *peers[64];
            int count = 0;
            for (char *p = strtok(rest, " "); p != NULL && count < 64; p = strtok(NULL, " "))
                peers[count++] = p;
            if (count == 0) { puts("?"); continue; }
            for (long i = 0; i < n; i++) {
                if (!peer_ends(peers[i % count], &e)) { in = -1; break; }
                in += member(&e);
            }
            printf("%ld\n", in);
        } else if (line[0] == 'T') {
            fake_seconds += strtol(arg, NULL, 10);
            puts("ok");
        } else if (line[0] == 'S') {
            setenv("GRAPHDIST_ALLOW", arg, 1);
            puts("ok");
        } else if (line[0] == 'U') {
            unsetenv("GRAPHDIST_ALLOW");
            puts("ok");
        } else if (line[0] == 'C') {
            printf("%d\n", graphdist_members());
        } else if (line[0] == 'D') {
            setenv("GRAPHDIST_DIAL", arg, 1);
            puts("ok");
        } else if (line[0] == 'N') {
            unsetenv("GRAPHDIST_DIAL");
            puts("ok");
        } else if (line[0] == 'K') {
            printf("%d\n", graphdist_dial());
        } else if (line[0] == 'P') {
            char host[64];
            unsigned port;
            int udp = strstr(arg, " udp") != NULL;
            if (sscanf(arg, "%63s %u", host, &port) != 2) { puts("?"); continue; }
            struct sockaddr_storage to;
            socklen_t len;
            memset(&to, 0, sizeof to);
            struct sockaddr_in *v4 = (struct sockaddr_in *)&to;
            struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&to;
            if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
                v4->sin_family = AF_INET, v4->sin_port = htons((uint16_t)port), len = sizeof *v4;
            } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
                v6->sin6_family = AF_INET6, v6->sin6_port = htons((uint16_t)port);
                len = sizeof *v6;
            } else { puts("?"); continue; }
            int fd = socket(to.ss_family, udp ? SOCK_DGRAM : SOCK_STREAM, 0);
            if (fd < 0) { puts("?"); continue; }
            printf("%d\n", dialable(fd, (struct sockaddr *)&to, len));
            close(fd);
        } else {
            puts("?");
        }
    }
    return 0;
}
"""

V4_BASE = ipaddress.IPv4Address("203.0.113.77")  # TEST-NET-3: parsed here, never contacted
V6_BASE = ipaddress.IPv6Address("2001:db8:a5c3:1234:5678:9abc:def0:1357")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _source() -> Path:
    return Path(str(resources.files("graphdist._net").joinpath("loopback.c")))


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: the bind shim cannot be built here either")
    folder = tmp_path_factory.mktemp("matcher")
    (folder / "driver.c").write_text(DRIVER, encoding="utf-8")
    exe = folder / "driver"
    flags = ["-O1", "-Wall", "-Werror", "-Wno-unused-function", "-I", str(_source().parent)]
    result = subprocess.run(
        [compiler, *flags, "-o", str(exe), str(folder / "driver.c"), "-ldl"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return exe


def _log(
    driver: Path, lines: list[str], env: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """The driver's answers to ``lines`` (one each) and what it wrote on stderr (the log)."""
    result = subprocess.run(
        [str(driver)],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", ""), **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answers = result.stdout.splitlines()
    assert len(answers) == len(lines), (answers, result.stderr[-2000:])
    return answers, result.stderr.splitlines()


def _ask(driver: Path, lines: list[str], env: dict[str, str] | None = None) -> list[str]:
    return _log(driver, lines, env)[0]


ALL_V4 = ipaddress.IPv6Network("::ffff:0:0/96")  # every IPv4 address, as an IPv6 socket sees it


def _expected(network: Network, peer: Address) -> int:
    """The oracle: 1 if ``peer`` is in ``network`` (an IPv4 peer seen over IPv6 being
    ::ffff:a.b.c.d), 0 if not; -1 (matches nothing) for a network that holds every IPv4
    address, however it is spelled (``0.0.0.0/0``, ``::ffff:0:0/96``, ``::/80``, ``::/0``)."""
    if isinstance(network, ipaddress.IPv4Network):
        if network.prefixlen == 0:
            return -1
        v4 = peer if isinstance(peer, ipaddress.IPv4Address) else peer.ipv4_mapped
        return int(v4 is not None and v4 in network)
    if ALL_V4.subnet_of(network):
        return -1
    if isinstance(peer, ipaddress.IPv4Address):
        peer = ipaddress.IPv6Address(f"::ffff:{peer}")
    return int(peer in network)


def _flip(address: Address, bit: int) -> Address:
    """``address`` with bit ``bit`` flipped, counting from the most significant (bit 0)."""
    width = address.max_prefixlen
    return type(address)(int(address) ^ (1 << (width - 1 - bit)))


def _peers(base: Address, length: int, rng: random.Random) -> Iterator[Address]:
    """Peers on both sides of a prefix of ``length`` bits over ``base``: the base, the last bit
    inside the prefix flipped (out), the first bit past it flipped (in), the network's first and
    last addresses, each bit of the prefix flipped, and a few random addresses."""
    width = base.max_prefixlen
    network = ipaddress.ip_network(f"{base}/{length}", strict=False)
    yield base
    yield network.network_address
    yield network.broadcast_address
    for bit in range(width):  # every bit: those inside the prefix take the peer out
        yield _flip(base, bit)
    for _ in range(4):
        yield type(base)(rng.getrandbits(width))
        yield type(base)(int(network.network_address) | rng.getrandbits(width - length))


def _cases() -> list[tuple[str, Address]]:
    rng = random.Random(41)
    cases: list[tuple[str, Address]] = []
    for length in range(33):
        for peer in _peers(V4_BASE, length, rng):
            cases.append((f"{V4_BASE}/{length}", peer))
            cases.append((f"{V4_BASE}/{length}", ipaddress.IPv6Address(f"::ffff:{peer}")))
    for length in range(129):
        for peer in _peers(V6_BASE, length, rng):
            cases.append((f"{V6_BASE}/{length}", peer))
    return cases


def test_every_prefix_length_of_both_families_matches_what_ipaddress_says(driver: Path) -> None:
    cases = _cases()
    answers = _ask(driver, [f"E {entry} {peer}" for entry, peer in cases])
    wrong = [
        (entry, str(peer), answer)
        for (entry, peer), answer in zip(cases, answers, strict=True)
        if answer != str(_expected(ipaddress.ip_network(entry, strict=False), peer))
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} wrong, e.g. {wrong[:10]}"
    # each prefix length was decided both ways, by the bit on each side of its end; the /0s
    # (and 2001:db8::/1, /2, which hold ::ffff:0:0/96) match nothing
    assert set(answers) == {"-1", "0", "1"}


@pytest.mark.parametrize(
    ("entry", "peer", "answer"),
    [
        ("10.0.1.0/25", "10.0.1.100", "1"),  # the partial byte: 100 < 128
        ("10.0.1.0/25", "10.0.1.200", "0"),  # 200 has the 25th bit set
        ("10.0.1.0/25", "::ffff:10.0.1.100", "1"),  # the same peer on an IPv6 socket
        ("10.0.1.0/25", "::ffff:10.0.1.200", "0"),
        ("10.0.1.128/25", "10.0.1.200", "1"),
        ("10.0.1.0/31", "10.0.1.1", "1"),
        ("10.0.1.0/31", "10.0.1.2", "0"),  # one bit short would let it in
        ("10.0.0.3", "10.0.0.3", "1"),  # an address is a /32
        ("10.0.0.3", "10.0.0.2", "0"),
        ("10.0.0.3", "::ffff:10.0.0.3", "1"),
        ("10.0.0.3", "::10.0.0.3", "0"),  # IPv4-compatible is not v4-mapped
        ("10.0.0.3", "64:ff9b::10.0.0.3", "0"),  # nor is NAT64
        ("10.0.0.0/8", "fd00::a00:3", "0"),  # an IPv6 peer is never in an IPv4 entry
        ("fd00::/64", "fd00::1:2:3:4", "1"),
        ("fd00::/64", "fd00:0:0:1::1", "0"),
        ("fd00::1", "fd00::1", "1"),  # a /128
        ("fd00::1", "10.0.0.1", "0"),
        ("::ffff:10.0.0.0/104", "10.1.2.3", "1"),  # a v4-mapped IPv6 entry holds IPv4 peers
        ("::ffff:10.0.0.0/104", "11.1.2.3", "0"),
        # every IPv4 address, however spelled: matches nothing (parse_allow refuses them too)
        ("10.0.0.0/0", "1.2.3.4", "-1"),
        ("10.0.0.0/0", "fd00::1", "-1"),
        ("::ffff:0:0/96", "1.2.3.4", "-1"),
        ("::ffff:0.0.0.0/96", "::ffff:1.2.3.4", "-1"),
        ("::ffff:0:0/95", "1.2.3.4", "-1"),
        ("::/80", "1.2.3.4", "-1"),
        ("::/0", "fd00::1", "-1"),
        ("::ffff:0:0/97", "1.2.3.4", "1"),  # half of IPv4 is a network like any other
        ("::ffff:0:0/97", "200.2.3.4", "0"),
        ("::fffe:0:0/96", "1.2.3.4", "0"),  # the /96 beside IPv4 holds none of it
        ("10.0.0.0/33", "10.0.0.1", "-1"),  # unparsable: matches nothing
        ("fd00::/129", "fd00::1", "-1"),
        ("10.0.0.0/", "10.0.0.1", "-1"),
        ("10.0.0.0/-1", "10.0.0.1", "-1"),
        ("10.0.0.0/8x", "10.0.0.1", "-1"),
        ("10.0.0", "10.0.0.1", "-1"),
        ("host.example", "10.0.0.1", "-1"),
        (" 10.0.0.1", "10.0.0.1", "-1"),  # the list has no spaces: one is a broken entry
    ],
)
def test_the_examples_that_name_each_rule(driver: Path, entry: str, peer: str, answer: str) -> None:
    assert _ask(driver, [f"E {entry} {peer}"]) == [answer]


PEERS = ["10.0.0.1", "10.0.1.100", "192.168.7.9", "::ffff:10.0.0.1", "fd00::1", "2001:db8::5"]


def test_an_empty_member_list_lets_in_no_other_machine(driver: Path) -> None:
    """``GRAPHDIST_ALLOW=""``: what an exposed fleet on loopback hosts sets (its hosts are all
    loopback, so it has no members): every peer from another machine is refused, and the shim
    reads the list as 0 entries (what check_enforced compares with)."""
    answers = _ask(driver, ["S", "C", *(f"M {p}" for p in PEERS)])
    assert answers == ["ok", "0", *["0"] * len(PEERS)]


def test_the_list_is_walked_whole_and_a_broken_entry_matches_nothing(driver: Path) -> None:
    lines = ["S 10.0.0.1,,bogus,10.0.1.0/25,fd00::/64", "C"]
    lines += [f"M {p}" for p in PEERS]
    answers = _ask(driver, lines)
    assert answers[:2] == ["ok", "-1"]  # check_enforced refuses to start a server on this
    assert answers[2:] == ["1", "1", "0", "1", "1", "0"]
    answers = _ask(driver, ["S 10.0.0.1,10.0.1.0/25", "C", "M 10.0.1.200", "M 10.0.0.2"])
    assert answers == ["ok", "2", "0", "0"]


def test_without_a_list_the_shim_lets_in_no_other_machine(driver: Path) -> None:
    """No ``GRAPHDIST_ALLOW`` (an environment that lost it, a process that binds a host address
    by itself, ``GRAPHDIST_BIND_ADDR="*"`` alone): fail closed, every other machine refused and
    the reason logged. Loopback peers never reach this check (the same-user rule decides)."""
    answers, log = _log(driver, ["U", "C", *(f"M {p}" for p in PEERS)])
    assert answers == ["ok", "-2", *["0"] * len(PEERS)]
    assert "refused a connection from 10.0.0.1: this server was given no member list" in log[0]


def test_a_refused_peer_is_logged_with_its_address(driver: Path) -> None:
    answers, log = _log(driver, ["S 10.0.0.1", "M 10.0.1.200", "M ::ffff:10.0.1.201", "M fd00::7"])
    assert answers == ["ok", "0", "0", "0"]
    for line, peer in zip(log, ("10.0.1.200", "10.0.1.201", "fd00::7"), strict=True):
        assert f"refused a connection from {peer}: not a member" in line, log  # v4-mapped: IPv4
        assert f"--allow {peer}" in line


SUMMARY = re.compile(r"graphdist: refused (\d+) more connection\(s\) in the last")


def test_the_refusal_log_is_one_line_per_address_per_interval(driver: Path) -> None:
    """An outsider alternating two source addresses (issue 38: 58,133 lines in 5 s when the
    shim remembered one address): one line for each per 10 s; the next interval's first
    refusal counts the rest in one line, and each address gets its line again."""
    answers, log = _log(
        driver,
        [
            "S 10.0.0.1",
            "R 20000 10.9.0.1 10.9.0.2",
            "T 9",
            "R 100 10.9.0.1",
            "T 1",
            "R 2 10.9.0.2 10.9.0.1",
        ],
    )
    assert answers == ["ok", "0", "ok", "0", "ok", "0"]
    assert len(log) == 5, log
    assert "refused a connection from 10.9.0.1: not a member" in log[0]
    assert "refused a connection from 10.9.0.2: not a member" in log[1]
    counted = SUMMARY.search(log[2])
    assert counted and int(counted.group(1)) == 20000 + 100 - 2, log[2]
    assert "from 10.9.0.2: not a member" in log[3] and "from 10.9.0.1: not a member" in log[4]


def test_the_refusal_log_has_a_cap_per_interval_over_all_addresses(driver: Path) -> None:
    """Many addresses (more than the shim remembers, and more than the cap): at most 20 lines
    per 10 s in all, then one line counting the rest; a member is let in all along."""
    peers = " ".join(f"10.9.{i // 256}.{i % 256}" for i in range(64))
    answers, log = _log(
        driver, ["S 10.0.0.1", f"R 6400 {peers}", "M 10.0.0.1", "T 10", f"R 64 {peers}"]
    )
    assert answers == ["ok", "0", "1", "ok", "0"]
    assert len(log) == 20 + 1 + 20, log[:3]
    assert all("not a member" in line for line in log[:20])
    counted = SUMMARY.search(log[20])
    assert counted and int(counted.group(1)) == 6400 - 20, log[20]


# ---- the dial list: which addresses a server may connect() to (GRAPHDIST_DIAL) ------------------

DIAL = "127.0.0.1:2222,[::1]:2222,10.0.0.3:2223,[fd00::3]:2224"


@pytest.mark.parametrize(
    ("address", "port", "answer"),
    [
        ("127.0.0.1", 2222, "1"),
        ("127.0.0.1", 2223, "0"),  # the address of a task, another port: another server
        ("127.0.0.2", 2222, "0"),  # another loopback address (another user's fleet, say)
        ("::ffff:127.0.0.1", 2222, "1"),  # an IPv4 task dialled on an IPv6 socket: v4-mapped
        ("::ffff:127.0.0.2", 2222, "0"),
        ("::1", 2222, "1"),
        ("::1", 2223, "0"),
        ("10.0.0.3", 2223, "1"),
        ("::ffff:10.0.0.3", 2223, "1"),
        ("10.0.0.3", 2222, "0"),
        ("fd00::3", 2224, "1"),
        ("fd00::3:0", 2224, "0"),
        ("::10.0.0.3", 2223, "0"),  # IPv4-compatible is not v4-mapped
        ("10.0.0.4", 2223, "0"),
    ],
)
def test_a_server_dials_only_the_addresses_and_ports_of_its_list(
    driver: Path, address: str, port: int, answer: str
) -> None:
    assert _ask(driver, [f"D {DIAL}", f"P {address} {port}"]) == ["ok", answer]


def test_the_dial_list_is_counted_and_checked_only_where_set(driver: Path) -> None:
    """Unset (run tasks, Ray actors: user code) nothing is checked; an empty list dials no
    TCP address; UDP (a DNS query) is never checked; the count is what check_enforced compares
    with (empty entries skipped, as in GRAPHDIST_ALLOW)."""
    answers = _ask(
        driver,
        [
            "N",
            "K",
            "P 10.9.9.9 80",
            f"D {DIAL}",
            "K",
            "P 10.9.9.9 53 udp",
            "P 10.9.9.9 53",
            "D",
            "K",
            "P 127.0.0.1 2222",
            "D 127.0.0.1:2222,,[::1]:2222,",
            "K",
            "P ::1 2222",
        ],
    )
    assert answers == ["ok", "-2", "1", "ok", "4", "1", "0", "ok", "0", "0", "ok", "2", "1"]


@pytest.mark.parametrize(
    "entry",
    [
        "localhost:2222",  # names are resolved by graphdist, never by the shim
        "127.0.0.1",  # no port
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:22x",
        "127.0.0.1:-1",
        "::1:2222",  # IPv6 needs brackets
        "[::1]2222",
        "[::1:2222",
        "[127.0.0.1]:2222",
        " 127.0.0.1:2222",
        "127.0.0.1:2222/32",
    ],
)
def test_a_malformed_dial_list_refuses_every_tcp_connect_and_says_so_once(
    driver: Path, entry: str
) -> None:
    answers, log = _log(
        driver,
        [f"D 127.0.0.1:2222,{entry}", "K", "P 127.0.0.1 2222", "P ::1 2222", "P 10.0.0.1 53 udp"],
    )
    assert answers == ["ok", "-1", "0", "0", "1"]
    assert sum("GRAPHDIST_DIAL is malformed" in line for line in log) == 1, log


def test_a_refused_dial_is_logged_with_its_address_within_the_shared_bound(driver: Path) -> None:
    """One line per address per interval, the cap shared with refused peers: a session that
    names thousands of addresses writes no more than an outsider knocking."""
    answers, log = _log(
        driver,
        [f"D {DIAL}", "P 127.0.0.9 2222", "P 127.0.0.9 2225", "P fd00::9 80", "S 10.0.0.1"]
        + [f"P 10.8.{i // 256}.{i % 256} 80" for i in range(300)]
        + ["T 10", "M 10.9.0.1"],
    )
    assert answers[:4] == ["ok", "0", "0", "0"] and set(answers[5:305]) == {"0"}
    assert "refused to dial 127.0.0.9:2222: not a task of this server's cluster" in log[0]
    assert "refused to dial [fd00::9]:80" in log[1]
    assert len(log) == 20 + 1 + 1, log[:3]
    counted = SUMMARY.search(log[20])
    assert counted and int(counted.group(1)) == 3 + 300 - 20, log[20]
    assert "from 10.9.0.1: not a member" in log[21]
