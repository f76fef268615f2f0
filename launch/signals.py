"""Stop exactly what we started: the launcher's record of its children, and the Ctrl-C/SIGTERM policy.

Every child is a `childproc.ChildProcess` (its own process group, so a Ctrl-C in the terminal reaches only
the launcher). The first SIGINT/SIGTERM raises `Interrupted` in the main thread, which unwinds into the
normal, graceful stop (SIGTERM each group, SIGKILL after a grace period, strays that left the group
included). A second one SIGKILLs every recorded group at once.
"""

from __future__ import annotations

import signal
import sys

from envservice.childproc import ChildProcess


class Interrupted(KeyboardInterrupt):
    """The first Ctrl-C or SIGTERM: stop gracefully."""


class ProcessTracker:
    """The children we started; `stop_all` ends their process groups and nothing else."""

    def __init__(self) -> None:
        self.children: list[ChildProcess] = []
        self.interrupts = 0
        self.on_add = None  # called with the children list after each add (the launcher records them)

    def add(self, child: ChildProcess) -> ChildProcess:
        """Record a child (started in its own process group)."""
        self.children.append(child)
        if self.on_add:
            self.on_add(self.children)
        return child

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every recorded child, newest first (training before the services it uses)."""
        for child in reversed(self.children):
            child.stop(grace_s)

    def kill_all(self) -> None:
        """SIGKILL every recorded group now (the second Ctrl-C)."""
        for child in reversed(self.children):
            child.kill()

    def alive(self) -> list[str]:
        """Names of children whose process group still has members."""
        return [child.name for child in self.children if child.group_alive()]


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
