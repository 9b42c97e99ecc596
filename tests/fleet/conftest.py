"""Fixtures of the fleet tests: a private Ray for the tests that start one."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import sys
import tempfile

import psutil
import pytest

from tests.conftest import EVENTUALLY_S, forbid_in_unit_tier, wait_gone


def processes_of(marker: str) -> dict[int, psutil.Process]:
    """Live processes whose command line mentions ``marker`` (the Ray instance's temp folder)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or []):
                found[proc.pid] = proc
    return found


@pytest.fixture
def ray_env(monkeypatch):
    """A private Ray temp folder and auth token, RAY_ADDRESS=local (a Ray instance of the
    test's own, never a cluster that another test runs on this machine: see tests/conftest.py);
    every process the test's Ray started must be gone afterwards."""
    forbid_in_unit_tier("a Ray instance")
    # Short: Ray's socket paths live below it and AF_UNIX paths stop at 107 bytes.
    tmp = tempfile.mkdtemp(prefix="gdrx-")
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
    monkeypatch.setenv("RAY_ADDRESS", "local")
    import ray

    try:
        require_token_auth()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if ray.is_initialized():  # a connection an earlier test of this worker left open
        ray.shutdown()
    reload_ray_token()
    driver = psutil.Process()
    before = {p.pid for p in driver.children(recursive=True)}
    try:
        yield tmp
    finally:
        # What this test's Ray started (its workers' command lines do not name the folder).
        left = {p.pid for p in driver.children(recursive=True) if p.pid not in before}
        ray.shutdown()
        monkeypatch.undo()
        reload_ray_token()
        assert wait_gone(left | set(processes_of(tmp)), EVENTUALLY_S) == []
        shutil.rmtree(tmp, ignore_errors=True)


def require_token_auth() -> None:
    """Fail, saying why, where Ray runs without token auth in this process although
    RAY_AUTH_MODE=token is set: Ray reads the mode once, at its first import in a process, so
    a test of this worker imported it without the variable (give that test ``ray_env``). Its
    clusters would then refuse this process with a bare "InvalidAuthToken"."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        pytest.fail(
            "Ray's auth mode is not 'token' in this worker although RAY_AUTH_MODE=token: an "
            "earlier test imported Ray without it (give that test the ray_env fixture)"
        )


def reload_ray_token() -> None:
    """Ray caches its auth token per process: make it read this test's (or the next one's)."""
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
