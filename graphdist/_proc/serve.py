"""``graphdist serve``: exactly one TensorFlow server in the foreground, for real hosts.

The building block for systemd, Kubernetes and Slurm (see ``servers/``). It logs one line when
the server is ready and exits 0 on SIGTERM or SIGINT. Unlike a bare ``tf.train.Server``, which
always listens on every interface, it binds only the address its own task has in the cluster
spec (through the same ``bind()`` shim a local fleet uses, loaded by re-executing itself with
``LD_PRELOAD``); ``--bind-all`` restores TensorFlow's wildcard bind. Either way the shim lets in
only the cluster's own hosts and the addresses given to ``--allow`` (members only: see
:mod:`graphdist._net.members`), and dials only the cluster's own tasks (``GRAPHDIST_DIAL``);
the server does not start where that is not in force.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ClusterSpecError,
    CredentialsError,
    LoopbackUnavailableError,
    PortInUseError,
    UsageError,
)
from graphdist._failures import task_name
from graphdist._net.exposure import check_listening
from graphdist._net.loopback import BIND_ADDR_ENV, bind_address_for
from graphdist._net.members import ALLOW_ENV, parse_allow, shim_members
from graphdist._net.policy import NetPolicy
from graphdist._ports import is_port_free, port_holder
from graphdist._proc.signals import stop_on_signals, wait_for_stop
from graphdist._tflog import tf_logs_kept_out
from graphdist._validate import show

__all__ = ["check_own_address", "check_slurm_environment", "serve", "slurm_task"]

_SHIMMED_ENV = "GRAPHDIST_SERVE_SHIMMED"
_GATEWAY_ENV = "GRAPHDIST_SERVE_GATEWAY"


SLURM_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)
"""What TensorFlow's ``SlurmClusterResolver`` reads: ``srun`` sets them for each task."""
_NUMBER_RE = re.compile(r"[0-9]{1,9}")
# host names and bracketed ranges, comma-separated: node[01-03,07],login1 (each alternative starts
# with its own characters, so the match never backtracks)
_NODELIST_RE = re.compile(r"(?:[A-Za-z0-9_.-]|\[[0-9,-]+\]|,)+")
_PER_NODE_RE = re.compile(r"[0-9]{1,6}(?:\(x[0-9]{1,6}\))?(?:,[0-9]{1,6}(?:\(x[0-9]{1,6}\))?)*")


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


#: The first port of a ``serve --slurm`` task (TensorFlow's SlurmClusterResolver's default).
SLURM_PORT_BASE = 8888


def check_slurm_environment(jobs: Mapping[str, int], port_base: int) -> None:
    """Raise :class:`ClusterSpecError` (one line) unless this process runs in a Slurm step whose
    task count fits ``jobs`` and ``port_base`` is a port; checked before TensorFlow is imported,
    whose resolver would fail with a traceback."""
    Cluster.check_counts(jobs)
    if isinstance(port_base, bool) or not isinstance(port_base, int) or not 1 <= port_base <= 65535:
        raise ClusterSpecError(f"port_base must be a port from 1 to 65535, not {show(port_base)}")
    missing = [name for name in SLURM_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ClusterSpecError(
            f"--slurm needs Slurm's environment, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; run it inside a Slurm step "
            "(srun graphdist serve --slurm ...), or pass --cluster, --job and --task",
            missing,
        )
    for name, pattern, what in (
        ("SLURM_PROCID", _NUMBER_RE, "a whole number"),
        ("SLURM_STEP_NUM_TASKS", _NUMBER_RE, "a whole number"),
        ("SLURM_STEP_NODELIST", _NODELIST_RE, "a Slurm host list such as node[01-04]"),
        ("SLURM_STEP_TASKS_PER_NODE", _PER_NODE_RE, "a Slurm task list such as 2(x3),1"),
    ):
        value = os.environ[name]
        if len(value) > 4096 or not pattern.fullmatch(value):
            raise ClusterSpecError(f"{name}={show(value)} is not {what}", value)
    wanted, have = sum(jobs.values()), int(os.environ["SLURM_STEP_NUM_TASKS"])
    if wanted > have:
        raise ClusterSpecError(
            f"--slurm asks for {wanted} task(s) but the Slurm step has {have} "
            "(SLURM_STEP_NUM_TASKS); ask srun for as many tasks as the jobs add up to",
            wanted,
        )
    if int(os.environ["SLURM_PROCID"]) >= wanted:
        raise ClusterSpecError(
            f"This is Slurm task {os.environ['SLURM_PROCID']}, but --slurm names only {wanted} "
            "task(s); ask srun for as many tasks as the jobs add up to",
            os.environ["SLURM_PROCID"],
        )


def check_own_address(task: str, address: str, ip: str) -> None:
    """Raise :class:`ClusterSpecError` (one line) unless this host has ``ip``, the address
    ``task``'s server would listen on (``address`` resolved): a socket bound to it (port 0) is
    the honest check, made before TensorFlow is imported, whose server would fail after seconds
    with "Could not start gRPC server" and a traceback. Serving a task on the wrong host (another
    host's cluster file entry, a wrong --task) is the likeliest mistake on real hosts."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                return  # not a question of which host this is: the server's start says more
            resolved = "" if address.startswith(f"{ip}:") else f" ({ip})"
            raise ClusterSpecError(
                f"Task {task} is at {address!r}{resolved}, which is not an address of this "
                f"host ({exc.strerror}): serve it on the host that has that address, or check "
                "which task this host serves and the cluster's address for it (bind_all=True "
                "if the address reaches this host only through NAT)",
                address,
            ) from None


def slurm_task(
    jobs: Mapping[str, int], port_base: int = SLURM_PORT_BASE, gpus_per_node: int = 0
) -> tuple[Cluster, str, int]:
    """The cluster and this task's job and index under Slurm, from TensorFlow's
    ``SlurmClusterResolver`` (reads ``SLURM_PROCID``, ``SLURM_STEP_NODELIST``,
    ``SLURM_STEP_TASKS_PER_NODE`` ...). Raises :class:`ClusterSpecError` outside a Slurm step,
    or for a step that does not fit ``jobs`` (see :func:`check_slurm_environment`). Imports
    TensorFlow."""
    check_slurm_environment(jobs, port_base)
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    try:
        if gpus_per_node == 0:
            # TensorFlow's resolver allocates one task per GPU slot and so finds no task at all
            # on CPU-only nodes; pretend one slot per task (auto_set_gpu=False: nothing pinned).
            per_node = os.environ["SLURM_STEP_TASKS_PER_NODE"]
            gpus_per_node = max(slurm.expand_tasks_per_node(per_node))
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs=dict(jobs), port_base=port_base, gpus_per_node=gpus_per_node, auto_set_gpu=False
        )
        spec = resolver.cluster_spec()
        task_type, task_id = resolver.task_type, int(resolver.task_id)
    except (ValueError, RuntimeError, AttributeError, IndexError) as exc:
        raise ClusterSpecError(
            f"TensorFlow's Slurm resolver cannot read this Slurm step: {show(str(exc))}", str(exc)
        ) from None
    return Cluster.parse(spec), task_type, task_id


def serve(
    cluster: Cluster,
    job: str,
    index: int,
    *,
    bind_all: bool,
    argv: Sequence[str],
    allow: Sequence[str] | str | None = None,
    tls: str | None = None,
) -> int:
    """Run the server of ``job:index`` until SIGTERM/SIGINT; returns the exit status (0).

    The first call re-executes ``python -m graphdist ARGV`` with the bind shim loaded (it never
    returns then): bound to the task's own address (every interface with ``bind_all``), and
    letting in other machines only if they are the cluster's hosts or in ``allow``. With
    ``tls`` (a credentials folder from ``graphdist certs``), the server stays on its host's
    loopback alias and a mutual-TLS gateway listens on the task's address instead (see
    :mod:`graphdist._net.gateway`). Raises ClusterSpecError, PortInUseError,
    LoopbackUnavailableError, UsageError, CredentialsError.
    """
    task = cluster.task(job, index)
    if tls is not None:
        return _serve_tls(cluster, job, index, bind_all=bind_all, argv=argv, allow=allow, tls=tls)
    networks = parse_allow(allow, name="allow")
    if networks and not bind_all and bind_address_for(task.host) is not None:
        raise UsageError(
            f"allow does nothing for {task_name(job, index)}: its server stays on loopback "
            f"({task.host}), which no other machine reaches; drop it, or name the host's "
            "address in the cluster",
            name="allow",
            value=allow,
        )
    if os.environ.get(_SHIMMED_ENV) == "1" and shim_members() is None:
        # re-executed, or the variable came from outside: either way the shim is not in this
        # process, and a server without it would listen and let in whatever it was told
        raise LoopbackUnavailableError(
            f"graphdist's bind shim is not loaded in this serve process ({_SHIMMED_ENV}=1 is "
            "set, which graphdist sets only once it has loaded the shim): unset "
            f"{_SHIMMED_ENV}, and check that LD_PRELOAD is honoured (not a static or setuid "
            "Python)"
        )
    if os.environ.get(_SHIMMED_ENV) != "1":
        net = NetPolicy(expose=bind_all, allow=networks)
        address = net.bind(task, own_host=True)
        if not bind_all and bind_address_for(task.host) is None:
            check_own_address(task_name(job, index), task.address, address)
        # the members and allow let in; it dials only its cluster's tasks, whatever a session
        # names
        shim = net.serve(cluster, cluster).env(address, os.environ.get("LD_PRELOAD"))
        env = {**os.environ, **shim, _SHIMMED_ENV: "1"}
        os.execve(sys.executable, [sys.executable, "-m", "graphdist", *argv], env)
    if not is_port_free(task.port):
        holder = port_holder(task.port)
        raise PortInUseError(
            f"Port {task.port} of task {task_name(job, index)} is already in use"
            + (f" by pid {holder}" if holder else ""),
            port=task.port,
            holder_pid=holder,
            task=task_name(job, index),
            address=task.address,
        )
    bound = os.environ.get(BIND_ADDR_ENV, "every interface") if not bind_all else "every interface"
    members = os.environ.get(ALLOW_ENV) or "none"
    return _run_server(
        cluster,
        job,
        index,
        check=not bind_all,
        how=f"listening on {bound}, other machines let in: {members}",
    )


def _run_server(cluster: Cluster, job: str, index: int, *, check: bool, how: str) -> int:
    """Start the (shimmed) server of ``job:index`` of ``cluster`` as TensorFlow sees it, check
    where it listens, say it is ready and serve until SIGTERM/SIGINT."""
    from graphdist._proc.server import start_server

    task = cluster.task(job, index)
    stop = stop_on_signals()
    with tf_logs_kept_out():  # quiet as demo, up and run are (GRAPHDIST_TF_LOGS=1: live)
        server = start_server(cluster.as_dict(), job, index)
    if check:  # the shim's effect is checked, not assumed (see _fleet/exposure.py)
        own = os.environ.get(BIND_ADDR_ENV, "")
        check_listening(task_name(job, index), task.address, os.getpid(), {own}, port=task.port)
    print(
        f"graphdist serve: /job:{job}/task:{index} ready at {server.target} "
        f"({how}; pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    threading.Thread(target=server.join, name="tf-server", daemon=True).start()
    wait_for_stop(stop)
    print(f"graphdist serve: /job:{job}/task:{index} stopping", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, ValueError):  # a reader gone: nothing left to say
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # TensorFlow cannot stop a gRPC server; leaving is the clean way out


def _watch_gateway(pid: int) -> None:
    """Leave (exit status 1) when the TLS gateway, this process's child, ends: the server would
    be out of reach, and a host's supervisor should restart the pair."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    print(
        f"graphdist serve: the TLS gateway (pid {pid}) ended; stopping", file=sys.stderr, flush=True
    )
    os._exit(1)


def _serve_tls(
    cluster: Cluster,
    job: str,
    index: int,
    *,
    bind_all: bool,
    argv: Sequence[str],
    allow: Sequence[str] | str | None,
    tls: str,
) -> int:
    """:func:`serve` in TLS mode: the server on its host's loopback alias, sessions between
    hosts through this serve's gateway (started before the re-execution, watched after it)."""
    from graphdist._net.gateway import tls_cluster
    from graphdist._net.tlscerts import identity_folder

    task = cluster.task(job, index)
    name = task_name(job, index)
    for given, flag in ((bind_all, "bind_all"), (parse_allow(allow, name="allow"), "allow")):
        if given:
            raise UsageError(
                f"{flag} does nothing with tls: in TLS mode no server listens on a host "
                "address, and the gateway admits by certificate, not by address; drop it",
                name=flag,
                value=allow if flag == "allow" else True,
            )
    if bind_address_for(task.host) is not None:
        raise UsageError(
            f"tls does nothing for {name}: its server stays on loopback ({task.host}), which "
            "no other machine reaches; name the host's address in the cluster, or drop tls",
            name="tls",
            value=tls,
        )
    wire = tls_cluster(cluster)
    alias_address = wire.task(job, index).host
    if os.environ.get(_SHIMMED_ENV) == "1":
        gateway = os.environ.get(_GATEWAY_ENV, "")
        if shim_members() is None or not gateway.isdigit():
            raise LoopbackUnavailableError(
                f"graphdist's bind shim or TLS gateway is missing in this serve process "
                f"({_SHIMMED_ENV}=1 is set, which graphdist sets only once both run): unset "
                f"{_SHIMMED_ENV} and {_GATEWAY_ENV}"
            )
        threading.Thread(
            target=_watch_gateway, args=(int(gateway),), name="tls-gateway", daemon=True
        ).start()
        return _run_server(
            wire,
            job,
            index,
            check=True,
            how=f"over mutual TLS at {task.address}: the server on {alias_address}, loopback; "
            f"the TLS gateway (pid {gateway}) lets in holders of this cluster's certificates",
        )
    from graphdist._net.tlsmode import credentials_from_stdin

    received = None
    # a stop signal before the server runs (a failed Slurm start's SIGTERM): an exit that runs
    # the finally below, so that received credentials are not left on the node's disk
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _exit_on_signal)
    try:
        if tls == "-":  # on stdin (SlurmFleet: srun's channel), on disk until the gateway read it
            tls = received = credentials_from_stdin()
        tls = identity_folder(tls, task.host.strip("[]"))  # the whole folder: hosts/HOST
        relay = _start_tls_gateway(cluster, task, name, tls)
    finally:
        if received is not None:
            shutil.rmtree(received, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # on loopback: no other machine, only this user; it dials its peers' aliases: the gateways
    net = NetPolicy(tls=True).serve(cluster, wire)
    shim = net.env(alias_address, os.environ.get("LD_PRELOAD"))
    env = {**os.environ, **shim, _SHIMMED_ENV: "1", _GATEWAY_ENV: str(relay.pid)}
    os.execve(sys.executable, [sys.executable, "-m", "graphdist", *argv], env)


def _start_tls_gateway(cluster: Cluster, task: Task, name: str, tls: str) -> Any:
    """Check that the credentials in ``tls`` are ``task``'s host's and that its address is on
    this host, then start its gateway (before the server: the re-executed serve watches it)."""
    from graphdist._net.gateway import routes, start_gateway
    from graphdist._net.tlscerts import load_credentials

    credentials = load_credentials(tls)
    if not credentials.covers(task.host):
        raise CredentialsError(
            f"The certificate in {tls} is for {', '.join(credentials.names)}, not for "
            f"{task.host}, the host of {name}: pass the folder `graphdist certs` made for "
            f"{task.host} (OUT/hosts/{task.host.replace(':', '_')})",
            tls,
        )
    check_own_address(name, task.address, NetPolicy().bind(task, own_host=True))
    return start_gateway(routes(cluster, [task]), tls)
