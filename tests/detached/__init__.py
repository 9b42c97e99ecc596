"""Tests of graphdist._detached: detached fleets, their state folder, supervisor and control."""
