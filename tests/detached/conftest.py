"""Fixtures of the detached-fleet tests: the private Ray of the fleet tests, for a detached
fleet on the Ray backend."""

from tests.fleet.conftest import ray_env  # noqa: F401 - a fixture, found by its name
