"""What a sandbox allows: its kind, its limits and the variables it is given on purpose."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

SANDBOX_KINDS = ("bwrap", "none")
"""`bwrap`: contained by bubblewrap (the package docstring); `none`: a plain child process (an explicit opt-out
that warns; only the environment allowlist, the output caps and the wall clock still hold)."""

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

LIMIT_FIELDS = ("memory_mb", "cpu_s", "processes", "file_size_mb", "open_files", "scratch_mb", "output_kb")


@dataclass(frozen=True)
class SandboxConfig:
    """How code runs in the sandbox (YAML: e.g. `beyond_agent.agent.sandbox`)."""

    kind: str = "bwrap"
    """One of SANDBOX_KINDS."""
    memory_mb: int = 4096
    """Address space of each process, MiB (an allocation past it fails inside the sandbox)."""
    cpu_s: int = 600
    """CPU seconds of each process (past it the process is killed)."""
    processes: int = 128
    """Processes and threads the sandbox may run at once (a fork past it fails)."""
    file_size_mb: int = 64
    """Largest file a process may write, MiB."""
    open_files: int = 1024
    """Open file descriptors per process."""
    scratch_mb: int = 256
    """Size of the private writable folder (`/tmp`, also `HOME`), MiB."""
    output_kb: int = 64
    """Kept of stdout and of stderr each, KiB: the first and the last half; the rest is counted, not kept."""
    pass_env: tuple[str, ...] = ()
    """Names of the trainer's variables given to the sandbox on purpose (e.g. a key the agent's own tools
    need); a name that is not set is left out. Nothing else of the trainer's environment goes in."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set in the sandbox to these values."""
    writable: tuple[str, ...] = ()
    """Host folders the sandbox may write to, at the same paths (e.g. where an agent writes its own logs); each
    must exist. Everything else of the host is read-only."""
    hidden: tuple[str, ...] = ()
    """Host paths the sandbox must not read (e.g. a package's data holding the answers a model's code is checked
    against, or the folder other sessions' workspaces are in): an empty folder stands in a folder's place, an
    unreadable node in a file's; a `writable` folder inside a hidden one stays reachable. A path that does not exist
    is skipped. Only `kind: bwrap` can hide anything."""

    def __post_init__(self) -> None:
        if self.kind not in SANDBOX_KINDS:
            raise ValueError(f"sandbox.kind={self.kind!r} is not valid; choose one of {', '.join(SANDBOX_KINDS)}")
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.pass_env, str) or not all(isinstance(n, str) for n in self.pass_env or ()):
            raise ValueError(f"sandbox.pass_env must be a list of variable names, got {self.pass_env!r}")
        if isinstance(self.writable, str) or not all(isinstance(p, str) and p.startswith("/")
                                                       for p in self.writable or ()):
            raise ValueError(f"sandbox.writable must be a list of absolute folder paths, got {self.writable!r}")
        if isinstance(self.hidden, str) or not all(isinstance(p, str) and p.startswith("/") for p in self.hidden or ()):
            raise ValueError(f"sandbox.hidden must be a list of absolute paths, got {self.hidden!r}")
        object.__setattr__(self, "pass_env", tuple(self.pass_env or ()))
        object.__setattr__(self, "writable", tuple(self.writable or ()))
        object.__setattr__(self, "hidden", tuple(self.hidden or ()))
        object.__setattr__(self, "env", dict(self.env or {}))
        for name in (*self.pass_env, *self.env):
            if not _VARIABLE_NAME.fullmatch(name):
                raise ValueError(f"sandbox: {name!r} is not a valid environment variable name")
        for name, value in self.env.items():
            if not isinstance(value, str):
                raise ValueError(f"sandbox.env.{name} must be a string, got {value!r}")

    @property
    def contained(self) -> bool:
        """Whether runs are contained by bubblewrap (False for the `none` opt-out)."""
        return self.kind == "bwrap"

    def given_environment(self, parent: Mapping[str, str]) -> dict[str, Any]:
        """The variables given on purpose: `pass_env` names found in `parent`, then `env`."""
        given = {name: parent[name] for name in self.pass_env if name in parent}
        given.update(self.env)
        return given
