"""Fleets of TensorFlow servers and the machinery under them (see ARCHITECTURE.md): the lifecycle
every fleet shares (``base``), its backends (``local``: processes forked from a
TensorFlow-preloaded fork server, ``forkserver``; ``ray``: Ray actors), what runs inside a server
process (``server``; imported without Keras and SciPy, ``lean``), process control
(``process``), readiness and health over gRPC (``probe``, ``health``), where servers listen and
the bind shim (``loopback``, ``loopback.c``), GPU pinning (``gpus``), detached fleets
(``detached``: start, attach, status, stop; ``state``: their folder; ``supervisor``: the process
that owns one; ``control``: its control socket), signals (``signals``) and single servers on
real hosts (``serve``). Ports are in ``graphdist._ports``."""
