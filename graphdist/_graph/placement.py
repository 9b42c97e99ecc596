"""The device-placement DSL: build, parse, normalise and check ``/job:J/task:N/gpu:0`` strings.

The grammar is TensorFlow's (``tensorflow/python/framework/device_spec.py``): ``/``-separated
parts ``job:NAME``, ``replica:N``, ``task:N``, and one device part, either the full
``device:TYPE:N`` (``N`` may be ``*``) or the short ``TYPE:N`` / ``TYPE`` for the known types
(``cpu:0``, ``gpu:0``, as in the seed). Unlike TensorFlow, graphdist also rejects negative or
repeated parts at parse time, and :func:`check_device` catches an unknown job or an out-of-range
task before TensorFlow only notices it at ``sess.run``. :func:`check_ops` checks the devices a
graph's ops ask for, however they were written (``tf.device`` strings, device functions,
``replica_device_setter``, colocation: ``op.device`` as TensorFlow merged it), by TensorFlow's own
rule: a device may leave parts out, and must match at least one device of the cluster (a fleet's
session calls it before each step that follows new ops). Numbers are ASCII digits only
(Arabic-Indic or fullwidth digits are refused, though Python's ``int()`` takes them) and at most
``2**31 - 1``; a device string is at most ``MAX_DEVICE_CHARS`` long.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from graphdist._cluster import MAX_TASK_INDEX, Cluster, ClusterLike
from graphdist._exceptions import PlacementError
from graphdist._validate import is_ascii_digits, show

__all__ = [
    "DeviceSpec",
    "check_device",
    "check_ops",
    "device",
    "normalize_device",
    "parse_device",
]

# The short form ``gpu:0`` is accepted for these types only, as in TensorFlow.
SHORT_DEVICE_TYPES = frozenset({"CPU", "GPU", "TPU", "CUSTOM", "EPU"})
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
MAX_DEVICE_CHARS = 1024
TASKS_SHOWN = 3
"""How many tasks of a job an op's error lists before it gives the job's range instead."""


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string; ``None`` means "not specified" for every field.

    ``device_index`` is ``None`` both when no device is named and for the wildcard ``TYPE:*``.
    ``str(spec)`` gives the canonical form, e.g. ``/job:local/replica:0/task:1/device:GPU:0``.
    """

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.job is not None and (
            not isinstance(self.job, str) or not _NAME_RE.fullmatch(self.job)
        ):
            raise PlacementError(
                f"Job name {show(self.job)} is not valid: use a letter followed by letters, "
                "digits or '_'",
                self.job,
            )
        for field, value in (
            ("replica", self.replica),
            ("task", self.task),
            ("device index", self.device_index),
        ):
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_TASK_INDEX
            ):
                raise PlacementError(
                    f"The {field} must be a whole number >= 0 and <= {MAX_TASK_INDEX}, not "
                    f"{show(value)}"
                )
        if self.device_type is not None and (
            not isinstance(self.device_type, str) or not _NAME_RE.fullmatch(self.device_type)
        ):
            raise PlacementError(f"Device type {show(self.device_type)} is not valid")
        if self.device_index is not None and self.device_type is None:
            raise PlacementError("A device index needs a device type (e.g. GPU)")

    def to_string(self) -> str:
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{self.device_type}:{index}")
        return "".join(parts)

    __str__ = to_string

    def replace(self, **changes: object) -> DeviceSpec:
        return replace(self, **changes)  # type: ignore[arg-type]


def _int_part(name: str, text: str, spec: str) -> int:
    if not is_ascii_digits(text) or len(text) > 10 or int(text) > MAX_TASK_INDEX:
        raise PlacementError(
            f"Device {show(spec)}: {name} {show(text)} is not a whole number >= 0 of ASCII digits "
            f"(at most {MAX_TASK_INDEX})",
            spec,
        )
    return int(text)


def _device_type(text: str, spec: str) -> str:
    if not isinstance(text, str):
        raise PlacementError(f"Device type {show(text)} is not a string", show(spec))
    upper = text.upper()
    if text.isascii() and upper in SHORT_DEVICE_TYPES:
        return upper
    if not _NAME_RE.fullmatch(text):
        raise PlacementError(f"Device {show(spec)}: device type {show(text)} is not valid", spec)
    return text


def parse_device(spec: str | DeviceSpec | None) -> DeviceSpec:
    """Parse any device string TensorFlow accepts into a :class:`DeviceSpec`.

    Accepts ``None`` or ``""`` (no constraint), full and partial forms, the short ``gpu:0`` form
    and ``*`` for the device index. Raises :class:`PlacementError` naming the bad part.
    """
    if isinstance(spec, DeviceSpec):
        return spec
    if spec is None:
        return DeviceSpec()
    if not isinstance(spec, str):
        raise PlacementError(f"A device must be a string, not {type(spec).__name__} {show(spec)}")
    if len(spec) > MAX_DEVICE_CHARS:
        raise PlacementError(
            f"Device string of {len(spec)} characters; at most {MAX_DEVICE_CHARS}", show(spec)
        )
    fields: dict[str, object] = {}

    def put(key: str, value: object, part: str) -> None:
        if key in fields:
            what = "device" if key == "device_type" else key
            raise PlacementError(
                f"Device {show(spec)} names the {what} twice (at {show(part)})", spec
            )
        fields[key] = value

    for part in spec.strip().split("/"):
        if not part:
            continue
        pieces = part.split(":")
        head = pieces[0]
        if len(pieces) == 2 and head == "job":
            if not _NAME_RE.fullmatch(pieces[1]):
                raise PlacementError(
                    f"Device {show(spec)}: job name {show(pieces[1])} is not valid", spec
                )
            put("job", pieces[1], part)
        elif len(pieces) == 2 and head == "replica":
            put("replica", _int_part("replica", pieces[1], spec), part)
        elif len(pieces) == 2 and head == "task":
            put("task", _int_part("task", pieces[1], spec), part)
        elif len(pieces) in (1, 2) and head.isascii() and head.upper() in SHORT_DEVICE_TYPES:
            put("device_type", head.upper(), part)
            if len(pieces) == 2 and pieces[1] != "*":
                fields["device_index"] = _int_part("device index", pieces[1], spec)
        elif len(pieces) == 3 and head == "device":
            put("device_type", _device_type(pieces[1], spec), part)
            if pieces[2] != "*":
                fields["device_index"] = _int_part("device index", pieces[2], spec)
        else:
            hint = ""
            if head in ("tsk", "tasks", "jobs", "replicas", "dev"):
                hint = "; did you mean job:, replica:, task: or device:?"
            raise PlacementError(
                f"Device {show(spec)}: unknown part {show(part)}; expected job:NAME, replica:N, "
                "task:N, "
                f"device:TYPE:N or TYPE:N{hint}",
                spec,
            )
    return DeviceSpec(**fields)  # type: ignore[arg-type]


def normalize_device(spec: str | DeviceSpec | None) -> str:
    """The canonical string of any accepted device form (``/job:local/task:0/gpu:0`` →
    ``/job:local/task:0/device:GPU:0``)."""
    return parse_device(spec).to_string()


def device(
    job: str,
    task: int | None = None,
    *,
    replica: int | None = 0,
    gpu: int | None = None,
    cpu: int | None = None,
    device_type: str | None = None,
    index: int | None = None,
) -> str:
    """Build a canonical device string.

    ``device("local", task=1, gpu=0)`` → ``/job:local/replica:0/task:1/device:GPU:0``. Give at most
    one of ``gpu``, ``cpu`` or ``device_type`` (with ``index``; ``None`` index means ``*``). The
    task is left out when ``None``; ``replica`` defaults to 0. Raises :class:`PlacementError`.
    """
    chosen: list[tuple[str, int | None]] = [
        (t, i) for t, i in (("GPU", gpu), ("CPU", cpu)) if i is not None
    ]
    if device_type is not None:
        chosen.append((_device_type(device_type, device_type), index))
    elif index is not None:
        raise PlacementError("index= needs device_type=; or use gpu=N / cpu=N")
    if len(chosen) > 1:
        raise PlacementError(
            "Give at most one of gpu=, cpu= or device_type=, not " + ", ".join(t for t, _ in chosen)
        )
    dtype, dindex = chosen[0] if chosen else (None, None)
    return DeviceSpec(job, replica, task, dtype, dindex).to_string()


def check_device(
    spec: str | DeviceSpec | None,
    cluster: ClusterLike,
    *,
    gpus: dict[tuple[str, int], int] | None = None,
) -> DeviceSpec:
    """Parse ``spec`` and check it against ``cluster`` (anything :meth:`Cluster.parse` takes: a
    ``Cluster``, a dict, JSON, a ``tf.train.ClusterSpec``...); return the parsed spec.

    Raises :class:`PlacementError` for a malformed string, a job the cluster lacks, a task index
    out of range, a replica other than 0 (a graphdist cluster has one replica per job), a task
    without a job in a cluster of several jobs, or (when ``gpus`` maps ``(job, task)`` to its GPU
    count) a GPU index the task does not have.
    """
    cluster = Cluster.parse(cluster)
    parsed = parse_device(spec)
    text = parsed.to_string() or repr(spec)
    job = parsed.job
    if job is None and parsed.task is not None:
        if len(cluster.jobs) != 1:
            raise PlacementError(
                f"Device {text!r} names a task but no job; add /job:NAME (jobs: "
                f"{', '.join(cluster.jobs)})",
                text,
            )
        job = cluster.jobs[0]
    if job is not None:
        if job not in cluster:
            raise PlacementError(
                f"Device {text!r}: no job {job!r} in the cluster; its jobs are "
                f"{', '.join(cluster.jobs)}",
                text,
            )
        indices = cluster.task_indices(job)
        if parsed.task is not None and parsed.task not in indices:
            span = (
                f"0-{len(indices) - 1}"
                if list(indices) == list(range(len(indices)))
                else ", ".join(map(str, indices))
            )
            raise PlacementError(
                f"Device {text!r}: no task with index {parsed.task} in job {job!r} "
                f"(it has tasks {span})",
                text,
            )
    if parsed.replica not in (None, 0):
        raise PlacementError(
            f"Device {text!r}: replica {parsed.replica} does not exist; graphdist clusters have "
            "only replica 0",
            text,
        )
    if gpus is not None and parsed.device_type == "GPU" and job is not None:
        tasks = [parsed.task] if parsed.task is not None else list(cluster.task_indices(job))
        for task in tasks:
            have = gpus.get((job, task), 0)
            if have == 0 or (parsed.device_index is not None and parsed.device_index >= have):
                raise PlacementError(
                    f"Device {text!r}: task {job}:{task} has {have} GPU(s)"
                    + (f" (indices 0-{have - 1})" if have else ""),
                    text,
                )
    return parsed


def check_ops(
    ops: Iterable[tuple[str, str]],
    cluster: ClusterLike,
    *,
    gpus: Mapping[tuple[str, int], int] | None = None,
) -> None:
    """Check the device each op asks for against ``cluster``, by TensorFlow's rule for placing
    it: ``ops`` are ``(op.name, op.device)`` pairs, the device as TensorFlow merged it (empty:
    no constraint, fine). A device may leave out its job, task or device (``/task:1`` matches
    task 1 of any job, ``/job:ps`` any ps task), and must match at least one task of the
    cluster, with replica 0; with ``gpus`` (``(job, task)`` -> GPU count; ``None``: unknown, or
    soft placement allowed, and GPUs are not checked) a GPU device must be one a matching task
    has. Each distinct device is checked once.

    Raises :class:`PlacementError` (``device``: the op's device, ``op``: its name) for the
    first op whose device no task has: one line naming the op, the device and what the cluster
    has. TensorFlow would fail every step of the graph for it ("Cannot assign a device").
    """
    cluster = Cluster.parse(cluster)
    seen: set[str] = set()
    for name, text in ops:
        if not text or text in seen:
            continue
        try:
            parsed = parse_device(text)
        except PlacementError as exc:
            raise PlacementError(f"Op {name!r}: {exc}", text, op=name) from None
        lacks = _lacks(parsed, cluster, gpus)
        if lacks is not None:
            raise PlacementError(
                f"Op {name!r} asks for {text}, which this fleet does not have ({lacks})",
                text,
                op=name,
            )
        seen.add(text)


def _lacks(
    parsed: DeviceSpec, cluster: Cluster, gpus: Mapping[tuple[str, int], int] | None
) -> str | None:
    """What ``cluster`` has instead of a device that matches ``parsed`` (None: it has one)."""
    jobs = list(cluster.jobs) if parsed.job is None else [parsed.job]
    tasks = [
        (job, index)
        for job in jobs
        if job in cluster
        for index in cluster.task_indices(job)
        if parsed.task in (None, index)
    ]
    if not tasks or parsed.replica not in (None, 0):
        return "it has " + ", ".join(_job_tasks(job, cluster) for job in cluster.jobs)
    if gpus is None or parsed.device_type != "GPU":
        return None
    wanted = parsed.device_index or 0  # the wildcard GPU:* needs one
    if any(gpus.get(task, 0) > wanted for task in tasks):
        return None
    counts = [(f"/job:{job}/task:{index}", gpus.get((job, index), 0)) for job, index in tasks]
    if not any(n for _, n in counts):
        return (
            "its tasks have no GPU; place the op on a CPU, or allow soft placement in the "
            "session's config"
        )
    return ", ".join(f"{name} has {n} GPU(s)" for name, n in counts)


def _job_tasks(job: str, cluster: Cluster) -> str:
    """A job's task devices: each one, or the first and last of a long job."""
    indices = list(cluster.task_indices(job))
    if len(indices) <= TASKS_SHOWN:
        return ", ".join(f"/job:{job}/task:{i}" for i in indices)
    return f"/job:{job}/task:{indices[0]} to /job:{job}/task:{indices[-1]} ({len(indices)} tasks)"
