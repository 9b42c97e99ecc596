"""The network policy's table: for each engine and kind of process, expose x allow x tls ->
the bind address and the accept (``GRAPHDIST_ALLOW``) and dial (``GRAPHDIST_DIAL``) lists.

The expected values were pinned from what each engine computed for itself before the policy
was one module (the refactor is behaviour-preserving); the shim library's path and this host's
addresses are injected, the clusters are numeric (no name service)."""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import types

import pytest

import graphdist
from graphdist._cluster import Cluster
from graphdist._exceptions import ArgumentError, ClusterSpecError
from graphdist._net import exposure, loopback
from graphdist._net.gateway import alias, tls_cluster
from graphdist._net.members import parse_allow
from graphdist._net.policy import NetPolicy, gateway_env, member_list

SHIM = "/cache/loopback-bind.so"
HOST = "192.168.5.5"  # this host's own address (host_addresses)
LOOP = Cluster({"worker": ["127.0.0.1:2222", "127.0.0.2:2223"]})
REAL = Cluster({"worker": ["10.1.2.3:2222", "10.1.2.4:2223"]})
A3, A4 = alias("10.1.2.3"), alias("10.1.2.4")
PRE = {"LD_PRELOAD": SHIM}
INHERIT = {"GRAPHDIST_SHIM_INHERIT": "1"}


@pytest.fixture(autouse=True)
def _facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loopback, "loopback_library", lambda: SHIM)
    monkeypatch.setattr(exposure, "host_addresses", lambda: [HOST])
    fake_ray = types.ModuleType("ray")
    fake_ray.nodes = lambda: [  # type: ignore[attr-defined]
        {"NodeManagerAddress": "10.1.2.3", "Alive": True},
        {"NodeManagerAddress": "10.1.2.4", "Alive": True},
        {"NodeManagerAddress": "10.1.2.9", "Alive": False},
    ]
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    from graphdist._ray import nodes as raynodes

    monkeypatch.setattr(raynodes, "source_address", lambda ip: "10.1.2.7")


def _env(bind: str, accept: str | None = None, dial: str | None = None) -> dict[str, str]:
    env = {"GRAPHDIST_BIND_ADDR": bind}
    if accept is not None:
        env["GRAPHDIST_ALLOW"] = accept
    if dial is not None:
        env["GRAPHDIST_DIAL"] = dial
    return env


LOOP_DIAL = "127.0.0.1:2222,127.0.0.2:2223"
REAL_DIAL = "10.1.2.3:2222,10.1.2.4:2223"
ALIAS_DIAL = f"{A3}:2222,{A4}:2223"
NET = "10.9.0.0/16"

# (engine/kind, cluster, expose, allow, tls) -> the environment of the process of worker:0
TABLE = [
    # a LocalFleet's server: its fork server carries LD_PRELOAD; the task env says the rest
    ("local-server", LOOP, False, None, False, _env("127.0.0.1", None, LOOP_DIAL)),
    ("local-server", LOOP, True, None, False, _env("*", "", LOOP_DIAL)),
    ("local-server", LOOP, True, [NET], False, _env("*", NET, LOOP_DIAL)),
    ("local-server", REAL, True, [NET], False, _env("*", f"10.1.2.3,10.1.2.4,{NET}", REAL_DIAL)),
    ("local-server", REAL, False, None, True, _env(A3, None, ALIAS_DIAL)),
    # a local run's command task: the shim inherited, no dial list, no allow option
    ("local-task", LOOP, False, None, False, {**PRE, **_env("127.0.0.1"), **INHERIT}),
    ("local-task", LOOP, True, None, False, {**PRE, **_env("*", ""), **INHERIT}),
    ("local-task", REAL, True, None, False, {**PRE, **_env("*", "10.1.2.3,10.1.2.4"), **INHERIT}),
    ("local-task", REAL, False, None, True, {**PRE, **_env(A3), **INHERIT}),
    # graphdist serve (expose: --bind-all); on real hosts, always with its members and dials
    (
        "serve",
        REAL,
        False,
        None,
        False,
        {**PRE, **_env("10.1.2.3", "10.1.2.3,10.1.2.4", REAL_DIAL)},
    ),
    (
        "serve",
        REAL,
        False,
        [NET],
        False,
        {**PRE, **_env("10.1.2.3", f"10.1.2.3,10.1.2.4,{NET}", REAL_DIAL)},
    ),
    ("serve", REAL, True, None, False, {**PRE, **_env("*", "10.1.2.3,10.1.2.4", REAL_DIAL)}),
    ("serve", LOOP, False, None, False, {**PRE, **_env("127.0.0.1", "", LOOP_DIAL)}),
    ("serve", REAL, False, None, True, {**PRE, **_env(A3, "", ALIAS_DIAL)}),
    # a RayFleet's actor: the shim on its node's address; members exposed or in TLS mode
    ("ray-fleet", REAL, False, None, False, {**PRE, **_env("10.1.2.3"), **INHERIT}),
    (
        "ray-fleet",
        REAL,
        True,
        None,
        False,
        {**PRE, **_env("10.1.2.3", "10.1.2.3,10.1.2.4,10.1.2.7"), **INHERIT},
    ),
    (
        "ray-fleet",
        REAL,
        True,
        [NET],
        False,
        {**PRE, **_env("10.1.2.3", f"10.1.2.3,10.1.2.4,10.1.2.7,{NET}"), **INHERIT},
    ),
    (
        "ray-fleet",
        REAL,
        False,
        None,
        True,
        {**PRE, **_env("10.1.2.3", "10.1.2.3,10.1.2.4,10.1.2.7"), **INHERIT},
    ),
    # a Ray run's server actor: members only exposed (not in TLS mode)
    ("ray-run-server", REAL, False, None, False, {**PRE, **_env("10.1.2.3"), **INHERIT}),
    (
        "ray-run-server",
        REAL,
        True,
        None,
        False,
        {**PRE, **_env("10.1.2.3", "10.1.2.3,10.1.2.4,10.1.2.7"), **INHERIT},
    ),
    ("ray-run-server", REAL, False, None, True, {**PRE, **_env("10.1.2.3"), **INHERIT}),
    # a Ray run's command task: the members in its env, the shim set on its node
    ("ray-run-task", REAL, False, None, False, {**PRE, **_env("10.1.2.3"), **INHERIT}),
    (
        "ray-run-task",
        REAL,
        True,
        None,
        False,
        {**PRE, **_env("10.1.2.3", "10.1.2.3,10.1.2.4,10.1.2.7"), **INHERIT},
    ),
    ("ray-run-task", REAL, False, None, True, {**PRE, **_env(A3), **INHERIT}),
    # a Slurm run's task on its node: members are the allocation's and this host's
    (
        "slurm-task",
        REAL,
        True,
        None,
        False,
        {**PRE, **_env("10.1.2.3", f"10.1.2.3,10.1.2.4,{HOST}/32"), **INHERIT},
    ),
    ("slurm-task", REAL, True, None, True, {**PRE, **_env(A3, ""), **INHERIT}),
]


def _policy_env(kind: str, cluster: Cluster, expose: bool, allow, tls: bool) -> dict[str, str]:
    """What each engine now asks the policy for worker:0 (as its code does)."""
    from graphdist._ray.nodes import ray_members

    wire = tls_cluster(cluster) if tls else cluster
    task = wire.task("worker", 0)
    if kind == "local-server":
        net = NetPolicy.checked(expose, allow, tls).servers(wire)
        return net.env(net.bind(task), shim=False)
    if kind == "local-task":
        net = NetPolicy(expose=expose, tls=tls).tasks(wire)
        return net.env(net.bind(task), inherit=True)
    if kind == "serve":
        net = NetPolicy(expose=expose, allow=parse_allow(allow), tls=tls).serve(cluster, wire)
        return net.env(task.host if tls else net.bind(task, own_host=True))
    ip = cluster.task("worker", 0).host
    if kind == "ray-fleet":
        return ray_members(NetPolicy.checked(expose, allow, tls), fleet=True).env(ip, inherit=True)
    net = ray_members(NetPolicy(expose=expose, tls=tls), fleet=False)
    if kind == "ray-run-server":
        return net.env(ip, inherit=True)
    if kind == "ray-run-task":
        return {**net.lists(), **NetPolicy().env(task.host, inherit=True)}
    assert kind == "slurm-task"
    net = NetPolicy(expose=True, tls=tls).node_tasks(cluster, exposure.host_addresses())
    return net.env(task.host.strip("[]"), inherit=True)


@pytest.mark.parametrize(("kind", "cluster", "expose", "allow", "tls", "expected"), TABLE)
def test_policy_table_gives_each_engine_its_bind_accept_and_dial_lists(
    kind, cluster, expose, allow, tls, expected
):
    assert _policy_env(kind, cluster, expose, allow, tls) == expected


def test_a_slurm_fleets_servers_let_in_the_allocation_this_host_and_allow():
    members = member_list(["10.1.2.3", "10.1.2.4", HOST, "10.1.2.3"], (NET,))
    assert members == f"10.1.2.3,10.1.2.4,{HOST},{NET}"


def test_a_tls_gateway_lets_in_every_machine_inbound_and_dials_anything(monkeypatch):
    monkeypatch.setenv("GRAPHDIST_ALLOW", "10.0.0.1")
    monkeypatch.setenv("GRAPHDIST_DIAL", "10.0.0.1:2222")
    inbound, outbound = gateway_env(True), gateway_env(False)
    assert (inbound["GRAPHDIST_ALLOW"], inbound["GRAPHDIST_BIND_ADDR"]) == ("*", "127.0.0.1")
    assert inbound["LD_PRELOAD"].split(":")[0] == SHIM
    assert "GRAPHDIST_DIAL" not in inbound
    assert "GRAPHDIST_ALLOW" not in outbound and "GRAPHDIST_DIAL" not in outbound


@pytest.mark.parametrize(
    ("expose", "allow", "tls", "slurm", "error", "words"),
    [
        ("no", None, False, False, ArgumentError, "expose must be True or False, not 'no'"),
        (False, None, "yes", False, ArgumentError, "tls must be True or False"),
        (True, None, True, False, ArgumentError, "expose does nothing with tls=True"),
        (False, NET, True, False, ArgumentError, "allow does nothing with tls=True"),
        (False, NET, False, False, ArgumentError, "allow does nothing without expose=True"),
        (True, "0.0.0.0/0", False, False, ArgumentError, "is a wildcard"),
        (False, None, False, True, ClusterSpecError, "expose=False cannot be kept on Slurm"),
        (True, NET, True, True, ArgumentError, "allow does nothing with tls=True"),
    ],
)
def test_the_policy_refuses_each_combination_that_would_not_do_what_it_says(
    expose, allow, tls, slurm, error, words
):
    with pytest.raises(error, match=re.escape(words)):
        NetPolicy.checked(expose, allow, tls, nodes="Slurm" if slurm else None)


def test_the_policy_keeps_the_switches_it_checked():
    assert NetPolicy.checked(True, NET) == NetPolicy(expose=True, allow=(NET,))
    assert NetPolicy.checked(True, NET, nodes="Slurm").allow == (NET,)
    assert NetPolicy.checked(True, None, False, nodes="Slurm").expose is True
    assert NetPolicy.checked(False, None, True) == NetPolicy(tls=True)


# -- only the policy (and the shim's own module) writes the shim's variables -------------------

SHIM_VARIABLES = {"GRAPHDIST_ALLOW", "GRAPHDIST_DIAL", "GRAPHDIST_BIND_ADDR"}
SHIM_CONSTANTS = {"ALLOW_ENV", "DIAL_ENV", "BIND_ADDR_ENV"}
WRITERS = {"_net/policy.py", "_net/loopback.py"}


def _names_a_variable(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in SHIM_VARIABLES
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in SHIM_CONSTANTS


def shim_writes(source: str) -> list[int]:
    """The lines of ``source`` that set one of the shim's variables (a dict's key, an item
    assigned, ``setdefault``/``putenv``/``update(NAME=...)``) or build its environment
    (``shim_env``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            hit = any(_names_a_variable(key) for key in node.keys)
        elif isinstance(node, ast.Subscript):
            hit = not isinstance(node.ctx, ast.Load) and _names_a_variable(node.slice)
        elif isinstance(node, ast.Call):
            called = getattr(node.func, "attr", getattr(node.func, "id", ""))
            hit = (
                called == "shim_env"
                or (called in ("setdefault", "putenv") and _names_a_variable(node.args[0]))
                or any(k.arg in SHIM_VARIABLES for k in node.keywords)
            )
        else:
            continue
        if hit:
            found.append(node.lineno)
    return found


def test_no_module_but_the_policy_and_the_shims_own_writes_the_shims_variables():
    package = pathlib.Path(graphdist.__file__).parent
    writers = {}
    for path in sorted(package.rglob("*.py")):
        lines = shim_writes(path.read_text())
        if lines and str(path.relative_to(package)) not in WRITERS:
            writers[str(path.relative_to(package))] = lines
    assert writers == {}, "set the shim's variables through graphdist._net.policy.NetPolicy"


@pytest.mark.parametrize(
    "planted",
    [
        'env = {ALLOW_ENV: "10.0.0.3"}',
        'os.environ["GRAPHDIST_DIAL"] = ""',
        "env[members.DIAL_ENV] = x",
        'os.environ.setdefault(BIND_ADDR_ENV, "*")',
        'env.update(GRAPHDIST_ALLOW="*")',
        "env = {**shim_env(ip, inherit=True)}",
    ],
)
def test_the_layout_check_finds_each_way_of_writing_a_variable(planted):
    assert shim_writes(f"import os\n{planted}\n") == [2]
    assert shim_writes("import os\nnode = os.environ.get(BIND_ADDR_ENV)\n") == []


def test_a_runs_tls_and_expose_are_refused_in_a_runs_words():
    with pytest.raises(ArgumentError) as info:
        NetPolicy.checked(True, None, True, run=True)
    assert str(info.value) == (
        "expose does nothing with tls=True: the tasks' servers stay on loopback, and the "
        "gateways admit other machines by certificate, not by address; drop expose"
    )
