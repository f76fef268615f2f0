"""`envservice.check_env`: passes on every registered environment, fails with a useful message on broken ones."""

from __future__ import annotations

import pytest

import envservice
from envservice import registry
from envservice.check import EnvCheckError
from envservice.errors import EnvServiceError

BUILTIN_ENVS = ["babyai", "frozenlake", "textcraft"]


def test_builtin_envs_are_registered() -> None:
    assert set(BUILTIN_ENVS) <= set(registry.registered_ids())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_id", BUILTIN_ENVS)
def test_check_env_passes_on_registered_env(env_id: str) -> None:
    clauses = envservice.check_env(env_id)
    assert {"reset_deterministic", "step_types", "step_after_end_refused", "release_closes"} <= set(clauses)


def test_check_env_passes_on_test_env(test_envs) -> None:
    assert "evaluate" in envservice.check_env("counting")


def test_check_env_fails_on_nondeterministic_reset(test_envs) -> None:
    with pytest.raises(EnvCheckError) as failure:
        envservice.check_env("nondeterministic")
    message = str(failure.value)
    assert message.startswith("check_env[reset_deterministic]: saw observations differ")
    assert "'reset number" in message and "expected the same observation" in message
    assert "likely cause: reset ignores task.seed" in message


def test_check_env_fails_on_wrong_step_types(test_envs) -> None:
    with pytest.raises(EnvCheckError, match=r"check_env\[step_types\]: saw \(str, float, int, bool, dict\); "
                                            r"expected \(str, finite float, bool, bool, dict\); likely cause: numpy"):
        envservice.check_env("wrongtypes")


def test_unknown_env_id_lists_registered_ids() -> None:
    with pytest.raises(EnvServiceError) as failure:
        envservice.check_env("chess")
    assert failure.value.code.value == "unknown_env" and failure.value.status == 404
    assert set(BUILTIN_ENVS) <= set(failure.value.valid_choices)


def test_register_rejects_duplicates_and_bad_limits(test_envs) -> None:
    with pytest.raises(ValueError, match="'counting' is already registered"):
        registry.register("counting", test_envs["counting"], max_steps=5, max_sessions=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        registry.register("other", test_envs["counting"], max_steps=0, max_sessions=1)


# --- garbage_actions: hostile actions get a bounded observation, never an exception ---

from typing import Any  # noqa: E402

from envservice.check import GARBAGE_ACTIONS, check_garbage_actions  # noqa: E402
from envservice.envs.base import StepResult, Task, TextEnv, clip_text  # noqa: E402

OFFLINE_ENVS = ["alfworld", "babyai", "frozenlake", "sciworld", "search", "textcraft", "textworld"]
"""Registered envs that run here without downloaded data (appworld needs its own venv and data)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env_id", OFFLINE_ENVS)
def test_garbage_actions_get_bounded_observations(env_id: str, tmp_path_factory, monkeypatch) -> None:
    if env_id == "textworld":  # compiled games go where test_textworld_on_cpu.py puts them, not the user's cache
        monkeypatch.setenv("BEYOND_AGENT_TEXTWORLD_CACHE", str(tmp_path_factory.getbasetemp() / "textworld-cache"))
    cls = registry.get(env_id).env_class()
    check_garbage_actions(cls, cls.resolve_task(0, next(iter(cls.splits)), 0, {}))


class _GarbageProneEnv(TextEnv):
    """Answers unknown actions, but in one of two broken ways (set by the subclasses)."""

    description = "test env: mishandles hostile actions"
    splits = {"train": ["one"]}
    params = {}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return "ready", {}

    def evaluate(self) -> tuple[float, bool]:
        return 0.0, False


class _EchoingEnv(_GarbageProneEnv):
    def step(self, action: str) -> StepResult:
        return f"Unknown action {action!r}.", 0.0, False, False, {}


class _CountParsingEnv(_GarbageProneEnv):
    """Parses 'go N' with int(): Python refuses to convert a number of more than 4300 digits."""

    def step(self, action: str) -> StepResult:
        words = action.split()
        if len(words) == 2 and words[0] == "go" and words[1].isdigit():
            return f"You went {int(words[1]) % 7} steps.", 0.0, False, False, {}
        return f"Unknown action {clip_text(action)!r}.", 0.0, False, False, {}


def _task_of(cls: type[TextEnv]) -> Task:
    return cls.resolve_task(0, "train", 0, {})


def test_garbage_actions_catch_an_unbounded_echo() -> None:
    with pytest.raises(EnvCheckError) as failure:
        check_garbage_actions(_EchoingEnv, _task_of(_EchoingEnv))
    message = str(failure.value)
    assert message.startswith("check_env[garbage_actions]: saw a 100018-char observation for 100000 chars of junk")
    assert "likely cause: the env echoes the action unbounded" in message and len(message) < 1000


def test_garbage_actions_catch_a_step_that_raises() -> None:
    with pytest.raises(EnvCheckError) as failure:
        check_garbage_actions(_CountParsingEnv, _task_of(_CountParsingEnv))
    message = str(failure.value)
    assert message.startswith("check_env[garbage_actions]: saw ValueError: Exceeds the limit (4300 digits)")
    assert "for a 5000-digit number after 'go' (5003 chars: 'go 999" in message
    assert "expected an observation saying the action is not understood" in message and len(message) < 1500
    assert isinstance(failure.value.__cause__, ValueError)


def test_check_env_runs_garbage_actions() -> None:
    registry.register("garbageprone", _EchoingEnv, max_steps=5, max_sessions=1)
    try:
        with pytest.raises(EnvCheckError, match=r"^check_env\[garbage_actions\]"):
            envservice.check_env("garbageprone")
    finally:
        registry.unregister("garbageprone")


def test_garbage_actions_cover_the_hostile_kinds() -> None:
    actions = dict(GARBAGE_ACTIONS)
    assert "" in actions.values() and any(len(a) >= 100_000 for a in actions.values())
    assert any("9" * 5000 in a for a in actions.values()) and "1e400" in actions.values()
    assert any("\x00" in a for a in actions.values()) and any("\ud800" in a for a in actions.values())
    assert "{0.__class__}" in actions["format-string injection"] and "%s%n" in actions["printf injection"]


def test_textworld_command_never_gives_jericho_a_nul_a_surrogate_or_a_split_character() -> None:
    textworld_env = pytest.importorskip("envservice.envs.textworld_env")
    assert textworld_env.game_command(" go\x00north\r\n\x1b[0m ") == "go north [0m"  # a NUL used to hang or crash frotz
    assert textworld_env.game_command("take \ud800 apple") is None
    command = textworld_env.game_command("x" + "é" * 300)  # Jericho cut this at byte 198, inside an 'é'
    assert len(command.encode("utf-8")) <= textworld_env.INPUT_BYTES and command == "x" + "é" * 98
