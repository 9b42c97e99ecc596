"""The ``graphdist`` command line: a thin layer over the library (``main``)."""
