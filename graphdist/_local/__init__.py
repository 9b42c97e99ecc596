"""The local engine: a fleet whose servers are processes of this machine forked from a fork server
that imported TensorFlow once (``fleet``, ``task``, ``checks``), and ``graphdist run``'s local
backend, its tasks warm where they can be (``run``)."""
