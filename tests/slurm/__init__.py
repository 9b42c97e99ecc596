"""Tests under Slurm: a real cluster on namespaced hosts (tests/slurmbed.py), graphdist in it."""
