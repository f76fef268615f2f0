"""A long child program's output goes to its log, progress is reported meanwhile, and a child never outlives us."""

from __future__ import annotations

import os
import sys

import pytest

from beyond_agent.child_log import log_tail, run_logged


def test_the_output_goes_to_the_log_and_progress_is_reported_until_the_child_exits(tmp_path):
    reports = []
    script = "import sys, time\nprint('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\ntime.sleep(0.6)\nsys.exit(3)"
    code = run_logged([sys.executable, "-c", script], tmp_path / "logs" / "child.log",
                      lambda: reports.append(1), every_s=0.1)
    assert code == 3
    assert (tmp_path / "logs" / "child.log").read_text().split() == ["out", "err"]
    assert len(reports) >= 3  # every 0.1 s while it slept 0.6 s


def test_a_child_is_killed_when_the_caller_stops_waiting(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"

    def interrupt():
        if pid_file.exists() and pid_file.read_text():
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_logged([sys.executable, "-c", script], tmp_path / "child.log", interrupt, every_s=0.1)
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)


def test_the_tail_of_a_long_log_reads_only_its_end(tmp_path):
    log = tmp_path / "big.log"
    log.write_text("".join(f"line {n}\n" for n in range(200_000)))  # ~2.3 MB
    assert log_tail(log, lines=3) == "line 199997\nline 199998\nline 199999"
    assert log_tail(log, lines=10**6, read_bytes=24).splitlines()[-1] == "line 199999"
    assert len(log_tail(log, lines=10**6, read_bytes=24).splitlines()) <= 3
