"""The graph side: device strings checked against a cluster (``placement``), sessions with
bounded timeouts (``session``), the choice of a session's master (``master``), splitting a graph
over tasks (``split``), proof of where ops ran (``trace``), shared variables (``variables``) and
the seeds' example graph (``graphs``). Nothing here starts a process."""
