"""The ``graphdist`` command's standard streams while it runs: stdout whose failed writes are
marked as the command's output (:func:`is_output_error`; :func:`graphdist._cli.main.main` ends
the command with one line or quietly, never a traceback), stderr that loses what it cannot
write, and fds 0-2 open whatever the command started with."""

from __future__ import annotations

import contextlib
import errno
import os
from typing import IO, Any

from graphdist._tflog import LossyText, lossy_stream

__all__ = ["CommandStdout", "is_output_error", "lossy_stderr", "standard_fds_open"]

_OUTPUT_ERROR = "_graphdist_output_error"  # set on an OSError of a write to stdout


class CommandStdout:
    """``sys.stdout`` while a command runs: a write or flush that fails raises as it would,
    marked as the command's output (:func:`graphdist._cli.main.main` tells it from any other
    OSError), and fd 1 becomes /dev/null, so that what is still buffered, another thread's line
    and Python's flush at exit cannot fail again (no "Exception ignored ... BrokenPipeError").
    ``None``: fd 1 was closed when the command started, and every write fails as a closed file
    descriptor's does."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._stream = stream
        self._failed_once = False

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                if self._failed_once:  # said once; the rest is lost as on /dev/null
                    return len(text)
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def _failed(self, exc: OSError) -> OSError:
        setattr(exc, _OUTPUT_ERROR, True)
        self._failed_once = True
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if self._stream is not None and self._stream.fileno() == 1:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.close(devnull)
        return exc

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def is_output_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write of the command's stdout (:class:`CommandStdout`)."""
    return isinstance(exc, OSError) and getattr(exc, _OUTPUT_ERROR, False)


def standard_fds_open() -> None:
    """/dev/null on fd 0, 1 or 2 where the command started with it closed (``graphdist status
    >&-``): otherwise the next file or socket opened takes its number, and a child's output or
    TensorFlow's C++ logging (which writes to fd 2) would land in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            os.set_inheritable(fd, True)


def lossy_stderr(stream: IO[str] | None) -> IO[str]:
    """``sys.stderr`` while a command runs: a :class:`LossyText` on fd 2, unless it is another
    stream than fd 2 (pytest's capture, a notebook's)."""
    if isinstance(stream, LossyText):
        return stream
    if stream is not None:
        try:
            if stream.fileno() != 2:
                return stream
        except (AttributeError, OSError, ValueError):
            return stream
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return lossy_stream(2, stream)
