"""graphdist's benchmarks. Each runs as a script (``python benchmarks/suite.py``) or as a module
of this package (``python -m benchmarks.suite``); ``_common`` holds their shared plumbing."""
