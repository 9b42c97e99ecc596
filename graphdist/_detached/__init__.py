"""Detached fleets (``graphdist up --detach``): the handle and the start/stop of one (``fleet``),
its state folder (``state``), the supervisor process that owns it (``supervisor``) and its
control socket (``control``)."""
