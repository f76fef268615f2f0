"""A terminal in the sandbox: shell tasks the project writes (files, text processing, archives, permissions, a
small build), each checked by a function over the final files. Every command is the model's, so it runs in the
sandbox (`sandbox/`), with the episode's workspace as its only writable folder and working directory.

Actions: a shell command as plain text (run with `bash -c` in the workspace; the observation is its exit
status and the end of its output), or tool calls in JSON (`{"name": "shell", "arguments": {"command": "..."}}`,
`{"name": "submit"}`). `submit` (or the command `submit`) ends the episode; the reward is 1 when the task's check
holds over the workspace then. `evaluate` checks the workspace as it is, submitted or not.

The checks read the workspace from the service's side, so they never follow a link (a command could point
`answer.txt` at a file outside) and read at most `MAX_CHECK_BYTES` of a file. A workspace that grows past
`MAX_WORKSPACE_MB` ends the episode with reward 0 (each file is also capped by the sandbox's file-size limit).

The state an observation shows (`STATE_KEY`) is the workspace: every entry's path, kind, permission bits and
content (a file's size and bytes; a link's target, never followed). A command that only reads (`ls`, `cat`, a
failing `grep`) leaves it as it was, as does a refused action. Its cost is bounded: `MAX_STATE_BYTES` of file
content are read per step at most (past them a file counts by its size and modification time) and
`MAX_STATE_ENTRIES` entries are described (past them only their number counts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from envservice.envs.base import (STATE_KEY, StepResult, Task, TextEnv, content_digest, content_split,
                                   parse_tool_call, passable_as_argument)
from sandbox import SandboxConfig, run_sandboxed

COMMAND_TIMEOUT_S = 10.0
"""Wall-clock seconds one command may take (the sandbox is killed past it)."""
MAX_COMMAND_CHARS = 4_000
"""Longest command an action may give."""
OUTPUT_CHARS = 2_000
"""Characters of a command's output an observation shows (head and tail)."""
MAX_CHECK_BYTES = 1 << 20
"""Most a check reads of one file."""
MAX_WORKSPACE_MB = 64
"""A workspace past this size ends the episode (reward 0)."""
MAX_STATE_ENTRIES = 2_000
"""Entries of the workspace the state key describes one by one (past them, only their number counts)."""
MAX_STATE_BYTES = 4 << 20
"""File content the state key reads per step at most (the tasks' files are a few hundred bytes)."""
COMMAND_SANDBOX = dict(memory_mb=1024, cpu_s=10, processes=32, file_size_mb=16, open_files=128, scratch_mb=32,
                       output_kb=16)
"""What one command may use (the workspace is added as its writable folder)."""
HELP = ("Run one shell command per turn (bash, in your working directory), e.g. `ls -la`, or as JSON "
        '{"name": "shell", "arguments": {"command": "..."}}. When the task is done, answer `submit`.')


class Workspace:
    """Reading a workspace for a check: relative paths only, never through a link, at most MAX_CHECK_BYTES."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, relative: str) -> Path | None:
        """The path, when it is inside the workspace and not a link (else None)."""
        path = self.root / relative
        try:
            inside = path.parent.resolve().is_relative_to(self.root.resolve())
            return path if inside and not path.is_symlink() else None
        except OSError:
            return None

    def text(self, relative: str) -> str | None:
        """The file's text, or None (missing, a link, a folder, unreadable)."""
        path = self.path(relative)
        if path is None or not path.is_file():
            return None
        with open(path, "rb") as handle:
            return handle.read(MAX_CHECK_BYTES).decode("utf-8", "replace")

    def mode(self, relative: str) -> int | None:
        """The file's permission bits, or None."""
        path = self.path(relative)
        return stat.S_IMODE(path.lstat().st_mode) if path is not None and path.exists() else None

    def exists(self, relative: str) -> bool:
        """Whether the path exists (not through a link)."""
        path = self.path(relative)
        return path is not None and path.exists()


@dataclass(frozen=True)
class TerminalTask:
    """One task: what to do, the files it starts with, the check over the final files, and a reference."""

    name: str
    instruction: str
    files: dict[str, str]
    """Relative path -> content, written before the first command."""
    check: Callable[[Workspace], bool]
    """Whether the workspace shows the task done."""
    solution: tuple[str, ...]
    """Commands that do it (the gold test runs them)."""
    modes: dict[str, int] = field(default_factory=dict)
    """Relative path -> permission bits set after the files are written."""
    setup: Callable[[Path], None] | None = None
    """Writes what `files` cannot hold (e.g. an archive) into the fresh workspace, after the files."""


def _lines(text: str | None) -> list[str]:
    return (text or "").strip().splitlines()


_WORDS = "apple\nbanana\napple\ncherry\nbanana\napple\n"
_LOG = "".join(f"2026-11-{day:02d} {level} job{n}\n" for n, (day, level) in
               enumerate([(1, "INFO"), (1, "ERROR"), (2, "WARN"), (3, "ERROR"), (3, "INFO"), (4, "ERROR")]))
_CSV = "name,team,score\nada,red,31\nbob,blue,12\ncyd,red,7\ndee,blue,40\n"

TASKS = (
    TerminalTask("make-file", "Create a file `hello.txt` whose only line is `hello, terminal`.", {},
                 lambda w: _lines(w.text("hello.txt")) == ["hello, terminal"],
                 ("echo 'hello, terminal' > hello.txt",)),
    TerminalTask("count-errors", "`app.log` is a log. Write the number of its ERROR lines (just the number) to "
                 "`errors.txt`.", {"app.log": _LOG},
                 lambda w: _lines(w.text("errors.txt")) == ["3"], ("grep -c ERROR app.log > errors.txt",)),
    TerminalTask("unique-sorted", "Write the distinct lines of `words.txt`, sorted, one per line, to `unique.txt`.",
                 {"words.txt": _WORDS}, lambda w: _lines(w.text("unique.txt")) == ["apple", "banana", "cherry"],
                 ("sort -u words.txt > unique.txt",)),
    TerminalTask("most-common", "Write the most frequent line of `words.txt` to `top.txt`.", {"words.txt": _WORDS},
                 lambda w: _lines(w.text("top.txt")) == ["apple"],
                 ("sort words.txt | uniq -c | sort -rn | head -1 | awk '{print $2}' > top.txt",)),
    TerminalTask("csv-sum", "`scores.csv` has a header. Write the sum of the `score` column for team `red` to "
                 "`red.txt`.", {"scores.csv": _CSV}, lambda w: _lines(w.text("red.txt")) == ["38"],
                 ("awk -F, '$2==\"red\" {s+=$3} END {print s}' scores.csv > red.txt",)),
    TerminalTask("archive", "Pack `notes/` into a gzip-compressed tar archive `notes.tar.gz` (paths starting with "
                 "`notes/`).", {"notes/a.txt": "first\n", "notes/b.txt": "second\n"},
                 lambda w: _archive_holds(w, "notes.tar.gz", {"notes/a.txt": "first\n", "notes/b.txt": "second\n"}),
                 ("tar czf notes.tar.gz notes",)),
    TerminalTask("extract", "`bundle.tar.gz` holds a file `secret/code.txt`. Write its content to `code.txt`.",
                 {}, lambda w: _lines(w.text("code.txt")) == ["7-alpha-42"],
                 ("tar xzf bundle.tar.gz && cp secret/code.txt code.txt",),
                 setup=lambda root: _write_archive(root / "bundle.tar.gz", {"secret/code.txt": b"7-alpha-42\n"})),
    TerminalTask("permissions", "Make `run.sh` executable by its owner and nobody else able to write it (mode 744),"
                 " then write what it prints to `out.txt`.", {"run.sh": "#!/bin/sh\necho ran fine\n"},
                 lambda w: w.mode("run.sh") == 0o744 and _lines(w.text("out.txt")) == ["ran fine"],
                 ("chmod 744 run.sh && ./run.sh > out.txt",), modes={"run.sh": 0o644}),
    TerminalTask("rename", "Rename every `.txt` file in `docs/` to `.md` (same names otherwise).",
                 {"docs/a.txt": "A\n", "docs/b.txt": "B\n", "docs/keep.cfg": "x\n"},
                 lambda w: w.exists("docs/a.md") and w.exists("docs/b.md") and not w.exists("docs/a.txt")
                 and not w.exists("docs/b.txt") and w.exists("docs/keep.cfg"),
                 ("for f in docs/*.txt; do mv \"$f\" \"${f%.txt}.md\"; done",)),
    TerminalTask("build", "`Makefile`'s default target must build `greeting.txt` from `name.txt` (the line "
                 "`Hello, <name>!`). Write the rule, then run make.", {"name.txt": "Ada\n"},
                 lambda w: _lines(w.text("greeting.txt")) == ["Hello, Ada!"] and "greeting.txt" in (w.text("Makefile")
                                                                                                   or ""),
                 ("printf 'greeting.txt: name.txt\\n\\techo \"Hello, $$(cat name.txt)!\" > greeting.txt\\n' > Makefile",
                  "make")),
)
"""The tasks, by name."""


def _archive_holds(workspace: Workspace, relative: str, expected: dict[str, str]) -> bool:
    """Whether a gzip tar archive holds exactly these files. Read as a stream and given up past
    MAX_CHECK_BYTES of content or 100 members: a command may have written a bomb."""
    import tarfile

    path = workspace.path(relative)
    if path is None or not path.is_file():
        return False
    found, read = {}, 0
    try:
        with tarfile.open(path, "r|gz") as archive:
            for count, member in enumerate(archive):
                read += member.size
                if count >= 100 or read > MAX_CHECK_BYTES:
                    return False
                if member.isfile():
                    found[member.name] = archive.extractfile(member).read().decode()
    except (tarfile.TarError, OSError, UnicodeDecodeError, EOFError):
        return False
    return found == expected


def _write_archive(path: Path, members: dict[str, bytes]) -> None:
    """A gzip tar archive at `path` holding `members` (name -> content)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _prepare(task: TerminalTask, root: Path) -> None:
    """Write the task's files, their modes and its `setup` into a fresh workspace."""
    for relative, content in task.files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(content)
    for relative, mode in task.modes.items():
        os.chmod(root / relative, mode)
    if task.setup is not None:
        task.setup(root)


TASKS_BY_NAME = {task.name: task for task in TASKS}


def _splits() -> dict[str, tuple[str, ...]]:
    split: dict[str, list[str]] = {"train": [], "test": []}
    for task in TASKS:
        split[content_split(content_digest("terminal", task.instruction))].append(task.name)
    return {key: tuple(names) for key, names in split.items()}


def run_command(command: str, workspace: Path) -> tuple[int | None, str, str]:
    """(exit status or None past the wall clock, the end of its output, how it ended) of one command."""
    config = SandboxConfig(writable=(str(workspace),), **COMMAND_SANDBOX)
    done = run_sandboxed(["bash", "-c", command], config, wall_s=COMMAND_TIMEOUT_S, cwd=str(workspace))
    output = (done.stdout.text() + done.stderr.text()).strip()
    if len(output) > OUTPUT_CHARS:
        output = f"{output[:OUTPUT_CHARS // 2]}\n[...]\n{output[-OUTPUT_CHARS // 2:]}"
    return done.returncode, output, done.ended


def workspace_state(root: Path) -> str:
    """The digest of what the workspace holds (module docstring): the same files, modes and contents, the same key,
    whatever commands made them."""
    digest, entries, budget = hashlib.sha256(), 0, [MAX_STATE_BYTES]
    for folder, folders, files in os.walk(root):
        folders.sort()  # os.walk visits the folders in this order: the same walk in every process
        for name in sorted(folders + files):
            entries += 1
            if entries > MAX_STATE_ENTRIES:
                continue
            path = os.path.join(folder, name)
            entry = f"{os.path.relpath(path, root)}\0{_entry_state(path, budget)}\0"
            digest.update(entry.encode("utf-8", "surrogateescape"))
    digest.update(f"entries {entries}".encode())
    return digest.hexdigest()[:20]


def _entry_state(path: str, budget: list[int]) -> str:
    """One entry's kind, mode and content, read without following a link; `budget[0]`: the bytes still to read."""
    try:
        info = os.lstat(path)
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        if stat.S_ISLNK(info.st_mode):
            return f"link -> {os.readlink(path)}"
        if stat.S_ISDIR(info.st_mode):
            return f"folder {mode}"
        if not stat.S_ISREG(info.st_mode):
            return f"special {stat.S_IFMT(info.st_mode):o} {mode}"
        if info.st_size > budget[0]:
            return f"file {mode} {info.st_size} modified {info.st_mtime_ns}"
        budget[0] -= info.st_size
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as handle:
            content = hashlib.sha256(handle.read(info.st_size)).hexdigest()
        return f"file {mode} {info.st_size} {content}"
    except OSError as error:  # unreadable (mode 000) or gone: still an entry, named by what stopped the read
        return f"unreadable {error.errno}"


def _size_mb(root: Path) -> float:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total / (1 << 20)


class TerminalEnv(TextEnv):
    """Shell tasks in the sandbox (module docstring)."""

    description = "shell tasks (files, text, archives, permissions, make), each command run in the sandbox"
    splits = _splits()
    max_steps = 20
    max_sessions = 256

    def __init__(self) -> None:
        """An instance without an episode; `reset` starts one."""
        self._task: TerminalTask | None = None
        self._root: Path | None = None
        self._overgrown = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """The task's instruction."""
        return content_digest("terminal", TASKS_BY_NAME[task.name].instruction)

    def reset(self, task: Task) -> tuple[str, dict]:
        """A fresh workspace with the task's files; the observation is the task and its files."""
        self.close()
        self._task, self._overgrown = TASKS_BY_NAME[task.name], False
        self._root = Path(tempfile.mkdtemp(prefix="beyond-terminal-"))
        _prepare(self._task, self._root)
        listing = sorted(str(p.relative_to(self._root)) for p in self._root.rglob("*") if p.is_file())
        files = ", ".join(listing) if listing else "(empty)"
        return (f"Task: {self._task.instruction}\nYour working directory holds: {files}.\n{HELP}",
                {"task": self._task.name, STATE_KEY: workspace_state(self._root)})

    def step(self, action: str) -> StepResult:
        """Run one command, or `submit` (module docstring)."""
        observation, reward, terminated, truncated, info = self._answer(action)
        return observation, reward, terminated, truncated, {**info, STATE_KEY: workspace_state(self._root)}

    def _answer(self, action: str) -> StepResult:
        command = action.strip()
        if command.startswith("{"):
            call = parse_tool_call(command)
            if isinstance(call, str):
                return f"Invalid action: {call}. {HELP}", 0.0, False, False, {}
            name, arguments = call
            if name == "submit":
                command = "submit"
            elif name == "shell" and isinstance(arguments.get("command"), str):
                command = arguments["command"]
            else:
                return f"Invalid action: use the tools shell or submit. {HELP}", 0.0, False, False, {}
        if command == "submit":
            done = self._done()
            return f"Submitted: the task is {'done' if done else 'not done'}.", float(done), True, False, {}
        if not command or len(command) > MAX_COMMAND_CHARS or not passable_as_argument(command):
            return (f"Invalid action: give one command of 1 to {MAX_COMMAND_CHARS} characters of text. {HELP}",
                    0.0, False, False, {})
        status, output, ended = run_command(command, self._root)
        if _size_mb(self._root) > MAX_WORKSPACE_MB:
            self._overgrown = True
            return (f"The working directory grew past {MAX_WORKSPACE_MB} MB: the episode ends.", 0.0, True, False,
                    {"ended": "workspace_limit"})
        said = f"(stopped after {COMMAND_TIMEOUT_S:g} s)" if ended == "wall_clock" else f"(exit {status})"
        return f"{said}\n{output}" if output else said, 0.0, False, False, {"exit": status}

    def evaluate(self) -> tuple[float, bool]:
        """1 and success when the task's check holds over the workspace now."""
        done = self._done()
        return float(done), done

    def close(self) -> None:
        """Remove the workspace."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _done(self) -> bool:
        if self._task is None or self._root is None or self._overgrown:
            return False
        try:
            return bool(self._task.check(Workspace(self._root)))
        except Exception:  # a check that meets a workspace it cannot read: not done
            return False
