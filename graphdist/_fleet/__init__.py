"""Fleets of TensorFlow servers and the machinery under them: the lifecycle every fleet shares
(``base``), its backends (``local``: processes forked from a TensorFlow-preloaded fork server;
``ray``: Ray actors), what runs inside a server process (``server``), readiness and health over
gRPC (``probe``, ``health``), ports are in ``graphdist._ports``, loopback-only binding
(``loopback``, ``loopback.c``), GPU pinning (``gpus``), detached fleets (``detached``: start,
attach, status, stop; ``state``: their folder; ``supervisor``: the process that owns one;
``control``: its control socket), signals (``signals``) and single servers on real hosts
(``serve``)."""
