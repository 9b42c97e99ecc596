"""Ask a TensorFlow server over gRPC whether it is really serving, without importing TensorFlow.

An open port is not enough (gRPC may be listening while the server is still being built), so
readiness and health are checked with a real call: ``WorkerService/GetStatus`` with an empty
request, which every TensorFlow gRPC server answers with the devices it owns. Raw bytes travel
both ways, so only ``grpcio`` (a TensorFlow dependency, 0.1 s to import) is needed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROBE_TIMEOUT_S", "Prober", "probe_many"]

PROBE_TIMEOUT_S = 1.0
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"
# Short reconnect back-off, so a server that starts a moment after a failed probe is seen at once
# instead of after gRPC's default 1 s back-off.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
    ("grpc.enable_retries", 0),
]


class Prober:
    """One gRPC channel to one server's address; :meth:`probe` returns whether it answered."""

    def __init__(self, address: str) -> None:
        import grpc

        self.address = address
        self._grpc = grpc
        self._channel: Any = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._call = self._channel.unary_unary(_GET_STATUS)
        self.last_error: str | None = None

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """True if the server answered GetStatus within ``timeout_s`` seconds."""
        return self._outcome(self._call.future(b"", timeout=timeout_s))

    def _outcome(self, future: Any) -> bool:
        """Whether ``future`` (a GetStatus call) was answered; keeps the error otherwise."""
        try:
            future.result()
        except self._grpc.RpcError as exc:
            self.last_error = f"{exc.code().name}: {exc.details()}"
            return False
        self.last_error = None
        return True

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_many(probers: list[Prober], timeout_s: float = PROBE_TIMEOUT_S) -> list[bool]:
    """Probe every server at once (one call each, all in flight together); whether each
    answered within ``timeout_s`` seconds, in the order of ``probers``."""
    futures = [p._call.future(b"", timeout=timeout_s) for p in probers]
    return [p._outcome(f) for p, f in zip(probers, futures, strict=True)]
