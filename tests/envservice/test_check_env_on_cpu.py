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
