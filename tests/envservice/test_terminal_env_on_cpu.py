"""The `terminal` env (envservice/envs/terminal_env.py, issue #52): shell tasks in the real sandbox. Every task's
reference commands pass and doing nothing passes none; an episode is played over a real envservice; hostile
commands are contained and the service stays up."""

from __future__ import annotations

import json
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
