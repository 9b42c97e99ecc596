"""tf.distribute on graphdist clusters: TF_CONFIG per task (``tfconfig``), strategy and
checkpoint helpers (``strategy``), resuming a restarted run from its last backup (``resume``),
and the launcher that runs one process per task (``launcher``, with ``taskfn`` for Python
functions)."""
