"""A cap on the files in the sandbox's memory-backed folders where no memory group bounds them.

bubblewrap sizes a tmpfs but cannot cap its inodes, and an empty file costs its folder no size: 200 000 fitted in
a 32 MiB scratch. Each inode is kernel memory; where the sandbox has a memory group they are charged to it (and
the group stops the program), but a trainer that is not root and has no delegated control groups gets none. There
a watcher outside counts the files of each such folder, seen through a sandboxed process's `/proc/PID/root`, and
kills the whole sandbox once one holds more than its cap. It looks every `POLL_S`, so a program may overshoot by
what it makes in that time (tested: stopped under twice the cap)."""

from __future__ import annotations

import os
import threading
from typing import Callable, Mapping

FILES_PER_MIB = 1024
"""Files (inodes) a memory-backed folder may hold per MiB of its size: one per KiB, so that their kernel memory
(an inode with its directory entry is about 0.6-1 KiB) stays about the folder's own size."""
POLL_S = 0.05
"""How often the files are counted."""


def file_caps(folder_mib: Mapping[str, int]) -> dict[str, int]:
    """{folder inside the sandbox: files it may hold} for {folder: its size in MiB}."""
    return {folder: mib * FILES_PER_MIB for folder, mib in folder_mib.items()}


class FileCountWatch(threading.Thread):
    """Counts the files of the sandbox's memory-backed folders until `stop()`, and calls `kill` (once) when one
    holds more than its cap."""

    def __init__(self, outer_pid: int, caps: Mapping[str, int], kill: Callable[[], None]) -> None:
        super().__init__(daemon=True, name=f"sandbox-files-{outer_pid}")
        self._outer_pid = outer_pid
        self._caps = dict(caps)
        self._kill = kill
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def run(self) -> None:
        while not self._stopped.wait(POLL_S):
            inner = _first_child(self._outer_pid)
            if inner is None:
                continue  # bubblewrap has not made the sandbox yet, or it has ended
            if any(_files(inner, folder) > cap for folder, cap in self._caps.items()):
                self._kill()
                return


def _first_child(pid: int) -> int | None:
    """The outer bubblewrap's child: the sandbox's first process, whose root is the sandbox's."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            children = handle.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _files(pid: int, folder: str) -> int:
    """Inodes in use in the sandbox's `folder` (0 when it cannot be seen: the sandbox is ending)."""
    try:
        found = os.statvfs(f"/proc/{pid}/root{folder}")
    except OSError:
        return 0
    return found.f_files - found.f_ffree
