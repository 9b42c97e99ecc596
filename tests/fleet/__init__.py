"""Tests of graphdist._fleet: the fleet client and lifecycle, backends, session guard, health."""
