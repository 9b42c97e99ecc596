"""How a run's log folder is named (:class:`graphdist._distribute.runlogs.RunLogs`): ``run-N`` in
a folder of the user's own, a name that says whose in a shared one such as ``/tmp``."""

from __future__ import annotations

import os
import re

from graphdist._distribute.runlogs import RunLogs


def test_a_private_log_dir_gets_run_1_then_run_2(tmp_path):
    mine = tmp_path / "logs"
    mine.mkdir(mode=0o700)
    assert [os.path.basename(RunLogs(mine).path) for _ in range(2)] == ["run-1", "run-2"]


def test_a_shared_log_dir_gets_a_folder_that_says_it_is_graphdists_and_whose(tmp_path):
    """``--log-dir /tmp`` made a bare ``run-1`` there (issue 57): among everyone's files, a run's
    folder names graphdist, its start and its launcher's pid; two runs of one process in the same
    second get two folders."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: everyone writes, the sticky bit keeps entries their owners'
    first, second = (os.path.basename(RunLogs(shared).path) for _ in range(2))
    stem = rf"graphdist-run-\d{{8}}-\d{{6}}-{os.getpid()}"
    assert re.fullmatch(stem, first), first
    assert re.fullmatch(rf"{stem}-2", second) or re.fullmatch(stem, second), second
    assert first != second and not (shared / "run-1").exists()
    assert oct((shared / first).stat().st_mode & 0o777) == "0o700"
