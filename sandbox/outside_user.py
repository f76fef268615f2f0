"""Who the sandbox's programs are outside it when the trainer is root.

bubblewrap run by root maps the sandbox's user to root outside: files and sockets only root may open (`/etc/shadow`,
a 0600 key, a root-only socket on a visible path) would be open to it. So when the trainer is root, the sandbox
joins a user namespace made here, where its user (uid/gid `SANDBOX_UID` inside) is `OUTSIDE_UID` outside
(nobody/nogroup): the kernel then checks every host file against that id. bubblewrap's setup still needs root's
reach (the hidden home's interpreter, a 0700 workspace folder), so the namespace also maps root to root, and our
first program inside, util-linux `setpriv`, drops to the sandbox's user, every capability and the bounding set before
anything of the command's runs; no_new_privs, nosuid mounts and the seccomp filter (no new namespaces) keep it
there. What the sandbox must write (its `writable` folders, its forwarded sockets) is handed to `OUTSIDE_UID`.

Not root: bubblewrap's own user namespace already maps the sandbox's user to the trainer's (unprivileged) uid, and
nothing here is used.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from typing import Iterable

OUTSIDE_UID = 65534
"""The uid and gid the sandbox's user is outside when the trainer is root (Debian's nobody / nogroup)."""
CHOWN_ENTRIES = 100_000
"""Most entries of one writable folder handed to `OUTSIDE_UID` per start (past it the rest stay the trainer's:
the sandbox cannot write them, its own outcome)."""
_NAMESPACE_WAIT_S = 5.0


def trainer_is_root() -> bool:
    """Whether the sandbox must drop root itself (bubblewrap's own mapping would make it root outside)."""
    return os.geteuid() == 0


def user_namespace_fd(sandbox_uid: int) -> int:
    """A user namespace (an open fd for bubblewrap's `--userns`) where root is root, for bubblewrap's setup, and
    `sandbox_uid` is `OUTSIDE_UID`, for everything after `drop_to_sandbox_user`. The caller closes the fd."""
    holder = subprocess.Popen(["unshare", "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + _NAMESPACE_WAIT_S
        while os.readlink(f"/proc/{holder.pid}/ns/user") == own:  # until `unshare` has made its namespace
            if holder.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user failed: {holder.stderr.read().decode(errors='replace').strip()}")
            time.sleep(0.001)
        mapping = f"0 0 1\n{sandbox_uid} {OUTSIDE_UID} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as handle:
                handle.write(mapping)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()
        holder.stderr.close()


def drop_to_sandbox_user(sandbox_uid: int) -> list[str]:
    """The first program inside, before the command (root of the namespace only during bubblewrap's setup)."""
    return ["setpriv", f"--reuid={sandbox_uid}", f"--regid={sandbox_uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def hand_to_sandbox_user(folders: Iterable[str], sockets: Iterable[str]) -> None:
    """Give `OUTSIDE_UID` what the sandbox must write: each writable folder's entries the trainer owns (at most
    `CHOWN_ENTRIES` a folder; never through a link: a symbolic link is changed itself, a file with other hard
    links is left alone) and each forwarded socket."""
    for path in sockets:
        os.chown(path, OUTSIDE_UID, OUTSIDE_UID, follow_symlinks=False)
    for folder in folders:
        _chown_tree(folder)


def _chown_tree(folder: str) -> None:
    """Iterative, by directory fds opened without following links, bounded in entries."""
    trainer = os.geteuid()
    top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    os.fchown(top, OUTSIDE_UID, OUTSIDE_UID)
    pending, budget = [top], CHOWN_ENTRIES
    try:
        while pending and budget > 0:
            directory = pending.pop()
            try:
                with os.scandir(directory) as entries:
                    names = [entry.name for entry in entries]
                for name in names[:budget]:
                    budget -= 1
                    _chown_entry(directory, name, trainer, pending)
            finally:
                os.close(directory)
    finally:
        for directory in pending:
            os.close(directory)


def _chown_entry(directory: int, name: str, trainer: int, pending: list[int]) -> None:
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        try:
            pending.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   dir_fd=directory))
        except OSError:
            return
    # Why only the trainer's own entries with one link: a hard link could name a file outside the folder.
    if info.st_uid == trainer and (stat.S_ISDIR(info.st_mode) or info.st_nlink == 1):
        os.chown(name, OUTSIDE_UID, OUTSIDE_UID, dir_fd=directory, follow_symlinks=False)
