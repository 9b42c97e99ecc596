"""graphdist's own folders are private to their user, and a hostile one is refused in one line."""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import tempfile

import pytest

import graphdist
from graphdist._net.tlsmode import RECEIVED_GLOB
from graphdist._private import private_dir, runtime_dir
from tests.conftest import run_python


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_folder_is_created_0700_and_a_wide_one_of_ours_is_narrowed(tmp_path):
    new = str(tmp_path / "a" / "b")
    assert private_dir(new) == new and mode(new) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o777)
    os.chmod(wide, 0o777)
    private_dir(str(wide))
    assert mode(str(wide)) == 0o700


def test_a_link_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(graphdist.StateError, match="symbolic link") as info:
        private_dir(str(link), "the test folder")
    assert info.value.state_dir == str(link)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder owned by another user")
def test_a_folder_owned_by_another_user_is_refused(tmp_path):
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    os.chown(hostile, 65534, 65534)
    with pytest.raises(graphdist.StateError, match="belongs to uid 65534"):
        private_dir(str(hostile))
    # a missing folder is fine without creating it; an existing hostile one is not
    assert private_dir(str(tmp_path / "missing"), create=False) == str(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_runtime_dir_prefers_the_users_own_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == str(tmp_path / "graphdist")
    assert mode(runtime_dir()) == 0o700
    assert os.lstat(runtime_dir()).st_uid == os.getuid()


@pytest.mark.parametrize("xdg", ["missing", "unset", "a file"])
def test_without_a_usable_xdg_runtime_dir_it_is_the_users_own_temp_folder(
    xdg, tmp_path, monkeypatch
):
    """The fallback is exactly ``<temp>/graphdist-<uid>``: one per user, 0700, the user's own."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    if xdg == "unset":
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        (tmp_path / "a file").write_text("")
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / xdg))
    path = runtime_dir()
    assert path == str(temp / f"graphdist-{os.getuid()}")
    assert mode(path) == 0o700 and os.lstat(path).st_uid == os.getuid()


def test_a_fleets_own_temp_folder_carries_its_owners_pid(tmp_path, monkeypatch):
    """``graphdist-fleet-<owner pid>-*``: what the next start's sweep reads to find the owner."""
    from graphdist._private import owned_temp_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    path = owned_temp_dir("fleet")
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(tmp_path)
    assert re.fullmatch(rf"graphdist-fleet-{os.getpid()}-[A-Za-z0-9_]+", name), name
    assert mode(path) == 0o700 and os.lstat(path).st_uid == os.getuid()


# Makes a TLS cluster's credentials (no gateway), prints their folder, then dies by SIGKILL:
# an owner that could not remove them.
KILLED_TLS_OWNER = """
import os, signal
from graphdist import Cluster
from graphdist._net.tlsmode import TlsMode, write_received
mode = TlsMode(Cluster.parse({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}), start=False)
print(mode.folder, flush=True)
print(write_received(mode.host_files("127.0.0.1")), flush=True)  # a node's, as a gateway gets it
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_credentials_of_a_tls_owner_killed_by_sigkill_are_swept_at_the_next_tls_start(
    tmp_path,
):
    """A TLS cluster's credentials folder holds private keys, and so does the folder a node's
    gateway gets its own in (over srun's stdin or Ray's channel); an owner killed by SIGKILL
    cannot remove them. The next TLS cluster made (in any process of this user's) removes
    them, and leaves a live owner's folder alone."""
    env = {"TMPDIR": str(tmp_path)}
    killed = run_python(["-c", KILLED_TLS_OWNER], env=env)
    assert killed.returncode == -9, killed.stderr
    left, received = killed.stdout.split()
    assert os.path.basename(left).startswith("graphdist-tls-"), left
    assert os.path.exists(os.path.join(left, "credentials", "client", "key.pem")), left
    assert fnmatch.fnmatch(os.path.basename(received), RECEIVED_GLOB), received
    assert os.path.exists(os.path.join(received, "key.pem")), received
    live = tmp_path / f"graphdist-tls-{os.getpid()}-live"
    live.mkdir(mode=0o700)
    again = run_python(
        ["-c", KILLED_TLS_OWNER.replace("os.kill", "mode.close() or print")], env=env
    )
    assert again.returncode == 0, again.stderr
    assert not os.path.exists(left), sorted(os.listdir(tmp_path))
    assert not os.path.exists(received), sorted(os.listdir(tmp_path))
    assert live.exists(), sorted(os.listdir(tmp_path))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a folder as another user")
def test_a_port_lock_folder_planted_by_another_user_is_a_one_line_error(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    planted = runtime / "graphdist"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    code = "import graphdist; graphdist.LocalFleet('local=2').start()"
    result = run_python(["-c", code], env={"XDG_RUNTIME_DIR": str(runtime)})
    assert result.returncode != 0
    assert f"StateError: {planted} (graphdist's runtime folder) belongs to uid 65534" in (
        result.stderr
    )
    cli = run_python(
        ["-m", "graphdist", "up", "--cluster", "local=2", "--json"],
        env={"XDG_RUNTIME_DIR": str(runtime)},
    )
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines()[-1].startswith(f"Error: {planted} (graphdist's")
    assert "Traceback" not in cli.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a folder as another user")
def test_a_state_folder_of_another_user_is_never_read(tmp_path, run_cli):
    planted = tmp_path / "state"
    planted.mkdir()
    (planted / "fleet.json").write_text("{}")
    os.chown(planted, 65534, 65534)
    for command in ("status", "down"):
        result = run_cli(command, "--state-dir", str(planted))
        assert result.returncode == 2, (command, result.stderr)
        assert "belongs to uid 65534" in result.stderr.strip().splitlines()[-1]
