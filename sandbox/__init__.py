"""The sandbox: where code we did not write runs (a user's agent run as a command, a model's solution, a shell
command), never with the trainer's environment, memory or lifetime.

One mechanism, in one place, below both envservice and the library (it imports neither):

    from sandbox import SandboxConfig, run_sandboxed

    result = run_sandboxed(["python", "-c", code], SandboxConfig(), wall_s=30)
    result.returncode, result.ended, result.stdout.text()

    peer = start_sandboxed([...], config, wall_s=30, pass_fds=(pipe_end,))   # runs beside the caller
    ...; result = peer.stop()   # or peer.wait()

With `kind: bwrap` (Debian's bubblewrap) a run gets: no network (its own loopback; with `forward`, one port on
it reaches one Unix socket outside, e.g. the episode's gateway); the host's file system read-only (its top-level
folders bound one by one on a root of the sandbox's own, so its mountinfo shows none of the host's mounts under
/proc, /sys, /dev, /run or /tmp), `/sys` empty, and a private writable scratch folder (`/tmp`, also `HOME`) and `/dev/shm`, both size-capped (`/run` and the
hidden home read-only); its own PID namespace, so everything it started dies with it; no way to make namespaces
of its own or reach kernel interfaces it never needs (a seccomp filter, `sandbox/seccomp.py`, and bubblewrap's `--disable-userns` where it makes the namespace:
no nested user or mount namespace, mount, io_uring, keyrings, bpf, perf, userfaultfd, attaching to a process it did
not start, sockets but AF_UNIX / AF_INET / AF_INET6); an environment built from an allowlist plus what the caller
names on purpose, never the trainer's (nor in bubblewrap's own, which it can read as /proc/1/environ); limits on
memory, CPU time, processes, file size and open files (the files in its memory-backed folders are memory
too: their inodes are charged to its memory group where one can be made, and counted otherwise, the sandbox killed
past one file per KiB of the folder's size, `sandbox/inodes.py`); stdout and stderr kept as head and tail with a count of
what was dropped; a wall clock that kills the whole sandbox. Inside, it runs as uid 1000 of a user namespace of its
own, with no capabilities; outside, that user is the trainer's uid, or `nobody` when the trainer is root, so files
and sockets only root may open stay closed (`sandbox/outside_user.py`: the `writable` folders and forwarded sockets
are handed to `nobody` at each start). `kind: none` runs the command as a plain child process
with the same environment allowlist, output caps and wall clock, and warns: nothing else is contained.
"""

from sandbox.config import SANDBOX_KINDS, SandboxConfig
from sandbox.output import CapturedOutput
from sandbox.run import (SandboxedProcess, SandboxResult, SandboxUnavailable, check_sandbox, run_sandboxed,
                         sandbox_path, start_sandboxed)

__all__ = ["SANDBOX_KINDS", "CapturedOutput", "SandboxConfig", "SandboxResult", "SandboxUnavailable",
           "SandboxedProcess", "check_sandbox", "run_sandboxed", "sandbox_path", "start_sandboxed"]
