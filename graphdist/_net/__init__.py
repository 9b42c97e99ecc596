"""Network safety: the bind shim that keeps servers on loopback and refuses other users
(``loopback``, ``loopback.c``), where a server really listens (``exposure``), readiness probes
over gRPC (``probe``) and free-port choice with per-user locks (``ports``)."""
