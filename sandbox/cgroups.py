"""Control groups for one sandbox, where this machine lets us create them: a cap on its processes (the only one
that holds when the trainer is root, whom the kernel exempts from RLIMIT_NPROC) and on its memory (all its
processes together), and a way to kill every process in it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


class SandboxCgroups:
    """The control groups of one sandbox run (none where they cannot be created)."""

    def __init__(self, processes: int, memory_bytes: int) -> None:
        self.folders: list[Path] = []
        """One folder per controller that caps this run."""
        self.capped: set[str] = set()
        """The cap files written (`pids.max`, `memory.max` or `memory.limit_in_bytes`)."""
        name = f"beyond-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for controller, cap, value in _caps(processes, memory_bytes):
            folder = _own_group(controller) / name
            try:
                folder.mkdir()
            except OSError:
                continue
            try:
                (folder / cap).write_text(str(value))
            except OSError:
                folder.rmdir()
                continue
            self.folders.append(folder)
            self.capped.add(cap)

    @property
    def caps_memory(self) -> bool:
        """Whether a memory group holds this run (its memory-backed folders' inodes are then charged to it)."""
        return bool(self.capped & {"memory.max", "memory.limit_in_bytes"})

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to enter every group (before it starts anything)."""
        return [str(folder / "cgroup.procs") for folder in self.folders]

    def kill_all(self) -> None:
        """SIGKILL every process in the groups."""
        for folder in self.folders:
            for pid in _pids(folder):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove the groups (a group is removable once its last process is gone)."""
        deadline = time.monotonic() + timeout_s
        for folder in self.folders:
            while True:
                self.kill_all()
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
        self.folders = []


def _caps(processes: int, memory_bytes: int) -> list[tuple[str, str, int]]:
    """(controller, cap file, value) in the layout this machine has: cgroup v2 (one tree) or v1 (one per
    controller)."""
    if (_ROOT / "cgroup.controllers").exists():
        return [("", "pids.max", processes), ("", "memory.max", memory_bytes)]
    return [("pids", "pids.max", processes), ("memory", "memory.limit_in_bytes", memory_bytes)]


def _own_group(controller: str) -> Path:
    """The folder of this process's own group for `controller` ("" on cgroup v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller == "" and controllers == "") or controller in controllers.split(","):
            return _ROOT / controller / path.lstrip("/") if controller else _ROOT / path.lstrip("/")
    return _ROOT / controller


def _pids(folder: Path) -> list[int]:
    try:
        return [int(line) for line in (folder / "cgroup.procs").read_text().split()]
    except OSError:
        return []
