"""Tests of graphdist._proc: the fork server, server processes, lean import, GPU plans, serve."""
