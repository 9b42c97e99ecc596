"""A real Slurm cluster on this one machine, for tests of graphdist under Slurm: one slurmctld
and N slurmd daemons, each on a host of a :class:`tests.hostbed.HostBed` (a network namespace
with an address of its own on one bridge), with a munged, a slurm.conf, spool, state and log
folders of the bed's own, so that it never touches /etc/slurm, the system's munge or another bed.

A :class:`SlurmBed` of N nodes is N+1 hosts: ``bed.controller`` (host 0) runs munged and
slurmctld and is the bed's login host too: it belongs to no partition, and every client command
(``srun``, ``sbatch`` ...) runs there unless told otherwise. ``bed.nodes`` (hosts 1..N) each run
one slurmd, all in the one partition ``gd`` (the default). Every host has a name:
``gdc-KEY`` for the controller, ``gdn-KEY-I`` for node I, where KEY is the host bed's key (the
creating process's pid in base 36, then a random tag): unique per bed, so that xdist workers'
beds never collide. Ports need no choosing: SlurmctldPort 6817 and SlurmdPort 6818 are each
host's own (every host has a network namespace of its own), and the unix sockets (munge's, the
slurmstepd ones in SlurmdSpoolDir/%n) are under the bed's folder.

Names and hostnames, without touching /etc/hosts: every command the bed runs on a host
(:meth:`SlurmBed.argv`) enters the host's network namespace with ``nsenter --net`` (not ``ip
netns exec``, which remounts /sys, where slurmd then finds no cgroup mount), then a mount and UTS
namespace of its own (``unshare --mount --uts``) in which the bed's hosts file is bind-mounted
over /etc/hosts and the hostname is the host's name. Slurm's step processes inherit slurmd's, so
a task sees its node's name as ``hostname`` and every name of the bed resolves on every host;
both vanish with the last process that uses them: nothing to remove, nothing for a parallel
worker to clash with. (slurmctld checks that SlurmctldHost names the machine it runs on: the
controller's hostname is its name.)

A second shape, ``SlurmBed(n, site=True)``, breaks those name assumptions as sites do (``slurmd
-N``, ``NodeHostname``, several slurmd per host, containers): its nodes are ``sn-KEY-I``, names in
no hosts file (Slurm reaches them at their NodeAddr), and every node's hostname is this
machine's own, one name for all; and Slurm tracks and limits its steps by cgroup
(``proctrack/cgroup``, ``task/cgroup``, cgroup v1, memory a consumable resource: each job's limit
its ``--mem``, default :data:`DEF_MEM_PER_NODE_MB`; a step over it is killed by the kernel and
``srun`` says ``task N: Out Of Memory``). Its nodes' cgroups (``slurm_NODE`` in each hierarchy)
are removed with the bed, and a dead creator's by :func:`sweep_stale`. Tests run on it with
``@pytest.mark.parametrize("slurm", SHAPES, indirect=True)`` (tests/slurm/conftest.py).

The first shape has no cgroups, and neither has accounting: proctrack/linuxproc (a job's
processes are found by their parent chain, so a task that daemonizes escapes scancel, but not
:meth:`SlurmBed.close`), task/none, accounting_storage/none. Jobs run as root (SlurmUser=root).
Timings, measured on the 2-core machine: a bed of 3 nodes is made in 0.5 s (1.1 s under load;
half of it the host bed) and closed in 0.2 s; a killed node is "not responding" (``idle*``) 6-8
s later (slurmctld's ping retries a refused connection once a second for MessageTimeout, 5 s,
then waits for its next cycle) and DOWN 15-16 s later (a second failed cycle: its jobs are
requeued or failed then); ReturnToService=2 brings a restarted slurmd back within 0.2 s; a
requeued job may start again cred_expire+1 s later (6 s: 5 is Slurm's minimum); time limits and
``--signal=B:SIG@S`` are checked by slurmctld every 30 s only (PERIODIC_TIMEOUT), so a warning
signal arrives up to 30 s after it is due.

Needs root, network namespaces (:func:`tests.hostbed.require_hostbed`), nsenter and unshare
(util-linux), and Slurm (slurmctld, slurmd, the client commands) and munge: without them
:func:`require_slurmbed` skips, naming what is missing (``tests/slurm/install-slurm.sh`` installs
them), which fails a ``promise`` test unless GRAPHDIST_ALLOW_PROMISE_SKIPS=1.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import psutil
import pytest

from tests.conftest import Killed, is_gone, wait_gone
from tests.hostbed import Host, HostBed, HostBedError, require_hostbed
from tests.hostbed import sweep_stale as sweep_stale_hosts

CGROUP_ROOT = "/sys/fs/cgroup"
# a node's name: gdn- (or the site shape's sn-), the host bed's key (the creator's pid in base
# 36, then a 4-character tag), its number
_NODE_RE = re.compile(r"^(?:gdn|sn)-([0-9a-z]+)[0-9a-z]{4}-\d+$")
FOLDER_PREFIX = "gdslurm-"
_FOLDER_RE = re.compile(r"^gdslurm-(\d+)-([0-9a-z]{4})$")
PARTITION = "gd"
CPUS_PER_NODE = 4  # what each node offers (SlurmdParameters=config_overrides: whatever it has)
SLURMCTLD_PORT = 6817  # each host's own port: every host has a network namespace of its own
SLURMD_PORT = 6818
# The shortest timings Slurm takes that keep a loaded 2-core machine working: a node is pinged
# every SlurmdTimeout/3 s; an RPC (ping, step launch, client request) fails after MessageTimeout.
SLURMD_TIMEOUT_S = 3
MESSAGE_TIMEOUT_S = 5
# A step credential's lifetime, and so how long a requeued job waits: Slurm's minimum is 5.
CRED_EXPIRE_S = 5
KILL_WAIT_S = 5  # SIGTERM to SIGKILL, at scancel and at the time limit
# How long the bed gets to start (daemons up, every node idle), a client command to end, killed
# processes to exit.
START_S = 60.0
COMMAND_S = 60.0
GONE_S = 10.0
# How long close() waits for the last processes of the hosts, SIGKILLed, to be gone: longer than
# GONE_S, as one clean-clone CI run on a busy machine had one still there after 10 s (which, its
# state and command line now in the message, a leak would show after this wait too).
LEFT_WAIT_S = 30.0
POLL_S = 0.05
PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# What Slurm's commands read from the environment: none of the caller's reaches the bed.
_CLIENT_ENV_PREFIXES = (
    "SLURM_",
    "SLURMD_",
    "SBATCH_",
    "SALLOC_",
    "SRUN_",
    "SQUEUE_",
    "SINFO_",
    "SCONTROL_",
    "SCANCEL_",
)
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "squeue", "scancel", "scontrol", "sinfo", "munge")
TOOLS = ("nsenter", "unshare", "mount", "hostname")
# On a host: the bed's hosts file over /etc/hosts, the host's name as hostname, then the command
# (exec'd: the pid the caller sees is the command's). argv: hosts file, name, command...
#: MB of memory a node of the site shape says it has, and a job's there without --mem.
REAL_MEMORY_MB = 24000
DEF_MEM_PER_NODE_MB = 3000
# The site shape's cgroup.conf: steps tracked and constrained by cgroup v1 (this machine's),
# each job's memory its --mem (or the node's RealMemory), no swap.
CGROUP_CONF = """CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
AllowedSwapSpace=0
"""
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


class SlurmBedError(RuntimeError):
    """The bed could not be made, or a Slurm command of it failed (its own words included)."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([*PATH_DIRS, os.environ.get("PATH", "")]))


@functools.cache
def _missing() -> str:
    """What this machine lacks to make a bed ("" for nothing)."""
    absent = [name for name in (*DAEMONS, *CLIENTS, *TOOLS) if _which(name) is None]
    if absent:
        return (
            f"Slurm test bed: {', '.join(absent)} not installed (install slurmd slurmctld "
            "slurm-client munge: tests/slurm/install-slurm.sh does, as root)"
        )
    return ""


def require_slurmbed() -> None:
    """Skip (with what is missing) unless this process can make a :class:`SlurmBed`."""
    require_hostbed()
    missing = _missing()
    if missing:
        pytest.skip(missing)


def _folder_pids(folder: str) -> list[int]:
    """Live processes that name ``folder`` in their command line or environment (a bed's
    daemons, its clients and their jobs): what a sweep kills wherever they are."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(folder in word for word in proc.info["cmdline"] or ()) or any(
                folder in value for value in proc.environ().values()
            ):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _described(pids: Iterable[int]) -> str:
    """Each pid's state and command line, for a message about processes left behind."""
    words = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            words.append(f"{pid} {proc.status()} {' '.join(proc.cmdline())[:200]!r}")
        except psutil.Error:
            words.append(f"{pid} gone")
    return "; ".join(words)


def _kill_all(pids_of: Callable[[], Iterable[int]], timeout_s: float = GONE_S) -> list[int]:
    """SIGKILL what ``pids_of()`` lists, again and again (a process may fork between the scan
    and the kill) until it lists nothing; return every pid killed, once gone, or raise
    :class:`AssertionError` naming those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    killed = Killed()  # by pid and start time: never another test's process on a recycled pid
    while time.monotonic() < deadline:
        pids = [pid for pid in pids_of() if not is_gone(pid)]
        if not pids:
            break
        killed.kill(pids)
        time.sleep(0.02)
    alive = killed.alive_after(max(0.1, deadline - time.monotonic()))
    if alive:
        raise AssertionError(f"processes still alive after SIGKILL: {alive}")
    return sorted(killed.procs)


def _listens(pid: int, port: int) -> bool:
    """Whether anything listens on TCP ``port`` in the network namespace of process ``pid``."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(f":{port:04X}"):
                return True
    return False


def sweep_stale() -> list[str]:
    """Remove every Slurm bed whose creating process is dead (a crashed run's): its hosts (by
    :func:`tests.hostbed.sweep_stale`: every process in them killed, the namespaces and links
    deleted), any process still naming its folder, and the folder; return the swept folders.
    Called whenever a bed is made. Raises :class:`AssertionError` naming what it could not
    remove."""
    sweep_stale_hosts()
    base = tempfile.gettempdir()
    swept, failures = [], []
    for entry in sorted(os.listdir(base)):
        m = _FOLDER_RE.match(entry)
        if not m or not is_gone(int(m.group(1))):
            continue
        folder = os.path.join(base, entry)
        try:
            _kill_all(functools.partial(_folder_pids, folder))
        except AssertionError as exc:
            failures.append(f"{folder}: {exc}")
            continue
        shutil.rmtree(folder, ignore_errors=True)  # another sweep may be at it too
        if os.path.exists(folder):
            failures.append(f"{folder} could not be removed")
        swept.append(folder)
    cgroups = _bed_cgroups(_stale_node)
    failures += [f"cgroup {c}" for c in _remove_cgroups(cgroups)]
    if failures:
        raise AssertionError("could not remove stale Slurm beds: " + "; ".join(failures))
    return swept + cgroups


def _bed_cgroups(owned: Callable[[str], bool]) -> list[str]:
    """The cgroup folders of Slurm beds' nodes (the site shape's slurmd makes ``slurm_NODE`` in
    every hierarchy it uses) whose node name ``owned`` says is one of the caller's."""
    found = []
    with contextlib.suppress(OSError):
        for controller in os.listdir(CGROUP_ROOT):
            folder = os.path.join(CGROUP_ROOT, controller)
            with contextlib.suppress(OSError):
                found += [
                    os.path.join(folder, entry)
                    for entry in os.listdir(folder)
                    if entry.startswith("slurm_") and owned(entry.removeprefix("slurm_"))
                ]
    return sorted(found)


def _remove_cgroups(folders: Iterable[str]) -> list[str]:
    """Remove each cgroup folder, its sub-folders first (a cgroup's files go with it); the ones
    still there (a process left in them)."""
    left = []
    for top in folders:
        for root, dirs, _ in os.walk(top, topdown=False):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, name))
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(top)
        if os.path.exists(top):
            left.append(top)
    return left


def _stale_node(name: str) -> bool:
    """Whether ``name`` is a node of a bed whose creating process is gone."""
    found = _NODE_RE.match(name)
    return found is not None and is_gone(int(found.group(1), 36))


class Node:
    """A host of a bed with its Slurm name: the controller (``gdc-KEY``) or a compute node
    (``gdn-KEY-I``). ``address`` is its eth0's; ``host`` the :class:`tests.hostbed.Host` it is
    (whose own ``run``/``popen`` use ``ip netns exec``: no Slurm names, no hostname; use the
    node's). ``run``, ``popen`` and ``pids`` are :meth:`SlurmBed.run`'s, :meth:`SlurmBed.popen`'s
    and the host's processes, so that a node can stand where a test wants a host."""

    def __init__(
        self, bed: SlurmBed, name: str, host: Host, *, compute: bool, hostname: str | None = None
    ) -> None:
        self.name = name
        self.hostname = name if hostname is None else hostname  # what `hostname` says there
        self.host = host
        self.address = host.address
        self.compute = compute
        self._bed = bed

    def __repr__(self) -> str:
        return f"Node({self.name!r}, address={self.address!r}, netns={self.netns!r})"

    @property
    def netns(self) -> str:
        return self.host.netns

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """:meth:`SlurmBed.run` on this node."""
        return self._bed.run(self, cmd, **kwargs)

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """:meth:`SlurmBed.popen` on this node."""
        return self._bed.popen(self, cmd, **kwargs)

    def pids(self) -> list[int]:
        """Every process on this node's host, whoever started it."""
        return self.host.pids()


class SlurmBed:
    """A Slurm cluster of ``n`` compute nodes and a controller, started and checked ready (every
    node idle) once made; :meth:`close` removes all of it. ``owner_pid`` (for tests of
    :func:`sweep_stale` only) names another process as the bed's creator; ``debug`` has the
    daemons log at debug2 (their logs: :meth:`log`).

    :attr:`env` is what Slurm's clients need (this process's environment when the bed was made,
    without any Slurm variable, with SLURM_CONF the bed's): :meth:`run` and :meth:`popen` use
    it, and srun passes it on to the tasks (``--export=ALL``). :attr:`start_s` is how long the
    bed took to make, :attr:`close_s` how long closing it took."""

    def __init__(
        self, n: int = 3, *, owner_pid: int | None = None, debug: bool = False, site: bool = False
    ) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"a Slurm bed has 1 to 250 nodes, not {n}")
        t = time.monotonic()
        sweep_stale()
        self._popens: list[subprocess.Popen[Any]] = []
        self._daemons: dict[str, subprocess.Popen[Any]] = {}
        self._scripts = 0
        self._closed = False
        self.close_s = 0.0
        self.hosts = HostBed(n + 1, owner_pid=owner_pid)
        self.key = self.hosts.key
        self.folder = os.path.join(
            tempfile.gettempdir(), f"{FOLDER_PREFIX}{self.hosts.owner_pid}-{self.hosts.tag}"
        )
        self.controller = Node(self, f"gdc-{self.key}", self.hosts[0], compute=False)
        self.site = site
        self.cgroup = site  # the site shape tracks steps by cgroup, with memory limits
        # the site shape: node names that are no host's (they resolve nowhere), every node's
        # host name this machine's own, shared by all (slurmd -N, as with NodeHostname)
        shared = socket.gethostname() if site else None
        self.nodes = [
            Node(self, f"{'sn' if site else 'gdn'}-{self.key}-{i}", host, compute=True,
                 hostname=shared)
            for i, host in enumerate(self.hosts.hosts[1:], 1)
        ]  # fmt: skip
        self.cluster_name = f"gd{self.key}"
        self.conf = os.path.join(self.folder, "etc", "slurm.conf")
        self.hosts_file = os.path.join(self.folder, "etc", "hosts")
        self.jobs_dir = os.path.join(self.folder, "jobs")
        self.log_dir = os.path.join(self.folder, "log")
        self.munge_socket = os.path.join(self.folder, "run", "munge.socket")
        self.env = self._client_env()
        try:
            self._write_files(debug)
            self._start()
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t

    def __repr__(self) -> str:
        return f"SlurmBed({self.key!r}, controller={self.controller!r}, nodes={self.nodes!r})"

    def __enter__(self) -> SlurmBed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def node(self, name: str) -> Node:
        """The node (or the controller) called ``name``."""
        for node in (self.controller, *self.nodes):
            if node.name == name:
                return node
        raise KeyError(name)

    # -- setting up ----------------------------------------------------------------------------

    def _client_env(self) -> dict[str, str]:
        """This process's environment without any Slurm variable, with SLURM_CONF the bed's and
        the sbin folders on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        path = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join([*path, *(d for d in PATH_DIRS if d not in path)])
        env["SLURM_CONF"] = self.conf
        return env

    def _write_files(self, debug: bool) -> None:
        # The folder reaches the munge socket (0711: others may pass, not list); munged wants
        # its key, log and seed in a folder only its user can write, and the socket's folder
        # open to all (the jobs that use it run as root here anyway).
        os.mkdir(self.folder, 0o711)
        for sub, mode in (("etc", 0o755), ("run", 0o755), ("munge", 0o700), ("state", 0o700)):
            os.mkdir(os.path.join(self.folder, sub), mode)
        for sub in ("spool", "log", "jobs"):
            os.mkdir(os.path.join(self.folder, sub), 0o755)
        key = os.path.join(self.folder, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        with open(os.path.join(self.folder, "etc", "plugstack.conf"), "w"):
            pass  # no SPANK plugin: not the system's /etc/slurm/plugstack.conf either
        names = {n.name for n in (self.controller, *self.nodes)}
        with open("/etc/hosts", encoding="utf-8", errors="replace") as f:
            system = [ln for ln in f if not names & set(ln.split("#", 1)[0].split()[1:])]
        with open(self.hosts_file, "w") as f:
            f.writelines(system)
            f.write(f"# Slurm bed {self.key}\n")
            named = [self.controller, *([] if self.site else self.nodes)]
            f.writelines(f"{n.address} {n.name}\n" for n in named)
        with open(self.conf, "w") as f:
            f.write(self._slurm_conf(debug))
        if self.cgroup:
            with open(os.path.join(self.folder, "etc", "cgroup.conf"), "w") as f:
                f.write(CGROUP_CONF)

    def _slurm_conf(self, debug: bool) -> str:
        level = "debug2" if debug else "info"
        d = self.folder
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.controller.name}({self.controller.address})",
            f"SlurmctldPort={SLURMCTLD_PORT}",
            f"SlurmdPort={SLURMD_PORT}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            f"SlurmctldDebug={level}",
            f"SlurmdDebug={level}",
            f"PlugStackConfig={d}/etc/plugstack.conf",
            *(
                ("ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup")
                if self.cgroup
                else ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none")
            ),
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            # the site shape: memory a resource, each job's own limit (its --mem, default 3 GB)
            *(
                ("SelectTypeParameters=CR_CPU_Memory", f"DefMemPerNode={DEF_MEM_PER_NODE_MB}")
                if self.cgroup
                else ("SelectTypeParameters=CR_CPU",)
            ),
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "SchedulerType=sched/backfill",
            # The main loop and backfill every second, not every 60 and 30 s: a requeued job
            # starts as soon as it may.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            f"MessageTimeout={MESSAGE_TIMEOUT_S}",
            "InactiveLimit=0",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=300",
            "JobRequeue=1",
            "SlurmdParameters=config_overrides",
        ]
        lines += [
            f"NodeName={n.name} NodeAddr={n.address} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            + (f" RealMemory={REAL_MEMORY_MB}" if self.cgroup else "")
            for n in self.nodes
        ]
        lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, where: Node, argv: Sequence[str]) -> subprocess.Popen[Any]:
        """``argv`` on ``where`` in the foreground, its output in log/NAME.out."""
        with open(os.path.join(self.log_dir, f"{name}.out"), "ab") as log:
            proc = self.popen(where, argv, stdout=log, stderr=subprocess.STDOUT)
        self._daemons[name] = proc
        return proc

    def _start_slurmd(self, node: Node) -> subprocess.Popen[Any]:
        slurmd = _which("slurmd")
        assert slurmd is not None
        return self._daemon(f"slurmd-{node.name}", node, [slurmd, "-D", "-N", node.name])

    def _start(self) -> None:
        munged, slurmctld = _which("munged"), _which("slurmctld")
        assert munged is not None and slurmctld is not None
        m = os.path.join(self.folder, "munge")
        self._daemon(
            "munged",
            self.controller,
            [
                munged,
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self._wait_for("munged to listen on its socket", self._munge_listens, "munged")
        self._daemon("slurmctld", self.controller, [slurmctld, "-D"])
        # slurmds started before slurmctld answers would register only when it pings them (up
        # to SlurmdTimeout/3 s later).
        self._wait_for("slurmctld to answer", self._controller_answers, "slurmctld")
        for node in self.nodes:
            self._start_slurmd(node)
        self.wait_nodes("idle", timeout_s=START_S)

    def _munge_listens(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(self.munge_socket)
            except OSError:
                return False
        return True

    def _controller_answers(self) -> bool:
        """slurmctld listens on its port (seen in its namespace's /proc/PID/net/tcp: a client
        refused would wait a whole second before it tries again), and answers."""
        pid = self._daemons["slurmctld"].pid
        if not _listens(pid, SLURMCTLD_PORT):
            return False
        return self.run(None, ["sinfo", "-h", "-o", "%D"], timeout=COMMAND_S).returncode == 0

    def _wait_for(self, what: str, ready: Callable[[], bool], *daemons: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            for name in daemons:
                if self._daemons[name].poll() is not None:
                    raise SlurmBedError(
                        f"{name} exited {self._daemons[name].returncode} while waiting for "
                        f"{what}: {self.log(name)[-3000:]}"
                    )
            if time.monotonic() >= deadline:
                raise SlurmBedError(f"timed out after {START_S:g} s waiting for {what}")
            time.sleep(POLL_S)

    # -- running commands ----------------------------------------------------------------------

    def argv(self, where: Node | None, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on ``where`` (None: the controller, the bed's login host): in its network
        namespace (``nsenter --net``), with its name as hostname and the bed's names in
        /etc/hosts (a mount and UTS namespace of its own). Every step is exec'd: same pid."""
        node = self.controller if where is None else where
        return [
            *("nsenter", f"--net=/run/netns/{node.netns}", "--"),
            *("unshare", "--mount", "--uts", "--propagation", "private", "--"),
            *("sh", "-c", _ENTER, "sh", self.hosts_file, node.hostname),
            *cmd,
        ]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**self.env, **(env or {})}

    def run(
        self,
        where: Node | None,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = COMMAND_S,
        check: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` on ``where`` (None: the controller) with :attr:`env`
        (updated with ``env``), in :attr:`jobs_dir` unless ``cwd`` says otherwise; its output
        captured as text unless ``stdout``/``stderr``/``text`` say otherwise. With ``check``, a
        failure raises :class:`SlurmBedError` with the command's stderr."""
        self._check_open()
        kwargs.setdefault("cwd", self.jobs_dir)
        if not {"stdout", "stderr", "capture_output"} & kwargs.keys():
            kwargs["capture_output"] = True
        if not {"text", "encoding", "errors", "universal_newlines"} & kwargs.keys():
            kwargs["text"] = True
        result = subprocess.run(
            self.argv(where, cmd), env=self._env(env), timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise SlurmBedError(
                f"{shlex.join(cmd)} on {(where or self.controller).name} exited "
                f"{result.returncode}: {(result.stderr or '').strip()[-3000:]}"
            )
        return result

    def popen(
        self,
        where: Node | None,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``cmd`` on ``where`` (None: the controller) with :attr:`env`
        (updated with ``env``), in :attr:`jobs_dir` unless ``cwd`` says otherwise; its pid is
        the command's. Killed (it is on a host) and reaped when the bed closes."""
        self._check_open()
        kwargs.setdefault("cwd", self.jobs_dir)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.argv(where, cmd), env=self._env(env), **kwargs
        )
        self._popens.append(proc)
        return proc

    def _slurm(self, cmd: Sequence[str], where: Node | None = None, **kwargs: Any) -> str:
        """A Slurm client command's stdout; a failure raises :class:`SlurmBedError`."""
        return str(self.run(where, cmd, check=True, **kwargs).stdout)

    # -- jobs ----------------------------------------------------------------------------------

    def salloc(self, nodes: int, *options: str, where: Node | None = None) -> int:
        """``salloc --no-shell -N NODES OPTIONS``: the id of the allocation, granted (salloc
        waits for it); it stays until :meth:`scancel` (InactiveLimit=0)."""
        result = self.run(where, ["salloc", "--no-shell", "-N", str(nodes), *options], check=True)
        m = re.search(r"Granted job allocation (\d+)", result.stderr + result.stdout)
        if not m:
            raise SlurmBedError(f"salloc granted nothing: {result.stderr.strip()}")
        return int(m.group(1))

    def srun(
        self,
        cmd: Sequence[str],
        *options: str,
        jobid: int | None = None,
        where: Node | None = None,
        check: bool = True,
        timeout: float = COMMAND_S,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``srun [--jobid JOBID] OPTIONS CMD`` to its end, output captured (a new job of its
        own without ``jobid``, a step of that allocation with it)."""
        return self.run(
            where, self._srun_argv(cmd, options, jobid), check=check, timeout=timeout, env=env
        )

    def srun_popen(
        self,
        cmd: Sequence[str],
        *options: str,
        jobid: int | None = None,
        where: Node | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """``srun [--jobid JOBID] OPTIONS CMD`` in the background (:meth:`popen`)."""
        return self.popen(where, self._srun_argv(cmd, options, jobid), env=env, **kwargs)

    @staticmethod
    def _srun_argv(cmd: Sequence[str], options: Sequence[str], jobid: int | None) -> list[str]:
        return ["srun", *(["--jobid", str(jobid)] if jobid is not None else []), *options, *cmd]

    def sbatch(self, script: str, *options: str, where: Node | None = None) -> int:
        """``sbatch OPTIONS`` of a batch script (its text: ``#!/bin/bash ...``), written to
        :attr:`jobs_dir`; its output goes to :meth:`output_path` unless ``options`` name one.
        Returns the job id."""
        self._scripts += 1
        path = os.path.join(self.jobs_dir, f"script-{self._scripts}.sh")
        with open(path, "w") as f:
            f.write(script)
        os.chmod(path, 0o755)
        out = (
            []
            if {"-o", "--output"} & {o.split("=", 1)[0] for o in options}
            else [f"--output={os.path.join(self.jobs_dir, 'slurm-%j.out')}"]
        )
        stdout = self._slurm(["sbatch", "--parsable", *out, *options, path], where)
        return int(stdout.strip().split(";")[0])

    def output_path(self, jobid: int) -> str:
        """Where a batch job of :meth:`sbatch` writes its output (without ``--output``)."""
        return os.path.join(self.jobs_dir, f"slurm-{jobid}.out")

    def output(self, jobid: int) -> str:
        """A batch job's output so far ("" before it starts)."""
        try:
            with open(self.output_path(jobid), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def scancel(self, jobid: int, *options: str) -> None:
        """``scancel OPTIONS JOBID`` (returns at once: Slurm signals the job's steps, SIGKILL
        KillWait s after SIGTERM)."""
        self._slurm(["scancel", *options, str(jobid)])

    def requeue(self, jobid: int, *options: str) -> None:
        """``scontrol requeue OPTIONS JOBID``: a batch job back to PENDING, its processes killed;
        it may start again CRED_EXPIRE_S+1 s later (``scontrol show job``'s EligibleTime)."""
        self._slurm(["scontrol", "requeue", *options, str(jobid)])

    def job_ids(self, name: str | None = None) -> list[int]:
        """The ids of the jobs in ``squeue`` (pending, running, completing), of those called
        ``name`` only if given."""
        out = self._slurm(["squeue", "-h", "-o", "%i", *(["-n", name] if name else [])])
        return sorted(int(word) for word in out.split())

    def job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job JOBID`` as a dict (JobState, NodeList, Restarts, BatchHost ...);
        empty once Slurm has forgotten the job (MinJobAge after its end). A value with spaces
        in it (a Command, a WorkDir) is cut at the first one."""
        result = self.run(None, ["scontrol", "-o", "show", "job", str(jobid)])
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return {}
            raise SlurmBedError(f"scontrol show job {jobid}: {result.stderr.strip()}")
        fields = {}
        for word in result.stdout.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def job_state(self, jobid: int) -> str | None:
        """The job's state (PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, TIMEOUT,
        NODE_FAIL ...), None once Slurm has forgotten it."""
        return self.job(jobid).get("JobState")

    def wait_job(
        self, jobid: int, states: str | Collection[str], timeout_s: float = COMMAND_S
    ) -> str:
        """Wait until the job is in one of ``states``; return that state, or raise
        :class:`SlurmBedError` naming the last one seen after ``timeout_s``."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job_state(jobid)
            if state in wanted:
                return state
            if time.monotonic() >= deadline:
                raise SlurmBedError(
                    f"job {jobid} is {state} after {timeout_s:g} s, not {sorted(wanted)}"
                )
            time.sleep(POLL_S * 2)

    def job_pids(self, jobid: int) -> list[int]:
        """The live processes of a job on the compute nodes: its slurmstepd daemons and every
        process whose environment has SLURM_JOB_ID=JOBID (the batch script, the tasks and what
        they started); in the site shape, every process of the job's cgroups too
        (:meth:`cgroup_pids`)."""
        found = self.cgroup_pids(jobid) if self.cgroup else []
        for node in self.nodes:
            for pid in node.pids():
                try:
                    proc = psutil.Process(pid)
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    cmdline = " ".join(proc.cmdline())
                    if cmdline.startswith(f"slurmstepd: [{jobid}.") or (
                        proc.environ().get("SLURM_JOB_ID") == str(jobid)
                    ):
                        found.append(pid)
                except psutil.Error:
                    continue
        return sorted(set(found))

    def cgroup_pids(self, jobid: int) -> list[int]:
        """The site shape: every process in a cgroup of job ``jobid`` on any node, as the
        kernel lists them (``cgroup.procs`` under ``freezer/slurm_NODE/uid_U/job_JOBID``, where
        proctrack/cgroup puts each step, and the memory hierarchy's, where task/cgroup does);
        what ``scancel`` of the job must end, whoever forked it. Empty in the first shape."""
        found: set[int] = set()
        for node in self.nodes:
            for controller in ("freezer", "memory"):
                job = f"slurm_{node.name}/uid_*/job_{jobid}/**/cgroup.procs"
                pattern = os.path.join(CGROUP_ROOT, controller, job)
                for path in glob.glob(pattern, recursive=True):
                    with contextlib.suppress(OSError, ValueError), open(path) as f:
                        found.update(int(line) for line in f.read().split())
        return sorted(found)

    # -- nodes ---------------------------------------------------------------------------------

    def node_states(self) -> dict[str, str]:
        """Each compute node's state as ``sinfo`` writes it (``%T``): idle, allocated, mixed,
        ``idle*``/``down*`` (``*``: not responding), down, drained ..."""
        out = self._slurm(["sinfo", "-h", "-N", "-o", "%N %T"])
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def wait_nodes(
        self,
        states: str | Collection[str],
        nodes: Iterable[Node] | None = None,
        timeout_s: float = COMMAND_S,
    ) -> dict[str, str]:
        """Wait until each of ``nodes`` (all compute nodes by default) is in one of ``states``;
        return every node's state, or raise :class:`SlurmBedError` with them after
        ``timeout_s``."""
        wanted = {states} if isinstance(states, str) else set(states)
        names = [n.name for n in (self.nodes if nodes is None else nodes)]
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.node_states()
            if all(found.get(name) in wanted for name in names):
                return found
            lost_ok = any(s.endswith("*") or s.startswith("down") for s in wanted)
            for name, proc in self._daemons.items():
                if (
                    not lost_ok
                    and name.startswith("slurmd-")
                    and name[7:] in names
                    and proc.poll() is not None
                ):
                    raise SlurmBedError(
                        f"{name} exited {proc.returncode}: {self.log(name)[-3000:]}"
                    )
            if time.monotonic() >= deadline:
                raise SlurmBedError(
                    f"nodes {found} after {timeout_s:g} s, not all {sorted(wanted)}; "
                    f"slurmctld's log: {self.log('slurmctld')[-2000:]}"
                )
            time.sleep(POLL_S)

    def kill_node(self, node: Node) -> list[int]:
        """A lost node: its slurmd and every process on its host SIGKILLed, and gone; returns
        their pids. The host keeps its address, so Slurm's pings are refused (as by a machine
        whose slurmd died); :meth:`restart_node` starts its slurmd again."""
        assert node.compute, f"{node!r} is no compute node"
        self._check_open()
        killed = _kill_all(node.pids)
        self._daemons[f"slurmd-{node.name}"].wait(timeout=GONE_S)
        return killed

    def restart_node(self, node: Node, timeout_s: float = COMMAND_S) -> None:
        """Start a killed node's slurmd again and wait until Slurm has it idle (ReturnToService=2
        returns a DOWN node once it registers)."""
        self._check_open()
        old = self._daemons[f"slurmd-{node.name}"]
        if old.poll() is None:
            raise SlurmBedError(f"the slurmd of {node.name} still runs (pid {old.pid})")
        self._start_slurmd(node)
        self.wait_nodes("idle", [node], timeout_s=timeout_s)

    # -- state ---------------------------------------------------------------------------------

    @property
    def daemon_pids(self) -> dict[str, int]:
        """The pids of the bed's daemons (munged, slurmctld, slurmd-NODE), live or not."""
        return {name: proc.pid for name, proc in self._daemons.items()}

    def log(self, name: str) -> str:
        """A daemon's log: ``munged``, ``slurmctld``, ``slurmd-NODE`` (its log file, then what
        it wrote to stdout and stderr)."""
        if name == "munged":
            paths = [os.path.join(self.folder, "munge", "munged.log")]
        else:
            paths = [os.path.join(self.log_dir, f"{name}.log")]
        paths.append(os.path.join(self.log_dir, f"{name}.out"))
        text = ""
        for path in paths:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                text += f.read()
        return text

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def close(self) -> None:
        """Kill every process of the bed (its daemons by pid, then every process on its hosts:
        job steps, clients, whatever they started), delete the hosts (namespaces, links), remove
        the folder (conf, munge key, spool, state, logs, jobs); then check that none of them is
        left, or raise :class:`AssertionError` naming what is. Idempotent."""
        if self._closed:
            return
        t = time.monotonic()
        # only processes alive now, each with its start time: a pid of one that ended long ago
        # (a reaped Popen's) may be a stranger's by now (pids wrap in about 25 minutes of a suite:
        # CI once found its own xdist worker's fresh child "left behind")
        seen = {p.pid for p in self._popens if p.poll() is None}
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.kill()
        for host in self.hosts:
            with contextlib.suppress(HostBedError):
                seen.update(host.pids())
        born = _start_times(seen)
        left = []
        try:
            self.hosts.close()
        except AssertionError as exc:
            left.append(str(exc))
        for proc in self._popens:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=GONE_S)
        alive = [
            pid for pid in wait_gone(born, LEFT_WAIT_S) if _start_times([pid]) == {pid: born[pid]}
        ]
        if alive:
            left.append(f"processes {alive} ({_described(alive)})")
        if os.path.exists(self.folder):
            try:
                _kill_all(lambda: _folder_pids(self.folder))
            except AssertionError as exc:
                left.append(str(exc))
            shutil.rmtree(self.folder, ignore_errors=True)
            if os.path.exists(self.folder):
                left.append(f"folder {self.folder}")
        names = {n.name for n in self.nodes}
        left += [f"cgroup {c}" for c in _remove_cgroups(_bed_cgroups(names.__contains__))]
        self.close_s = time.monotonic() - t
        if left:
            raise AssertionError(f"{self!r} left behind: {'; '.join(left)}")
        self._closed = True


def _start_times(pids: Iterable[int]) -> dict[int, float]:
    """Each live pid of ``pids`` with its process's start time (a pid reused later has another)."""
    from graphdist._proc.process import proc_stat

    stats = {pid: proc_stat(pid) for pid in pids}
    return {pid: stat.started for pid, stat in stats.items() if stat is not None}
