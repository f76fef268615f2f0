"""Our keys of the training config (`beyond_agent:` in config/beyond_agent_trainer.yaml), validated early.

Everything else in the config is verl's. Errors name the key and, where there is a fixed set, the valid
choices, before any Ray actor starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from recipe.beyond_agent.rollout.actions import ACTION_PARSERS
from recipe.beyond_agent.rollout.rounds import RoundScheduler

# Estimators whose baseline is computed from the other samples of the same prompt (verl's `uid` group):
# an infrastructure failure takes its whole group out of training with it.
NON_GROUP_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax")
FAILURE_POLICIES_IN_TRAINING = ("mask",)


@dataclass
class BeyondAgentSettings:
    """The validated `beyond_agent:` section."""

    env_url: str
    """envservice base URL, e.g. http://127.0.0.1:8000."""
    env_token: str | None
    """Bearer token when the service requires one."""
    default_env_id: str | None
    """Env id for dataset rows whose extra_info names none."""
    env_timeout_s: float
    """Seconds per envservice request."""
    rounds: RoundScheduler
    """Round limit per training step (ScalingInter-RL when stepwise)."""
    val_max_rounds: int | None
    """Round limit in validation; None uses the schedule's value at the current step."""
    action_format: str
    """Name of the action parser (see rollout/actions.py)."""
    max_tokens_per_turn: int
    """New tokens per assistant turn at most."""
    system_prompt: str | None
    """System message of every episode; None uses the dataflow's default."""
    concurrency: int
    """Episodes in flight at once (threads), and the LLM front's in-flight limit."""
    episode_timeout_s: float
    """Wall-clock budget of one episode (past it: `timeout`, not reward)."""
    llm_request_timeout_s: float
    """Deadline of one generation request."""
    failure_policy: str
    """How infrastructure failures leave training; only `mask` keeps the shape verl's fit() needs."""
    trajectory_every: int
    """Write sampled trajectories every N training steps (0: never)."""
    trajectory_dir: str
    """Folder of the trajectories/step_<N>.jsonl files."""
    trajectory_max_per_step: int
    """Episodes written per dump at most."""

    @classmethod
    def from_config(cls, config: Any) -> "BeyondAgentSettings":
        """Read `config.beyond_agent` (an OmegaConf node or a mapping); raise ValueError naming the key."""
        section = _as_dict(_get(config, "beyond_agent", None), "beyond_agent")
        env = _as_dict(section.get("env", {}), "beyond_agent.env")
        dump = _as_dict(section.get("trajectories", {}), "beyond_agent.trajectories")
        settings = cls(
            env_url=_required(env, "url", "beyond_agent.env.url"),
            env_token=env.get("token") or None,
            default_env_id=env.get("env_id"),
            env_timeout_s=float(env.get("timeout_s", 90.0)),
            rounds=RoundScheduler.from_config(_as_dict(section.get("rounds", {"type": "fixed", "rounds": 8}),
                                                        "beyond_agent.rounds")),
            val_max_rounds=section.get("val_max_rounds"),
            action_format=section.get("action_format", "plain"),
            max_tokens_per_turn=int(section.get("max_tokens_per_turn", 256)),
            system_prompt=section.get("system_prompt"),
            concurrency=int(section.get("concurrency", 64)),
            episode_timeout_s=float(section.get("episode_timeout_s", 600.0)),
            llm_request_timeout_s=float(section.get("llm_request_timeout_s", 300.0)),
            failure_policy=section.get("failure_policy", "mask"),
            trajectory_every=int(dump.get("every", 0)),
            trajectory_dir=str(dump.get("dir", "trajectories")),
            trajectory_max_per_step=int(dump.get("max_per_step", 16)),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise ValueError for the first invalid field, naming it and the valid choices."""
        if self.action_format not in ACTION_PARSERS:
            raise ValueError(f"beyond_agent.action_format={self.action_format!r} is not registered; "
                             f"choose one of {sorted(ACTION_PARSERS)}")
        if self.failure_policy not in FAILURE_POLICIES_IN_TRAINING:
            raise ValueError(f"beyond_agent.failure_policy={self.failure_policy!r} is not valid in training; choose "
                             f"one of {list(FAILURE_POLICIES_IN_TRAINING)} (verl's fit() needs every row back)")
        for name in ("max_tokens_per_turn", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"beyond_agent.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("env_timeout_s", "episode_timeout_s", "llm_request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"beyond_agent.{name} must be > 0, got {getattr(self, name)}")
        if self.val_max_rounds is not None and int(self.val_max_rounds) < 1:
            raise ValueError(f"beyond_agent.val_max_rounds must be >= 1 or null, got {self.val_max_rounds}")
        if not self.env_url.startswith(("http://", "https://")):
            raise ValueError(f"beyond_agent.env.url must start with http:// or https://, got {self.env_url!r}")


def is_group_estimator(adv_estimator: str) -> bool:
    """Whether the advantage estimator baselines each sample against its group."""
    return str(adv_estimator) not in NON_GROUP_ESTIMATORS


def _get(config: Any, key: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default) if hasattr(config, key) else default


def _as_dict(node: Any, where: str) -> dict:
    if node is None:
        raise ValueError(f"the config has no `{where}` section; see recipe/beyond_agent/config/beyond_agent_trainer.yaml")
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    if not isinstance(node, Mapping):
        raise ValueError(f"`{where}` must be a mapping, got {type(node).__name__}")
    return dict(node)


def _required(section: dict, key: str, where: str) -> Any:
    value = section.get(key)
    if value in (None, ""):
        raise ValueError(f"{where} is required (e.g. http://127.0.0.1:8000 for a local envservice)")
    return value
