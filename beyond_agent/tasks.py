"""The task seam: how an agent is prompted, how its replies become actions, and how an episode is scored.

An environment (envservice) knows its world: observations, the effect of an action, whether the task was
solved. An `AgentTask` knows the *agent's* side of one kind of episode:

- `first_messages(observation, row_prompt)`: the system prompt and first user message. When the dataset
  row has a `prompt` (verl's `raw_prompt`, written by `beyond_agent.data`), the row's messages are
  used, so editing the parquet changes what the model sees; `{observation}` in a user message is replaced
  by the environment's live first observation (and a prompt that does not end with a user message gets
  the observation as one). Without a row prompt: the task's system prompt and the observation.
- `parse(text)`: the action parser (`rollout/actions.py`), chosen by `action_format`.
- `reward(outcome)`: the episode's reward from the env's final `evaluate()` score and its per-step
  rewards (`EpisodeOutcome`). Infrastructure failures never reach it: they are not reward.

Each dataset row picks its task (`TaskTable.for_row`): the row's `task` (in `extra_info`, or a `task`
column), else the task configured under the row's `env_id`, else `default`. So one batch can mix
environments with different parsers and rewards.

Adding a task is one class and one YAML entry:

    # my_tasks.py (importable where training runs)
    from beyond_agent.tasks import AgentTask

    class DenseTask(AgentTask):
        def reward(self, outcome):
            return outcome.score + 0.1 * sum(outcome.step_rewards)

    # overrides: +beyond_agent.tasks.babyai._target_=my_tasks.DenseTask
    #            +beyond_agent.tasks.babyai.action_format=tagged

Built-in tasks are registered by name with `@register_task` (`env`, `step_rewards`); a config entry
names one with `name:` or a class with `_target_:`, and passes the rest as keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from beyond_agent.actions import ACTION_PARSERS, ParsedAction, get_action_parser

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent acting in a text environment. Read the observation and reply with exactly one action."
)
DEFAULT_TASK = "default"
"""The entry of `beyond_agent.tasks` used by rows that name no task and whose env has no entry."""
OBSERVATION_PLACEHOLDER = "{observation}"


@dataclass(frozen=True)
class EpisodeOutcome:
    """What the environment said about one finished episode: the input of `AgentTask.reward`."""

    score: float
    """The env's final `evaluate()` score (in [0, 1] for the built-in envs)."""
    success: bool
    """The env's final `evaluate()` verdict."""
    step_rewards: tuple[float, ...]
    """One per assistant turn, in order: the reward the env returned for that turn's action (0.0 for a turn
    whose reply was not an action, or that was cut by the length limit, since the env never stepped)."""
    termination: str
    """Why the episode ended: `done`, `max_rounds` or `length` (infrastructure failures are never scored)."""
    rounds: int
    """Assistant turns played."""


class AgentTask:
    """How one kind of episode is prompted, parsed and scored (see the module docstring).

    Args:
        action_format: name of a registered action parser (`plain`, `tagged`, `tool_call`, ...).
        system_prompt: the system message when the row's prompt has none; None: `DEFAULT_SYSTEM_PROMPT`.
        parser_args: keyword arguments of the parser (e.g. `{"tag": "act"}` for `tagged`).
    """

    name: ClassVar[str] = ""
    """The registered name (set by `register_task`); empty for classes used through `_target_`."""

    def __init__(self, action_format: str = "plain", system_prompt: str | None = None,
                 parser_args: Mapping[str, Any] | None = None):
        if action_format not in ACTION_PARSERS:
            raise ValueError(f"action_format={action_format!r} is not registered; choose one of "
                             f"{sorted(ACTION_PARSERS)}")
        self.action_format = action_format
        """The parser's registered name."""
        self.system_prompt = system_prompt or DEFAULT_SYSTEM_PROMPT
        """The system message used when the row's prompt brings none."""
        self.parser = get_action_parser(action_format, **dict(parser_args or {}))
        """The action parser of this task."""

    @property
    def label(self) -> str:
        """What episode records call this task: its registered name, else its class path."""
        return self.name or f"{type(self).__module__}.{type(self).__qualname__}"

    def first_messages(self, observation: str, row_prompt: Sequence[Mapping[str, Any]] | None = None) -> list[dict]:
        """The conversation the episode starts from (system + first user message)."""
        if row_prompt is None or len(row_prompt) == 0:  # a row's prompt may be a numpy array (verl's raw_prompt)
            return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": observation}]
        messages = [_row_message(i, m, observation) for i, m in enumerate(row_prompt)]
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if messages[-1]["role"] != "user":  # a prompt with no task message: the observation is the task
            messages.append({"role": "user", "content": observation})
        return messages

    def parse(self, text: str) -> ParsedAction:
        """The action in one assistant reply, or the sentence that tells the model why there is none."""
        return self.parser.parse(text)

    def reward(self, outcome: EpisodeOutcome) -> float:
        """The episode's reward; the base task returns the env's final score."""
        return outcome.score


TASKS: dict[str, type[AgentTask]] = {}
"""Task classes by registered name; filled by `register_task`."""


def register_task(name: str) -> Callable[[type[AgentTask]], type[AgentTask]]:
    """Class decorator: make an AgentTask subclass available by `name` in `beyond_agent.tasks`."""

    def decorate(cls: type[AgentTask]) -> type[AgentTask]:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered by {TASKS[name]!r}")
        if not (isinstance(cls, type) and issubclass(cls, AgentTask)):
            raise TypeError(f"register_task({name!r}) needs an AgentTask subclass, got {cls!r}")
        cls.name = name
        TASKS[name] = cls
        return cls

    return decorate


@register_task("env")
class EnvTask(AgentTask):
    """The default: the env's final `evaluate()` score is the reward."""


@register_task("step_rewards")
class StepRewardTask(AgentTask):
    """Dense reward: the sum of the env's per-step rewards, plus the final score when `add_score` is true."""

    def __init__(self, add_score: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_score = bool(add_score)
        """Whether the final `evaluate()` score is added to the summed step rewards."""

    def reward(self, outcome: EpisodeOutcome) -> float:
        return sum(outcome.step_rewards) + (outcome.score if self.add_score else 0.0)


def build_task(spec: Any, where: str) -> AgentTask:
    """An AgentTask from one config entry: a registered name, or a mapping with `name:` (default `env`) or
    `_target_:` (a `package.module.Class`) plus keyword arguments. Errors name `where` and the choices."""
    if spec is None or isinstance(spec, str):
        spec = {"name": spec or "env"}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a task name or a mapping with `name` or `_target_`, got {spec!r}")
    kwargs = dict(spec)
    target, name = kwargs.pop("_target_", None), kwargs.pop("name", None)
    if target and name:
        raise ValueError(f"{where} gives both _target_ ({target!r}) and name ({name!r}): give one")
    cls = _task_class(target, where) if target else _registered(name or "env", where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {cls.__qualname__}({_kwargs_text(kwargs)}) failed: {error}") from None


def _registered(name: str, where: str) -> type[AgentTask]:
    if name not in TASKS:
        raise ValueError(f"{where}: task {name!r} is not registered; registered tasks: {sorted(TASKS)} "
                         "(or give _target_: package.module.Class)")
    return TASKS[name]


def _task_class(target: str, where: str) -> type[AgentTask]:
    from hydra.utils import get_class

    try:
        cls = get_class(str(target))
    except Exception as error:  # Hydra wraps import errors; say which entry and why
        raise ValueError(f"{where}._target_={target!r} cannot be imported: {error}") from None
    if not issubclass(cls, AgentTask):
        raise ValueError(f"{where}._target_={target!r} is not an AgentTask subclass "
                         "(from beyond_agent.tasks import AgentTask)")
    return cls


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in kwargs.items())


class TaskTable:
    """The tasks of one run by name, and the rule that gives each dataset row its task.

    Built from `beyond_agent.tasks` (name -> entry, see `build_task`); `default` is always present.
    A row's task: its own `task` name, else the entry named like its env id, else `default`. A row may
    also name a registered task that has no entry; it is then built with its defaults.
    """

    def __init__(self, tasks: Mapping[str, AgentTask]):
        self.tasks = dict(tasks)
        """The configured tasks by name."""
        self.tasks.setdefault(DEFAULT_TASK, EnvTask())

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None, where: str = "beyond_agent.tasks") -> "TaskTable":
        """Build every configured task now, so that a bad entry fails before any episode runs."""
        section = dict(section or {})
        return cls({str(name): build_task(spec, f"{where}.{name}") for name, spec in section.items()})

    def for_row(self, env_id: str, task_name: str | None = None) -> AgentTask:
        """The task of a row of env `env_id` that names `task_name` (or none)."""
        if task_name:
            if task_name not in self.tasks:
                if task_name not in TASKS:
                    raise ValueError(f"a dataset row names task {task_name!r}, which is neither configured "
                                     f"(beyond_agent.tasks: {sorted(self.tasks)}) nor registered ({sorted(TASKS)})")
                self.tasks[task_name] = TASKS[task_name]()
            return self.tasks[task_name]
        return self.tasks.get(env_id, self.tasks[DEFAULT_TASK])


def _row_message(index: int, message: Mapping[str, Any], observation: str) -> dict:
    """One message of a row's prompt as a plain dict; `{observation}` in user text becomes the live one."""
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise ValueError(f"the row's prompt message {index} must be a system, user or assistant message with text "
                         f"content, got role={role!r}, content of type {type(content).__name__}")
    if role == "user":
        content = content.replace(OBSERVATION_PLACEHOLDER, observation)
    return {"role": role, "content": content}
