"""Tests of graphdist._graph."""
