"""Tests of graphdist._cli."""
