"""A real multi-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``: a
head and nodes, each its own raylet and object store, all on this machine's address), with its
state and auth token private to it; everything it started is checked gone when it closes."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import psutil

from tests.conftest import EVENTUALLY_S, forbid_in_unit_tier, wait_gone
from tests.fleet.conftest import reload_ray_token, require_token_auth


def ray_processes(marker: str) -> list[int]:
    """Live processes whose command line mentions ``marker`` (the cluster's temp folder)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            mine = any(marker in part for part in proc.info["cmdline"] or [])
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@contextlib.contextmanager
def simulated_cluster(cpus: Sequence[int]) -> Iterator[Any]:
    """A head with ``cpus[0]`` CPUs and a node for each further entry; Ray's state and its auth
    token in a folder and environment of the cluster's own (not $HOME), restored after."""
    forbid_in_unit_tier("a Ray cluster")
    # Short: Ray's socket paths live below it and AF_UNIX paths stop at 107 bytes.
    tmp = tempfile.mkdtemp(prefix="gdray-")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    reload_ray_token()  # another test of this process may have made Ray cache its token
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    try:
        require_token_auth()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": cpus[0], "include_dashboard": False},
        )
        for n in cpus[1:]:
            cluster.add_node(num_cpus=n)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reload_ray_token()
        assert wait_gone(ray_processes(tmp), EVENTUALLY_S) == []
        shutil.rmtree(tmp, ignore_errors=True)
