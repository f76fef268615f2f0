"""A deliberately faulty env for the tests of worker isolation and time limits (not a real environment).

Tests that run envs in worker processes or Ray actors need an env class the *child* can import: a class
defined in a test file or conftest cannot be imported there. This module is that class. Nothing registers
it: the tests do, as `faulty`, with `python -m envservice --register faulty=envservice.envs.testing:FaultyEnv`
or `envservice.register(...)`, so it never shows up in a normal service.

Actions: `inc` counts (reaching 3 solves the task), `boom` raises, `exit` calls `os._exit(3)`, `segfault`
crashes the interpreter, `hang` sleeps for an hour. Every observation's info carries the pid of the
process that ran the step, so a test can tell workers apart.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from envservice.envs.base import Param, StepResult, Task, TextEnv
from envservice.envs.base import clip_text

ENTRY_POINT = "envservice.envs.testing:FaultyEnv"


class FaultyEnv(TextEnv):
    """Counts to three, or breaks on purpose (see the module docstring); params: `hang_in_reset`."""

    description = "test env: counts to three or breaks on purpose (exit, segfault, hang, boom)"
    splits = {"train": ["count"]}
    params = {"hang_in_reset": Param("non-empty: reset sleeps for an hour", str)}
    max_steps = 20
    max_sessions = 64

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if task.params.get("hang_in_reset"):
            time.sleep(3600)
        self.value = 0
        return "value 0", {"pid": os.getpid()}

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("simulated crash inside the env")
        if action == "exit":
            os._exit(3)
        if action == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if action == "hang":
            time.sleep(3600)
        if action != "inc":
            return f"Invalid action {clip_text(action)!r}. Valid actions: inc.", 0.0, False, False, {"pid": os.getpid()}
        self.value += 1
        done = self.value >= 3
        return f"value {self.value}", float(done), done, False, {"pid": os.getpid()}

    def evaluate(self) -> tuple[float, bool]:
        return (1.0 if self.value >= 3 else 0.0), self.value >= 3
