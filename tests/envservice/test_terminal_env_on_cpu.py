"""The `terminal` env (envservice/envs/terminal_env.py, issue #52): shell tasks in the real sandbox. Every task's
reference commands pass and doing nothing passes none; an episode is played over a real envservice; hostile
commands are contained and the service stays up."""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import psutil
import pytest

import envservice.envs.terminal_env as terminal_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY, Task
from envservice.envs.terminal_env import TASKS, TerminalEnv
from envservice.server import EnvServiceConfig, create_app


def split_of(name: str) -> str:
    return "train" if name in TerminalEnv.splits["train"] else "test"


@pytest.mark.parametrize("task", TASKS, ids=[task.name for task in TASKS])
def test_each_reference_solution_passes_and_doing_nothing_does_not(task):
    env = TerminalEnv()
    try:
        env.reset(Task(split_of(task.name), 0, task.name, 0))
        assert env.evaluate() == (0.0, False)  # the starting files do not already pass
        for command in task.solution:
            assert env.step(command)[0].startswith("(exit 0)"), command
        observation, reward, terminated, _, _ = env.step("submit")
        assert (observation, reward, terminated) == ("Submitted: the task is done.", 1.0, True)
    finally:
        env.close()


def test_the_splits_are_disjoint_by_instruction():
    train, test = TerminalEnv.splits["train"], TerminalEnv.splits["test"]
    assert sorted(train + test) == sorted(task.name for task in TASKS) and train and test
    fingerprints = {split: {TerminalEnv.task_fingerprint(Task(split, 0, name, 0)) for name in names}
                    for split, names in TerminalEnv.splits.items()}
    assert not fingerprints["train"] & fingerprints["test"]


def test_the_state_key_is_the_workspace_whatever_commands_made_it():
    """GiGPO's anchor (#53): what the next command starts from. Reading commands, a failing one and a refused action
    keep it; the same files made by other commands reach the same key; a mode change or an emptied file changes
    it; a link counts by its target, never followed."""
    env, other = TerminalEnv(), TerminalEnv()
    task = Task(split_of("unique-sorted"), 0, "unique-sorted", 0)
    try:
        start = env.reset(task)[1][STATE_KEY]
        assert other.reset(task)[1][STATE_KEY] == start
        for command in ("ls -la", "cat words.txt", "grep -c kiwi words.txt", json.dumps({"name": "rm"})):
            assert env.step(command)[4][STATE_KEY] == start, command
        made = env.step("sort -u words.txt > unique.txt")[4][STATE_KEY]
        assert made != start
        assert other.step("printf 'apple\\nbanana\\ncherry\\n' > unique.txt")[4][STATE_KEY] == made
        assert other.step("chmod 600 unique.txt")[4][STATE_KEY] != made
        assert env.step(": > unique.txt")[4][STATE_KEY] not in (start, made)
        linked = env.step("ln -s /etc/passwd link")[4][STATE_KEY]
        assert env.step("rm link && ln -s /etc/hostname link")[4][STATE_KEY] != linked
    finally:
        env.close()
        other.close()



def test_a_folder_of_mode_000_does_not_hide_what_it_holds():
    """The walk reads a folder its owner may not read or search (granting itself u+rx meanwhile, putting the mode
    back after): the key changes with what such a folder holds, and the mode stays as the command left it."""
    env = TerminalEnv()
    try:
        env.reset(Task(split_of("make-file"), 0, "make-file", 0))
        first = env.step("mkdir -p box/inner && echo one > box/inner/f && chmod 000 box/inner box")[4][STATE_KEY]
        assert env.step("stat -c %a box")[0] == "(exit 0)\n0"
        second = env.step("chmod 700 box box/inner && echo two > box/inner/f && chmod 000 box/inner box")[4][STATE_KEY]
        assert second != first and env.step("stat -c %a box")[0] == "(exit 0)\n0"
    finally:
        env.close()

@pytest.fixture(scope="module")
def service(serve_app):
    with serve_app(create_app(EnvServiceConfig(env_ids=["terminal"], max_sessions=8))) as url, EnvClient(url) as client:
        yield client


def test_an_episode_over_the_service(service):
    created = service.create("terminal", task_id="count-errors", split=split_of("count-errors"))
    assert "Task: `app.log` is a log." in created.observation and "app.log" in created.observation
    session = created.session_id
    assert service.step(session, "grep -c ERROR app.log").observation == "(exit 0)\n3"
    assert service.step(session, "cat missing.txt").observation.startswith("(exit 1)\ncat: missing.txt")
    call = json.dumps({"name": "shell", "arguments": {"command": "grep -c ERROR app.log > errors.txt"}})
    assert service.step(session, call).observation == "(exit 0)"
    assert "use the tools shell or submit" in service.step(session, json.dumps({"name": "rm"})).observation
    done = service.step(session, json.dumps({"name": "submit"}))
    assert done.terminated and done.reward == 1.0 and service.evaluate(session).success
    service.release(session)


def test_hostile_commands_are_contained_and_the_service_stays_up(service, monkeypatch):
    monkeypatch.setattr(terminal_env, "COMMAND_TIMEOUT_S", 2.0)
    monkeypatch.setenv("TERMINAL_SECRET", "secret-of-the-service")
    outside = Path.cwd() / f".terminal-probe-{uuid.uuid4().hex[:8]}"  # the host, outside the sandbox's /tmp
    session = service.create("terminal", task_id="make-file", split=split_of("make-file")).session_id

    def run(command: str) -> str:
        return service.step(session, command).observation

    assert "secret-of-the-service" not in run("env; cat /proc/1/environ | tr '\\0' '\\n'")
    port = service.base_url.rsplit(":", 1)[1]
    probe = run(f"echo hi > /dev/tcp/127.0.0.1/{port}")  # the service's own port, from inside the sandbox
    assert probe.startswith("(exit 1)") and "Connection refused" in probe
    assert "Read-only file system" in run(f"echo escaped > {outside}") and not outside.exists()
    bomb = run(":(){ :|:& };:; sleep 5")  # the bomb meets the process cap; the wall clock ends it all
    assert bomb.startswith("(stopped after 2 s)") and "fork: retry: Resource temporarily unavailable" in bomb
    assert run("while true; do :; done").startswith("(stopped after 2 s)")
    assert [child for child in psutil.Process().children(recursive=True) if child.name() in ("bash", "bwrap")] == []
    # A link to a file outside is not followed by the check: not done, however it reads.
    run("ln -s /etc/hostname hello.txt")
    assert service.evaluate(session).score == 0.0
    assert service.health().sessions == 1
    service.release(session)

    grown = service.create("terminal", task_id="make-file", split=split_of("make-file")).session_id
    ended = service.step(grown, "for i in 1 2 3 4 5; do head -c 15M /dev/zero > f$i; done")
    assert ended.terminated and ended.reward == 0.0 and "grew past 64 MB" in ended.observation
    service.release(grown)
    assert service.health().sessions == 0


# --- Rewards that cannot be gamed (issue #69) -------------------------------------------------------------------------

def write_file(name: str, content: str) -> str:
    """A command that writes `content` to `name` byte for byte (base64: no quoting to get wrong)."""
    return f"echo {base64.b64encode(content.encode()).decode()} | base64 -d > {name}"


GREETING_RULE = 'greeting.txt: name.txt\n\techo "Hello, $$(cat name.txt)!" > greeting.txt\n'


@pytest.fixture
def workspaces(tmp_path, monkeypatch):
    """The folder where this test's workspaces (and build-check folders) are made: the service runs in this process,
    so the test sees exactly what an episode leaves on disk."""
    folder = tmp_path / "workspaces"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def play(service: EnvClient, task: str, commands: list[str]) -> tuple[str, float]:
    """Create a session, run `commands` (each must be a command that ran), submit; (session, reward)."""
    session = service.create("terminal", task_id=task, split=split_of(task)).session_id
    for command in commands:
        answer = service.step(session, command)
        assert not answer.terminated and answer.observation.startswith("(exit"), (command, answer.observation)
    return session, service.step(session, "submit").reward


@pytest.mark.parametrize("commands", [
    ["echo 'Hello, Ada!' > greeting.txt", "echo '# greeting.txt' > Makefile"],  # the file by hand; make never runs
    [write_file("Makefile", 'greeting.txt: name.txt\n\techo "Hello, Ada!" > greeting.txt\n'), "make"],  # knows Ada
    [write_file("Makefile", 'greeting.txt:\n\techo "Hello, $$(cat name.txt)!" > greeting.txt\n'), "make"],  # no prereq
    [write_file("Makefile", ".PHONY: all\nall:\n\t@true\n"), "echo 'Hello, Ada!' > greeting.txt", "make"],  # phony
], ids=["file-by-hand-makefile-without-rule", "rule-that-knows-only-ada", "rule-without-prerequisite",
        "phony-target-that-builds-nothing"])
def test_the_build_check_runs_the_makefile_on_names_the_agent_never_saw(service, workspaces, commands):
    """Hole: a greeting written by hand and `echo '# greeting.txt' > Makefile` passed (the check only read the
    files). Now the Makefile alone runs in a fresh folder, in the sandbox, for two unseen names; and nothing of the
    check is left on disk after release."""
    session, reward = play(service, "build", commands)
    assert reward == 0.0
    service.release(session)
    assert list(workspaces.iterdir()) == []


def test_a_makefile_that_does_the_work_passes_and_runs_only_in_the_sandbox(service, workspaces):
    """Another honest Makefile (a phony default target over the real rule) passes; the rule, which also tries to
    write on the host, runs in the sandbox: the host file is never made."""
    outside = Path.cwd() / f".terminal-build-probe-{uuid.uuid4().hex[:8]}"
    makefile = f".PHONY: all\nall: greeting.txt\n{GREETING_RULE}\t-touch {outside}\n"
    session, reward = play(service, "build", [write_file("Makefile", makefile), "make"])
    assert reward == 1.0 and not outside.exists()
    service.release(session)
    assert list(workspaces.iterdir()) == []


def test_the_build_check_writes_nothing_through_what_make_left(service, workspaces):
    """The check writes the second name itself, in the service: a rule that turns `name.txt` into a link to a host
    file must not get that file written (the check replaces the link, never follows it)."""
    victim = Path.cwd() / f".terminal-build-victim-{uuid.uuid4().hex[:8]}"
    victim.write_text("untouched\n")
    try:
        makefile = f"{GREETING_RULE}\tln -sf {victim} name.txt\n"
        session, reward = play(service, "build", [write_file("Makefile", makefile), "make"])
        assert victim.read_text() == "untouched\n"
        assert reward == 1.0  # the rule does build the greeting from name.txt; the link it leaves is its own business
        service.release(session)
        assert list(workspaces.iterdir()) == []
    finally:
        victim.unlink()


ODD_TREE = """python -c '
import os
os.mkdir(b"odd-\\xff\\xfe")
os.symlink("/etc", "outside")
os.symlink(".", "loop")
os.makedirs("ro/inner")
os.chmod("ro", 0o555)
os.makedirs("locked/inner")
open("locked/inner/f", "w").close()
os.chmod("locked/inner", 0)
os.chmod("locked", 0)
top = os.open(".", os.O_RDONLY)
for name in ["d"] * 1100:
    os.mkdir(name)
    os.chdir(name)
os.fchdir(top)
os.mkdir("long")
os.chdir("long")
for name in ["e" * 200] * 1100:
    os.mkdir(name)
    os.chdir(name)
open("bottom.txt", "w").write("deep")
os.chmod(".", 0o500)
'"""
"""Folders 1 100 deep with one-letter names (os.walk's recursion ran out in them) and 1 100 deep with 200-letter names
(a path of 220 000 characters, far past PATH_MAX), the deepest read-only; a folder of mode 000 holding one of mode
000; a read-only folder; a name that is not UTF-8; links out and to itself. One command."""


def test_a_deep_odd_tree_is_the_agents_outcome_and_release_removes_it(service, workspaces):
    """Hole: 1 100 nested folders made the step an env_error (os.walk's recursion) and left the workspace on disk
    (rmtree's recursion, errors ignored). Now the walk stops at its depth bound: the episode ends with reward 0 and
    the reason; release removes everything."""
    session = service.create("terminal", task_id="make-file", split=split_of("make-file")).session_id
    answer = service.step(session, ODD_TREE)
    assert answer.terminated and answer.reward == 0.0 and answer.info["ended"] == "workspace_limit"
    assert f"nest more than {terminal_env.MAX_WORKSPACE_DEPTH} deep" in answer.observation
    assert service.evaluate(session).score == 0.0
    service.release(session)
    assert list(workspaces.iterdir()) == []


def test_many_files_end_the_episode_and_the_walk_stays_bounded(service, workspaces):
    """Hole: 100 000 empty files made every later step cost 0.6-0.8 s of service time (the state and size walks
    were unbounded). Now the walk stops past MAX_WORKSPACE_ENTRIES: the episode ends, and a walk of that workspace
    costs a bounded time, not one that grows with the files. (10 000 files, twice the bound, keep the test
    fast on a loaded machine; the report measures 100 000.)"""
    session = service.create("terminal", task_id="make-file", split=split_of("make-file")).session_id
    answer = service.step(session, "mkdir many && cd many && touch $(seq 10000)")
    assert answer.terminated and answer.reward == 0.0 and answer.info["ended"] == "workspace_limit"
    assert f"more than {terminal_env.MAX_WORKSPACE_ENTRIES} entries" in answer.observation
    [root] = workspaces.iterdir()
    assert len(os.listdir(root / "many")) == 10_000  # the command did make them all
    started = time.perf_counter()
    survey = terminal_env.survey_workspace(root)
    assert time.perf_counter() - started < 1.0 and "entries" in survey.past_bounds
    assert service.evaluate(session).score == 0.0
    service.release(session)
    assert list(workspaces.iterdir()) == []


LONG_NAME_BOMB = """python -c '
import tarfile, zlib
header = tarfile.TarInfo("././@LongLink")
header.type, header.size = tarfile.GNUTYPE_LONGNAME, 64 << 20
packer = zlib.compressobj(9, zlib.DEFLATED, 31)
with open("notes.tar.gz", "wb") as out:
    out.write(packer.compress(header.tobuf(tarfile.GNU_FORMAT)))
    for _ in range(64):
        out.write(packer.compress(b"a" * (1 << 20)))
    out.write(packer.compress(bytes(2048)) + packer.flush())
'"""
"""A gzip'd tar of ~64 KB whose first header is a GNU long name of 64 MiB."""


def test_an_archive_bomb_is_refused_without_reading_it(service):
    """Hole: a small gzip'd tar whose first header is a huge GNU long name grew the service by twice that size
    (tarfile reads the whole name before any check). Now the header's size refuses it before its content is read:
    the check allocates next to nothing."""
    session = service.create("terminal", task_id="archive", split=split_of("archive")).session_id
    assert service.step(session, LONG_NAME_BOMB).observation == "(exit 0)"
    size = int(service.step(session, "stat -c %s notes.tar.gz").observation.split("\n")[1])
    assert size < terminal_env.MAX_CHECK_BYTES  # small enough that the check reads it
    tracemalloc.start()
    try:
        score = service.evaluate(session).score
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert score == 0.0 and peak < 8 << 20, peak
    service.release(session)


@pytest.mark.parametrize("commands, reward", [
    (["tar --format=posix -czf notes.tar.gz notes"], 1.0),  # pax headers: still the task's archive
    (["ln -s /etc/passwd notes/c.txt", "tar czf notes.tar.gz notes"], 0.0),  # a link member pointing outside
    (["mkdir -p w/notes && echo wrong > w/notes/a.txt && tar cf n.tar -C w notes/a.txt && tar rf n.tar notes "
      "&& gzip -c n.tar > notes.tar.gz"], 0.0),  # notes/a.txt twice, a wrong copy first
    (["mkdir notes/extra && tar czf notes.tar.gz notes"], 0.0),  # a member that is not the task's
    (["tar czf notes.tar.gz notes && head -c 100 notes.tar.gz > cut && mv cut notes.tar.gz"], 0.0),  # cut short
], ids=["posix-format", "link-member", "duplicate-name", "extra-folder", "truncated"])
def test_the_archive_must_hold_exactly_the_files(service, commands, reward):
    """The archive check reads members by their headers: exactly the task's files with their bytes, folders above
    them only; a link, a second copy of a name or an extra member fails (the first two passed before)."""
    session, got = play(service, "archive", commands)
    assert got == reward
    service.release(session)


@pytest.mark.parametrize("task, commands", [
    ("make-file", ["(echo 'hello, terminal'; head -c 2M /dev/zero | tr '\\0' ' '; echo junk) > hello.txt"]),
    ("rename", ["mkdir docs/a.md docs/b.md && rm docs/a.txt docs/b.txt"]),
    ("make-file", ["mkdir real && echo 'hello, terminal' > real/hello.txt && ln -s real/hello.txt hello.txt"]),
], ids=["answer-followed-by-a-megabyte-of-blanks", "folders-named-like-the-renamed-files", "answer-through-a-link"])
def test_checks_read_whole_regular_files(service, task, commands):
    """A check judges the whole file, never a link to it: an answer followed by 2 MiB of blanks and a line of junk,
    and folders named `a.md`/`b.md` in place of the renamed files, both passed before."""
    session, reward = play(service, task, commands)
    assert reward == 0.0
    service.release(session)


def test_the_extract_task_starts_from_the_same_bytes_at_every_reset(monkeypatch):
    """The bundle is written with gzip's time stamp 0, so two resets a second apart give the same state key."""
    keys = []
    for now in (1_000_000_000.0, 1_000_000_001.0):
        monkeypatch.setattr(time, "time", lambda: now)
        env = TerminalEnv()
        try:
            keys.append(env.reset(Task(split_of("extract"), 0, "extract", 0))[1][STATE_KEY])
        finally:
            env.close()
    assert keys[0] == keys[1]


def test_a_command_cannot_read_another_sessions_workspace_outside_tmp(monkeypatch):
    """Workspaces live in the temporary folder; under the host's /tmp the sandbox's scratch hides them, but with
    TMPDIR elsewhere (here /var/tmp) a command read a sibling session's files before #69 (each command's sandbox
    now hides the folder of every workspace but its own)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(dir="/var/tmp", prefix="beyond-terminal-test-")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    first, second = TerminalEnv(), TerminalEnv()
    try:
        first.reset(TerminalEnv.resolve_task("make-file", "train", 0, {}))
        second.reset(TerminalEnv.resolve_task("make-file", "train", 1, {}))
        first.step("echo the-first-sessions-secret > secret.txt")
        seen = second.step(f"cat {folder}/*/secret.txt; ls {folder} | wc -l; echo mine > mine.txt; cat mine.txt")[0]
        assert "the-first-sessions-secret" not in seen
        assert "mine" in seen  # its own workspace is still writable
    finally:
        first.close()
        second.close()
        shutil.rmtree(folder)
