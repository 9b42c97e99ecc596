"""The Ray engine: the Ray a fleet and a run share (``nodes``: joining it, placement, lost nodes,
Ray's own out-of-memory words), its actors (``actors``: servers, TLS gateways), the fleet
(``fleet``), ``graphdist run``'s Ray backend (``run``) and its warm agents (``agents``)."""
