"""The recipe's settings: everything the rollout needs from the composed config, validated once per process.

`BeyondAgentSettings.from_config(config)` reads our `beyond_agent:` section and the verl keys the rollout
depends on (`data.max_prompt_length`, `data.max_response_length`, the rollout's sampling, the advantage
estimator) and builds the objects the rollout uses as they are: the episode limits (`DataflowConfig`),
the LLM front's limits (`LLMManagerConfig`), the round schedule (`RoundScheduler`), the tasks
(`TaskTable`), the sampling parameters and the multi-task options (`MultitaskConfig`). Each field is
validated by its own class; errors come back naming the config key and, where there is a fixed set, the
valid choices. The driver (`main_beyond_agent`) calls it to fail before any Ray actor starts; the rollout
manager calls it where it is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from recipe.beyond_agent.multitask import MultitaskConfig
from recipe.beyond_agent.rollout.async_pool import AsyncRolloutSettings
from recipe.beyond_agent.rollout.dataflow import DataflowConfig
from recipe.beyond_agent.rollout.llm import LLMManagerConfig, SamplingParams
from recipe.beyond_agent.rollout.rounds import RoundScheduler
from recipe.beyond_agent.tasks import TaskTable
from recipe.beyond_agent.weights.delta import WeightSyncConfig

ROLLOUT_MODES = ("sync", "async")
# Estimators whose baseline is computed from the other samples of the same prompt (verl's `uid` group):
# an infrastructure failure takes its whole group out of training with it.
NON_GROUP_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax")
CONFIG_KEYS = {
    "DataflowConfig.max_prompt_length": "data.max_prompt_length",
    "DataflowConfig.max_response_length": "data.max_response_length",
    "DataflowConfig.max_tokens_per_turn": "beyond_agent.max_tokens_per_turn",
    "DataflowConfig.episode_timeout_s": "beyond_agent.episode_timeout_s",
    "DataflowConfig.max_rounds": "beyond_agent.rounds",
    "LLMManagerConfig.max_in_flight": "beyond_agent.concurrency",
    "LLMManagerConfig.request_timeout_s": "beyond_agent.llm_request_timeout_s",
    "SamplingParams.temperature": "actor_rollout_ref.rollout.temperature (or val_kwargs.temperature)",
    "SamplingParams.top_p": "actor_rollout_ref.rollout.top_p (or val_kwargs.top_p)",
}
"""The class field named in a validation error -> the config key a user sets."""


@dataclass(frozen=True)
class EnvSettings:
    """Where the environments are served (`beyond_agent.env`)."""

    url: str
    """envservice base URL, e.g. http://127.0.0.1:8000."""
    token: str | None = None
    """Bearer token when the service requires one."""
    env_id: str | None = None
    """Env id for dataset rows whose extra_info names none."""
    timeout_s: float = 90.0
    """Seconds per envservice request (above the service's own --step-timeout, so that answers first)."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("beyond_agent.env.url is required (e.g. http://127.0.0.1:8000 for a local envservice)")
        if not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"beyond_agent.env.url must start with http:// or https://, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"beyond_agent.env.timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class TrajectoryDump:
    """Which sampled episodes are written to disk (`beyond_agent.trajectories`)."""

    every: int = 0
    """Write trajectories/step_<N>.jsonl every N training steps, and val_step_<N>.jsonl at every validation
    (0: never). The schema is `recipe/beyond_agent/trajectories.py`'s `TrajectoryRecord`."""
    dir: str = "trajectories"
    """The folder of those files."""
    max_per_step: int = 16
    """Episodes written per dump at most."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.max_per_step < 1:
            raise ValueError(f"beyond_agent.trajectories needs every >= 0 and max_per_step >= 1, got every="
                             f"{self.every}, max_per_step={self.max_per_step}")


@dataclass(frozen=True)
class BeyondAgentSettings:
    """The validated settings of a run (see the module docstring)."""

    env: EnvSettings
    rounds: RoundScheduler
    """Round limit per training step (ScalingInter-RL when stepwise)."""
    val_max_rounds: int | None
    """Round limit in validation; None uses the schedule's value at the current step."""
    episode: DataflowConfig
    """Limits of every episode; `max_rounds` is the schedule's first value and is set per call."""
    llm: LLMManagerConfig
    """Requests in flight at once and their deadline (the shared LLM front)."""
    tasks: TaskTable
    """The run's AgentTasks and the rule that gives each dataset row its own."""
    trajectories: TrajectoryDump
    train_sampling: SamplingParams
    """Sampling of training rollouts (actor_rollout_ref.rollout.temperature/top_p)."""
    val_sampling: SamplingParams
    """Sampling of validation rollouts (greedy unless val_kwargs.do_sample)."""
    group_based: bool
    """Whether the advantage estimator baselines each sample against its group (GRPO, RLOO, ...)."""
    rollout_mode: str = "sync"
    """sync: each step plays its own episodes; async: episodes are played ahead while the actor trains."""
    async_rollout: AsyncRolloutSettings = AsyncRolloutSettings()
    """The staleness bound and policies of async mode (`beyond_agent.async_rollout`)."""
    weight_sync: WeightSyncConfig = WeightSyncConfig(mode="full")
    """How weights reach the rollout after each update (`beyond_agent.weight_sync`; full: verl's own sync)."""
    multitask: MultitaskConfig = MultitaskConfig()
    """Task sampling weights and per-task advantage normalisation (`beyond_agent.multitask`)."""

    @classmethod
    def from_config(cls, config: Any) -> "BeyondAgentSettings":
        """Read the composed config (OmegaConf or a mapping); raise ValueError naming the bad key."""
        section = _section(_get(config, "beyond_agent"), "beyond_agent")
        _check_keys(section)
        env = _section(section.get("env", {}), "beyond_agent.env")
        dump = _section(section.get("trajectories", {}), "beyond_agent.trajectories")
        rounds = RoundScheduler.from_config(_section(section.get("rounds", {"type": "fixed", "rounds": 8}),
                                                     "beyond_agent.rounds"))
        return cls(
            env=EnvSettings(url=env.get("url") or "", token=env.get("token") or None, env_id=env.get("env_id"),
                            timeout_s=float(env.get("timeout_s", 90.0))),
            rounds=rounds, val_max_rounds=_val_max_rounds(section.get("val_max_rounds")),
            episode=_named(DataflowConfig, max_rounds=rounds.max_rounds(0), **_episode_limits(config, section)),
            llm=_named(LLMManagerConfig, max_in_flight=section.get("concurrency", 64),
                       request_timeout_s=float(section.get("llm_request_timeout_s", 300.0))),
            tasks=TaskTable.from_config(section.get("tasks")),
            trajectories=TrajectoryDump(every=int(dump.get("every", 0)), dir=str(dump.get("dir", "trajectories")),
                                        max_per_step=int(dump.get("max_per_step", 16))),
            train_sampling=_sampling(config, validate=False), val_sampling=_sampling(config, validate=True),
            group_based=is_group_estimator(_get(_get(config, "algorithm"), "adv_estimator") or "grpo"),
            rollout_mode=_rollout_mode(config, section),
            async_rollout=AsyncRolloutSettings.from_mapping(_section(section.get("async_rollout") or {},
                                                                     "beyond_agent.async_rollout")),
            weight_sync=_weight_sync(section.get("weight_sync")),
            multitask=MultitaskConfig.from_mapping(_section(section.get("multitask") or {}, "beyond_agent.multitask")),
        )

    @property
    def is_async(self) -> bool:
        """Whether training episodes are played ahead in the background (`rollout_mode: async`)."""
        return self.rollout_mode == "async"

    @property
    def concurrency(self) -> int:
        """Episodes in flight at once (threads): `beyond_agent.concurrency`, also the LLM front's in-flight limit."""
        return self.llm.max_in_flight

    def max_rounds(self, meta_info: Mapping[str, Any]) -> int:
        """The round limit of one rollout call: a pure function of verl's global step (validation may fix it)."""
        if meta_info.get("validate") and self.val_max_rounds:
            return self.val_max_rounds
        return self.rounds.max_rounds(int(meta_info.get("global_steps", 0)))

    def sampling(self, meta_info: Mapping[str, Any]) -> SamplingParams:
        """Training samples at the rollout temperature; validation follows val_kwargs."""
        return self.val_sampling if meta_info.get("validate") else self.train_sampling


def is_group_estimator(adv_estimator: str) -> bool:
    """Whether the advantage estimator baselines each sample against its group."""
    return str(adv_estimator) not in NON_GROUP_ESTIMATORS


def _episode_limits(config: Any, section: dict) -> dict[str, Any]:
    data = _get(config, "data")
    return {"max_prompt_length": _get(data, "max_prompt_length"), "max_response_length": _get(data, "max_response_length"),
            "max_tokens_per_turn": section.get("max_tokens_per_turn", 256),
            "episode_timeout_s": float(section.get("episode_timeout_s", 600.0))}


def _sampling(config: Any, validate: bool) -> SamplingParams:
    """verl's rollout sampling keys as SamplingParams: validation is greedy unless val_kwargs.do_sample."""
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    if not validate:
        return _named(SamplingParams, temperature=float(_get(rollout, "temperature", 1.0)),
                      top_p=float(_get(rollout, "top_p", 1.0)))
    val = _get(rollout, "val_kwargs") or {}
    if not _get(val, "do_sample", False):
        return SamplingParams(temperature=0.0)
    return _named(SamplingParams, temperature=float(_get(val, "temperature", 1.0)), top_p=float(_get(val, "top_p", 1.0)))


def _rollout_mode(config: Any, section: dict) -> str:
    """`beyond_agent.rollout_mode`, checked against what the rollout engine must allow for it."""
    mode = section.get("rollout_mode", "sync")
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"beyond_agent.rollout_mode={mode!r} is not valid; choose one of {', '.join(ROLLOUT_MODES)}")
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    if mode == "async" and _get(rollout, "free_cache_engine", False):
        # verl puts the rollout engine to sleep after each generation when this is on, and async episodes
        # are still generating then.
        raise ValueError("beyond_agent.rollout_mode=async needs actor_rollout_ref.rollout.free_cache_engine=false "
                         "(the rollout server must keep serving while the actor trains)")
    return mode


def _weight_sync(node: Any) -> WeightSyncConfig:
    """`beyond_agent.weight_sync`; absent means full syncs (verl's behaviour)."""
    section = None if node is None else _section(node, "beyond_agent.weight_sync")
    try:
        return WeightSyncConfig.from_mapping(section)
    except ValueError as error:  # its messages name `weight_sync.<key>`
        raise ValueError(f"beyond_agent.{error}") from None


def _val_max_rounds(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"beyond_agent.val_max_rounds must be >= 1 or null, got {value!r}")
    return value


def _named(build: Callable, *args: Any, **kwargs: Any) -> Any:
    """`build(...)`, with a validation error's class field replaced by the config key a user sets."""
    try:
        return build(*args, **kwargs)
    except (TypeError, ValueError) as error:
        text = str(error)
        for field, key in CONFIG_KEYS.items():
            text = re.sub(rf"\b{re.escape(field)}\b", key, text)
        raise ValueError(text) from None


SECTION_KEYS = ("env", "rounds", "val_max_rounds", "tasks", "max_tokens_per_turn", "concurrency", "episode_timeout_s",
                "llm_request_timeout_s", "trajectories", "rollout_mode", "async_rollout", "weight_sync", "multitask")
MOVED_KEYS = {"action_format": "beyond_agent.tasks.default.action_format",
              "system_prompt": "beyond_agent.tasks.default.system_prompt"}


def _check_keys(section: dict) -> None:
    """Refuse keys of `beyond_agent:` that nothing reads (a typo, or a key that moved)."""
    unknown = sorted(set(section) - set(SECTION_KEYS))
    if unknown:
        moved = [f"{key} is now {MOVED_KEYS[key]}" for key in unknown if key in MOVED_KEYS]
        raise ValueError(f"beyond_agent has unknown key(s) {unknown}; valid keys: {', '.join(SECTION_KEYS)}"
                         + (f" ({'; '.join(moved)})" if moved else ""))


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, Mapping):
        return node.get(key, default)
    return getattr(node, key, default) if hasattr(node, key) else default


def _section(node: Any, where: str) -> dict:
    """An OmegaConf node or mapping as a plain dict (interpolations resolved)."""
    if node is None:
        raise ValueError(f"the config has no `{where}` section; see recipe/beyond_agent/config/beyond_agent_trainer.yaml")
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ValueError(f"`{where}` must be a mapping, got {type(node).__name__}")
    return dict(node)
