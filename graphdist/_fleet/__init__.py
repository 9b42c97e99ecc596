"""Fleets of TensorFlow servers (see ARCHITECTURE.md): what using a fleet offers (``client``),
the lifecycle of a fleet that owns its servers (``lifecycle``), the backends that supply the
servers (``local``: processes on this machine; ``ray``: Ray actors), registered by name
(``backends``), the guard of every fleet session (``guard``) and task health, the one home of
"a task failed" (``health``). Process machinery is in :mod:`graphdist._proc`, network safety in
:mod:`graphdist._net`, detached fleets in :mod:`graphdist._detached`."""
