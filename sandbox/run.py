"""Running one command in the sandbox (the package docstring says what it may and may not do)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from sandbox.cgroups import SandboxCgroups
from sandbox.config import SandboxConfig
from sandbox.inodes import FileCountWatch, file_caps
from sandbox.inside import exit_status
from sandbox.output import CapturedOutput, StreamKeeper
from sandbox.outside_user import drop_to_sandbox_user, hand_to_sandbox_user, trainer_is_root, user_namespace_fd
from sandbox.seccomp import program_fd

SCRATCH = "/tmp"
"""The sandbox's private writable folder (also its HOME and TMPDIR); what is written there is gone after."""
SOCKETS = "/run/beyond"
"""Where forwarded Unix sockets are bound inside the sandbox."""
INSIDE = Path(__file__).with_name("inside.py")
"""The sandbox's first program when ports are forwarded (the process cap, the forwards, then the command); it
imports only the standard library."""
SANDBOX_UID = 1000
"""The user id the sandbox's processes have inside it (their own user namespace)."""

_MIB = 1 << 20
_OWN_PROCESSES = 4
"""Processes of the sandbox's own making (bubblewrap's two, the first program and its forwarding thread),
allowed on top of `SandboxConfig.processes` in its control group."""
_OWN_INSIDE = {False: 1, True: 3}
"""Of those, the ones the process cap inside counts (forwarding or not): bubblewrap's init, and the forwarding
first program with its thread (the first program without forwards becomes the command; the outer bubblewrap is
outside the namespace)."""
_ENTER_GROUPS = ('for procs in $SANDBOX_CGROUP_PROCS; do echo $$ > "$procs" || exit 125; done; '
                 'unset SANDBOX_CGROUP_PROCS; exec "$@"')
"""A shell that enters the sandbox's control groups, then becomes bubblewrap: nothing starts outside them (and the
groups' paths do not stay in bubblewrap's environment, which the sandbox can read as /proc/1/environ)."""
_OUTER_PATH = "/usr/bin:/bin"
"""The PATH of the programs that start the sandbox (`prlimit` and `bubblewrap`, given by absolute paths): the
sandbox reads bubblewrap's environment as /proc/1/environ, so nothing of the trainer's is in it."""
RUN_MB = 1
"""Size of the sandbox's /run (it holds the forwarded sockets' mount points, read-only once they are bound)."""
SHM_MB = 64
"""Size of the sandbox's /dev/shm at most (`scratch_mb` when smaller): shared memory is memory."""
MADE_FRESH = ("/dev", "/proc", "/run", "/sys", SCRATCH)
"""Top-level folders the sandbox makes its own instead of showing the host's (nor the host's mounts under them)."""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bubblewrap missing or refused by the kernel): refuse to start."""


@dataclass
class SandboxResult:
    """How one sandboxed command ended."""

    returncode: int | None
    """Its exit status (a shell's: 128 + N when killed by signal N); None when it was killed (wall clock, stop)."""
    ended: str
    """`exit` (it ended by itself, whatever its status), `wall_clock` (killed at the deadline, with everything it
    started) or `stopped` (its caller ended it early: `SandboxedProcess.stop`)."""
    stdout: CapturedOutput
    """What was kept of its stdout."""
    stderr: CapturedOutput
    """What was kept of its stderr."""
    wall_s: float
    """Seconds from start to end."""


def run_sandboxed(argv: Sequence[str], config: SandboxConfig, *, wall_s: float,
                  environment: Mapping[str, str] | None = None, forward: Mapping[int, str] | None = None,
                  cwd: str | None = None, pass_fds: Sequence[int] = ()) -> SandboxResult:
    """Run `argv` in the sandbox and wait for it (at most `wall_s` seconds, then kill everything it started).

    `environment`: variables this run needs (e.g. the episode's URLs), added to the allowlist and the config's
    own (`SandboxConfig.env`, `pass_env`). `forward`: {port: unix socket path outside}; inside, 127.0.0.1:port
    reaches that socket (bwrap only: with `kind: none` the command shares the host's network). `cwd`: the
    working directory inside (read-only unless it is the scratch folder; default: the scratch folder).
    `pass_fds`: open file descriptors the command gets at the same numbers (e.g. the ends of pipes to a peer
    process started with `start_sandboxed`); nothing else of the caller's is inherited."""
    return start_sandboxed(argv, config, wall_s=wall_s, environment=environment, forward=forward, cwd=cwd,
                           pass_fds=pass_fds).wait()


def start_sandboxed(argv: Sequence[str], config: SandboxConfig, *, wall_s: float,
                    environment: Mapping[str, str] | None = None, forward: Mapping[int, str] | None = None,
                    cwd: str | None = None, pass_fds: Sequence[int] = ()) -> "SandboxedProcess":
    """Start `argv` in the sandbox (as `run_sandboxed` does) and return at once: the caller works beside it (e.g.
    talks to it over the pipes in `pass_fds`) and ends it with `SandboxedProcess.wait()` or `.stop()`; the wall
    clock holds either way."""
    if not argv:
        raise ValueError("run_sandboxed: empty command")
    missing = [path for path in config.writable if not os.path.isdir(path)]
    if missing:
        raise ValueError(f"sandbox.writable: no folder {missing[0]!r} (each must exist)")
    check_sandbox(config)
    env = {**_allowlist(), **config.given_environment(os.environ), **dict(environment or {})}
    if not config.contained:
        resolved = shutil.which(argv[0], path=env["PATH"]) or argv[0]
        return SandboxedProcess([resolved, *argv[1:]], config, wall_s, env, cwd, pass_fds)
    groups = SandboxCgroups(config.processes + _OWN_PROCESSES, config.memory_mb * _MIB)
    fds = _SetupFds()
    try:
        if fds.userns is not None:
            hand_to_sandbox_user(config.writable, dict(forward or {}).values())
        command = _limits_argv(config) + _bwrap_argv(config, env, dict(forward or {}), cwd or SCRATCH, fds)
        command += _first_program(config, forward or {}, dropping_root=fds.userns is not None) + list(argv)
        outer_env = {"PATH": _OUTER_PATH, "SANDBOX_CGROUP_PROCS": " ".join(groups.procs_files)}
        files = {} if groups.caps_memory else file_caps(_memory_backed_mib(config))
        return SandboxedProcess(["/bin/sh", "-c", _ENTER_GROUPS, "sh", *command], config, wall_s, outer_env, None,
                                (*pass_fds, *fds.passed), groups, files)
    except BaseException:
        groups.remove()
        raise
    finally:
        fds.close()  # bubblewrap holds its own copies once started


class _SetupFds:
    """The fds bubblewrap is given: the seccomp filter's program and, when the trainer is root, the user namespace
    where the sandbox's user is unprivileged outside (sandbox/outside_user.py)."""

    def __init__(self) -> None:
        self.seccomp = program_fd()
        try:
            self.userns = user_namespace_fd(SANDBOX_UID) if trainer_is_root() else None
        except BaseException:
            os.close(self.seccomp)
            raise

    @property
    def passed(self) -> tuple[int, ...]:
        return (self.seccomp,) if self.userns is None else (self.seccomp, self.userns)

    def close(self) -> None:
        for fd in self.passed:
            os.close(fd)


def _memory_backed_mib(config: SandboxConfig) -> dict[str, int]:
    """The sandbox's writable memory-backed folders and their sizes, MiB (/run and the home's stand-in are
    read-only)."""
    return {SCRATCH: config.scratch_mb, "/dev/shm": min(config.scratch_mb, SHM_MB)}


def _first_program(config: SandboxConfig, forward: Mapping[int, str], dropping_root: bool) -> list[str]:
    """What runs first inside, before the command: util-linux `prlimit` setting the process cap (a C program:
    ~1 ms), or, when ports are forwarded, our Python first program that also serves the forwards (~130 ms); when
    the trainer is root, `setpriv` first makes everything the sandbox's unprivileged user."""
    processes = config.processes + _OWN_INSIDE[bool(forward)]
    drop = drop_to_sandbox_user(SANDBOX_UID) if dropping_root else []
    if not forward:
        return [*drop, "prlimit", f"--nproc={processes}", "--"]
    command = [*drop, sys.executable, "-I", str(INSIDE), "--nproc", str(processes)]
    for port in forward:
        command += ["--forward", f"{port}={SOCKETS}/{port}.sock"]
    return command + ["--"]


def check_sandbox(config: SandboxConfig) -> None:
    """Refuse (SandboxUnavailable, saying what to do) when `config`'s kind cannot run here; warn once for the
    `none` opt-out."""
    if not config.contained:
        _warn_uncontained()
        return
    problem = _bwrap_problem()
    if problem:
        raise SandboxUnavailable(f"the sandbox (bubblewrap) cannot run here: {problem}. Install it "
                                 "(`bash scripts/install.sh` does: apt-get install bubblewrap), or set "
                                 "sandbox.kind: none to run this code uncontained (not recommended)")


@functools.cache
def _warn_uncontained() -> None:
    warnings.warn("sandbox.kind is none: code we did not write runs as a plain child process, with the host's "
                  "network and files (only its environment, output and wall clock are bounded)", stacklevel=3)


@functools.cache
def _bwrap_problem() -> str:
    """Why bubblewrap cannot run here ('' when a probe sandbox ran)."""
    if shutil.which("bwrap") is None:
        return "no `bwrap` program on PATH"
    try:
        fds = _SetupFds()
    except ImportError as error:
        return f"its seccomp filter cannot be built ({error}; `bash scripts/install.sh` installs pyseccomp)"
    except OSError as error:
        return f"its seccomp filter or user namespace cannot be made ({error})"
    try:
        probe = subprocess.run(_bwrap_argv(SandboxConfig(), {}, {}, SCRATCH, fds) + ["true"],
                               capture_output=True, text=True, timeout=30, pass_fds=fds.passed)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"a probe sandbox failed to start ({error})"
    finally:
        fds.close()
    if probe.returncode != 0:
        return f"a probe sandbox failed ({probe.stderr.strip()[-300:]})"
    return ""


def sandbox_path() -> str:
    """The PATH every sandboxed command runs with (and is looked up on): this interpreter's folder first, so
    that `python` is the interpreter with the trainer's packages (a virtual environment need not be activated),
    then the system's."""
    return os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])


def _allowlist() -> dict[str, str]:
    """The variables every sandbox gets: `sandbox_path()`, and neutral settings."""
    return {"PATH": sandbox_path(), "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}


def _limits_argv(config: SandboxConfig) -> list[str]:
    """util-linux `prlimit` setting the per-process limits before bubblewrap starts (the process count is set
    inside, once the sandbox's user namespace exists, so that it counts the sandbox's processes only)."""
    limits = {"as": config.memory_mb * _MIB, "cpu": config.cpu_s, "fsize": config.file_size_mb * _MIB,
              "nofile": config.open_files, "core": 0}
    return [_program("prlimit"), *(f"--{name}={value}" for name, value in limits.items()), "--"]


def _program(name: str) -> str:
    """The absolute path of a program the sandbox is started with (its starters run with `_OUTER_PATH` only)."""
    return shutil.which(name) or name


def _bwrap_argv(config: SandboxConfig, env: dict[str, str], forward: dict[int, str], cwd: str,
                fds: _SetupFds) -> list[str]:
    """bubblewrap's arguments: every namespace of its own (user and network included) and no way to make more
    (the seccomp filter, and `--disable-userns` where bubblewrap makes the user namespace), the host read-only but
    the `writable` folders, a fresh /tmp and /dev/shm (size-capped, writable by all: their root is the namespace's),
    /run, /sys and the trainer's home hidden (read-only once the sockets and what the run needs are bound in), only
    `env` in the environment."""
    argv = [_program("bwrap"), *_user_argv(fds.userns), "--die-with-parent", "--new-session",
            "--seccomp", str(fds.seccomp), *_root_argv(), "--dev", "/dev", "--proc", "/proc",
            *_memory_backed_argv(config),
            "--size", str(RUN_MB * _MIB), "--tmpfs", "/run", "--size", "4096", "--tmpfs", "/sys",
            "--remount-ro", "/sys"]
    for cover, needed in _covers_and_needed(fds.userns is not None):
        argv += ["--size", "4096", "--tmpfs", cover]
        for path in needed:
            argv += _bind("--ro-bind", path, path)
        argv += ["--remount-ro", cover]
    if cwd != SCRATCH and os.path.commonpath([SCRATCH, os.path.realpath(cwd)]) == SCRATCH:
        argv += _bind("--ro-bind", cwd, cwd)  # a working directory under the host's /tmp, which the scratch hides
    hide, seal = _hiding_argv(config.hidden)
    argv += hide
    for path in config.writable:  # after the hidden paths: a writable folder inside one stays reachable
        argv += _bind("--bind", path, path)
    argv += seal
    for port, outside in forward.items():
        argv += _bind("--bind", outside, f"{SOCKETS}/{port}.sock")
    argv += ["--remount-ro", "/run", "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return argv + ["--"]


def _memory_backed_argv(config: SandboxConfig) -> list[str]:
    """The scratch and /dev/shm: size-capped tmpfs, writable by all (their root is the namespace's)."""
    return [arg for folder, mib in _memory_backed_mib(config).items()
            for arg in ("--size", str(mib * _MIB), "--perms", "1777", "--tmpfs", folder)]


@functools.cache
def _root_argv() -> tuple[str, ...]:
    """The host's top-level folders bound read-only one by one (each with the mounts under it) on the sandbox's own
    root, rather than `/` whole: the host's mounts under the folders it makes fresh (its control groups, its
    /dev/shm and devpts, its /proc) then are not in the sandbox's mountinfo at all. Top-level links (a merged
    /usr's /bin) are made again as links; top-level files (a container's notes about its host) are left out."""
    argv: list[str] = []
    for entry in sorted(os.scandir("/"), key=lambda entry: entry.name):
        if entry.path in MADE_FRESH:
            continue
        if entry.is_symlink():
            argv += ["--symlink", os.readlink(entry.path), entry.path]
        elif entry.is_dir():
            argv += ["--ro-bind", entry.path, entry.path]
    return tuple(argv)


def _bind(kind: str, source: str, dest: str) -> list[str]:
    """A bind mount whose missing parent folders are made searchable by all: bubblewrap makes them 0700 and
    owned by the namespace's root, which the sandbox's user is not when the trainer is root."""
    parents = [str(parent) for parent in reversed(Path(dest).parents) if str(parent) != "/"]
    return [*(arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)), kind, source, dest]


def _user_argv(userns_fd: int | None) -> list[str]:
    """Who the sandbox is: bubblewrap's own user namespace (the sandbox's user is the trainer outside, no
    capabilities), or, when the trainer is root, the namespace of `outside_user` (root during the setup only:
    the first program drops to the sandbox's user, unprivileged outside)."""
    if userns_fd is None:
        return ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID),
                "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
    return ["--userns", str(userns_fd), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try"]


def _hiding_argv(hidden: Sequence[str]) -> tuple[list[str], list[str]]:
    """bubblewrap's arguments that put an empty stand-in over each hidden path (a folder gets an empty tmpfs,
    anything else /dev/null, which cannot be opened there: the host's devices are not usable inside), and those
    that make each tmpfs read-only once the writable folders inside it are bound. A path under the scratch folder
    is hidden already (the host's /tmp is not seen)."""
    hide: list[str] = []
    seal: list[str] = []
    for path in hidden:
        real = os.path.realpath(path)
        if real == SCRATCH or real.startswith(SCRATCH + os.sep):
            continue
        if os.path.isdir(real):
            hide += ["--size", "4096", "--tmpfs", real]
            seal += ["--remount-ro", real]
        elif os.path.lexists(real):
            hide += ["--ro-bind", "/dev/null", real]
    return hide, seal


def _covers_and_needed(dropping_root: bool) -> list[tuple[str, list[str]]]:
    """Folders an empty read-only one stands in for, each with the folders under it a sandboxed Python needs
    (the interpreter's installation, the virtual environment, the working directory, this package's), bound back
    in: the trainer's home (keys, tokens, caches), and, when the sandbox drops root, the topmost folder above
    what it needs that others may not search (the sandbox's user could not pass it, so it loses nothing)."""
    wanted = {os.path.realpath(path) for path in (sys.base_prefix, sys.prefix, os.getcwd(), INSIDE.parent.parent)}
    home = os.path.realpath(os.path.expanduser("~"))
    shown = home != "/" and not any(home == fresh or _is_under(home, fresh) for fresh in MADE_FRESH)
    covers = {home} if shown and os.path.isdir(home) else set()  # a home under /tmp is hidden with the host's /tmp
    if dropping_root:
        covers |= {closed for path in wanted if (closed := _first_closed_folder(path)) is not None}
    covers = {cover for cover in covers if not any(_is_under(cover, other) for other in covers)}
    result = []
    for cover in sorted(covers):
        under = sorted(path for path in wanted if _is_under(path, cover))
        result.append((cover, [path for path in under if not any(_is_under(path, other) for other in under)]))
    return result


def _first_closed_folder(path: str) -> str | None:
    """The topmost folder above `path` that others may not search (mode without o+x), if any."""
    for parent in reversed(Path(path).parents):
        if str(parent) != "/" and not os.stat(parent).st_mode & 0o001:
            return str(parent)
    return None


def _is_under(path: str, folder: str) -> bool:
    """Whether `path` lies strictly inside `folder`."""
    return path != folder and os.path.commonpath([folder, path]) == folder


class SandboxedProcess:
    """One sandboxed command, started in a session of its own with head and tail of its output kept; `wait()` or
    `stop()` ends it: its process group and control groups are killed (whatever it left running goes too) and its
    result returned."""

    def __init__(self, argv: list[str], config: SandboxConfig, wall_s: float, env: dict[str, str],
                 cwd: str | None, pass_fds: Sequence[int] = (), groups: SandboxCgroups | None = None,
                 file_limits: Mapping[str, int] | None = None) -> None:
        self._started = time.monotonic()
        self._deadline = self._started + max(0.0, wall_s)
        self._groups = groups
        self._result: SandboxResult | None = None
        self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
                                         pass_fds=tuple(pass_fds))
        self._keepers = [StreamKeeper(self._process.stdout, config.output_kb * 1024),
                         StreamKeeper(self._process.stderr, config.output_kb * 1024)]
        for keeper in self._keepers:
            keeper.start()
        self._file_watch = None
        if file_limits:  # no memory group holds the sandbox: count its files instead (sandbox/inodes.py)
            self._file_watch = FileCountWatch(self._process.pid, file_limits, self._kill_everything)
            self._file_watch.start()

    def wait(self) -> SandboxResult:
        """Wait until the command ends or its wall clock runs out, then end everything it started."""
        if self._result is not None:
            return self._result
        try:
            self._process.wait(timeout=max(0.0, self._deadline - time.monotonic()))
            return self._finish("exit")
        except subprocess.TimeoutExpired:
            return self._finish("wall_clock")

    def stop(self) -> SandboxResult:
        """End it now (`ended` is `stopped` unless it had already ended by itself)."""
        if self._result is not None:
            return self._result
        return self._finish("exit" if self._process.poll() is not None else "stopped")

    def _kill_everything(self) -> None:
        _kill_group(self._process.pid)
        if self._groups is not None:
            self._groups.kill_all()

    def _finish(self, ended: str) -> SandboxResult:
        try:
            if self._file_watch is not None:
                self._file_watch.stop()
            self._kill_everything()
            self._process.wait()
            for keeper in self._keepers:
                keeper.join()
        finally:
            if self._groups is not None:
                self._groups.remove()
        returncode = exit_status(self._process.returncode) if ended == "exit" else None
        self._result = SandboxResult(returncode, ended, self._keepers[0].captured, self._keepers[1].captured,
                                     time.monotonic() - self._started)
        return self._result


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
