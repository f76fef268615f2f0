"""BeyondAgentLoopManager: verl's rollout manager seam, filled with our ParallelEnvManager.

verl 0.9's RayPPOTrainer builds its rollout manager as
`AgentLoopManager.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)` and lets a
config key swap the class (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`); `fit()` then calls
`generate_sequences(batch)` once per step with `meta_info["global_steps"]`. BeyondAgentTrainer sets that
key to this class, so verl's `fit()` runs unchanged and every episode is played against envservice.

What goes back to verl per row: prompts, responses, response_mask, input_ids, attention_mask,
position_ids, rollout_log_probs, rm_scores (the env's score on the last policy token), the input's
non-tensor fields, `__num_turns__` (verl logs num_turns/*) and `success` (verl's validation logs it per
data source). Our rollout figures go in `meta_info["timing"]`, which verl logs as `timing_s/<key>`, the
same channel verl's own agent loop uses for its counters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from envservice.client import EnvClient
from recipe.beyond_agent.rollout.actions import get_action_parser
from recipe.beyond_agent.rollout.dataflow import DEFAULT_SYSTEM_PROMPT, DataflowConfig, EpisodeResult, EpisodeSpec
from recipe.beyond_agent.rollout.env_manager import ParallelEnvManager, RolloutOutput, build_training_batch
from recipe.beyond_agent.rollout.llm import AsyncLLMServerManager, LLMManagerConfig, SamplingParams, VerlLLMServerBackend
from recipe.beyond_agent.settings import BeyondAgentSettings, is_group_estimator

logger = logging.getLogger(__name__)
TASK_FIELDS = ("env_id", "task_id", "seed", "split")


def episode_specs(non_tensor_batch: dict, default_env_id: str | None) -> list[EpisodeSpec]:
    """One EpisodeSpec per row, from the row's `extra_info` (written by recipe.beyond_agent.data)."""
    extra_infos = non_tensor_batch.get("extra_info")
    uids = non_tensor_batch.get("uid")
    if extra_infos is None:
        raise ValueError("the batch has no `extra_info` column: write the dataset with "
                         "`python -m recipe.beyond_agent.data` (it stores env_id/task_id/seed/split there)")
    specs = []
    for row, info in enumerate(extra_infos):
        info = dict(info or {})
        env_id = info.get("env_id") or default_env_id
        if not env_id:
            raise ValueError(f"row {row}: extra_info has no env_id and beyond_agent.env.env_id is not set")
        specs.append(EpisodeSpec(env_id=env_id, task_id=info.get("task_id"), seed=info.get("seed"),
                                 split=info.get("split") or "train", params=dict(info.get("params") or {}),
                                 group_id=str(uids[row]) if uids is not None else f"row{row}", index=row))
    return specs


def rollout_timing(output: RolloutOutput, llm_busy_s: float) -> dict[str, float]:
    """Our per-step figures for verl's `timing` channel (logged as timing_s/beyond_agent/...)."""
    figures = {f"beyond_agent/{key}": value for key, value in output.metrics.as_dict(prefix="").items()}
    figures["beyond_agent/llm_busy_s"] = llm_busy_s
    return figures


class BeyondAgentLoopManager:
    """The rollout manager verl's trainer calls: one ParallelEnvManager run per `generate_sequences`."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, llm: AsyncLLMServerManager | None = None):
        """`llm` replaces the front over verl's `llm_client` (e.g. vLLM servers over HTTP outside training)."""
        from verl.utils import hf_tokenizer

        self.config = config
        self.settings = BeyondAgentSettings.from_config(config)
        model = config.actor_rollout_ref.model
        self.tokenizer = hf_tokenizer(model.path, trust_remote_code=model.get("trust_remote_code", False))
        self.llm = llm or AsyncLLMServerManager(VerlLLMServerBackend(llm_client), LLMManagerConfig(
            max_in_flight=self.settings.concurrency, request_timeout_s=self.settings.llm_request_timeout_s))
        self.env_client = EnvClient(self.settings.env_url, token=self.settings.env_token,
                                    timeout=self.settings.env_timeout_s, pool_size=self.settings.concurrency)
        self.parser = get_action_parser(self.settings.action_format)
        self.group_based = is_group_estimator(config.algorithm.adv_estimator)

    @classmethod
    def create(cls, config: Any, llm_client: Any, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None) -> "BeyondAgentLoopManager":
        """verl's factory signature (its own manager's `create` is async and starts Ray workers; ours needs none)."""
        return cls(config, llm_client, teacher_client, reward_loop_worker_handles)

    def max_rounds(self, meta_info: dict) -> int:
        """The round limit for this call: a pure function of verl's global step (validation may fix it)."""
        if meta_info.get("validate") and self.settings.val_max_rounds:
            return int(self.settings.val_max_rounds)
        return self.settings.rounds.max_rounds(int(meta_info.get("global_steps", 0)))

    def sampling(self, meta_info: dict) -> SamplingParams:
        """Training samples at the rollout temperature; validation follows val_kwargs (greedy unless do_sample)."""
        rollout = self.config.actor_rollout_ref.rollout
        if meta_info.get("validate"):
            temperature = rollout.val_kwargs.temperature if rollout.val_kwargs.do_sample else 0.0
            top_p = rollout.val_kwargs.top_p if rollout.val_kwargs.do_sample else 1.0
        else:
            temperature, top_p = rollout.temperature, rollout.top_p
        return SamplingParams(temperature=float(temperature), top_p=float(top_p))

    def dataflow_config(self, max_rounds: int) -> DataflowConfig:
        data = self.config.data
        return DataflowConfig(max_rounds=max_rounds, max_prompt_length=int(data.max_prompt_length),
                              max_response_length=int(data.max_response_length),
                              max_tokens_per_turn=self.settings.max_tokens_per_turn,
                              system_prompt=self.settings.system_prompt or DEFAULT_SYSTEM_PROMPT,
                              episode_timeout_s=self.settings.episode_timeout_s)

    def generate_sequences(self, prompts: Any) -> Any:
        """Play one episode per row and return verl's rollout batch (see the module docstring)."""
        meta = dict(prompts.meta_info)
        specs = episode_specs(prompts.non_tensor_batch, self.settings.default_env_id)
        manager = ParallelEnvManager(self.env_client, self.llm.with_sampling(self.sampling(meta)), self.tokenizer,
                                     self.parser, self.dataflow_config(self.max_rounds(meta)),
                                     max_workers=self.settings.concurrency)
        busy_before = self.llm.metrics().busy_time_s
        output = manager.run(specs)
        batch, _ = build_training_batch(output.results, self.tokenizer.pad_token_id,
                                        int(self.config.data.max_prompt_length),
                                        int(self.config.data.max_response_length),
                                        policy=self.settings.failure_policy, group_based=self.group_based)
        self._attach_fields(batch, prompts, output.results)
        batch.meta_info = {"timing": rollout_timing(output, self.llm.metrics().busy_time_s - busy_before),
                           "reward_extra_keys": ["success"]}
        self._log_step(meta, output)
        return batch

    def _attach_fields(self, batch: Any, prompts: Any, results: list[EpisodeResult]) -> None:
        rows = len(results)
        # The input's non-tensor fields come back unchanged: verl unions this batch with its own copy.
        for key, values in prompts.non_tensor_batch.items():
            batch.non_tensor_batch[key] = values
        batch.non_tensor_batch["success"] = np.array([float(r.success) for r in results], dtype=np.float32)
        batch.non_tensor_batch["multi_modal_inputs"] = np.array([{} for _ in range(rows)], dtype=object)

    def _log_step(self, meta: dict, output: RolloutOutput) -> None:
        step = int(meta.get("global_steps", 0))
        m = output.metrics
        kind = "validation" if meta.get("validate") else "training"
        print(f"[beyond_agent] step {step} {kind} rollout: {m.episodes} episodes, success {m.success_rate:.3f}, "
              f"mean rounds {m.mean_rounds:.2f}, terminations {m.terminations}, wall {m.wall_time_s:.1f} s", flush=True)
        every = self.settings.trajectory_every
        if every and not meta.get("validate") and step % every == 0:
            self._dump_trajectories(step, output.results)

    def _dump_trajectories(self, step: int, results: list[EpisodeResult]) -> None:
        folder = Path(self.settings.trajectory_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step}.jsonl"
        with path.open("w") as out:
            for result in results[: self.settings.trajectory_max_per_step]:
                out.write(json.dumps(result.to_record()) + "\n")
