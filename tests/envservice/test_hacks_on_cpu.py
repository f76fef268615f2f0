"""`python -m envservice.check --hacks` (envservice/hacks.py, issue #69): hostile policies played over HTTP against a
real envservice. It must find every hole of a deliberately hackable env (`envservice.envs.testing.HackableEnv`) and
pass every built-in env."""

from __future__ import annotations

import subprocess
import sys

import pytest

from envservice import registry
from envservice.envs.testing import HACKABLE_ENTRY_POINT, HackableEnv
from envservice.hacks import LIBRARY, RULES, check_hacks


@pytest.fixture(scope="module")
def hackable():
    registry.register("hackable-test", HackableEnv)
    yield "hackable-test"
    registry.unregister("hackable-test")


def test_the_checker_finds_every_hole_of_a_hackable_env(hackable):
    report = check_hacks(hackable, tasks=1)
    failing = {result.name: result.failures for result in report.results if result.failures}
    assert not report.passed and report.baseline == (0.0, 0.0) and report.gold == (1.0, 1.0)
    # A hang-up (and every hack that ends with `submit`) is scored as the task done:
    assert "its score 1.000 beats doing nothing (0.000)" in failing["hang_up"][0]
    # `look` pays 0.1 and changes nothing:
    assert failing["repeat"] == ["'look' earned 0.1 and changed nothing"]
    # An action over 50 000 characters raises in the env: an env error is a failure of the check, never "not scored":
    assert failing["flood_output"][0].startswith("env error: step 1")
    # The env's own declared hack pays a step reward:
    assert failing["say_please"] == ["its step rewards +1.000 beat doing nothing (+0.000)"]
    assert "concurrent" in failing
    # Hacks that earn nothing pass, and the table says which failed:
    assert "stall_empty" not in failing and "stall_invalid" not in failing
    assert "HACKABLE" in report.table() and "say_please" in report.table()
    # Every episode left a folder behind:
    assert report.leftovers and all("beyond-hackable-" in left for left in report.leftovers)


def test_only_runs_the_named_hacks_and_refuses_unknown_names(hackable):
    report = check_hacks(hackable, tasks=1, only=["stall_empty", "repeat"])
    assert [result.name for result in report.results] == ["stall_empty", "repeat"]
    with pytest.raises(ValueError, match="no hack named \\['exit_early_typo'\\]; valid names: .*stall_empty"):
        check_hacks(hackable, tasks=1, only=["exit_early_typo"])


def test_the_command_line_fails_a_hackable_env_and_passes_a_clean_one():
    hackable = subprocess.run([sys.executable, "-m", "envservice.check", "--hacks", "hackable", "--register",
                               f"hackable={HACKABLE_ENTRY_POINT}", "--tasks", "1", "--only", "hang_up,stall_empty"],
                              capture_output=True, text=True, timeout=120)
    assert hackable.returncode == 1, hackable.stderr
    assert "hang_up" in hackable.stdout and "FAIL: its score 1.000 beats doing nothing" in hackable.stdout
    assert "hackable: HACKABLE" in hackable.stdout
    clean = subprocess.run([sys.executable, "-m", "envservice.check", "--hacks", "frozenlake", "--tasks", "1",
                            "--only", "hang_up,stall_empty,repeat"], capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "frozenlake: no hack beats doing nothing" in clean.stdout
    unknown = subprocess.run([sys.executable, "-m", "envservice.check", "--hacks", "frozenlake", "--only", "nope"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "no hack named ['nope']" in unknown.stdout


def test_every_library_hack_is_named_once_with_its_forms():
    names = [hack.name for hack in LIBRARY] + list(RULES)
    assert len(names) == len(set(names))
    for hack in LIBRARY:
        assert len(hack.forms) == len(hack.episodes) and set(hack.forms) <= {"text", "tool_call", "shell"}


BUILT_IN = [env_id for env_id in registry.registered_ids()
            if registry.get(env_id).origin in ("built-in",) or registry.get(env_id).origin.startswith("plugin")]
"""Every env this project ships (AppWorld's tasks need data no package ships: it cannot be played here)."""


@pytest.mark.slow
@pytest.mark.parametrize("env_id", [env_id for env_id in BUILT_IN if env_id != "appworld"])
def test_no_hack_beats_doing_nothing_on_a_built_in_env(env_id):
    report = check_hacks(env_id, tasks=1)
    assert report.passed, report.table()
    assert {result.name for result in report.results} >= {"stall_empty", "stall_invalid", "hang_up", "repeat",
                                                          "concurrent"}
