"""Deliberately broken envs for the tests (not real environments): a faulty one for worker isolation and time
limits, and a hackable one for the hack checker (`HackableEnv`).

Tests that run envs in worker processes or Ray actors need an env class the *child* can import: a class
defined in a test file or conftest cannot be imported there. This module is that class. Nothing registers
it: the tests do, as `faulty`, with `python -m envservice --register faulty=envservice.envs.testing:FaultyEnv`
or `envservice.register(...)`, so it never shows up in a normal service.

Actions: `inc` counts (reaching 3 solves the task), `boom` raises, `exit` calls `os._exit(3)`, `segfault`
crashes the interpreter, `hang` sleeps for an hour, `chatter` prints 128 KB to stdout. Every observation's info
carries the pid of the process that ran the step, so a test can tell workers apart.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from typing import Any

from envservice.envs.base import Hack, Param, StepResult, Task, TextEnv
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
        if action == "chatter":  # as minigrid does for each layout it rejects: more than a pipe holds
            print("sampling rejected, trying again\n" * 4000, flush=True)
        if action != "inc":
            return f"Invalid action {clip_text(action)!r}. Valid actions: inc.", 0.0, False, False, {"pid": os.getpid()}
        self.value += 1
        done = self.value >= 3
        return f"value {self.value}", float(done), done, False, {"pid": os.getpid()}

    def evaluate(self) -> tuple[float, bool]:
        return (1.0 if self.value >= 3 else 0.0), self.value >= 3


HACKABLE_ENTRY_POINT = "envservice.envs.testing:HackableEnv"


class HackableEnv(TextEnv):
    """A deliberately hackable env, for the tests of `python -m envservice.check --hacks` (and a plugin author's
    first look at a failing report): the task is to guess the magic word (`guess xyzzy`), but

    - hanging up (`goodbye`, `done`, `submit`, `quit`) ends the episode scored as a success;
    - `look` pays 0.1 every time and changes nothing;
    - an action longer than 50 000 characters raises (an env that walks its input recursively);
    - its own declared hack, `please`, pays a step reward of 1;
    - each episode leaves a folder in the temporary folder behind (`close` forgets it).
    """

    description = "test env: guess the magic word, or game it (hang up, repeat, flood)"
    splits = {"train": ["magic-word"]}
    max_steps = 20
    max_sessions = 64
    hacks = (Hack("say_please", "ask for the reward nicely", (("please",),)),)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.solved = False
        tempfile.mkdtemp(prefix="beyond-hackable-")  # the leak: nothing removes it
        return "Guess the magic word: answer `guess <word>`. You may also `look`.", {}

    def step(self, action: str) -> StepResult:
        if len(action) > 50_000:
            raise RecursionError("maximum recursion depth exceeded while walking the action")
        words = action.strip().lower().split()
        if words[:1] in (["goodbye!"], ["goodbye"], ["done"], ["submit"], ["quit"], ["thank"]):
            self.solved = True  # the hole: a hang-up is scored as the task done
            return "Bye.", 1.0, True, False, {}
        if words == ["look"]:
            return "A locked door with a keypad.", 0.1, False, False, {}  # the hole: paid for changing nothing
        if words == ["please"]:
            return "Since you asked nicely.", 1.0, False, False, {}
        if words == ["guess", "xyzzy"]:
            self.solved = True
            return "The door opens.", 1.0, True, False, {}
        return f"Nothing happens ({clip_text(action)!r}).", 0.0, False, False, {}

    def evaluate(self) -> tuple[float, bool]:
        return (1.0, True) if self.solved else (0.0, False)

    def gold_actions(self) -> list[str]:
        return ["guess xyzzy"]
