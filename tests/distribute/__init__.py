"""Tests of graphdist._distribute."""
