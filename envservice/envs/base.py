"""The contract every environment of the service implements (Gymnasium-like, text in and text out).

`terminated` means the task ended by itself (solved or failed); `truncated` means someone stopped it
(a step limit). The service keeps the two apart all the way to the client.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Sequence, TypeVar

from envservice.errors import EnvServiceError, clip
from envservice.protocol import ErrorCode

STATE_KEY = "state_key"
"""The `info` key under which an env names the state an observation shows (a string), in its reset and step info.
Two turns whose states have one key start from the same state: GiGPO compares them (its anchor states). The key
is the state only, never the feedback on the last action ("You moved.", "Invalid action ..."), so the same state
reached by different moves has one key, and a rejected action leaves it as it was. Without it, the observation
text stands for the state."""

StepResult = tuple[str, float, bool, bool, dict[str, Any]]
"""(observation, reward, terminated, truncated, info)."""

MAX_LISTED_CHOICES = 50
"""How many valid choices an error lists at most (long task lists are cut, with a count)."""


@dataclass(frozen=True)
class Param:
    """One option of a create request's `params`: what it does and the JSON type its value must have.

    `type` is `bool`, `int`, `float` or `str`, checked strictly (JSON `true` is not an int, `"false"` is not a
    boolean, `1` is a valid float). An env may still check ranges itself (e.g. a size from 3 to 12).
    A class's `config_fields` may also declare `list` or `dict` (a JSON array or object).
    """

    description: str
    type: type = str


PARAM_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string"}
"""JSON name of each type a `Param` may declare (GET /envs shows them)."""


def param_type_name(declared: "Param | str") -> str:
    """The JSON type of a declared param ('any' for a bare description string: an untyped option)."""
    return PARAM_TYPE_NAMES[declared.type] if isinstance(declared, Param) else "any"


def param_description(declared: "Param | str") -> str:
    """What a declared param does."""
    return declared.description if isinstance(declared, Param) else declared


def _has_json_type(value: Any, expected: type) -> bool:
    if isinstance(value, bool) or expected is bool:  # bool is an int in Python, never in JSON
        return isinstance(value, bool) and expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


@dataclass(frozen=True)
class Task:
    """One resolved task: which split, which entry of it, the episode seed and the env options."""

    split: str
    index: int
    name: str
    seed: int
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hack:
    """A hostile policy: episodes of fixed actions that try to earn reward without doing the task (`TextEnv.hacks`,
    `envservice.hacks`)."""

    name: str
    """A short name (`exit_early`), unique among an env's hacks and the library's."""
    what: str
    """What it tries, in a few words."""
    episodes: tuple[tuple[str, ...], ...]
    """Each a sequence of actions played from a fresh episode until the env ends it (one per way of trying)."""
    tasks: tuple[str, ...] = ()
    """Names of the train tasks to play it on (a hack aimed at one task's check); empty: the checker's sample."""
    forms: tuple[str, ...] = ()
    """The `ACTION_FORMS` each episode is written in, one per episode (the checker plays an episode on the envs
    that read its form, `TextEnv.action_forms`); empty: every episode is played on every env."""


ACTION_FORMS = ("text", "tool_call", "shell")
"""How an env reads actions: words it parses (`text`: every env gets text), JSON tool calls (`tool_call`), shell
commands (`shell`)."""


class TextEnv(abc.ABC):
    """Base class of the service's environments.

    Subclasses set `description`, `splits` (task names per split) and `params` (valid option names with
    their meaning), and implement `reset`, `step`, `evaluate` and, when they hold resources, `close`.
    One instance serves one session at a time; `reset` may be called again with another task.
    `max_steps` and `max_sessions` are the limits the service enforces unless the registration sets its own.
    """

    description: ClassVar[str] = ""
    """One line for GET /envs."""
    splits: ClassVar[Mapping[str, Sequence[str]]] = {}
    """Task names per split, e.g. {"train": [...], "test": [...]}."""
    params: ClassVar[Mapping[str, "Param | str"]] = {}
    """Valid `params` names of a create request: a `Param` (what it does and its JSON type, checked at create),
    or just the description for an option that takes any JSON value."""
    max_steps: ClassVar[int] = 100
    """Steps per episode at most (the service then truncates the episode)."""
    max_sessions: ClassVar[int] = 1024
    """Sessions of this env open at once at most (beyond: a capacity error)."""
    config_fields: ClassVar[Mapping[str, Param]] = {}
    """Settings a registration may give this class (the `config:` of an env-config entry, see
    `envservice.env_config`): name -> what it is and its JSON type. Empty: the class takes no settings."""
    required_config: ClassVar[tuple[str, ...]] = ()
    """Names of `config_fields` a registration must give."""
    config: ClassVar[Mapping[str, Any]] = {}
    """The settings a configured subclass is bound to (see `configure`); empty on an unconfigured class."""
    fingerprint_folds: ClassVar[tuple[str, ...]] = ()
    """The symmetries `task_fingerprint` folds, one short phrase each (BabyAI: the room's rotations, whose egocentric
    view reads the same): tasks that differ only by one of them share a fingerprint, so they are never in two
    splits. Fold every symmetry the observation cannot tell apart (two tasks that give the same text and rewards
    for every action sequence are one task). Empty: the fingerprint folds none, so tasks that differ in anything
    it digests are different tasks. `envservice.contamination` reports it with every count."""
    action_forms: ClassVar[tuple[str, ...]] = ("text",)
    """The `ACTION_FORMS` this env reads (beyond text, which every env gets): the hack checker plays the library's
    episodes written in these forms only (a shell command sent to a grid world is one more invalid action)."""
    hacks: ClassVar[tuple["Hack", ...]] = ()
    """This env's own hostile policies, which `python -m envservice.check --hacks` plays besides its library
    (`envservice.hacks.LIBRARY`): action sequences that try to earn reward without doing the task (e.g. the
    terminal's Makefile that names the output but has no rule). None may earn more than doing nothing."""

    @abc.abstractmethod
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start an episode of `task`; return (observation, info)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one text action; an unknown action is an observation saying so, never an exception."""

    @abc.abstractmethod
    def evaluate(self) -> tuple[float, bool]:
        """Return (score in [0, 1], success) of the current episode."""

    def close(self) -> None:
        """Free what the instance holds; called once when its session is released."""

    def gold_actions(self) -> list[str] | None:
        """After `reset`: actions that do the task, played by `python -m envservice.check --hacks` to show what
        doing it earns beside what the hacks earn; None (the default): this env has no such oracle."""
        return None

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """What makes `task` the task it is, as a short text: two tasks with the same fingerprint are the same task
        to an agent (FrozenLake: the map; Sokoban: the room; a fixed dataset: its item), whatever their split,
        index or seed. A split is held-out only when none of its fingerprints is a fingerprint of another split
        (`envservice.check`'s `split_disjoint` clause samples both). Params that only change how a task is shown
        (e.g. FrozenLake's `around` line) stay out of it.

        None (the default): this env cannot say, so its splits are not known to be disjoint and nothing may call
        its test split held-out.
        """
        return None

    @classmethod
    def configure(cls, config: Mapping[str, Any]) -> type["TextEnv"]:
        """A subclass bound to `config`, with the class attributes that follow from it (`configured_attributes`).

        One class serves several registrations this way (two AgentGym servers, two Gymnasium games). A bad
        name or type raises `ValueError` naming the field and the valid choices.
        """
        check_config(cls, config)
        attributes = cls.configured_attributes(config)
        return type(cls.__name__, (cls,), {"config": dict(config), "__module__": cls.__module__, **attributes})

    @classmethod
    def configured_attributes(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """Class attributes that follow from `config` (e.g. `splits`, `description`); default: none."""
        return {}

    @classmethod
    def task_counts(cls) -> dict[str, int]:
        """Number of tasks in each split."""
        return {split: len(names) for split, names in cls.splits.items()}

    @classmethod
    def resolve_task(
        cls, task_id: int | str | None, split: str, seed: int | None, params: Mapping[str, Any]
    ) -> Task:
        """Check a create request's task fields and return the task they name (errors list valid values)."""
        names = cls._split_names(split)
        cls._check_params(params)
        index = cls._task_index(task_id, names)
        if seed is None:
            seed = random.randrange(2**31)
        return Task(split=split, index=index, name=names[index], seed=seed, params=dict(params))

    @classmethod
    def _split_names(cls, split: str) -> Sequence[str]:
        if split not in cls.splits:
            raise EnvServiceError(
                ErrorCode.unknown_task,
                f"split={clip(split)!r} is not a split of this environment",
                valid_choices=sorted(cls.splits),
            )
        return cls.splits[split]

    @classmethod
    def _check_params(cls, params: Mapping[str, Any]) -> None:
        unknown = sorted(set(params) - set(cls.params))
        if unknown:
            raise EnvServiceError(
                ErrorCode.bad_request,
                f"params has unknown name(s) {[clip(name) for name in unknown[:MAX_LISTED_CHOICES]]}",
                valid_choices=sorted(cls.params),
            )
        for name, value in params.items():
            declared = cls.params[name]
            if isinstance(declared, Param) and not _has_json_type(value, declared.type):
                raise EnvServiceError(
                    ErrorCode.bad_request,
                    f"params.{name}={clip(repr(value))} must be a JSON {PARAM_TYPE_NAMES[declared.type]}, "
                    f"not {_json_type_of(value)}",
                )

    @staticmethod
    def _task_index(task_id: int | str | None, names: Sequence[str]) -> int:
        if task_id is None:
            return random.randrange(len(names))
        if isinstance(task_id, int):
            if 0 <= task_id < len(names):
                return task_id
            raise EnvServiceError(
                ErrorCode.unknown_task, f"task_id={task_id} is out of range: this split has {len(names)} tasks "
                f"(valid indices 0..{len(names) - 1})"
            )
        try:
            return list(names).index(task_id)
        except ValueError:
            listed = f"; the first {MAX_LISTED_CHOICES} are listed" if len(names) > MAX_LISTED_CHOICES else ""
            raise EnvServiceError(
                ErrorCode.unknown_task,
                f"task_id={clip(task_id)!r} is not a task name of this split ({len(names)} tasks{listed})",
                valid_choices=list(names[:MAX_LISTED_CHOICES]),
            ) from None


def passable_as_argument(text: str) -> bool:
    """Whether `text` can be a process argument (a command, a program's source): encodable as UTF-8 (no lone
    surrogate) and without NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def parse_tool_call(action: str) -> tuple[str, dict[str, Any]] | str:
    """(tool name, arguments) of an action written as one tool call in JSON, `{"name": ..., "arguments": {...}}`,
    or what is wrong with it (for the observation that answers it)."""
    try:
        call = json.loads(action)
    except (json.JSONDecodeError, RecursionError):
        return "write one tool call as JSON"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'the JSON needs a "name" string'
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return 'its "arguments" must be an object'
    return call["name"], arguments


def content_digest(*parts: Any) -> str:
    """A short stable digest of a task's content (for `TextEnv.task_fingerprint`): the same parts, the same digest
    in every process (unlike `hash`)."""
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()[:20]


TEST_SHARE = 5
"""Envs that draw a task's content from an unbounded seed space split the contents themselves: one content in this
many (read off its digest) is the test split's, every other one the train split's (`content_split`)."""

MAX_DRAWS = 1000
"""Candidates an episode draws at most to find a content of its split. Missing a content drawn one time in five
(or even one in 30) this many times has probability 0.8**1000 ((29/30)**1000 = 2e-15): running out means the params
leave that split no content at all."""

_Candidate = TypeVar("_Candidate")


def content_split(fingerprint: str) -> str:
    """'test' or 'train': the split that owns a content, read off its digest (a `content_digest`), so the same
    content belongs to the same split whatever split, index or seed drew it."""
    return "test" if int(fingerprint, 16) % TEST_SHARE == 0 else "train"


def draw_for_split(split: str, candidates: Iterable[_Candidate], fingerprint: Callable[[_Candidate], str],
                   space: str) -> tuple[_Candidate, str]:
    """The first of `candidates` whose content belongs to `split` (`content_split`), with its fingerprint.

    For envs whose tasks are drawn from seeds (BabyAI, Sokoban, TextArena, TextWorld): disjoint seeds are not
    disjoint contents, so an episode of split S draws candidates in a fixed order from its (split, index, seed)
    and keeps the first that is S's. Its first candidate is what the env drew before, so a task keeps its old content
    whenever that content is S's (4 train tasks in 5). `space` names the env and its params for the error raised
    when none of `MAX_DRAWS` candidates is S's.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: contents are split between 'train' and 'test' only")
    for candidate in itertools.islice(candidates, MAX_DRAWS):
        digest = fingerprint(candidate)
        if content_split(digest) == split:
            return candidate, digest
    raise EnvServiceError(ErrorCode.bad_request, f"{space} has no {split} task: none of {MAX_DRAWS} draws is a "
                          f"{split} content (one content in {TEST_SHARE} is the test split's, the rest train's), so "
                          f"this content space is too small for disjoint splits; use larger params")


def unseen_seeds(content: Callable[[int], Hashable], seen: set, first_seed: int, count: int,
                 scan: int) -> dict[int, Hashable]:
    """From `first_seed` on (at most `scan` seeds), the first `count` seeds whose content is not in `seen` and
    repeats no earlier one of them, with their contents; `seen` grows by them.

    For envs whose train tasks are fixed seeds 0..N-1 (FrozenLake's maps, Gymnasium reset states): a held-out
    split keeps the train tasks as they are and takes only contents no train task has. Fewer than `count` come
    back when the content space runs out (3x3 FrozenLake, Taxi): the caller says so.
    """
    found: dict[int, Hashable] = {}
    for seed in range(first_seed, first_seed + scan):
        if len(found) == count:
            break
        value = content(seed)
        if value not in seen:
            seen.add(value)
            found[seed] = value
    return found


def check_config(cls: type[TextEnv], config: Mapping[str, Any]) -> None:
    """`config` names only `cls.config_fields`, with their JSON types, and gives every required one."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{cls.__name__}: config must be a mapping of setting names to values, got {config!r}")
    valid = sorted(cls.config_fields)
    unknown = sorted(set(config) - set(cls.config_fields))
    if unknown:
        raise ValueError(f"{cls.__name__}: config has unknown setting(s) {unknown}; valid settings: {valid or 'none'}")
    missing = [name for name in cls.required_config if name not in config]
    if missing:
        raise ValueError(f"{cls.__name__}: config lacks required setting(s) {missing} "
                         f"({'; '.join(f'{n}: {cls.config_fields[n].description}' for n in missing)})")
    for name, value in config.items():
        declared = cls.config_fields[name]
        if declared.type in PARAM_TYPE_NAMES and not _has_json_type(value, declared.type):
            raise ValueError(f"{cls.__name__}: config.{name}={value!r} must be a JSON "
                             f"{PARAM_TYPE_NAMES[declared.type]}, not {_json_type_of(value)}")
        if declared.type in (list, dict) and not isinstance(value, declared.type):
            raise ValueError(f"{cls.__name__}: config.{name}={value!r} must be a JSON "
                             f"{'array' if declared.type is list else 'object'}, not {_json_type_of(value)}")


def _json_type_of(value: Any) -> str:
    """'a boolean', 'a string', ... for an error message."""
    for python_type, name in {**PARAM_TYPE_NAMES, list: "array", dict: "object"}.items():  # bool before int
        if isinstance(value, python_type):
            return f"a{'n' if name[0] in 'aeiou' else ''} {name}"
    return "null"


clip_text = clip
"""Observations that quote the agent's action back clip it with this (`envservice.errors.clip`): an action of
any length must give a bounded observation."""
