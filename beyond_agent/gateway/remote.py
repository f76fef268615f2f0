"""The agent's side of `beyond_agent.agent.command`: an `AgentContext` rebuilt from the command's environment.

A command agent finds its episode in its environment (`agents.CommandAgent` lists the variables). A Python
command can take the same `AgentContext` an in-process agent gets, its env stepping over HTTP through the
gateway:

    from beyond_agent.gateway.remote import episode_context

    if __name__ == "__main__":
        run(episode_context())          # the same run(ctx) the trainer could also call in-process

Any other language reads the variables and calls the two routes itself.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import requests

from beyond_agent.gateway.agents import AgentContext, EnvStep
from beyond_agent.rollout.episode_loop import EpisodeSpec


class RemoteEnv:
    """The episode's env session over the gateway's `/env` routes: `observation`, `done`, `step(action)`, like
    `agents.EnvSession`."""

    def __init__(self, url: str, key: str | None = None, timeout_s: float = 600.0) -> None:
        """`key`: the episode's (`OPENAI_API_KEY` of a command agent), sent with every request."""
        self.url, self.timeout_s = url, timeout_s
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        state = self._answer(requests.get(url, headers=self._headers, timeout=timeout_s))
        self.observation: str = state["observation"]
        """The env's latest observation."""
        self.done: bool = state["done"]
        """True once the env ended the episode or its step limit was reached."""
        self.max_steps: int = state["max_steps"]
        """Env steps this episode may take."""

    def step(self, action: str) -> EnvStep:
        """Apply one action; RuntimeError once the episode is over or when the env failed (then stop)."""
        answer = self._answer(requests.post(f"{self.url}/step", json={"action": action}, headers=self._headers,
                                            timeout=self.timeout_s))
        self.observation, self.done = answer["observation"], answer["done"]
        return EnvStep(answer["observation"], float(answer["reward"]), bool(answer["terminated"]),
                       bool(answer["truncated"]), dict(answer.get("info") or {}))

    @staticmethod
    def _answer(response: requests.Response) -> dict[str, Any]:
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise RuntimeError(f"the env answered {response.status_code}: {message}")
        return response.json()


def episode_context(environment: Mapping[str, str] | None = None) -> AgentContext:
    """The `AgentContext` of the episode this command was started for (KeyError naming a missing variable)."""
    environment = os.environ if environment is None else environment
    missing = [name for name in ("OPENAI_BASE_URL", "BEYOND_AGENT_MODEL", "BEYOND_AGENT_ENV_URL",
                                 "BEYOND_AGENT_EPISODE") if name not in environment]
    if missing:
        raise KeyError(f"not started as a command agent: {', '.join(missing)} not set "
                       "(beyond_agent.agent.command sets them per episode)")
    episode = json.loads(environment["BEYOND_AGENT_EPISODE"])
    spec = EpisodeSpec(env_id=episode["env_id"], task_id=episode.get("task_id"), seed=episode.get("seed"),
                       split=episode.get("split") or "train", group_id=episode.get("group_id") or "",
                       index=int(episode.get("index") or 0))
    key = environment.get("OPENAI_API_KEY", "unused")
    return AgentContext(environment["OPENAI_BASE_URL"], key, environment["BEYOND_AGENT_MODEL"],
                        RemoteEnv(environment["BEYOND_AGENT_ENV_URL"], key), spec,
                        env_url=environment["BEYOND_AGENT_ENV_URL"])
