"""Run a long child program with its output in a log file, a short progress line on the console meanwhile, and
the log's end to show when it failed.

Why: a training program's own output (Ray, vLLM, verl, torch warnings) runs to thousands of lines; a user
watching a console wants the stages, the progress and the figures, and the whole output kept for when
something fails.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path


def run_logged(command: list[str], log_path: Path, progress: Callable[[], None] | None = None,
               every_s: float = 30.0, **popen_kwargs) -> int:
    """Run `command` with stdout and stderr in `log_path` (overwritten); call `progress` every `every_s` seconds
    until it exits; its exit status. The child is killed if we stop first, as `subprocess.run` would."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)
        try:
            while True:
                try:
                    return child.wait(timeout=every_s if progress else None)
                except subprocess.TimeoutExpired:
                    progress()
        except BaseException:
            child.kill()
            child.wait()
            raise


def log_tail(log_path: Path, lines: int = 20, read_bytes: int = 65536) -> str:
    """The log's last `lines` lines, read from its last `read_bytes` only (a log of gigabytes is not read whole),
    to print when the child failed."""
    with open(log_path, "rb") as log:
        log.seek(max(0, log.seek(0, 2) - read_bytes))
        return "\n".join(log.read().decode("utf-8", "replace").splitlines()[-lines:])
