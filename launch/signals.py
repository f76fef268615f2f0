"""Stop exactly what we started: a record of our children's process groups, and the Ctrl-C/SIGTERM policy.

Every child is started with `start_new_session=True`, so its pid is its process-group id and a Ctrl-C in
the terminal reaches only the launcher. The first SIGINT/SIGTERM raises `Interrupted` in the main thread,
which unwinds into the normal, graceful stop (SIGTERM each group, SIGKILL after a grace period). A second
one SIGKILLs every recorded group at once. Processes that left their group (e.g. daemons that call setsid)
are found as recorded descendants and killed only if they are still the same process (pid + start time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil


class Interrupted(KeyboardInterrupt):
    """The first Ctrl-C or SIGTERM: stop gracefully."""


@dataclass
class Child:
    """A process we started, in its own process group."""

    name: str
    process: subprocess.Popen
    descendants: list[psutil.Process] = field(default_factory=list)

    @property
    def pgid(self) -> int:
        return self.process.pid


def _group_alive(pgid: int) -> bool:
    """Whether any process is still in the group."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to the group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class ProcessTracker:
    """The children we started; `stop_all` ends their process groups and nothing else."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.interrupts = 0
        self.on_add = None  # called with the children list after each add (the launcher records them)

    def add(self, name: str, process: subprocess.Popen) -> Child:
        """Record a child started with `start_new_session=True`."""
        child = Child(name, process)
        self.children.append(child)
        if self.on_add:
            self.on_add(self.children)
        return child

    def snapshot_descendants(self) -> None:
        """Remember each child's current descendants (so that ones which left the group can be found)."""
        for child in self.children:
            try:
                child.descendants = psutil.Process(child.process.pid).children(recursive=True)
            except psutil.Error:
                pass

    def stop(self, child: Child, grace_s: float) -> None:
        """SIGTERM the child's group, wait up to `grace_s`, then SIGKILL it and its strays."""
        self.snapshot_descendants()
        _signal_group(child.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(child.pgid) and time.monotonic() < deadline:
            child.process.poll()
            time.sleep(0.1)
        self._kill(child)

    def _kill(self, child: Child) -> None:
        """SIGKILL the group and any recorded descendant that is still the same process."""
        _signal_group(child.pgid, signal.SIGKILL)
        for process in child.descendants:
            try:
                if process.is_running():  # psutil compares the start time: never a reused pid
                    process.kill()
            except psutil.Error:
                pass
        try:
            child.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every recorded child, newest first (training before the services it uses)."""
        for child in reversed(self.children):
            self.stop(child, grace_s)

    def kill_all(self) -> None:
        """SIGKILL every recorded group now (the second Ctrl-C)."""
        for child in reversed(self.children):
            self._kill(child)

    def alive(self) -> list[str]:
        """Names of children whose process group still has members."""
        return [child.name for child in self.children if _group_alive(child.pgid)]


def install_handlers(tracker: ProcessTracker, say=print) -> None:
    """First SIGINT/SIGTERM: raise Interrupted; second: SIGKILL every group we started."""

    def tell(message: str) -> None:
        try:
            say(message)
        except RuntimeError:  # the main thread was writing to the same stream ("reentrant call")
            pass

    def handle(signum, _frame):
        tracker.interrupts += 1
        name = signal.Signals(signum).name
        if tracker.interrupts == 1:
            tell(f"{name}: stopping what the launcher started (press Ctrl-C again to force)")
            raise Interrupted(name)
        tell(f"{name} again: killing every process group the launcher started")
        tracker.kill_all()
        if tracker.interrupts >= 3:
            sys.exit(130)

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
