"""A guard's report as its readers read it (graphdist/_proc/guardreport.py)."""

from __future__ import annotations

from graphdist._proc.guardreport import parse_report


def test_the_last_pid_and_the_first_end_each_read_once_said():
    assert parse_report(b"") == (None, None)
    assert parse_report(b"pid 12\n") == (12, None)
    text = b"pid 12\npid 13\nexit -9 1700000000.5\nexit 0 1700000001.0\nnoise\npid x\n"
    assert parse_report(text) == (13, (-9, 1700000000.5))
