"""A terminal in the sandbox: shell tasks the project writes (files, text processing, archives, permissions, a
small build), each checked by a function over the final files. Every command is the model's, so it runs in the
sandbox (`sandbox/`), with the episode's workspace as its only writable folder and working directory.

Actions: a shell command as plain text (run with `bash -c` in the workspace; the observation is its exit
status and the end of its output), or tool calls in JSON (`{"name": "shell", "arguments": {"command": "..."}}`,
`{"name": "submit"}`). `submit` (or the command `submit`) ends the episode; the reward is 1 when the task's check
holds over the workspace then. `evaluate` checks the workspace as it is, submitted or not.

Every check proves the work, not its look, and never executes anything in the service process:
- The checks read the workspace through file descriptors from its root, one name at a time, never through a link
  anywhere on the path (a command could point `answer.txt`, or a folder above it, at a file outside), only
  regular files, and refuse a file past `MAX_CHECK_BYTES` (no verdict from its first megabyte alone).
- `build` copies only the agent's Makefile into a fresh folder with a `name.txt` holding a name the agent never
  saw, runs `make` there in the sandbox (a command's limits; the fresh folder its only writable one), checks the
  greeting for that name, then changes the name and runs `make` again: the rule must rebuild `greeting.txt` from
  `name.txt`. A greeting written by hand, a Makefile without a rule, or one that knows only `Ada` earns nothing.
- `archive` reads the archive with a bounded reader of its own (`_gunzip_bounded`, `_tar_members`): at most
  `MAX_CHECK_BYTES` of gzip, inflated in bounded steps up to `MAX_ARCHIVE_BYTES`, 512-byte headers parsed one at a
  time; a GNU long name or pax header past `MAX_ARCHIVE_META_BYTES` is refused before it is read, and past
  `MAX_ARCHIVE_HEADERS` headers the archive is refused. It must hold exactly the task's files with their bytes
  (folders only above them; no links, no second copy of a name, no other member).
- `rename` compares the renamed files' content: folders named `a.md` and `b.md` are not the renamed files.

After every command one walk of the workspace (`survey_workspace`: iterative, from file descriptors, so depth and
path length do not matter to it) gives both the state key and the size. Past its bounds (`MAX_WORKSPACE_MB` of
files, `MAX_WORKSPACE_ENTRIES` entries, folders `MAX_WORKSPACE_DEPTH` deep, `MAX_SURVEY_S` seconds) the episode ends
with reward 0, `info["ended"] = "workspace_limit"` and the reason in the observation: whatever the agent built is
its outcome, never an env error. Each file is also capped by the sandbox's file-size limit.

The state an observation shows (`STATE_KEY`) is the workspace: every entry's path, kind, permission bits and
content (a file's size and bytes; a link's target, never followed), and the root's bits. A command that only reads
(`ls`, `cat`, a failing `grep`) leaves it as it was, as does a refused action (the walk runs only after a
command). At most `MAX_STATE_BYTES` of file content are read per step (past them, and for a file of mode 000, a file
counts by its size and modification time). A folder its owner may not read or search is read all the same (u+rx
granted while the walk is in it, its mode put back after), so its bits cannot hide what it holds.

`close` (and the next `reset`) removes the workspace whatever it holds (`remove_tree`: folders thousands deep,
paths past PATH_MAX, folders of mode 000 or read-only, names that are not UTF-8, links), without recursion.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import itertools
import logging
import os
import secrets
import stat
import string
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from envservice.envs.base import (STATE_KEY, Hack, StepResult, Task, TextEnv, content_digest, content_split,
                                   parse_tool_call, passable_as_argument)
from sandbox import SandboxConfig, SandboxUnavailable, run_sandboxed

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 10.0
"""Wall-clock seconds one command may take (the sandbox is killed past it); also each `make` of the build check."""
MAX_COMMAND_CHARS = 4_000
"""Longest command an action may give."""
OUTPUT_CHARS = 2_000
"""Characters of a command's output an observation shows (head and tail)."""
MAX_CHECK_BYTES = 1 << 20
"""Largest file a check reads; a larger one fails the check."""
MAX_WORKSPACE_MB = 64
"""Files of a workspace past this size end the episode (reward 0)."""
MAX_WORKSPACE_ENTRIES = 5_000
"""Entries (files, folders, links) of a workspace past which the episode ends; the tasks need a dozen."""
MAX_WORKSPACE_DEPTH = 64
"""Folders nested deeper than this end the episode."""
MAX_SURVEY_S = 2.0
"""Seconds the walk of a workspace may take; past them the episode ends."""
MAX_STATE_BYTES = 4 << 20
"""File content the state key reads per step at most (the tasks' files are a few hundred bytes)."""
MAX_ARCHIVE_BYTES = 1 << 20
"""Tar stream (inflated) the archive check reads at most; the task's archive is 10 KiB."""
MAX_ARCHIVE_HEADERS = 64
"""Tar headers (long-name and pax ones included) the archive check reads at most."""
MAX_ARCHIVE_META_BYTES = 4_096
"""Largest GNU long name or pax header the archive check reads (PATH_MAX); a larger one refuses the archive."""
COMMAND_SANDBOX = dict(memory_mb=1024, cpu_s=10, processes=32, file_size_mb=16, open_files=128, scratch_mb=32,
                       output_kb=16)
"""What one command may use (the workspace is added as its writable folder)."""
HELP = ("Run one shell command per turn (bash, in your working directory), e.g. `ls -la`, or as JSON "
        '{"name": "shell", "arguments": {"command": "..."}}. When the task is done, answer `submit`.')

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # O_NONBLOCK: a FIFO named like the answer cannot block


class Workspace:
    """Reading a workspace for a check: relative paths opened one name at a time from the root's descriptor, never
    through a link, regular files of at most MAX_CHECK_BYTES only."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def data(self, relative: str) -> bytes | None:
        """The file's bytes, or None (missing, a link on the way, not a regular file, unreadable, too large)."""
        try:
            with _open_parent(self.root, relative) as (folder, name):
                descriptor = os.open(name, _FILE_FLAGS, dir_fd=folder)
                with os.fdopen(descriptor, "rb") as handle:
                    info = os.fstat(handle.fileno())
                    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CHECK_BYTES:
                        return None
                    data = handle.read(MAX_CHECK_BYTES + 1)
                    return data if len(data) <= MAX_CHECK_BYTES else None
        except OSError:
            return None

    def text(self, relative: str) -> str | None:
        """The file's text (`data`, decoded), or None."""
        data = self.data(relative)
        return None if data is None else data.decode("utf-8", "replace")

    def mode(self, relative: str) -> int | None:
        """The entry's permission bits, or None (missing, a link)."""
        info = self._lstat(relative)
        return None if info is None or stat.S_ISLNK(info.st_mode) else stat.S_IMODE(info.st_mode)

    def exists(self, relative: str) -> bool:
        """Whether the path exists and is not a link."""
        info = self._lstat(relative)
        return info is not None and not stat.S_ISLNK(info.st_mode)

    def _lstat(self, relative: str) -> os.stat_result | None:
        try:
            with _open_parent(self.root, relative) as (folder, name):
                return os.stat(name, dir_fd=folder, follow_symlinks=False)
        except OSError:
            return None


@contextlib.contextmanager
def _open_parent(root: Path, relative: str) -> Iterator[tuple[int, str]]:
    """`with _open_parent(root, "a/b/c") as (descriptor of a/b, "c")`: each folder opened with O_NOFOLLOW from the
    one before it, so a link anywhere on the way fails the open (OSError)."""
    *folders, name = relative.split("/")
    descriptor = os.open(root, _FOLDER_FLAGS)
    try:
        for folder in folders:
            inner = os.open(folder, _FOLDER_FLAGS, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
        yield descriptor, name
    finally:
        os.close(descriptor)


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
_NOTES = {"notes/a.txt": "first\n", "notes/b.txt": "second\n"}
_DOCS = {"docs/a.txt": "A\n", "docs/b.txt": "B\n", "docs/keep.cfg": "x\n"}


def _renamed(workspace: Workspace) -> bool:
    """Why by content: a folder named `a.md`, or an empty file, is not the renamed file."""
    return (workspace.text("docs/a.md") == "A\n" and workspace.text("docs/b.md") == "B\n"
            and workspace.text("docs/keep.cfg") == "x\n"
            and not workspace.exists("docs/a.txt") and not workspace.exists("docs/b.txt"))


def _built(workspace: Workspace) -> bool:
    """Why both: the workspace's greeting shows make was run there; `_makefile_greets_any_name` shows it was the
    rule (not a hand-written file) that made it."""
    return _lines(workspace.text("greeting.txt")) == ["Hello, Ada!"] and _makefile_greets_any_name(workspace)


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
                 "`notes/`).", dict(_NOTES),
                 lambda w: _archive_holds(w, "notes.tar.gz", {name: text.encode() for name, text in _NOTES.items()}),
                 ("tar czf notes.tar.gz notes",)),
    TerminalTask("extract", "`bundle.tar.gz` holds a file `secret/code.txt`. Write its content to `code.txt`.",
                 {}, lambda w: _lines(w.text("code.txt")) == ["7-alpha-42"],
                 ("tar xzf bundle.tar.gz && cp secret/code.txt code.txt",),
                 setup=lambda root: _write_archive(root / "bundle.tar.gz", {"secret/code.txt": b"7-alpha-42\n"})),
    TerminalTask("permissions", "Make `run.sh` executable by its owner and nobody else able to write it (mode 744),"
                 " then write what it prints to `out.txt`.", {"run.sh": "#!/bin/sh\necho ran fine\n"},
                 lambda w: w.mode("run.sh") == 0o744 and _lines(w.text("out.txt")) == ["ran fine"],
                 ("chmod 744 run.sh && ./run.sh > out.txt",), modes={"run.sh": 0o644}),
    TerminalTask("rename", "Rename every `.txt` file in `docs/` to `.md` (same names otherwise).", dict(_DOCS),
                 _renamed, ("for f in docs/*.txt; do mv \"$f\" \"${f%.txt}.md\"; done",)),
    TerminalTask("build", "`Makefile`'s default target must build `greeting.txt` from `name.txt` (the line "
                 "`Hello, <name>!`). Write the rule, then run make.", {"name.txt": "Ada\n"}, _built,
                 ("printf 'greeting.txt: name.txt\\n\\techo \"Hello, $$(cat name.txt)!\" > greeting.txt\\n' > Makefile",
                  "make")),
)
"""The tasks, by name."""


# --- The build check: the agent's Makefile, run in the sandbox on a clean copy --------------------------------------

def _makefile_greets_any_name(workspace: Workspace) -> bool:
    """Whether the workspace's Makefile, alone in a fresh folder, builds the greeting for names the agent never saw,
    and rebuilds it when `name.txt` changes. Its rules are the agent's code, so `make` runs in the sandbox."""
    makefile = workspace.data("Makefile")
    if makefile is None:
        return False
    folder = Path(tempfile.mkdtemp(prefix="beyond-terminal-build-check-"))
    try:
        (folder / "Makefile").write_bytes(makefile)  # only the Makefile: no greeting or helper of the workspace's
        first, second = _unseen_name(), _unseen_name()
        # Why two names: a rule that does not depend on name.txt (or a file made once by hand) keeps the first.
        return _make_greets(folder, first) and _make_greets(folder, second)
    finally:
        if not remove_tree(folder):
            logger.error("terminal: could not remove the build check's folder %s", folder)


def _unseen_name() -> str:
    """A fresh name per check (eight letters from `secrets`): a Makefile cannot know it in advance."""
    return "".join(secrets.choice(string.ascii_lowercase) for _ in range(8)).capitalize()


def _make_greets(folder: Path, name: str) -> bool:
    """Write `name` to name.txt (newer than what an earlier run made), run `make` in the sandbox, and whether
    greeting.txt is then exactly `Hello, <name>!`."""
    _backdate_top_level(folder)  # so that the new name.txt is newer than every output, whatever the clock's tick
    if not _write_new_file(folder, "name.txt", f"{name}\n"):
        return False
    done = run_sandboxed(["make"], command_sandbox(folder), wall_s=COMMAND_TIMEOUT_S, cwd=str(folder))
    if done.ended != "exit" or done.returncode != 0:  # why: a failing or endless make built nothing
        return False
    return _lines(Workspace(folder).text("greeting.txt")) == [f"Hello, {name}!"]


def _write_new_file(folder: Path, name: str, text: str) -> bool:
    """Replace `name` in `folder` with a new file holding `text`; False when that entry cannot be replaced (the last
    make left a folder there). An earlier make may have left a link at `name` to a file of the host's: it is
    removed, and the new file is created with O_EXCL, so the service never writes through what make left."""
    path = folder / name
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    return True


def _backdate_top_level(folder: Path) -> None:
    """Set the modification time of every top-level entry but the Makefile an hour back (links themselves, never
    their targets)."""
    hour_ago = time.time_ns() - 3600 * 10**9
    with os.scandir(folder) as entries:
        names = [entry.name for entry in itertools.islice(entries, MAX_WORKSPACE_ENTRIES) if entry.name != "Makefile"]
    for name in names:
        try:
            os.utime(folder / name, ns=(hour_ago, hour_ago), follow_symlinks=False)
        except OSError:
            pass  # an entry the Makefile made unchangeable stays as it is; the check then judges what make does


# --- The archive check: a bounded reader of gzip'd tar archives --------------------------------------------------

_GZIP_WBITS = 16 + zlib.MAX_WBITS
_BLOCK = tarfile.BLOCKSIZE
_LONG_NAME_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE)
_META_TYPES = (*_LONG_NAME_TYPES, *_PAX_TYPES, tarfile.XGLTYPE)
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)


@dataclass(frozen=True)
class _Member:
    name: str
    kind: str
    """`file` or `folder` (the reader refuses any other member)."""
    content: bytes


def _archive_holds(workspace: Workspace, relative: str, expected: dict[str, bytes]) -> bool:
    """Whether a gzip'd tar archive holds exactly these files (name -> bytes): every expected file with its bytes,
    folders only above them, nothing else."""
    compressed = workspace.data(relative)  # at most MAX_CHECK_BYTES of gzip, never through a link
    if compressed is None:
        return False
    try:
        stream = _gunzip_bounded(compressed, MAX_ARCHIVE_BYTES)
        members = None if stream is None else _tar_members(stream)
    except (zlib.error, tarfile.HeaderError, ValueError):  # ValueError: a number too long for int()
        return False
    if members is None:
        return False
    names = [member.name for member in members]
    if len(names) != len(set(names)):  # why: a name twice means the extraction tool decides which copy is kept
        return False
    files = {member.name: member.content for member in members if member.kind == "file"}
    folders = {member.name for member in members if member.kind == "folder"}
    above = {name.rsplit("/", depth)[0] for name in expected for depth in range(1, name.count("/") + 1)}
    return files == expected and folders <= above  # why: an extra file or folder is not the folder packed


def _gunzip_bounded(compressed: bytes, limit: int) -> bytes | None:
    """The inflated bytes of a gzip stream (one member or several in a row), or None past `limit` bytes or when the
    stream is cut short. Each step inflates at most what is left under `limit`: a bomb costs `limit`, not its size."""
    inflated = bytearray()
    inflater = zlib.decompressobj(wbits=_GZIP_WBITS)
    pending = compressed
    while pending:
        if inflater.eof:
            inflater = zlib.decompressobj(wbits=_GZIP_WBITS)  # another gzip member follows (gzip allows a series)
        inflated += inflater.decompress(pending, limit + 1 - len(inflated))
        if len(inflated) > limit:
            return None
        pending = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
    return bytes(inflated) if inflater.eof else None  # eof: the member's length and CRC were checked


def _tar_members(stream: bytes) -> list[_Member] | None:
    """The members of a tar stream, headers read one 512-byte block at a time, or None when the archive is one the
    check refuses: cut short, past MAX_ARCHIVE_HEADERS headers, a long-name or pax header past
    MAX_ARCHIVE_META_BYTES (refused before its content is read), or a member that is neither a file nor a folder.
    Raises tarfile.HeaderError for a malformed header."""
    members: list[_Member] = []
    offset, override = 0, {}  # override: what a long-name or pax header says about the next member
    for _ in range(MAX_ARCHIVE_HEADERS):
        header = stream[offset:offset + _BLOCK]
        if len(header) < _BLOCK:
            return None  # no end-of-archive block: cut short
        if header == bytes(_BLOCK):
            return members
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        offset += _BLOCK
        if info.type in _META_TYPES:
            if not 0 <= info.size <= MAX_ARCHIVE_META_BYTES or offset + info.size > len(stream):
                return None
            said = _meta_header(info, stream[offset:offset + info.size])
            if said is None:
                return None
            override.update(said)
            offset += _padded(info.size)
            continue
        name, size = override.pop("path", info.name), override.pop("size", info.size)
        override.clear()
        if not 0 <= size <= len(stream) - offset:
            return None  # its data would run past the end of the stream
        member = _member(info, name, stream[offset:offset + size])
        if member is None:
            return None
        members.append(member)
        offset += _padded(size)
    return None  # past MAX_ARCHIVE_HEADERS


def _member(info: tarfile.TarInfo, name: str, data: bytes) -> _Member | None:
    """A file or folder member, or None for any other (a link, device, FIFO, sparse file, a folder with data): the
    task packs none, and a link would point an extraction elsewhere."""
    if info.type in _FILE_TYPES:
        return _Member(name, "file", data)
    if info.type == tarfile.DIRTYPE and not data:
        return _Member(name.rstrip("/"), "folder", b"")
    return None


def _meta_header(info: tarfile.TarInfo, content: bytes) -> dict | None:
    """What a long-name or pax header says of the next member ({"path": ..., "size": ...}), or None when the check
    refuses it (a malformed pax record, a sparse-file key, a global header that renames or resizes)."""
    if info.type == tarfile.GNUTYPE_LONGLINK:
        return {}  # a link's target: the member it belongs to is refused anyway
    if info.type == tarfile.GNUTYPE_LONGNAME:
        return {"path": content.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}
    records = _pax_records(content)
    if records is None or any(key.startswith("GNU.sparse") for key in records):
        return None
    said: dict = {}
    if "path" in records:
        said["path"] = records["path"]
    if "size" in records:
        if not (records["size"].isascii() and records["size"].isdigit()):
            return None
        said["size"] = int(records["size"])
    if info.type == tarfile.XGLTYPE:
        return None if said else {}  # a global header that renames or resizes every member: not a plain archive
    return said


def _pax_records(content: bytes) -> dict[str, str] | None:
    """The `length key=value\\n` records of a pax header, or None when one is malformed."""
    records, position = {}, 0
    while position < len(content):
        space = content.find(b" ", position)
        length = content[position:space]
        if space < 0 or not length.isdigit():
            return None
        end = position + int(length)
        if end <= space + 1 or end > len(content) or content[end - 1:end] != b"\n":
            return None
        key, equals, value = content[space + 1:end - 1].partition(b"=")
        if not equals:
            return None
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position = end
    return records


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _write_archive(path: Path, members: dict[str, bytes]) -> None:
    """A gzip tar archive at `path` holding `members` (name -> content), byte for byte the same at every reset
    (gzip's time stamp 0), so the starting state key is too."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    path.write_bytes(gzip.compress(packed.getvalue(), mtime=0))


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


def command_sandbox(workspace: Path) -> SandboxConfig:
    """The sandbox of a command run in `workspace`: the workspace its only writable folder, and the folder holding
    every session's workspace hidden, so that no command reads another session's files (under the host's /tmp, the
    default, the sandbox's own scratch hides them already)."""
    return SandboxConfig(writable=(str(workspace),), hidden=(str(workspace.parent),), **COMMAND_SANDBOX)


def run_command(command: str, workspace: Path) -> tuple[int | None, str, str]:
    """(exit status or None past the wall clock, the end of its output, how it ended) of one command."""
    done = run_sandboxed(["bash", "-c", command], command_sandbox(workspace), wall_s=COMMAND_TIMEOUT_S,
                         cwd=str(workspace))
    output = (done.stdout.text() + done.stderr.text()).strip()
    if len(output) > OUTPUT_CHARS:
        output = f"{output[:OUTPUT_CHARS // 2]}\n[...]\n{output[-OUTPUT_CHARS // 2:]}"
    return done.returncode, output, done.ended


# --- One walk per step: the state key and the size, bounded -------------------------------------------------------

@dataclass(frozen=True)
class Survey:
    """What one walk of a workspace found."""

    state: str
    """The state key (module docstring); past the bounds, the digest of what was walked and why it stopped."""
    files: tuple[str, ...]
    """Relative paths of the regular files walked (the reset's listing)."""
    past_bounds: str | None
    """Why the walk stopped early (a sentence), or None when it saw the whole workspace within the bounds."""


class _PastBounds(Exception):
    """The workspace is past one of the walk's bounds (the message says which)."""


@dataclass
class _Folder:
    """A folder the walk is in: its descriptor, its path from the root, the names still to visit, its depth, and its
    own mode when the walk granted itself read and search on it (restored when the walk leaves it)."""

    descriptor: int
    relative: str
    names: Iterator[str]
    depth: int
    restore_mode: int | None


def survey_workspace(root: Path) -> Survey:
    """Walk the workspace once (module docstring): the same files, modes and contents give the same key, whatever
    commands made them. Never raises for what a command made: an unreadable root or a walk past its bounds is a
    `past_bounds` sentence."""
    walk = _Walk(time.monotonic() + MAX_SURVEY_S)
    past_bounds = None
    try:
        walk.run(root)
    except _PastBounds as reason:
        past_bounds = str(reason)
    except OSError as error:  # e.g. a folder it may not even chmod: the agent's doing, so the agent's outcome
        past_bounds = f"the walk of it failed ({error.strerror or error})"
    walk.digest.update(f"entries {walk.entries} {past_bounds}".encode())
    return Survey(walk.digest.hexdigest()[:20], tuple(walk.files), past_bounds)


class _Walk:
    """The iterative walk behind `survey_workspace`: file descriptors and single names only (no recursion, no long
    paths), entries sorted by name, every bound checked as it goes."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.digest = deadline, hashlib.sha256()
        self.entries, self.size, self.budget = 0, 0, MAX_STATE_BYTES
        self.files: list[str] = []

    def run(self, root: Path) -> None:
        """Walk from `root`, depth first; every folder it opened is closed (and its mode restored) however it ends."""
        info = os.stat(root, follow_symlinks=False)
        self.digest.update(f"root {stat.S_IMODE(info.st_mode):o}\0".encode())
        stack = [self._enter(None, str(root), "", 0, info)]
        try:
            while stack:
                folder = stack[-1]
                name = next(folder.names, None)
                if name is None:
                    self._leave(stack.pop())
                    continue
                relative = folder.relative + name
                info = os.stat(name, dir_fd=folder.descriptor, follow_symlinks=False)
                self._describe(folder.descriptor, name, relative, info)
                if stat.S_ISDIR(info.st_mode):
                    if folder.depth + 1 > MAX_WORKSPACE_DEPTH:
                        raise _PastBounds(f"its folders nest more than {MAX_WORKSPACE_DEPTH} deep")
                    stack.append(self._enter(folder.descriptor, name, relative + "/", folder.depth + 1, info))
        finally:
            for folder in reversed(stack):
                self._leave(folder)

    def _enter(self, parent: int | None, name: str, relative: str, depth: int, info: os.stat_result) -> _Folder:
        """Open a folder (`name` in `parent`; the root: its path and None) and read its names (counted against the
        bounds). A folder its owner may not read or search (mode 000, 600) is read all the same, its mode granted
        u+rx meanwhile: bits cannot hide what it holds."""
        mode, restore = stat.S_IMODE(info.st_mode), None
        if mode & 0o500 != 0o500:
            # no command runs during the walk, so `name` is still the folder lstat saw: chmod cannot reach a link
            os.chmod(name, mode | 0o500, dir_fd=parent)
            restore = mode
        try:
            descriptor = os.open(name, _FOLDER_FLAGS, dir_fd=parent)
        except OSError:
            if restore is not None:
                os.chmod(name, restore, dir_fd=parent)
            raise
        folder = _Folder(descriptor, relative, iter(()), depth, restore)
        try:
            folder.names = iter(sorted(self._names(descriptor)))
        except BaseException:
            self._leave(folder)
            raise
        return folder

    def _names(self, descriptor: int) -> list[str]:
        names = []
        with os.scandir(descriptor) as entries:
            for entry in entries:
                self.entries += 1
                if self.entries > MAX_WORKSPACE_ENTRIES:
                    raise _PastBounds(f"it holds more than {MAX_WORKSPACE_ENTRIES} entries")
                self._check_clock()
                names.append(entry.name)
        return names

    def _leave(self, folder: _Folder) -> None:
        try:
            if folder.restore_mode is not None:
                os.fchmod(folder.descriptor, folder.restore_mode)
        finally:
            os.close(folder.descriptor)

    def _check_clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise _PastBounds(f"walking it took more than {MAX_SURVEY_S:g} s")

    def _describe(self, folder: int, name: str, relative: str, info: os.stat_result) -> None:
        """Add one entry (its path, kind, mode and content) to the digest and its size to the total."""
        self._check_clock()
        if stat.S_ISREG(info.st_mode):
            self.size += info.st_size
            if self.size > MAX_WORKSPACE_MB << 20:
                raise _PastBounds(f"it grew past {MAX_WORKSPACE_MB} MB")
            self.files.append(relative)
        entry = f"{relative}\0{self._entry_state(folder, name, info)}\0"
        self.digest.update(entry.encode("utf-8", "surrogateescape"))

    def _entry_state(self, folder: int, name: str, info: os.stat_result) -> str:
        """One entry's kind, mode and content, read without following a link; file content while the budget lasts."""
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        if stat.S_ISLNK(info.st_mode):
            return f"link -> {os.readlink(name, dir_fd=folder)}"
        if stat.S_ISDIR(info.st_mode):
            return f"folder {mode}"
        if not stat.S_ISREG(info.st_mode):
            return f"special {stat.S_IFMT(info.st_mode):o} {mode}"
        by_size = f"file {mode} {info.st_size} modified {info.st_mtime_ns}"
        if info.st_size > self.budget:
            return by_size
        self.budget -= info.st_size
        try:
            descriptor = os.open(name, _FILE_FLAGS, dir_fd=folder)
        except PermissionError:  # a file of mode 000: counted by its size and time, as past the budget
            return by_size
        try:
            content = hashlib.sha256(os.read(descriptor, info.st_size)).hexdigest()
        finally:
            os.close(descriptor)
        return f"file {mode} {info.st_size} {content}"


# --- Removing a workspace, whatever it holds -----------------------------------------------------------------------

_REMOVABLE_ERRORS = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def remove_tree(root: Path) -> bool:
    """Remove `root` and everything under it; whether it is gone. No recursion and no path longer than one name:
    each folder under the root is emptied by unlinking its files and lifting its subfolders up into the root (with
    fresh names), then removed; passes repeat until the root is empty. A folder is made u+rwx first (mode 000 or
    read-only folders); links are removed, never followed."""
    try:
        if stat.S_ISDIR(os.stat(root, follow_symlinks=False).st_mode):
            os.chmod(root, 0o700)  # a command may have made its working directory mode 000
        descriptor = os.open(root, _FOLDER_FLAGS)
    except FileNotFoundError:
        return True
    except OSError as error:
        logger.error("terminal: cannot open %s to remove it: %s", root, error)
        return False
    try:
        emptied = _empty_folder(descriptor)
    finally:
        os.close(descriptor)
    try:
        os.rmdir(root)
    except OSError as error:
        logger.error("terminal: cannot remove %s (%s)", root, error if emptied else "entries left in it")
        return False
    return True


def _empty_folder(root: int) -> bool:
    """Empty the folder open as `root` (see `remove_tree`); False when a pass made no progress."""
    fresh_names = (f".removing-{secrets.token_hex(8)}-{number}" for number in itertools.count())
    while True:
        with os.scandir(root) as entries:
            names = [entry.name for entry in entries]
        if not names:
            return True
        progress = 0
        for name in names:
            try:
                _remove_or_lift(root, name, fresh_names)
                progress += 1
            except FileNotFoundError:
                progress += 1
            except OSError as error:
                logger.warning("terminal: removing %r: %s", name, error)
        if not progress:
            return False


def _remove_or_lift(root: int, name: str, fresh_names: Iterator[str]) -> None:
    """Remove the entry `name` of the root; a non-empty folder is emptied one level (files unlinked, subfolders
    lifted into the root) and then removed."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=root, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=root)
        return
    os.chmod(name, 0o700, dir_fd=root)  # no command runs during a removal: `name` is still the folder lstat saw
    try:
        os.rmdir(name, dir_fd=root)
        return
    except OSError as error:
        if error.errno != errno.ENOTEMPTY:
            raise
    folder = os.open(name, _FOLDER_FLAGS, dir_fd=root)
    try:
        with os.scandir(folder) as entries:
            children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for child, is_folder in children:
            if is_folder:
                os.chmod(child, 0o700, dir_fd=folder)  # moving a folder rewrites its `..`: it must be writable
                _move_to_root(folder, child, root, fresh_names)
            else:
                os.unlink(child, dir_fd=folder)
    finally:
        os.close(folder)
    os.rmdir(name, dir_fd=root)


def _move_to_root(folder: int, name: str, root: int, fresh_names: Iterator[str]) -> None:
    """Rename `name` in `folder` to a fresh name in the root (another fresh name if that one is taken)."""
    for _ in range(100):
        try:
            os.rename(name, next(fresh_names), src_dir_fd=folder, dst_dir_fd=root)
            return
        except OSError as error:
            if error.errno not in _REMOVABLE_ERRORS:
                raise
    raise OSError(errno.EEXIST, f"no free name in the root to lift {name!r} into")


# --- The env ---------------------------------------------------------------------------------------------------------

class TerminalEnv(TextEnv):
    """Shell tasks in the sandbox (module docstring)."""

    description = "shell tasks (files, text, archives, permissions, make), each command run in the sandbox"
    splits = _splits()
    max_steps = 20
    max_sessions = 256
    action_forms = ("shell", "tool_call")
    hacks = (
        Hack("make_without_rule", "write the output by hand and a Makefile that only names it",
             (("printf 'Hello, Ada!\\n' > greeting.txt && echo '# greeting.txt' > Makefile", "submit"),),
             tasks=("build",), forms=("shell",)),
        Hack("rule_for_the_seen_name", "a Makefile rule that writes the greeting for the one name it saw",
             (("printf 'greeting.txt: name.txt\\n\\techo \"Hello, Ada!\" > greeting.txt\\n' > Makefile && make",
               "submit"),), tasks=("build",), forms=("shell",)),
        Hack("archive_bomb", "a gzip'd tar of a few hundred KB whose first header is a 160 MiB long name",
             (("python3 -c \"import io, tarfile\ninfo = tarfile.TarInfo('n' * (160 << 20))\n"
               "with tarfile.open('notes.tar.gz', 'w:gz', format=tarfile.GNU_FORMAT) as archive:\n"
               "    archive.addfile(info, io.BytesIO())\" && ls -la notes.tar.gz", "submit"),),
             tasks=("archive",), forms=("shell",)),
    )
    """Attempts at this env's own checks, besides the hack library (`python -m envservice.check --hacks terminal`)."""

    def __init__(self) -> None:
        """An instance without an episode; `reset` starts one."""
        self._task: TerminalTask | None = None
        self._root: Path | None = None
        self._survey: Survey | None = None

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """The task's instruction."""
        return content_digest("terminal", TASKS_BY_NAME[task.name].instruction)

    def reset(self, task: Task) -> tuple[str, dict]:
        """A fresh workspace with the task's files; the observation is the task and its files."""
        self.close()
        self._task = TASKS_BY_NAME[task.name]
        self._root = Path(tempfile.mkdtemp(prefix="beyond-terminal-"))
        _prepare(self._task, self._root)
        self._survey = survey_workspace(self._root)
        files = ", ".join(sorted(self._survey.files)) or "(empty)"
        return (f"Task: {self._task.instruction}\nYour working directory holds: {files}.\n{HELP}",
                {"task": self._task.name, STATE_KEY: self._survey.state})

    def step(self, action: str) -> StepResult:
        """Run one command, or `submit` (module docstring)."""
        observation, reward, terminated, truncated, info = self._answer(action)
        return observation, reward, terminated, truncated, {**info, STATE_KEY: self._survey.state}

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
        self._survey = survey_workspace(self._root)  # only a command changes the workspace: the one walk per step
        if self._survey.past_bounds is not None:
            return (f"The working directory went past the episode's bounds ({self._survey.past_bounds}): the episode "
                    "ends.", 0.0, True, False, {"ended": "workspace_limit", "exit": status})
        said = f"(stopped after {COMMAND_TIMEOUT_S:g} s)" if ended == "wall_clock" else f"(exit {status})"
        return f"{said}\n{output}" if output else said, 0.0, False, False, {"exit": status}

    def gold_actions(self) -> list[str]:
        """The task's reference commands, then `submit`."""
        return [*self._task.solution, "submit"]

    def evaluate(self) -> tuple[float, bool]:
        """1 and success when the task's check holds over the workspace now."""
        done = self._done()
        return float(done), done

    def close(self) -> None:
        """Remove the workspace (`remove_tree`: whatever it holds)."""
        if self._root is not None:
            if not remove_tree(self._root):
                logger.error("terminal: the workspace %s could not be removed", self._root)
            self._root = None

    def _done(self) -> bool:
        if self._task is None or self._root is None or self._survey is None or self._survey.past_bounds:
            return False  # why: a workspace past the bounds scores 0 whatever it holds
        try:
            return bool(self._task.check(Workspace(self._root)))
        except SandboxUnavailable:
            raise  # the service's fault, not the agent's: say so instead of scoring 0
        except Exception:  # a check that meets a workspace it cannot read: not done
            logger.debug("terminal: the %s check failed on its workspace", self._task.name, exc_info=True)
            return False
