"""`check_env(env_id)`: does a registered environment keep the service's contract?

    python -m envservice.check ENV_ID [--json] [--register ID=module:Class]
    python -m envservice.check --hacks ENV_ID [--tasks N] [--url URL] [--only NAME,...]   # is its reward hackable?

One small function per clause. A failing clause raises `EnvCheckError` whose message says what was seen,
what was expected and the likely cause. The command line checks any registered env, plugins included,
and exits 1 when a clause fails.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from envservice import registry
from envservice.envs.base import Task, TextEnv
from envservice.errors import EnvServiceError
from envservice.protocol import CreateRequest, ErrorCode
from envservice.sessions import SessionManager

PROBE_ACTION = "__envservice_check_unknown_action__"
"""An action no environment knows: it must be answered with an observation, not an exception."""

_JUNK = "zq9 Xw_k#% ;,.[]()<>=+?!@&*~^"
_LONG_NUMBER = "9" * 5000

GARBAGE_ACTIONS: tuple[tuple[str, str], ...] = (
    ("empty string", ""),
    ("whitespace only", " \t \r\n \n\t  "),
    ("newlines only", "\n" * 50),
    ("100000 chars of junk", (_JUNK * (100_000 // len(_JUNK) + 1))[:100_000]),
    ("one 100000-char token", "x" * 100_000),
    ("a 20000-char token in a command", "take " + "a" * 20_000),
    ("a 5000-digit number after 'go'", "go " + _LONG_NUMBER),
    ("a 5000-digit count of apples", "take " + _LONG_NUMBER + " apples"),
    ("a 5000-digit count to get", "get " + _LONG_NUMBER + " oak planks"),
    ("a 5000-digit count to craft", f"craft {_LONG_NUMBER} stick using {_LONG_NUMBER} oak planks"),
    ("a 5000-digit search", "search[" + _LONG_NUMBER + "]"),
    ("a 100000-char answer", "answer[" + "x" * 100_000 + "]"),
    ("1e400", "1e400"),
    ("1e400 in a command", "get 1e400 stick"),
    ("negative numbers", "-1"),
    ("negative counts in commands", "craft -1 stick using -2 oak planks"),
    ("a negative count to get", "get -3 oak planks"),
    ("NUL bytes", "go\x00north\x00\x00"),
    ("control characters", "\x1b[31mopen\x1b[0m \x07\x08\x7f\x0c\x0bdoor\r"),
    ("a lone surrogate", "take \ud800 apple"),
    ("emoji", "🙂🔥 go north 🚀👨‍👩‍👧"),
    ("right-to-left text", "\u202ehtron og\u202c اذهب شمالا עבור צפונה"),
    ("combining marks", "go" + "\u0301\u0302\u0303\u0308" * 50 + " north"),
    ("CJK and zero-width", "向北走\u200b\ufeff 拿起苹果 りんごを取る"),
    ("JSON", '{"action": "go north", "args": [1, -2.5e400, null, true], "nested": {"a": []}}'),
    ("format-string injection", "{0.__class__}{0.__class__.__mro__}{}{action!r}"),
    ("printf injection", "%s%n%x%(action)s%%"),
    ("template injection", "${jndi:ldap://x} {{7*7}} <script>alert(1)</script>"),
)
"""Hostile actions of the `garbage_actions` clause: (what it is, the action text)."""

GARBAGE_OBSERVATION_LIMIT = 10_000
"""Characters an observation may have after a garbage action (more: the env echoes the action unbounded)."""

_ECHO_WINDOW = 1000
"""A run of this many characters of a long action found in the observation counts as an unbounded echo."""


class EnvCheckError(AssertionError):
    """A clause of the environment contract does not hold."""


def _fail(clause: str, seen: Any, expected: str, cause: str) -> EnvCheckError:
    return EnvCheckError(f"check_env[{clause}]: saw {seen}; expected {expected}; likely cause: {cause}")


SPLIT_SAMPLES = 200
"""Tasks per split the `split_disjoint` clause compares by default (task k: index k mod the split's size, seed k)."""

UNDECLARED_SPLITS = "split_disjoint: not checked, the env gives no task_fingerprint (its test split is not held-out)"
"""The clause name `check_env` reports for an env that cannot say what its tasks are."""


def check_env(env_id: str, seed: int = 0, split_samples: int = SPLIT_SAMPLES) -> list[str]:
    """Run every clause on `env_id` (task 0 of its first split); return the names of the clauses checked."""
    registration = registry.get(env_id)
    cls = registration.env_class()
    check_limits(registration)
    check_tasks(cls)
    disjoint = check_split_disjoint(cls, split_samples)
    split = next(iter(cls.splits))
    task = cls.resolve_task(0, split, seed, {})
    clauses: list[Callable[[], None]] = [
        lambda: check_reset_types(cls, task),
        lambda: check_reset_deterministic(cls, task),
        lambda: check_step_types(cls, task),
        lambda: check_garbage_actions(cls, task),
        lambda: check_evaluate(cls, task),
        lambda: check_step_after_end_refused(registration, split),
        lambda: check_release_closes(registration, split),
    ]
    for clause in clauses:
        clause()
    return ["limits", "tasks", "split_disjoint" if disjoint else UNDECLARED_SPLITS, "reset_types", "reset_deterministic", "step_types", "garbage_actions", "evaluate",
            "step_after_end_refused", "release_closes"]


def check_limits(registration: registry.Registration) -> None:
    """The step and session limits in force are ints >= 1 (from the registration or the class attributes)."""
    for name in ("max_steps", "max_sessions"):
        value = getattr(registration, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _fail("limits", f"{name}={value!r}", "an int >= 1",
                        f"the class attribute `{name}` (or the registration's value) is not a positive int")


def check_tasks(cls: type[TextEnv]) -> None:
    """Every split has at least one task and the class declares its params as a mapping."""
    counts = cls.task_counts()
    if not counts or any(n < 1 for n in counts.values()):
        raise _fail("tasks", f"task counts {counts}", "at least one split, each with >= 1 task",
                    "the class attribute `splits` is empty or has an empty list")


def check_split_disjoint(cls: type[TextEnv], samples: int = SPLIT_SAMPLES) -> bool:
    """No task of one split has the content of a task of another split (`TextEnv.task_fingerprint`).

    Compares the first `samples` tasks of every split (task k: index k mod the split's size, seed k, default params;
    seeds matter to envs that draw a task's content from them). Returns False, checking nothing, when the env
    gives no fingerprint: then its test split may not be called held-out.
    """
    first: dict[str, tuple[str, int, int]] = {}
    for split in cls.splits:
        for task in split_sample(cls, split, samples):
            fingerprint = cls.task_fingerprint(task)
            if fingerprint is None:
                return False
            owner = first.setdefault(fingerprint, (split, task.index, task.seed))
            if owner[0] != split:
                raise _fail("split_disjoint", f"{split} task {task.index} (seed {task.seed}) has the content of "
                            f"{owner[0]} task {owner[1]} (seed {owner[2]}), fingerprint {fingerprint!r}",
                            "no task of one split equal by content to a task of another split",
                            "the splits differ only by seed or index offsets, and the generator repeats tasks; "
                            "skip the other split's content when drawing a task (see envs/frozenlake.py)")
    return True


def split_sample(cls: type[TextEnv], split: str, samples: int) -> list[Task]:
    """The first `samples` tasks of `split` as `check_split_disjoint` draws them (index k mod size, seed k)."""
    size = len(cls.splits[split])
    return [cls.resolve_task(k % size, split, k, {}) for k in range(samples)]


def check_reset_types(cls: type[TextEnv], task: Task) -> None:
    """`reset` returns (str, dict)."""
    env = cls()
    try:
        result = env.reset(task)
    finally:
        env.close()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str) and isinstance(result[1], dict)):
        raise _fail("reset_types", _types(result), "(observation: str, info: dict)",
                    "reset returns the raw gym observation or forgets the info dict")


def check_reset_deterministic(cls: type[TextEnv], task: Task) -> None:
    """Two instances reset with the same task and seed give the same observation."""
    first, second = cls(), cls()
    try:
        obs_a, obs_b = first.reset(task)[0], second.reset(task)[0]
    finally:
        first.close()
        second.close()
    if obs_a != obs_b:
        raise _fail("reset_deterministic", f"observations differ:\n{obs_a[:300]!r}\nvs\n{obs_b[:300]!r}",
                    "the same observation for the same task and seed",
                    "reset ignores task.seed or draws from an unseeded/global random source or a set's order")


def check_step_types(cls: type[TextEnv], task: Task) -> None:
    """An unknown action gives (str, finite float, bool, bool, dict), not an exception."""
    env = cls()
    try:
        env.reset(task)
        try:
            result = env.step(PROBE_ACTION)
        except Exception as exc:
            raise _fail("step_types", f"{exc!r} for action {PROBE_ACTION!r}", "an observation saying the action "
                        "is invalid", "step does not handle unknown actions") from exc
    finally:
        env.close()
    if not _is_step_result(result):
        raise _fail("step_types", _types(result), "(str, finite float, bool, bool, dict)",
                    "numpy scalars (np.bool_, np.float64) or a raw gym observation are returned unconverted")


def check_garbage_actions(cls: type[TextEnv], task: Task) -> None:
    """Each of `GARBAGE_ACTIONS` gives a step tuple with a bounded observation, not an exception.

    One instance takes the actions in turn (slow resets: ALFWorld, ScienceWorld, TextWorld), reset again
    whenever an action ended the episode.
    """
    env = cls()
    try:
        env.reset(task)
        for label, action in GARBAGE_ACTIONS:
            try:
                result = env.step(action)
            except Exception as exc:
                raise _fail("garbage_actions", f"{type(exc).__name__}: {str(exc)[:300]} for {label} "
                            f"({len(action)} chars: {action[:60]!r})", "an observation saying the action is not "
                            "understood", "step passes the action to a parser or package call that raises on this "
                            "input; validate it first or catch the input's exceptions") from exc
            if not _is_step_result(result):
                raise _fail("garbage_actions", _types(result) + f" for {label}", "(str, finite float, bool, bool, "
                            "dict)", "a path of step for bad input returns another shape or numpy scalars")
            _check_bounded(result[0], label, action)
            if result[2] or result[3]:
                env.reset(task)
    finally:
        env.close()


def _check_bounded(observation: str, label: str, action: str) -> None:
    """Fail when the observation is over `GARBAGE_OBSERVATION_LIMIT` or repeats a long stretch of the action."""
    middle = len(action) // 2
    window = action[middle - _ECHO_WINDOW // 2:middle + _ECHO_WINDOW // 2] if len(action) >= 2 * _ECHO_WINDOW else ""
    if len(observation) > GARBAGE_OBSERVATION_LIMIT or (window and window in observation):
        raise _fail("garbage_actions", f"a {len(observation)}-char observation for {label} ({len(action)} chars) "
                    f"starting {observation[:80]!r}", f"an observation of at most {GARBAGE_OBSERVATION_LIMIT} chars "
                    f"that quotes at most a few hundred chars of the action", "the env echoes the action unbounded; "
                    "clip the echoed text (envservice.envs.base.clip_text)")


def check_evaluate(cls: type[TextEnv], task: Task) -> None:
    """`evaluate` returns (score in [0, 1], bool) after reset and after a step."""
    env = cls()
    try:
        env.reset(task)
        results = [env.evaluate()]
        env.step(PROBE_ACTION)
        results.append(env.evaluate())
    finally:
        env.close()
    for result in results:
        score, success = result if isinstance(result, tuple) and len(result) == 2 else (None, None)
        if not (isinstance(score, (int, float)) and 0.0 <= score <= 1.0 and isinstance(success, bool)):
            raise _fail("evaluate", _types(result) + f" = {result!r}", "(score: float in [0, 1], success: bool)",
                        "an unnormalised return or a numpy bool is returned")


def check_step_after_end_refused(registration: registry.Registration, split: str) -> None:
    """Once an episode is over (here: by max_steps), the service refuses another step with `episode_over`."""
    manager = SessionManager([registration.env_id], max_sessions=1)
    try:
        session_id = manager.create(CreateRequest(env_id=registration.env_id, task_id=0, split=split, seed=0)).session_id
        for _ in range(registration.max_steps):
            response = manager.step(session_id, PROBE_ACTION)
            if response.terminated or response.truncated:
                break
        else:
            raise _fail("step_after_end_refused", f"no end after {registration.max_steps} steps",
                        "terminated or truncated by max_steps", "the step counter is not enforced")
        _expect_code(lambda: manager.step(session_id, PROBE_ACTION), ErrorCode.episode_over, "step_after_end_refused")
    finally:
        manager.shutdown()


def check_release_closes(registration: registry.Registration, split: str) -> None:
    """Releasing a session calls the env's `close` and forgets the session."""
    backend = _ClosingCounter()
    manager = SessionManager([registration.env_id], max_sessions=1, backend=backend)
    try:
        session_id = manager.create(CreateRequest(env_id=registration.env_id, task_id=0, split=split, seed=0)).session_id
        before = backend.closes
        manager.release(session_id)
        if backend.closes - before < 1:
            raise _fail("release_closes", "close not called by release", "release to call the env's close",
                        "the service backend does not close environments it releases")
        _expect_code(lambda: manager.step(session_id, PROBE_ACTION), ErrorCode.unknown_session, "release_closes")
    finally:
        manager.shutdown()


class _ClosingCounter:
    """A backend that counts `close` calls on the envs it builds."""

    def __init__(self) -> None:
        self.closes = 0

    def build(self, registration: registry.Registration) -> TextEnv:
        env = registration.env_class()()
        original = env.close

        def counted_close() -> None:
            self.closes += 1
            original()

        env.close = counted_close  # type: ignore[method-assign]
        return env


def _expect_code(call: Callable[[], Any], code: ErrorCode, clause: str) -> None:
    try:
        result = call()
    except EnvServiceError as exc:
        if exc.code != code:
            raise _fail(clause, f"error {exc.code.value}: {exc.message}", f"error {code.value}",
                        "the env raised instead of answering") from exc
        return
    raise _fail(clause, f"a normal response {result!r}", f"error {code.value}", "the session state is not tracked")


def _is_step_result(result: Any) -> bool:
    """Whether `result` is (str, finite float, bool, bool, dict)."""
    if not (isinstance(result, tuple) and len(result) == 5):
        return False
    obs, reward, terminated, truncated, info = result
    return (isinstance(obs, str) and isinstance(reward, (int, float)) and not isinstance(reward, bool)
            and math.isfinite(reward) and isinstance(terminated, bool) and isinstance(truncated, bool)
            and isinstance(info, dict))


def _types(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


def main(argv: list[str] | None = None) -> int:
    """`python -m envservice.check ENV_ID`: 0 when every clause holds, 1 (and the failing clause) otherwise."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m envservice.check", description=__doc__.splitlines()[0])
    parser.add_argument("env_id", help="a registered env id (built-in, plugin or --register)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-samples", type=int, default=SPLIT_SAMPLES,
                        help="tasks per split the split_disjoint clause compares by content")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--register", action="append", default=[], metavar="ID=MODULE:CLASS")
    parser.add_argument("--env-config", action="append", default=[], metavar="FILE",
                        help="a YAML file of envs (remote servers, Gymnasium games; see envservice/env_config.py)")
    parser.add_argument("--hacks", action="store_true",
                        help="play hostile policies against the env over HTTP instead (envservice/hacks.py): fails "
                             "when one earns more than doing nothing or turns into an env error")
    parser.add_argument("--tasks", type=int, default=2, help="--hacks: train tasks each hack plays (default 2)")
    parser.add_argument("--url", help="--hacks: check the env on this running service instead of one served here")
    parser.add_argument("--only", help="--hacks: comma-separated hack names to play (default: all)")
    parser.add_argument("--params", default="{}", help="--hacks: the create request's params, as JSON")
    args = parser.parse_args(argv)
    from envservice.__main__ import register_classes

    register_classes(args.register, args.env_config)
    if args.hacks:
        return _main_hacks(args)
    try:
        clauses, failure = check_env(args.env_id, seed=args.seed, split_samples=args.split_samples), None
    except (EnvCheckError, EnvServiceError) as exc:
        clauses, failure = [], str(exc)
    report = {"env_id": args.env_id, "passed": failure is None, "clauses": clauses, "failure": failure}
    print(json.dumps(report) if args.json else
          (f"{args.env_id}: every clause holds ({', '.join(clauses)})" if failure is None else failure))
    return 0 if failure is None else 1


def _main_hacks(args: Any) -> int:
    """`--hacks`: the report of `envservice.hacks.check_hacks`; 0 when no hack beats doing nothing."""
    import json
    import logging

    from envservice.hacks import check_hacks

    for name in ("envservice", "mcp", "uvicorn"):  # the served envs' errors still show; their chatter does not
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.tasks < 1:
        raise SystemExit("--tasks must be >= 1")
    try:
        params = json.loads(args.params)
        only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else None
        report = check_hacks(args.env_id, url=args.url, tasks=args.tasks, params=params, only=only)
    except (ValueError, EnvServiceError) as exc:  # a bad --only / --params, an env that cannot load
        print(f"envservice.check --hacks {args.env_id}: {exc}")
        return 2
    print(json.dumps(report.to_json()) if args.json else report.table())
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
