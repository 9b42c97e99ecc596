"""TensorFlow's own log lines: which lines they are, and keeping them out of graphdist's output.

TensorFlow writes a dozen lines on every start (absl's pre-init warning, "Could not find cuda
drivers", the CPU-instructions notice, ``failed call to cuInit``, the coordination service's
progress...), most of them straight from C++ to file descriptor 2, before and regardless of
``TF_CPP_MIN_LOG_LEVEL``. graphdist keeps them out of its own output unless
``GRAPHDIST_TF_LOGS=1`` (:data:`TF_LOGS_ENV`): every task's and server's log file, and
``graphdist run --output-format jsonl``, keep every line either way.

- :func:`is_tf_log` tells such a line from any other: ``graphdist run``'s console
  (:func:`graphdist._distribute.events.render`) drops them. Its patterns are anchored to
  TensorFlow's formats (a C++ log prefix with a ``file.cc:NN]`` part, the ``tensorflow`` Python
  logger, a warning raised in a ``tensorflow`` module, a few fixed texts), because dropping one of
  the user's own lines is worse than showing one of TensorFlow's.
- :func:`tf_logs_kept_out` reads file descriptor 2 through :func:`is_tf_log` while a graphdist
  command's own process imports TensorFlow (:func:`import_tensorflow_quietly`: ``demo``) or
  builds its server (``serve``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from graphdist._exceptions import ArgumentError

__all__ = [
    "LOOKBACK",
    "TF_LOGS_ENV",
    "LossyText",
    "import_tensorflow_quietly",
    "is_tf_log",
    "lossy_stream",
    "tf_logs_kept_out",
    "tf_logs_live",
]

TF_LOGS_ENV = "GRAPHDIST_TF_LOGS"
"""``1``: show TensorFlow's own log lines live; unset, empty or ``0``: keep them to the logs."""

LOOKBACK = 8  # previous lines of the same task that can make this one a continuation

# absl/glog (TF >= 2.16): "I0000 00:00:1796229802.870706    3727 cudart_stub.cc:31] ..."
_ABSL_RE = re.compile(
    r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.+-]+\.(?:cc|cpp|cxx|c|h|hpp):\d+\] "
)
# TensorFlow's own format before: "2023-05-01 12:00:00.123456: I tensorflow/core/.../port.cc:110] "
_TF_CC_RE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [\w./+-]+\.(?:cc|cpp|cxx|c|h|hpp):\d+\] "
)
_PRE_INIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_CPU_NOTICE_RE = re.compile(
    r"To enable the following instructions: .*, in other operations, rebuild TensorFlow with the "
    r"appropriate compiler flags\.$"
)
# TensorFlow's Python logger without absl's handler: "WARNING:tensorflow:From /...: ... deprecated"
_TF_LOGGER_RE = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL|FATAL):tensorflow:")
# warnings.showwarning for a warning raised in a tensorflow module:
# "/.../site-packages/tensorflow/python/x.py:12: UserWarning: ...", then its source line
_TF_WARNING_RE = re.compile(r"/\S*/(?:site|dist)-packages/tensorflow/\S+\.py:\d+: \w+: ")
# the coordination service's task lists, one a line after "...stragglers:"
_TASK_RE = re.compile(r"/job:[\w-]+/replica:\d+/task:\d+")
# the rest of a C++ log line's multi-line status (a collective aborted by a peer's death):
# gRPC's detail ("Additional GRPC error information from remote target ...:" then ":UNKNOWN:..."),
# TensorFlow's hint and the op it names ("\t [[{{node ...}}]]")
_STATUS_RE = re.compile(
    r"Additional GRPC error information from remote target \S+ while calling \S+:"
    r"|:UNKNOWN:.*"
    r"|The error could be from a previous operation\. Restart your program to reset\."
    r"|\t \[\[\{\{node .*\}\}\]\].*"
)


def tf_logs_live(environ: Mapping[str, str] | None = None, *, check: bool = True) -> bool:
    """Whether :data:`TF_LOGS_ENV` asks for TensorFlow's own log lines live (``1``) or not
    (unset, empty or ``0``); raises ArgumentError naming any other value (``check=False``: any
    other value is not ``1``)."""
    value = (os.environ if environ is None else environ).get(TF_LOGS_ENV, "").strip()
    if check and value not in ("", "0", "1"):
        raise ArgumentError(
            f"{TF_LOGS_ENV} must be 1 (show TensorFlow's own log lines live) or 0, not {value!r}",
            name=TF_LOGS_ENV,
            value=value,
        )
    return value == "1"


def classify(line: str, state: str | None = None) -> tuple[bool, str | None]:
    """(whether ``line`` is TensorFlow's, the state to read the same process's next line in):
    :func:`is_tf_log` one line at a time, for a reader that keeps the state (``None`` at first)."""
    if _ABSL_RE.match(line) or _TF_CC_RE.match(line):
        return True, "task-list" if line.endswith(":") else "status"
    if state == "task-list" and _TASK_RE.fullmatch(line):
        return True, "task-list"
    if state in ("status", "task-list") and _STATUS_RE.fullmatch(line):
        return True, "status"
    if line == _PRE_INIT or _CPU_NOTICE_RE.match(line):
        return True, None
    if _TF_LOGGER_RE.match(line):
        return True, "tf-logger"
    if state == "tf-logger" and line == "Instructions for updating:":
        return True, "instructions"
    if state == "instructions" and line.strip():
        return True, None
    if _TF_WARNING_RE.match(line):
        return True, "warning-source"
    if state == "warning-source" and line.startswith("  ") and line.strip():
        return True, None
    return False, None


def is_tf_log(line: str, before: Sequence[str] = ()) -> bool:
    """Whether ``line`` (no newline) is one of TensorFlow's own log lines; ``before``: the lines
    the same process wrote just before it, oldest first, for the few continuation lines
    (``Instructions for updating:`` and the line after it, a warning's source line, the task
    list after the coordination service's "stragglers:", the rest of a C++ line's multi-line
    status: gRPC's detail of a peer's failure, the op it names)."""
    state: str | None = None
    for previous in list(before)[-LOOKBACK:]:  # a deque too
        state = classify(previous, state)[1]
    return classify(line, state)[0]


def _forward(read_fd: int, out_fd: int) -> None:
    """Copy ``read_fd`` to ``out_fd`` line by line until EOF, leaving out TensorFlow's lines."""
    state: str | None = None
    with open(read_fd, "rb", closefd=True) as source:
        for raw in source:
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            tf_line, state = classify(text, state)
            if not tf_line:
                with contextlib.suppress(OSError):
                    os.write(out_fd, raw)


def import_tensorflow_quietly() -> Any:
    """``import tensorflow`` in this process, its log lines left out unless :func:`tf_logs_live`
    (see :func:`tf_logs_kept_out`)."""
    if "tensorflow" in sys.modules:
        import tensorflow

        return tensorflow
    with tf_logs_kept_out():
        import tensorflow
    return tensorflow


@contextlib.contextmanager
def tf_logs_kept_out() -> Iterator[None]:
    """Within: TensorFlow's own log lines on file descriptor 2 are left out, unless
    :func:`tf_logs_live` (importing TensorFlow, building a server: ``graphdist serve``).

    TensorFlow writes them from C++ to file descriptor 2, which no log level stops. Meanwhile fd
    2 is a pipe that a thread copies to the real stderr, leaving out what :func:`is_tf_log` says
    is TensorFlow's (a child started meanwhile keeps the pipe, and its lines are read the same
    way); Python's ``sys.stderr`` writes to the real stderr directly, so the program's own
    messages (an error another thread prints just before the process exits) never wait in the
    pipe. Neither the environment nor ``TF_CPP_MIN_LOG_LEVEL`` changes, so processes started
    from this one log everything. Also quiets the ``tensorflow`` Python logger and TensorFlow's
    Python warnings here."""
    if tf_logs_live():
        yield
        return
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", module=r"tensorflow(\.|$)")
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    os.set_inheritable(saved, False)
    python_stderr = sys.stderr
    direct = _direct_stderr(saved, python_stderr)
    read_fd, write_fd = os.pipe()
    thread = threading.Thread(
        target=_forward, args=(read_fd, saved), name="tf-log-filter", daemon=True
    )
    thread.start()
    if direct is not None:
        sys.stderr = direct
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        os.dup2(saved, 2)  # the pipe ends when every process that holds it has closed it
        if direct is not None and sys.stderr is direct:
            with contextlib.suppress(Exception):
                direct.flush()
            sys.stderr = python_stderr
        thread.join(0.2)  # what TensorFlow left in the pipe, shown before what follows


class LossyText(io.TextIOWrapper):
    """A text stream for diagnostics (stderr): a write that fails (its reader went away, a full
    disk) loses the text instead of raising in whichever thread wrote it, since there is nowhere
    left to report it; the stream's file descriptor becomes /dev/null then, so that what is still
    buffered, later lines and Python's flush at exit cannot fail again."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OSError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fileno(), inheritable=self.fileno() <= 2)
            os.close(devnull)
            super().flush()


def lossy_stream(fd: int, like: Any) -> LossyText:
    """A :class:`LossyText` on ``fd`` that writes as ``like`` (``sys.stderr``) does; never
    closed: it lives as long as the process (TensorFlow's log handlers may keep it)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return LossyText(
        io.BufferedWriter(raw),
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors=getattr(like, "errors", None) or "backslashreplace",
        line_buffering=True,
    )


def _direct_stderr(fd: int, like: Any) -> Any:
    """A text stream on ``fd`` (the real stderr) that writes as ``like`` (``sys.stderr``) does;
    None where ``sys.stderr`` is not the process's fd 2 (pytest's capture, a notebook)."""
    try:
        if like is None or like.fileno() != 2:
            return None
    except (AttributeError, OSError, ValueError):
        return None
    return lossy_stream(fd, like)
