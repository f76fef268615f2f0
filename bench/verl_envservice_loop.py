"""verl's own agent loop playing envservice episodes: the baseline of bench/gpu_rollout.py.

verl 0.9 ships no env "interactions" (ToolAgentLoop only calls tools, and cannot start an episode or stop on the
env's `terminated`), so the baseline is an `AgentLoopBase` subclass that holds only the turn loop; everything
around it is verl's: AgentLoopManager and its Ray AgentLoopWorkers, LLMServerClient and its load balancer, the
vLLM servers, `apply_chat_template` / `turn_separator` and the post-processing into a padded batch. The loop is
written the way verl's ToolAgentLoop tokenises (generated ids appended as sampled, mask 1; each observation
rendered alone without the system prompt after `turn_separator`, mask 0; the same `response_length` rules) and
plays the same episode as our EpisodeLoop: the row's task (prompt, action parser) from our TaskTable, one env
step per parsed action, a parse error shown to the model instead, at most `max_rounds` replies of at most
`max_tokens_per_turn` tokens each, the score from /evaluate as the reward.

verl builds one instance per episode inside its worker processes, from the YAML `rollout.agent.
agent_loop_config_path` names (`write_agent_loop_config`); the worker imports this module, so bench/ must be on
the workers' PYTHONPATH (bench/gpu_rollout.py sets it before Ray starts).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer

AGENT_NAME = "envservice_turns"
_WORKER_STATE: dict[str, Any] = {}
"""Per worker process: the env client, its threads and the task table (verl builds a loop object per episode)."""


def _worker_state(config: Any, concurrency: int) -> dict[str, Any]:
    """The env client, a thread pool for its blocking calls and our settings, built once per worker process."""
    if not _WORKER_STATE:
        from envservice.client import EnvClient
        from beyond_agent.settings import BeyondAgentConfig

        settings = BeyondAgentConfig.from_config(config)
        _WORKER_STATE.update(
            settings=settings,
            env=EnvClient(settings.env.url, token=settings.env.token, timeout=settings.env.timeout_s,
                          pool_size=concurrency),
            # Why a pool of our own: the loop's default executor has min(32, cpus + 4) threads, which would
            # cap the episodes in flight below `concurrency`.
            pool=ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="envservice"))
    return _WORKER_STATE


class EnvServiceTurnsLoop(AgentLoopBase):
    """One envservice episode per row through verl's agent-loop machinery (see the module docstring)."""

    def __init__(self, *args: Any, max_rounds: int, max_tokens_per_turn: int, concurrency: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_rounds = int(max_rounds)
        self.max_tokens_per_turn = int(max_tokens_per_turn)
        self.response_length = int(self.rollout_config.response_length)
        self.state = _worker_state(self.config, int(concurrency))

    async def _env(self, call: Any, *args: Any) -> Any:
        return await self.loop.run_in_executor(self.state["pool"], call, *args)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Play the row's episode; the response is every reply and observation after the prompt."""
        info = dict(kwargs.get("extra_info") or {})
        settings, env = self.state["settings"], self.state["env"]
        env_id = info.get("env_id") or settings.env.env_id
        task = settings.tasks.for_row(env_id, info.get("task"))
        metrics: dict[str, Any] = {}
        request_id = uuid4().hex  # one id per episode: verl's balancer keeps it on one server (prefix cache)
        with simple_timer("tool_calls", metrics):  # env time goes where verl puts tool time
            created = await self._env(env.create, env_id, info.get("task_id"), info.get("seed"),
                                      info.get("split") or "train", dict(info.get("params") or {}))
        replies = observations = 0
        llm_s = 0.0  # seconds waiting for replies, this episode's own (verl's timing reaches the batch as min/mean/max)
        try:
            prompt_ids = await self.apply_chat_template(task.first_messages(created.observation,
                                                                             list(kwargs.get("raw_prompt") or [])))
            ids, mask, logprobs = list(prompt_ids), [], []
            for round_number in range(1, self.max_rounds + 1):
                room = self.response_length - len(mask)
                if room <= 0:
                    break
                params = {**sampling_params, "max_tokens": min(self.max_tokens_per_turn, room)}
                started = time.perf_counter()
                with simple_timer("generate_sequences", metrics):
                    out = await self.server_manager.generate(request_id=request_id, prompt_ids=ids,
                                                             sampling_params=params)
                llm_s += time.perf_counter() - started
                replies += 1
                ids += out.token_ids
                mask += [1] * len(out.token_ids)  # sampled by the policy: trained on
                logprobs += out.log_probs or [0.0] * len(out.token_ids)
                if len(mask) >= self.response_length:
                    break
                parsed = task.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
                ended = False
                observation = parsed.error
                if parsed.action is not None:
                    with simple_timer("tool_calls", metrics):
                        step = await self._env(env.step, created.session_id, parsed.action)
                    observation, ended = step.observation, bool(step.terminated or step.truncated)
                if ended or round_number == self.max_rounds:
                    break
                observation_ids = self.turn_separator + await self.apply_chat_template(
                    [{"role": "user", "content": observation}], remove_system_prompt=True)
                if len(mask) + len(observation_ids) >= self.response_length:  # ToolAgentLoop's rule
                    break
                ids += observation_ids
                mask += [0] * len(observation_ids)  # the env's text: never trained on
                logprobs += [0.0] * len(observation_ids)
                observations += 1
            with simple_timer("tool_calls", metrics):
                score = float((await self._env(env.evaluate, created.session_id)).score)
        finally:
            await self._env(env.release, created.session_id)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):][: self.response_length],
            response_mask=mask[: self.response_length], response_logprobs=logprobs[: self.response_length],
            reward_score=score, num_turns=replies + observations + 1, metrics=metrics,
            extra_fields={"replies": replies, "llm_s": llm_s})


def write_agent_loop_config(path: Path, max_rounds: int, max_tokens_per_turn: int, concurrency: int) -> Path:
    """The YAML that `rollout.agent.agent_loop_config_path` names: this loop under AGENT_NAME, with its limits."""
    OmegaConf.save(OmegaConf.create([{"name": AGENT_NAME, "_target_": f"{__name__}.EnvServiceTurnsLoop",
                                      "max_rounds": max_rounds, "max_tokens_per_turn": max_tokens_per_turn,
                                      "concurrency": concurrency}]), path)
    return path
