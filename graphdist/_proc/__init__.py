"""Process machinery under a fleet: the TensorFlow-preloaded fork server (``forkserver``,
``forkserver_exit``), what runs in a server process (``server``; imported without Keras and
SciPy, ``lean``), stopping processes (``process``), signal handling (``signals``), GPU pinning
(``gpus``) and single servers on real hosts (``serve``)."""
