"""Tests of graphdist._fleet."""
