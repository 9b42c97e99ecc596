"""The network policy's table: for each engine and kind of process, expose x allow x tls ->
the bind address and the accept (``GRAPHDIST_ALLOW``) and dial (``GRAPHDIST_DIAL``) lists.

The expected values were pinned from what each engine computed for itself before the policy
was one module (the refactor is behaviour-preserving); the shim library's path and this host's
addresses are injected, the clusters are numeric (no name service)."""

from __future__ import annotations

import sys
import types

import pytest

from graphdist._cluster import Cluster
from graphdist._net import exposure, loopback
from graphdist._net.gateway import alias, tls_cluster

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
    from graphdist._fleet import ray as rayfleet

    monkeypatch.setattr(rayfleet, "source_address", lambda ip: "10.1.2.7")


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


def _old(kind: str, cluster: Cluster, expose: bool, allow: list[str] | None, tls: bool):
    """What each engine computed for worker:0 before the policy (its own expressions)."""
    from graphdist._fleet.ray import ray_members
    from graphdist._net.loopback import server_bind_address, shim_env
    from graphdist._net.members import (
        ALLOW_ENV,
        KEEP_WILDCARD,
        dial_env,
        exposed_allow,
        members_env,
        parse_allow,
    )

    wire = tls_cluster(cluster) if tls else cluster
    task = wire.task("worker", 0)
    if kind == "local-server":
        networks = exposed_allow(allow, expose)
        env = {"GRAPHDIST_BIND_ADDR": server_bind_address(task, expose=expose) or KEEP_WILDCARD}
        env.update(members_env(wire, networks) if expose else {})
        env.update(dial_env(wire))
        return env
    if kind == "local-task":
        address = server_bind_address(task, expose=expose) or KEEP_WILDCARD
        return {**shim_env(address, None, inherit=True), **(members_env(wire) if expose else {})}
    if kind == "serve":
        if tls:
            return {**shim_env(task.host, None), ALLOW_ENV: "", **dial_env(wire)}
        address = (
            KEEP_WILDCARD
            if expose
            else server_bind_address(task, expose=False, allow_own_host=True)
        )
        return {
            **shim_env(address, None),
            **members_env(cluster, parse_allow(allow)),
            **dial_env(cluster),
        }
    ip = cluster.task("worker", 0).host
    if kind == "ray-fleet":
        members = ray_members(exposed_allow(allow, expose)) if expose or tls else {}
        return {**shim_env(ip, inherit=True), **members}
    if kind == "ray-run-server":
        return {**shim_env(ip, inherit=True), **(ray_members(()) if expose else {})}
    if kind == "ray-run-task":
        members = ray_members(()) if expose else {}
        return {**members, **shim_env(task.host, None, inherit=True)}
    assert kind == "slurm-task"
    if tls:
        return {**shim_env(task.host, None, inherit=True), ALLOW_ENV: ""}
    own = parse_allow([f"{a}/{128 if ':' in a else 32}" for a in exposure.host_addresses()])
    return {**shim_env(task.host.strip("[]"), None, inherit=True), **members_env(wire, own)}


@pytest.mark.parametrize(("kind", "cluster", "expose", "allow", "tls", "expected"), TABLE)
def test_policy_table_gives_each_engine_its_bind_accept_and_dial_lists(
    kind, cluster, expose, allow, tls, expected
):
    assert _old(kind, cluster, expose, allow, tls) == expected
