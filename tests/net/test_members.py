"""Members only, the parts that need no second host: the ``allow`` list's parsing and refusals,
the CLI's one-line answers, and the fail-closed check that a server's own process makes before
its server starts (graphdist/_net/members.py). The behaviour across hosts is in test_hosts.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

import graphdist
from graphdist._cluster import Cluster
from graphdist._net.loopback import loopback_library
from graphdist._net.members import ALLOW_ENV, check_enforced, parse_allow
from graphdist._net.policy import NetPolicy, exposed_allow
from tests.conftest import QUIET_TF, CliResult


def members_env(cluster: Cluster, allow: tuple[str, ...] = ()) -> dict[str, str]:
    """What the policy sets for an exposed process of ``cluster`` allowing ``allow``."""
    return NetPolicy(expose=True, allow=allow).tasks(cluster).lists()


def test_allow_entries_are_normalized_networks() -> None:
    assert parse_allow("10.0.0.3, 10.0.1.7/24") == ("10.0.0.3/32", "10.0.1.0/24")
    assert parse_allow(["fd00::1", "10.0.0.3", "10.0.0.3/32"]) == ("fd00::1/128", "10.0.0.3/32")
    assert parse_allow(None) == ()


@pytest.mark.parametrize(
    ("allow", "named"),
    [
        ("10.0.0.300", "'10.0.0.300' is not an IP address"),
        ("10.0.0.0/33", "'10.0.0.0/33' is not an IP address"),
        ("0.0.0.0", "'0.0.0.0' is a wildcard"),
        ("10.0.0.1,0.0.0.0/0", "'0.0.0.0/0' is a wildcard"),
        ("::/0", "'::/0' is a wildcard"),
        # every IPv4 address, spelled as IPv6 (issue 38: accepted, and let every IPv4 machine in)
        ("::ffff:0:0/96", "'::ffff:0:0/96' is a wildcard"),  # 0.0.0.0/0
        ("::ffff:0.0.0.0/96", "'::ffff:0.0.0.0/96' is a wildcard"),
        ("::ffff:0:0/95", "'::ffff:0:0/95' holds every IPv4 address"),
        ("::fffe:0:0/94", "'::fffe:0:0/94' holds every IPv4 address"),
        ("fe80::1%eth0", "'fe80::1%eth0' is a scoped address"),
        ("10.0.0.1,fe80::1%2", "'fe80::1%2' is a scoped address"),
        ("", "allow is empty"),
        (" , ", "allow is empty"),
        ([], "allow is empty"),
        ([3], "entries must be strings"),
        (5, "must be addresses or networks"),
    ],
)
def test_a_bad_allow_list_is_refused_naming_the_value(allow: object, named: str) -> None:
    with pytest.raises(graphdist.ArgumentError, match="allow") as info:
        parse_allow(allow)  # type: ignore[arg-type]
    assert named in str(info.value)


def test_v4_mapped_networks_are_the_ipv4_networks_they_are() -> None:
    """An IPv4 peer on an IPv6 socket is ::ffff:a.b.c.d: a v4-mapped entry is kept as the IPv4
    network it spells (so the wildcard check sees it), and a network short of every IPv4
    address is a network like any other."""
    assert parse_allow("::ffff:10.0.0.0/104,::ffff:10.0.0.3") == ("10.0.0.0/8", "10.0.0.3/32")
    assert parse_allow("::ffff:128.0.0.0/97") == ("128.0.0.0/1",)
    assert parse_allow("::fffe:0:0/96,fe80::1") == ("::fffe:0:0/96", "fe80::1/128")
    for every in ("::ffff:0:0/96", "::ffff:0:0/95"):
        with pytest.raises(graphdist.ArgumentError, match=r"wildcard, which would let every"):
            graphdist.LocalFleet("local=1", expose=True, allow=[every])


def test_a_member_list_too_long_for_the_environment_is_refused_in_one_line() -> None:
    """The documented maximum of IPv6 entries fits one environment variable (issue 38: 4,096
    of them failed serve's execve with 'Argument list too long'); a longer list is refused
    before anything starts, naming what to do."""
    most = [f"2001:db8:ffff:ffff:ffff:ffff:ffff:{i:x}" for i in range(1024)]
    env = members_env(Cluster.parse({"w": ["localhost:2222"]}), parse_allow(most))
    assert len(env[ALLOW_ENV].split(",")) == 1024
    argv = [sys.executable, "-c", "import os; print(len(os.environ['GRAPHDIST_ALLOW']))"]
    ran = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
    assert ran.returncode == 0 and int(ran.stdout) == len(env[ALLOW_ENV])  # execve took it
    with pytest.raises(graphdist.ArgumentError, match="at most 1024"):
        parse_allow([*most, "2001:db8::1"])
    hosts = {"w": [f"[2001:db8:ffff:ffff:ffff:fffe:{i:x}:1]:2222" for i in range(3000)]}
    with pytest.raises(graphdist.ArgumentError, match="networks \\(CIDR\\) instead"):
        members_env(Cluster.parse(hosts), parse_allow(most))


def test_members_are_the_clusters_own_hosts_and_the_allow_list() -> None:
    cluster = Cluster.parse({"w": ["10.0.0.1:2222", "localhost:2223", "10.0.0.2:2222"]})
    env = members_env(cluster, parse_allow("10.9.0.0/16"))
    assert env == {ALLOW_ENV: "10.0.0.1,10.0.0.2,10.9.0.0/16"}  # loopback: the same-user rule


def test_a_member_host_that_does_not_resolve_is_refused() -> None:
    cluster = Cluster.parse({"w": ["no-such-host.invalid:2222"]})
    with pytest.raises(graphdist.ClusterSpecError, match=r"no-such-host\.invalid"):
        members_env(cluster)


def test_allow_without_expose_is_refused() -> None:
    with pytest.raises(graphdist.ArgumentError, match="expose=True"):
        graphdist.LocalFleet("local=1", allow=["10.0.0.3"])


def test_a_server_process_without_the_shim_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Members asked for, shim absent (this test process has none): refused, not assumed."""
    monkeypatch.setenv(ALLOW_ENV, "10.0.0.1")
    with pytest.raises(graphdist.LoopbackUnavailableError, match="shim is not loaded"):
        check_enforced("/job:w/task:0")
    monkeypatch.delenv(ALLOW_ENV)
    check_enforced("/job:w/task:0")  # nothing asked: nothing to check


def test_an_empty_member_list_without_the_shim_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``GRAPHDIST_ALLOW=""`` is members asked with none to let in (an exposed fleet on loopback
    hosts), not nothing asked: without the shim its server would serve every machine on the
    wildcard, so it is refused like any other list."""
    monkeypatch.setenv(ALLOW_ENV, "")
    with pytest.raises(graphdist.LoopbackUnavailableError) as info:
        check_enforced("/job:w/task:0")
    assert str(info.value) == (
        "The server of /job:w/task:0 would listen on a host address, but cannot enforce that "
        "only its cluster's hosts connect: graphdist's shim is not loaded in its process; it was "
        "not started. Is LD_PRELOAD honoured here (a wrapper such as env or nice in between "
        "drops it)?"
    )


def test_an_exposed_fleet_on_loopback_hosts_asks_for_an_empty_member_list() -> None:
    """Its hosts are all loopback (no member) and it allows nobody: the list is set, and empty,
    so the shim lets no other machine in and check_enforced insists on the shim."""
    cluster = Cluster.parse({"local": ["localhost:2222", "127.0.0.1:2223", "[::1]:2224"]})
    assert members_env(cluster) == {ALLOW_ENV: ""}
    assert members_env(cluster, parse_allow("10.0.0.3")) == {ALLOW_ENV: "10.0.0.3/32"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("allow", "outcome"),
    [("10.0.0.1,10.0.1.0/24", "ok"), ("", "ok"), ("10.0.0.1,bogus", "cannot read an entry")],
)
def test_the_shim_reads_the_list_the_server_was_given(allow: str, outcome: str) -> None:
    """In a process with the shim loaded, the check passes when the shim reads every entry and
    refuses where one is unreadable by it (the shim would match nothing: fail closed)."""
    code = (
        "from graphdist._net.members import check_enforced\n"
        "try:\n    check_enforced('/job:w/task:0'); print('ok')\n"
        "except Exception as exc:\n    print(exc)\n"
    )
    env = {**os.environ, **QUIET_TF, "LD_PRELOAD": loopback_library(), ALLOW_ENV: allow}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert outcome in result.stdout, result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--allow", "0.0.0.0/0"], "'0.0.0.0/0' is a wildcard"),
        (["serve", "--allow", "::ffff:0:0/96"], "'::ffff:0:0/96' is a wildcard"),
        (["serve", "--allow", "::ffff:0:0/95"], "'::ffff:0:0/95' holds every IPv4 address"),
        (["serve", "--allow", "fe80::1%eth0"], "'fe80::1%eth0' is a scoped address"),
        (["serve", "--allow", "10.1.2"], "'10.1.2' is not an IP address"),
        (["serve", "--allow", ","], "--allow is empty"),
        (["serve", "--allow", "10.0.0.3"], "--allow does nothing for local-0"),
        (["up", "--cluster", "local=1", "--allow", "10.0.0.3"], "--allow does nothing without"),
    ],
)
def test_cli_allow_mistakes_are_one_line_and_exit_2(
    argv: list[str], named: str, run_cli: Callable[..., CliResult]
) -> None:
    if argv[0] == "serve":
        argv = [*argv, "--cluster", '{"local": ["localhost:1"]}', "--job", "local", "--task", "0"]
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr


def test_a_detached_spec_carries_the_allow_list(tmp_path: object) -> None:
    from graphdist._detached.supervisor import SupervisorSpec

    spec = SupervisorSpec(
        state_dir=str(tmp_path), cluster="local=1", expose=True, allow=("10.0.0.3",)
    )
    again = SupervisorSpec.from_json(spec.to_json())
    assert again.allow == ("10.0.0.3/32",)
    with pytest.raises(graphdist.ArgumentError, match="expose=True"):
        SupervisorSpec(state_dir=str(tmp_path), cluster="local=1", allow=("10.0.0.3",))


# -- what mutation testing found unpinned (make mutants, docs/mutants.md) -----------------------


@pytest.mark.parametrize(
    ("allow", "message", "value"),
    [
        (5, "allow must be addresses or networks (a list, or a comma-separated string), not 5", 5),
        ([3], "allow entries must be strings such as '10.0.0.3' or '10.0.0.0/24', not 3", 3),
        (
            "10.0.0.300",
            "allow: '10.0.0.300' is not an IP address or network (CIDR) such as '10.0.0.3' or "
            "'10.0.0.0/24'",
            "10.0.0.300",
        ),
        (
            " 0.0.0.0",
            "allow: '0.0.0.0' is a wildcard, which would let every machine run code in the "
            "servers; name the clients' addresses or networks",
            "0.0.0.0",
        ),
        (
            "",
            "allow is empty; name at least one address or network, or leave it out (the "
            "cluster's own hosts are always let in)",
            "",
        ),
    ],
)
def test_a_bad_allow_list_is_refused_in_exact_words(allow: object, message: str, value: object):
    with pytest.raises(graphdist.ArgumentError) as info:
        parse_allow(allow)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert (info.value.name, info.value.value) == ("allow", value)


def test_the_allow_list_is_bounded_and_named_as_the_caller_names_it():
    most = ",".join(f"10.0.{i // 256}.{i % 256}" for i in range(1024))
    assert len(parse_allow(most)) == 1024
    with pytest.raises(graphdist.ArgumentError) as info:
        parse_allow(most + ",10.1.0.0", name="--allow")
    assert str(info.value) == "--allow has 1025 entries; at most 1024"
    assert (info.value.name, info.value.value) == ("--allow", most + ",10.1.0.0")
    with pytest.raises(graphdist.ArgumentError) as info:
        parse_allow("bogus", name="--allow")
    assert info.value.name == "--allow" and str(info.value).startswith("--allow: 'bogus' is not")


def test_empty_entries_are_skipped_and_the_widest_networks_short_of_everything_are_kept():
    assert parse_allow("10.0.0.1,,10.0.0.2") == ("10.0.0.1/32", "10.0.0.2/32")
    assert parse_allow(["10.0.0.1", " ", "10.0.0.2"]) == ("10.0.0.1/32", "10.0.0.2/32")
    assert parse_allow("128.0.0.0/1,8000::/1") == ("128.0.0.0/1", "8000::/1")
    assert parse_allow("10.0.0.7/24") == ("10.0.0.0/24",)  # host bits: the network, not an error


def test_allow_without_expose_is_refused_in_exact_words():
    with pytest.raises(graphdist.ArgumentError) as info:
        exposed_allow("10.0.0.3", False)
    assert str(info.value) == (
        "allow does nothing without expose=True: the servers stay on loopback, which no other "
        "machine reaches; drop it, or pass expose=True as well"
    )
    assert (info.value.name, info.value.value) == ("allow", "10.0.0.3")
    assert exposed_allow("10.0.0.3", True) == ("10.0.0.3/32",)
    assert exposed_allow(None, False) == ()


def test_member_addresses_are_resolved_once_each_without_their_zone():
    cluster = Cluster.parse({"w": ["10.0.0.1:1", "10.0.0.1:2", "[fe80::1%lo]:3"]})
    assert members_env(cluster) == {ALLOW_ENV: "10.0.0.1,fe80::1"}  # what the shim can parse
    with pytest.raises(graphdist.ClusterSpecError) as info:
        members_env(Cluster.parse({"w": ["X127.0.0.1X:1"]}))  # a name, not 127.0.0.1
    assert re.fullmatch(
        r"Host 'X127\.0\.0\.1X' of task w-0 does not resolve \(.+\), so its server could not be "
        r"let in as a member of the cluster; name it by address",
        str(info.value),
    ), str(info.value)
    assert info.value.value == "X127.0.0.1X:1"


class _Shim:
    """ctypes.CDLL(None) as a process with the shim loaded sees it: graphdist_members() is the
    number of entries the shim read (-1: one unreadable, -2: no list)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, name: object) -> _Shim:
        return self

    def graphdist_members(self) -> int:
        return self.count


@pytest.mark.parametrize(
    ("allow", "count", "why"),
    [
        ("10.0.0.1,10.0.1.0/24", 2, None),
        (",10.0.0.1,,", 1, None),  # empty entries are no entries, for both
        ("", 0, None),
        ("10.0.0.1,10.0.0.2", 1, "the shim reads 1 entries instead of 2"),
        ("10.0.0.1", 2, "the shim reads 2 entries instead of 1"),
        ("10.0.0.1", -1, "the shim cannot read an entry of the list"),
        ("10.0.0.1", -2, "the shim does not see the list"),
        ("", -2, "the shim does not see the list"),
    ],
)
def test_the_server_starts_only_if_the_shim_reads_the_list_it_was_given(
    monkeypatch: pytest.MonkeyPatch, allow: str, count: int, why: str | None
) -> None:
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", _Shim(count))
    monkeypatch.setenv(ALLOW_ENV, allow)
    if why is None:
        check_enforced("/job:w/task:0")
        return
    with pytest.raises(graphdist.LoopbackUnavailableError) as info:
        check_enforced("/job:w/task:0")
    assert str(info.value) == (
        "The server of /job:w/task:0 would listen on a host address, but cannot enforce that "
        f"only its cluster's hosts connect: {why}; it was not started. Is LD_PRELOAD honoured "
        "here (a wrapper such as env or nice in between drops it)?"
    )
