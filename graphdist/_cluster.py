"""The cluster model: which jobs exist, how many tasks each has, and where each task listens.

:class:`Cluster` is the one type every other part of graphdist takes. :meth:`Cluster.parse`
normalises every form a user may hold (a dict, JSON text, a JSON file, compact counts such as
``"local=2,ps=1"``, a ``tf.train.ClusterSpec``, a TF_CONFIG-style ``{"cluster": ...}``) in one
place.

Every input is bounded before it is used, so a mistake is one :class:`ClusterSpecError` line,
never a traceback or a hang: spec text and cluster files hold at most ``MAX_SPEC_BYTES`` (1 MiB),
JSON nests at most ``MAX_JSON_DEPTH`` (32) levels and names no key twice in one object, a cluster
file must be a regular file of UTF-8 text (those bounds are :mod:`graphdist._spectext`'s), ports,
task indices and counts are ASCII digits only (Python's ``int()`` also takes Arabic-Indic or
fullwidth digits), hosts are host names, IPv4 addresses or bracketed IPv6 literals, and a
``job=N`` spec asks for at most ``MAX_TASKS`` (1024) tasks in all, since each one holds a free
port (and a lock file) of this machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from graphdist._exceptions import ClusterSpecError
from graphdist._failures import task_name
from graphdist._spectext import check_size, load_json, read_text_file
from graphdist._validate import is_ascii_digits, show

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Cluster", "ClusterLike", "Task"]

JOB_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")  # what TensorFlow accepts as a job name
# A host name or IPv4 address: ASCII letters, digits, '-', '_' and '.', at most 253 characters.
_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$")
_SCOPE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")  # an IPv6 zone such as 'eth0'
_WHOLE_RE = re.compile(r"^-?[0-9]{1,10}$")  # a task index or count as text: ASCII digits only
DEFAULT_HOST = "localhost"
MAX_TASKS_PER_JOB = 1024
MAX_TASKS = 1024  # in all, for a job=N spec: each task holds a free port of this machine
MAX_TASK_INDEX = 2**31 - 1  # TensorFlow keeps task indices as int32

ClusterLike = Union["Cluster", Mapping[str, Any], str, os.PathLike[str], "tf.train.ClusterSpec"]


@dataclass(frozen=True, order=True)
class Task:
    """One task of a cluster: its ``job``, ``index`` and ``address`` (``host:port``)."""

    job: str
    index: int
    address: str

    @property
    def name(self) -> str:
        """``job-index``, as used for log files and output prefixes (``worker-1``)."""
        return f"{self.job}-{self.index}"

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    @property
    def port(self) -> int:
        return split_address(self.address)[1]

    @property
    def target(self) -> str:
        """The session target of this task: ``grpc://host:port``."""
        return f"grpc://{self.address}"

    def __str__(self) -> str:
        return f"/job:{self.job}/task:{self.index} ({self.address})"


def split_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) and check both halves; raises ClusterSpecError."""
    if not isinstance(address, str):
        raise ClusterSpecError(
            f"Task address {show(address)} is not a string; write it as 'host:port'", address
        )
    shown = show(address)
    if address.startswith("grpc://"):
        raise ClusterSpecError(
            f"Task address {shown} has a scheme; write it as 'host:port' without 'grpc://'",
            address,
        )
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ClusterSpecError(
            f"Task address {shown} has no port; write it as 'host:port'", address
        )
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ClusterSpecError(f"Task address {shown} has a malformed IPv6 host", address)
        if not _is_ipv6(host[1:-1]):
            raise ClusterSpecError(
                f"Task address {shown} has host {show(host)}, which is not an IPv6 address; "
                "brackets hold an IPv6 address such as [::1]",
                address,
            )
    elif ":" in host:
        raise ClusterSpecError(
            f"Task address {shown} looks like IPv6 without brackets; write "
            f"'[{host if len(host) <= 64 else 'HOST'}]:PORT'",
            address,
        )
    elif not _HOST_RE.fullmatch(host):
        raise ClusterSpecError(
            f"Task address {shown} has a malformed host: use a host name or address of ASCII "
            "letters, digits, '-', '_' and '.' (or [IPv6])",
            address,
        )
    if not is_ascii_digits(port_text) or len(port_text) > 5:
        raise ClusterSpecError(
            f"Task address {shown} has port {show(port_text)}, which is not a number of ASCII "
            "digits from 1 to 65535",
            address,
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ClusterSpecError(f"Task address {shown} has port {port}, outside 1-65535", address)
    return host, port


def _is_ipv6(text: str) -> bool:
    literal, _, scope = text.partition("%")
    if "%" in text and not _SCOPE_RE.fullmatch(scope):
        return False
    try:
        ipaddress.IPv6Address(literal)
    except ValueError:
        return False
    return True


def _check_job_name(job: object) -> str:
    if not isinstance(job, str) or not JOB_NAME_RE.fullmatch(job):
        raise ClusterSpecError(
            f"Job name {show(job)} is not valid: use a letter followed by letters, digits or '_'",
            job,
        )
    return job


class Cluster:
    """An immutable, validated description of a cluster's jobs and task addresses.

    Build one with :meth:`parse` (any supported form) or directly from a dict such as
    ``{"local": ["localhost:2020", "localhost:2021"]}``. Jobs are kept sorted by name, as
    TensorFlow does, so every listing is deterministic. Task indices may be sparse
    (``{"worker": {0: "a:1", 2: "b:1"}}``), as in TensorFlow.

    Raises :class:`ClusterSpecError` for an empty cluster or job, a bad job name, a malformed
    address or port, or an address used twice.
    """

    __slots__ = ("_jobs",)

    def __init__(self, jobs: Mapping[str, Sequence[str] | Mapping[int, str]]) -> None:
        if not isinstance(jobs, Mapping):
            raise ClusterSpecError(
                f"A cluster is a mapping of job name to addresses, not {type(jobs).__name__}",
                jobs,
            )
        if not jobs:
            raise ClusterSpecError("The cluster has no jobs; name at least one job", jobs)
        normalised: dict[str, dict[int, str]] = {}
        seen: dict[str, str] = {}
        for job in sorted(jobs, key=str):
            _check_job_name(job)
            tasks = _job_tasks(job, jobs[job])
            for index, address in tasks.items():
                host, port = split_address(address)
                key = f"{host.lower()}:{port}"
                if key in seen:
                    raise ClusterSpecError(
                        f"Address {address!r} is used by both {seen[key]} and "
                        f"{task_name(job, index)}; give every task its own host:port",
                        address,
                    )
                seen[key] = task_name(job, index)
            normalised[job] = tasks
        self._jobs = normalised

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: ClusterLike, *, host: str = DEFAULT_HOST) -> Cluster:
        """Turn any supported cluster form into a :class:`Cluster`.

        ``spec`` may be a Cluster; a mapping ``{job: [addresses]}`` or ``{job: {index: address}}``;
        a mapping or JSON text with a top-level ``"cluster"`` key (TF_CONFIG style); JSON text; a
        path to a JSON file; compact counts ``"job=N[,job=N...]"`` (free ports on ``host`` are
        chosen and reserved for this process); or a ``tf.train.ClusterSpec``.
        """
        if isinstance(spec, Cluster):
            return spec
        if hasattr(spec, "as_cluster_def") and hasattr(spec, "as_dict"):  # tf.train.ClusterSpec
            return cls(spec.as_dict())
        if isinstance(spec, Mapping):
            if "cluster" in spec and isinstance(spec["cluster"], Mapping):
                return cls(spec["cluster"])
            return cls(spec)
        if isinstance(spec, os.PathLike):
            return cls._from_file(os.fspath(spec))
        if not isinstance(spec, str):
            raise ClusterSpecError(
                f"Cannot read a cluster from {type(spec).__name__} {show(spec)}; pass a dict, "
                "JSON text, a JSON file path or 'job=N,...'",
                spec,
            )
        check_size(spec, "cluster spec text")
        text = spec.strip()
        if not text:
            raise ClusterSpecError(
                "The cluster spec is empty; pass JSON, a JSON file path or 'job=N,...'", spec
            )
        if text.startswith(("{", "[")):
            return cls.parse(load_json(text, "cluster spec text"), host=host)
        if _looks_like_counts(text):
            return cls.from_counts(_parse_counts(text), host=host)
        if os.path.exists(text) or text.endswith(".json"):
            return cls._from_file(text)
        counts = _colon_counts(text)
        hint = f"; did you mean {counts!r}?" if counts else ""
        raise ClusterSpecError(
            f"Cannot read a cluster from {show(spec)}: it is not JSON, not 'job=N[,job=N...]' "
            f"and not an existing file{hint}",
            spec,
        )

    @classmethod
    def parse_addresses(cls, spec: ClusterLike, *, what: str = "This cluster") -> Cluster:
        """:meth:`parse` for a cluster that several processes must each read the same (one
        task's TF_CONFIG, one server of ``graphdist serve``): ``job=N`` text is refused, since it
        picks new free ports in every process that parses it (so no two tasks would describe
        one cluster), as is a file or text that names no addresses."""
        if isinstance(spec, str) and _looks_like_counts(spec.strip()):
            raise ClusterSpecError(
                f"{what} must name every task's address, and {show(spec)} picks new free ports "
                "on every call (so no two tasks would describe the same cluster); pass JSON text "
                'or a JSON file path, e.g. \'{"worker": ["host1:2222", "host2:2222"]}\'',
                spec,
            )
        return cls.parse(spec)

    @classmethod
    def _from_file(cls, path: str) -> Cluster:
        text = read_text_file(path, "cluster file")
        data = load_json(text, f"cluster file {show(path, 4096)}")
        if not isinstance(data, Mapping):
            raise ClusterSpecError(
                f"Cluster file {show(path, 4096)} holds {type(data).__name__}, not a JSON object",
                path,
            )
        return cls.parse(data)

    @staticmethod
    def parse_counts(text: str) -> dict[str, int]:
        """``"worker=2,ps=1"`` → ``{"worker": 2, "ps": 1}``; raises ClusterSpecError."""
        return Cluster.check_counts(_parse_counts(text))

    @staticmethod
    def check_counts(counts: Mapping[str, int]) -> dict[str, int]:
        """``counts`` as a dict if every job name is valid and every count a whole number from 1
        to ``MAX_TASKS_PER_JOB``; raises ClusterSpecError naming the job. The one home of the
        count check, for ``job=N`` text, mappings, Ray fleets and launched runs."""
        if not isinstance(counts, Mapping):
            raise ClusterSpecError(
                f"Task counts are a mapping of job name to count, not {type(counts).__name__}",
                counts,
            )
        if not counts:
            raise ClusterSpecError("The cluster has no jobs; name at least one job", counts)
        for job, n in counts.items():
            _check_job_name(job)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ClusterSpecError(
                    f"Job {job!r} asks for {show(n)} tasks; the count must be a whole number >= 1",
                    n,
                )
            if n > MAX_TASKS_PER_JOB:
                raise ClusterSpecError(
                    f"Job {job!r} asks for {n} tasks; at most {MAX_TASKS_PER_JOB} per job", n
                )
        return dict(counts)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], *, host: str = DEFAULT_HOST) -> Cluster:
        """A cluster of ``counts[job]`` tasks per job on free ports of ``host``.

        The ports are reserved for this process (see :mod:`graphdist._ports`) until a fleet that
        serves them is up, so concurrent processes never pick the same one. Each reservation
        holds a lock file open, so the counts add up to at most ``MAX_TASKS`` (1024) in all.
        """
        from graphdist._ports import pick_free_ports

        counts = Cluster.check_counts(counts)
        total = sum(counts.values())
        if total > MAX_TASKS:
            raise ClusterSpecError(
                f"The jobs ask for {total} tasks in all; at most {MAX_TASKS} on free ports of "
                "this machine (name the addresses in a JSON spec for more)",
                total,
            )
        ports = iter(pick_free_ports(sum(counts.values())))
        return cls({job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in counts.items()})

    # -- queries --------------------------------------------------------------------------------

    @property
    def jobs(self) -> tuple[str, ...]:
        """Job names, sorted."""
        return tuple(self._jobs)

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task, sorted by job name then index."""
        return tuple(
            Task(job, index, address)
            for job, tasks in self._jobs.items()
            for index, address in sorted(tasks.items())
        )

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return sum(len(t) for t in self._jobs.values())

    def __contains__(self, job: object) -> bool:
        return job in self._jobs

    def task_indices(self, job: str) -> tuple[int, ...]:
        """The task indices of ``job``, sorted; raises ClusterSpecError for an unknown job."""
        return tuple(sorted(self._job(job)))

    def num_tasks(self, job: str) -> int:
        return len(self._job(job))

    def task(self, job: str, index: int) -> Task:
        """The :class:`Task` ``job:index``; raises ClusterSpecError naming what exists."""
        tasks = self._job(job)
        if index not in tasks:
            raise ClusterSpecError(
                f"No task with index {show(index)} in job {job!r}; it has {_describe(tasks)}",
                index,
            )
        return Task(job, index, tasks[index])

    def address(self, job: str, index: int) -> str:
        return self.task(job, index).address

    def target(self, job: str, index: int) -> str:
        return self.task(job, index).target

    def _job(self, job: str) -> dict[int, str]:
        try:
            return self._jobs[job]
        except KeyError:
            raise ClusterSpecError(
                f"No job named {show(job)} in the cluster; its jobs are {', '.join(self.jobs)}",
                job,
            ) from None

    def subset(self, jobs: Iterable[str]) -> Cluster:
        """The cluster of only ``jobs`` (same indices and addresses)."""
        return Cluster({job: dict(self._job(job)) for job in jobs})

    @property
    def is_sparse(self) -> bool:
        return any(sorted(t) != list(range(len(t))) for t in self._jobs.values())

    # -- conversions ----------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """``{job: [addresses]}``, or ``{job: {index: address}}`` for a job with sparse indices."""
        out: dict[str, Any] = {}
        for job, tasks in self._jobs.items():
            if sorted(tasks) == list(range(len(tasks))):
                out[job] = [tasks[i] for i in range(len(tasks))]
            else:
                out[job] = dict(sorted(tasks.items()))
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def to_cluster_spec(self) -> tf.train.ClusterSpec:
        """The equivalent ``tf.train.ClusterSpec`` (imports TensorFlow)."""
        from tensorflow.python.training.server_lib import ClusterSpec

        return ClusterSpec(self.as_dict())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(self.to_json(sort_keys=True))

    def __repr__(self) -> str:
        return f"Cluster({self.as_dict()!r})"


def _describe(tasks: Mapping[int, str]) -> str:
    indices = sorted(tasks)
    if indices == list(range(len(indices))):
        return f"{len(indices)} task(s), indices 0-{len(indices) - 1}"
    return "task indices " + ", ".join(map(str, indices))


def _job_tasks(job: str, value: object) -> dict[int, str]:
    if isinstance(value, str):
        value = [value]  # TensorFlow accepts a lone address for a one-task job
    if isinstance(value, Mapping):
        tasks: dict[int, str] = {}
        keys: dict[int, object] = {}
        for key, address in value.items():
            index = _task_index(job, key)
            if index in keys:
                raise ClusterSpecError(
                    f"Job {job!r} has task indices {show(keys[index])} and {show(key)}, which are "
                    f"both index {index}; name each task once",
                    key,
                )
            keys[index] = key
            tasks[index] = address
    elif isinstance(value, Sequence):
        tasks = dict(enumerate(value))
    else:
        raise ClusterSpecError(
            f"Job {job!r} maps to {type(value).__name__} {show(value)}; give a list of 'host:port'",
            value,
        )
    if not tasks:
        raise ClusterSpecError(f"Job {job!r} has no tasks; give it at least one address", job)
    for address in tasks.values():
        split_address(address)
    return tasks


def _task_index(job: str, key: object) -> int:
    """A task index key: an int, or ASCII digits as JSON object keys are."""
    if isinstance(key, int) and not isinstance(key, bool):
        index = key
    elif isinstance(key, str) and _WHOLE_RE.fullmatch(key):
        index = int(key)
    else:
        raise ClusterSpecError(
            f"Job {job!r} has task index {show(key)}, which is not a whole number of ASCII digits",
            key,
        )
    if index < 0:
        raise ClusterSpecError(f"Job {job!r} has negative task index {index}", key)
    if index > MAX_TASK_INDEX:
        raise ClusterSpecError(f"Job {job!r} has task index {index}; at most {MAX_TASK_INDEX}", key)
    return index


def _looks_like_counts(text: str) -> bool:
    """``job=N[,job=N...]`` in shape: each comma-separated part one ``=`` after a name without
    spaces (the count is checked later). A plain loop: a regular expression for this shape
    backtracks for minutes on long text."""
    for part in text.split(","):
        job, sep, count = part.partition("=")
        job = job.strip()
        if not sep or "=" in count or not job or any(c.isspace() for c in job):
            return False
    return True


def _colon_counts(text: str) -> str | None:
    """``"local=2"`` for ``"local:2"`` (counts written as addresses are), else None."""
    parts = [part.strip().partition(":") for part in text.split(",")]
    if all(JOB_NAME_RE.fullmatch(job) and sep and _WHOLE_RE.fullmatch(n) for job, sep, n in parts):
        return ",".join(f"{job}={n}" for job, _, n in parts)
    return None


def _parse_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for part in text.split(","):
        job, _, count_text = (s.strip() for s in part.partition("="))
        _check_job_name(job)
        if job in counts:
            raise ClusterSpecError(f"Job {job!r} is named twice in {show(text)}", job)
        if not _WHOLE_RE.fullmatch(count_text):
            raise ClusterSpecError(
                f"Job {job!r} has count {show(count_text)}, which is not a whole number of ASCII "
                "digits",
                count_text,
            )
        counts[job] = int(count_text)
    return counts
