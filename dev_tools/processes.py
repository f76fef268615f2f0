"""Process checks the tests share (a conftest is not importable by name: several exist)."""

from __future__ import annotations

import psutil


def is_alive(pid: int) -> bool:
    """Running and not a zombie (a container's init may not reap orphans at once)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
