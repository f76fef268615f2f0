"""The recipe's settings: everything the rollout needs from the composed config, validated once per process.

`BeyondAgentConfig.from_config(config)` reads our `beyond_agent:` section and the verl keys the rollout
depends on (`data.max_prompt_length`, `data.max_response_length`, the rollout's sampling, the advantage
estimator) and builds the objects the rollout uses as they are: the episode limits (`EpisodeConfig`),
the LLM front's limits (`LLMManagerConfig`), the round schedule (`RoundsConfig`), the tasks
(`TaskTable`), the sampling parameters and the multi-task options (`MultitaskConfig`). Each field is
validated by its own class; errors come back naming the config key and, where there is a fixed set, the
valid choices. The driver (`recipe/multiturn_rl/main.py`) calls it to fail before any Ray actor starts; the rollout
manager calls it where it is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

from beyond_agent.algorithms.estimators import is_group_based
from beyond_agent.algorithms.gigpo import GiGPOConfig
from beyond_agent.algorithms.target_kl import check_target_kl, check_target_kl_backtrack, check_target_kl_strategy
from beyond_agent.multitask import MultitaskConfig
from beyond_agent.rollout.async_pool import AsyncRolloutConfig
from beyond_agent.rollout.episode_loop import EpisodeConfig
from beyond_agent.gateway.agents import AgentConfig
from beyond_agent.integrity import IntegrityConfig
from beyond_agent.rollout.dynamic_sampling import DynamicSamplingConfig
from beyond_agent.rollout.llm import LLMManagerConfig, SamplingParams
from beyond_agent.rollout.rounds import RoundsConfig
from beyond_agent.rollout.seats import SelfPlayConfig
from beyond_agent.sections import from_section
from beyond_agent.tasks import TaskTable
from beyond_agent.weights.delta import WeightSyncConfig

ROLLOUT_MODES = ("sync", "async")
CONFIG_KEYS = {
    "EpisodeConfig.max_prompt_length": "data.max_prompt_length",
    "EpisodeConfig.max_response_length": "data.max_response_length",
    "EpisodeConfig.max_tokens_per_turn": "beyond_agent.max_tokens_per_turn",
    "EpisodeConfig.episode_timeout_s": "beyond_agent.episode_timeout_s",
    "LLMManagerConfig.max_in_flight": "beyond_agent.concurrency",
    "LLMManagerConfig.request_timeout_s": "beyond_agent.llm_request_timeout_s",
    "SamplingParams.temperature": "actor_rollout_ref.rollout.temperature (or val_kwargs.temperature)",
    "SamplingParams.top_p": "actor_rollout_ref.rollout.top_p (or val_kwargs.top_p)",
}
"""The class field named in a validation error -> the config key a user sets."""


@dataclass(frozen=True)
class EnvConfig:
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
        if self.token == "":  # an unset ${oc.env:ENVSERVICE_TOKEN,""} means no token
            object.__setattr__(self, "token", None)
        if not self.url:
            raise ValueError("beyond_agent.env.url is required (e.g. http://127.0.0.1:8000 for a local envservice)")
        if not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"beyond_agent.env.url must start with http:// or https://, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"beyond_agent.env.timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class TrajectoryDumpConfig:
    """Which sampled episodes are written to disk (`beyond_agent.trajectories`)."""

    every: int = 1
    """Write trajectories/step_<N>.jsonl every N training steps, and val_step_<N>.jsonl at every validation
    (0: never). The schema is `beyond_agent/trajectories.py`'s `TrajectoryRecord`."""
    dir: str = "trajectories"
    """The folder of those files (the YAML puts it in `${trainer.default_local_dir}/trajectories`)."""
    max_per_step: int = 16
    """Episodes written per dump at most."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.max_per_step < 1:
            raise ValueError(f"beyond_agent.trajectories needs every >= 0 and max_per_step >= 1, got every="
                             f"{self.every}, max_per_step={self.max_per_step}")


@dataclass(frozen=True)
class BeyondAgentSectionConfig:
    """The `beyond_agent:` section as written, read in one `from_section` call: its own values and its typed
    sub-sections (each read and validated by its own dataclass; `tasks` by `TaskTable` in
    `BeyondAgentConfig.from_config`)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {"action_format": "beyond_agent.tasks.default.action_format",
                                            "system_prompt": "beyond_agent.tasks.default.system_prompt"}
    """Keys `beyond_agent:` had once, and where they are now (named in the error)."""

    env: EnvConfig
    """Where envservice is (`url` is required)."""
    rounds: RoundsConfig = RoundsConfig(rounds=8)
    """The round limit per training step."""
    val_max_rounds: int | None = None
    """Round limit in validation; None uses the schedule's value at the current step."""
    tasks: Any = None
    """`TaskTable`: how episodes are prompted, parsed and scored."""
    max_tokens_per_turn: int = 256
    """New tokens per assistant turn."""
    concurrency: int = 64
    """Episodes in flight (threads), and LLM requests in flight."""
    episode_timeout_s: float = 600.0
    """Past it an episode ends with `timeout` (not reward)."""
    llm_request_timeout_s: float = 300.0
    """One generation request's deadline (past it: `timeout`, not reward)."""
    sampling_seed: int | None = None
    """The run's sampling seed: each request's seed derives from it and the request's place (step, row, sample,
    turn), so one config run twice samples alike; None lets the LLM server draw them."""
    rollout_mode: str = "sync"
    """One of ROLLOUT_MODES: sync, or async (episodes played ahead while the actor trains)."""
    async_rollout: AsyncRolloutConfig = AsyncRolloutConfig()
    """The staleness bound and policies of async mode."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """How weights reach the rollout."""
    multitask: MultitaskConfig = MultitaskConfig()
    """Several envs in one run."""
    gigpo: GiGPOConfig = GiGPOConfig()
    """The step-level part of `algorithm.adv_estimator=gigpo`."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Groups without learning signal dropped and replaced."""
    agent: AgentConfig = AgentConfig()
    """Episodes played by a user's agent behind the OpenAI-compatible gateway."""
    self_play: SelfPlayConfig = SelfPlayConfig()
    """Episodes played as games with the policy in every seat."""
    trajectories: TrajectoryDumpConfig = TrajectoryDumpConfig()
    """Which sampled episodes are written to disk."""
    integrity: IntegrityConfig = IntegrityConfig()
    """Monitors that warn or stop the run when its learning signal looks broken (`beyond_agent/integrity.py`)."""
    target_kl: float | None = None
    """A step's actor updates stop once the policy drifted this far (KL) from the one that sampled the batch
    (`beyond_agent/algorithms/target_kl.py`); None: every update runs."""
    target_kl_backtrack: bool = False
    """Each actor update is also measured right after it: one past `target_kl` is halved until within it, or undone
    (`beyond_agent/algorithms/target_kl.py`)."""

    def __post_init__(self) -> None:
        _check_val_max_rounds(self.val_max_rounds)
        _check_sampling_seed(self.sampling_seed)
        check_target_kl(self.target_kl)
        check_target_kl_backtrack(self.target_kl, self.target_kl_backtrack)
        if self.rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"beyond_agent.rollout_mode={self.rollout_mode!r} is not valid; choose one of "
                             f"{', '.join(ROLLOUT_MODES)}")
        if self.self_play.active and self.agent.active:
            raise ValueError("beyond_agent.self_play and beyond_agent.agent cannot be on together: a user's agent plays "
                             "one seat's episodes behind the gateway, self-play plays every seat with our own loop")


@dataclass(frozen=True, kw_only=True)
class BeyondAgentConfig(BeyondAgentSectionConfig):
    """The validated settings of a run: the `beyond_agent:` section as written (every field of
    `BeyondAgentSectionConfig`, stated there once) and what the run derives from it and from verl's keys (see the
    module docstring)."""

    tasks: TaskTable
    """The run's AgentTasks and the rule that gives each dataset row its own (built from `beyond_agent.tasks`)."""
    episode: EpisodeConfig
    """The limits every episode shares (the round limit comes from `rounds`, per training step)."""
    llm: LLMManagerConfig
    """Requests in flight at once and their deadline (the shared LLM front)."""
    train_sampling: SamplingParams
    """Sampling of training rollouts (actor_rollout_ref.rollout.temperature/top_p)."""
    val_sampling: SamplingParams
    """Sampling of validation rollouts (greedy unless val_kwargs.do_sample)."""
    group_based: bool
    """Whether the advantage estimator baselines each sample against its group (GRPO, RLOO, ...)."""
    adv_estimator: str = "grpo"
    """verl's `algorithm.adv_estimator` (gigpo: dynamic sampling also weighs the step-level advantages)."""

    @classmethod
    def from_config(cls, config: Any) -> "BeyondAgentConfig":
        """Read the composed config (OmegaConf or a mapping); raise ValueError naming the bad key."""
        section = from_section(BeyondAgentSectionConfig, _section(_get(config, "beyond_agent"), "beyond_agent"),
                               "beyond_agent")
        adv_estimator = str(_get(_get(config, "algorithm"), "adv_estimator") or "grpo")
        group_based = is_group_based(adv_estimator)
        _check_dynamic_sampling(config, section.dynamic_sampling, group_based)
        _check_rollout_engine(config, section.rollout_mode)
        check_target_kl_strategy(section.target_kl, _get(_get(_get(config, "actor_rollout_ref"), "actor"), "strategy",
                                                          "fsdp"))
        written = {field.name: getattr(section, field.name) for field in fields(section)}
        return cls(**{**written, "tasks": TaskTable.from_config(section.tasks)},
                   episode=_named(EpisodeConfig, **_episode_limits(config, section)),
                   llm=_named(LLMManagerConfig, max_in_flight=section.concurrency,
                              request_timeout_s=float(section.llm_request_timeout_s)),
                   train_sampling=_sampling(config, validate=False), val_sampling=_sampling(config, validate=True),
                   group_based=group_based, adv_estimator=adv_estimator)

    @property
    def is_async(self) -> bool:
        """Whether training episodes are played ahead in the background (`rollout_mode: async`)."""
        return self.rollout_mode == "async"

    @property
    def rows_played_by_loader(self) -> bool:
        """Whether the trainer's dataloader hands verl rows whose episodes are already played (async mode, or
        dynamic sampling, which must see a group's rewards before the row joins a batch)."""
        return self.is_async or self.dynamic_sampling.active

    def sampling(self, meta_info: Mapping[str, Any]) -> SamplingParams:
        """Training samples at the rollout temperature; validation follows val_kwargs."""
        return self.val_sampling if meta_info.get("validate") else self.train_sampling


def _episode_limits(config: Any, section: BeyondAgentSectionConfig) -> dict[str, Any]:
    data = _get(config, "data")
    return {"max_prompt_length": _get(data, "max_prompt_length"), "max_response_length": _get(data, "max_response_length"),
            "max_tokens_per_turn": section.max_tokens_per_turn, "episode_timeout_s": float(section.episode_timeout_s)}


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


def _check_sampling_seed(value: Any) -> None:
    """`beyond_agent.sampling_seed`: an int, or None (null) for seeds the server draws."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"beyond_agent.sampling_seed must be an int or null; got {value!r}")


def _check_dynamic_sampling(config: Any, dynamic: DynamicSamplingConfig, group_based: bool) -> None:
    """Dynamic sampling judges a group by its rewards: it needs groups, and an estimator that compares them."""
    if not dynamic.active:
        return
    samples = _get(_get(_get(config, "actor_rollout_ref"), "rollout"), "n", 1)
    if samples < 2:
        raise ValueError(f"beyond_agent.dynamic_sampling.drop={dynamic.drop!r} needs groups: set "
                         f"actor_rollout_ref.rollout.n >= 2 (it is {samples})")
    if not group_based:
        estimator = _get(_get(config, "algorithm"), "adv_estimator")
        raise ValueError(f"beyond_agent.dynamic_sampling.drop={dynamic.drop!r} drops groups whose rewards are all "
                         f"equal, which only carry no signal for a group-based estimator (grpo, rloo, gigpo, ...); "
                         f"algorithm.adv_estimator={estimator!r} is not one: set dynamic_sampling.drop=none")


def _check_rollout_engine(config: Any, mode: str) -> None:
    """`beyond_agent.rollout_mode` against what the rollout engine must allow for it."""
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    if mode == "async" and _get(rollout, "free_cache_engine", False):
        # verl puts the rollout engine to sleep after each generation when this is on, and async episodes
        # are still generating then.
        raise ValueError("beyond_agent.rollout_mode=async needs actor_rollout_ref.rollout.free_cache_engine=false "
                         "(the rollout server must keep serving while the actor trains)")


def _check_val_max_rounds(value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"beyond_agent.val_max_rounds must be >= 1 or null, got {value!r}")


def _named(build: Callable, *args: Any, **kwargs: Any) -> Any:
    """`build(...)`, with a validation error's class field replaced by the config key a user sets."""
    try:
        return build(*args, **kwargs)
    except (TypeError, ValueError) as error:
        text = str(error)
        for class_field, key in CONFIG_KEYS.items():
            text = re.sub(rf"\b{re.escape(class_field)}\b", key, text)
        raise ValueError(text) from None


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, Mapping):
        return node.get(key, default)
    return getattr(node, key, default) if hasattr(node, key) else default


def _section(node: Any, where: str) -> dict:
    """An OmegaConf node or mapping as a plain dict (interpolations resolved)."""
    if node is None:
        raise ValueError(f"the config has no `{where}` section: compose the config from an RL recipe's YAML "
                         "(its config/beyond_agent_trainer.yaml sets every key)")
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ValueError(f"`{where}` must be a mapping, got {type(node).__name__}")
    return dict(node)
