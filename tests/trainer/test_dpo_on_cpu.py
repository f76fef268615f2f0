"""DPO on pairs of trajectories (beyond_agent/dpo.py, the recipe/dpo program): pairing, the loss on trained tokens only, and
verl's SFT trainer running it on CPU.

The episodes are real: FrozenLake maps served by envservice, played through our EpisodeLoop by scripted
policies (beyond_agent/rollout/scripted.py), the oracle's shortest path (success, reward 1) and
walking into the left wall (reward 0), so each map gives one pair with the same first prompt, tokenised by
the tiny model's tokenizer and chat template exactly as a rollout would be.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from beyond_agent.dpo import TrajectoryDPODataset, collate_pairs, dpo_loss, preference_pairs, sequence_log_probs
from beyond_agent.sft import hf_model_dir, sft_command
from beyond_agent.trajectories import write_dump
from beyond_agent.trajectory_data import TrajectoryDataError

MAPS = range(8)


@pytest.fixture(scope="module")
def pair_dump(frozenlake_episodes, tmp_path_factory):
    """A dump with one oracle (success) and one wall-walking (failure) episode per FrozenLake map."""
    records = frozenlake_episodes(MAPS, ["oracle", lambda oracle: ["left"] * 6])
    assert [r.success for r in records] == [True, False] * len(MAPS)
    folder = tmp_path_factory.mktemp("pairs")
    write_dump(folder / "trajectories", 0, "train", records)
    return folder / "trajectories", records


def config(**values):
    from omegaconf import OmegaConf

    return OmegaConf.create({"max_length": 4096, "truncation": "error", "pad_mode": "no_padding",
                             "min_reward_margin": 0.5, **values})


def test_pairs_join_the_best_and_worst_episode_of_one_task_and_prompt(pair_dump):
    _, records = pair_dump
    pairs = preference_pairs(records, min_reward_margin=0.5)
    assert len(pairs) == len(MAPS)
    for chosen, rejected in pairs:
        assert chosen.success and not rejected.success and chosen.task == rejected.task
        assert chosen.prompt_ids == rejected.prompt_ids
    assert preference_pairs(records, min_reward_margin=2.0) == []  # reward gap 1 < 2
    with pytest.raises(TrajectoryDataError, match="min_reward_margin must be > 0"):
        preference_pairs(records, 0.0)


def test_no_pair_is_a_clear_error(pair_dump, tiny_model_dir):
    from transformers import AutoTokenizer

    folder, _ = pair_dump
    with pytest.raises(TrajectoryDataError, match="no preference pair .* >= data.min_reward_margin \\(5.0\\)"):
        TrajectoryDPODataset([str(folder)], AutoTokenizer.from_pretrained(tiny_model_dir), config(min_reward_margin=5.0))


def test_dpo_loss_is_log2_at_the_reference_and_only_trained_tokens_get_gradient(pair_dump, tiny_model_dir):
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu

    folder, _ = pair_dump
    dataset = TrajectoryDPODataset([str(folder)], AutoTokenizer.from_pretrained(tiny_model_dir), config())
    generator = torch.Generator().manual_seed(0)
    for pair in dataset.rows:
        for row in pair:  # any reference log-probs; the policy starts equal to them
            row["ref_log_probs"] = -torch.rand(len(row["input_ids"]), generator=generator)
    batch = collate_pairs([dataset[0], dataset[1]])
    values = batch["ref_log_probs"].values().clone().requires_grad_(True)
    policy = torch.nested.nested_tensor_from_jagged(values, batch["ref_log_probs"].offsets())
    data = tu.get_tensordict(tensor_dict=dict(batch), non_tensor_dict={"global_batch_size": 2, "dp_size": 1})

    loss, metrics = dpo_loss(None, {"log_probs": policy}, data, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # policy == reference: margin 0 for both pairs
    assert metrics["dpo/margin"] == 0.0
    loss.backward()
    scores_trained = torch.roll(batch["loss_mask"].values(), -1).bool()
    assert (values.grad[~scores_trained] == 0).all()  # prompt, observations, template: no gradient
    # d loss / d log pi = -beta * sigmoid(0) / pairs = -0.025 on chosen tokens, +0.025 on rejected ones.
    rows = torch.repeat_interleave(torch.arange(4), batch["input_ids"].offsets().diff())
    chosen = scores_trained & (rows % 2 == 0)
    assert torch.allclose(values.grad[chosen], torch.tensor(-0.025))
    assert torch.allclose(values.grad[scores_trained & ~chosen], torch.tensor(0.025))
    sums = sequence_log_probs(policy, batch["loss_mask"])
    assert sums.shape == (4,) and (sums < 0).all()


@pytest.mark.training
@pytest.mark.parametrize("lora", [[], ["model.lora_rank=8", "model.lora_alpha=16"]], ids=["full", "lora"])
def test_verls_trainer_runs_dpo_two_steps_on_cpu(pair_dump, tiny_model_dir, tmp_path, lora):
    """Full-model DPO, and DPO of a LoRA adapter (whose reference, scored before the first step, is the base: the
    adapter starts at B = 0)."""
    folder, _ = pair_dump
    out = tmp_path / "dpo"
    command, env = sft_command([
        f"data.train_files={folder}", f"model.path={tiny_model_dir}", "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=2", "optim.lr=1e-2", "dpo.beta=0.5",
        f"trainer.default_local_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}",
        *lora,
    ], "recipe.dpo.main", cpu=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    logged = [json.loads(line)["data"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2
    # Step 1 runs at the starting weights, which are the reference: every margin is 0 and the loss log 2.
    assert logged[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert logged[0]["train/grad_norm"] > 0
    # Step 2 runs after one update on other maps' pairs: the policy has moved away from the reference.
    assert logged[1]["train/dpo/margin"] != 0.0 and math.isfinite(logged[1]["train/loss"])
    assert (hf_model_dir(out) / "model.safetensors").exists()
    assert (hf_model_dir(out).parent.name == "lora_export") == bool(lora)  # LoRA: the adapter merged into the base


def test_odd_micro_batches_are_refused_naming_the_key(pair_dump, tiny_model_dir):
    from transformers import AutoTokenizer

    folder, _ = pair_dump
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(TrajectoryDataError, match="even data.micro_batch_size_per_gpu \\(rows; got 3\\)"):
        TrajectoryDPODataset([str(folder)], tokenizer, config(micro_batch_size_per_gpu=3))
    with pytest.raises(TrajectoryDataError, match="use_dynamic_bsz=false"):
        TrajectoryDPODataset([str(folder)], tokenizer, config(micro_batch_size_per_gpu=4, use_dynamic_bsz=True))
