"""SFT on trajectory records through verl's own SFT trainer (beyond_agent/sft.py, trajectory_data.py; the recipe/sft program).

The records are real: the dumps of a recorded BeyondAgentTrainer run (tests/viewer/recorded_run), written by
our rollout with the tiny model's tokenizer and chat template. The loss check runs verl's `sft_loss` on
rows our dataset gives verl's collator; the training run is verl's SFT trainer under torchrun on CPU
(~40 s).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from beyond_agent.sft import TrajectorySFTDataset, hf_model_dir, report_iterations, sft_command
from beyond_agent.trajectories import read_dump
from beyond_agent.trajectory_data import (
    TrajectoryDataError,
    TrajectoryFilter,
    read_trajectories,
    trajectory_files,
    training_row,
)

RECORDED = Path(__file__).resolve().parents[1] / "viewer" / "recorded_run" / "checkpoints" / "trajectories"


def data_config(**values):
    from omegaconf import OmegaConf

    return OmegaConf.create({"max_length": 4096, "truncation": "error", "pad_mode": "no_padding", **values})


def test_a_training_row_is_the_records_exact_tokens_with_loss_only_where_the_policy_wrote():
    record = next(read_dump(RECORDED / "step_1.jsonl"))
    row = training_row(record)
    assert row.input_ids == record.prompt_ids + record.response_ids
    assert row.loss_mask == [0] * len(record.prompt_ids) + record.response_mask
    # Each assistant turn's last token (turn_ends) is trained on; observation tokens between turns are not.
    start = len(record.prompt_ids)
    assert all(row.loss_mask[start + end] == 1 for end in record.turn_ends if end >= 0)
    assert 0 < sum(row.loss_mask) < len(row.input_ids) - len(record.prompt_ids)


def test_truncation_is_an_error_unless_asked_and_then_cuts_the_chosen_side():
    record = next(read_dump(RECORDED / "step_1.jsonl"))
    length = len(record.prompt_ids) + len(record.response_ids)
    with pytest.raises(TrajectoryDataError, match=f"has {length} tokens > max_length 100"):
        training_row(record, max_length=100)
    full = training_row(record)
    assert training_row(record, 100, "left").input_ids == full.input_ids[-100:]
    assert training_row(record, 100, "right").loss_mask == full.loss_mask[:100]
    with pytest.raises(TrajectoryDataError, match="truncation 'middle'; valid: error, left, right"):
        training_row(record, 100, "middle")


def test_filters_keep_what_they_name_and_never_infrastructure_failures():
    records = list(read_trajectories(RECORDED))
    assert len(records) == sum(1 for path in trajectory_files(RECORDED) for _ in read_dump(path))
    assert {r.kind for r in read_trajectories(RECORDED, TrajectoryFilter(kinds=("val",)))} == {"val"}
    lengths = read_trajectories(RECORDED, TrajectoryFilter.from_mapping({"terminations": "length"}))
    assert lengths and {r.termination for r in lengths} == {"length"}
    assert read_trajectories(RECORDED, TrajectoryFilter(success=True)) == []  # the random model never won
    assert read_trajectories(RECORDED, TrajectoryFilter(min_reward=0.0)) == [r for r in records if r.reward >= 0]

    broken = records[0]
    broken.termination = "env_error"
    assert not TrajectoryFilter().keeps(broken)


def test_bad_filter_keys_and_paths_are_named(tiny_model_dir):
    from transformers import AutoTokenizer

    with pytest.raises(TrajectoryDataError, match=r"unknown key\(s\) \[.sucess.\]; valid keys: success, min_reward, terminations"):
        TrajectoryFilter.from_mapping({"sucess": True})
    with pytest.raises(TrajectoryDataError, match="success must be true, false or null; got 'yes'"):
        TrajectoryFilter.from_mapping({"success": "yes"})
    with pytest.raises(TrajectoryDataError, match="does not exist"):
        trajectory_files("/nonexistent/trajectories")
    with pytest.raises(TrajectoryDataError, match="passes the filter"):
        TrajectorySFTDataset([str(RECORDED)], AutoTokenizer.from_pretrained(tiny_model_dir),
                             data_config(trajectory_filter={"success": True}))
    with pytest.raises(TrajectoryDataError, match="data.train_files is not set"):  # the config's default: null
        TrajectorySFTDataset(None, AutoTokenizer.from_pretrained(tiny_model_dir), data_config())


def test_a_weight_repeats_every_file_and_the_loops_refuse_bad_ones_before_any_model_starts(tmp_path, recipe_config):
    from recipe.agent_r import main as agent_r_loop
    from recipe.agentevol import main as agentevol
    from beyond_agent.sft import repeated_files

    files = trajectory_files(RECORDED)
    assert repeated_files(RECORDED, 3) == [str(path) for path in files for _ in range(3)]
    assert len(read_trajectories(repeated_files(RECORDED, 2))) == 2 * len(read_trajectories(RECORDED))
    with pytest.raises(TrajectoryDataError, match="integer >= 1; got 0"):
        repeated_files(RECORDED, 0)

    empty = tmp_path / "reflections.txt"
    empty.write_text("\n  \n")
    def agentevol_config(*overrides: str, **values):
        return recipe_config("agentevol", "agentevol", ["env=frozenlake", "base_model=m", *overrides], **values)

    def agent_r_config(*overrides: str, **values):
        return recipe_config("agent_r", "agent_r", ["env=frozenlake", "model=m", *overrides], **values)

    refused = {  # each names the key to change, before any model starts
        "agentevol.base_trajectories/base_weight: a trajectory weight must be an integer >= 1; got 0":
            lambda: agentevol.run_config(agentevol_config("base_weight=0", base_trajectories=[str(RECORDED)])),
        "agentevol.base_trajectories/base_weight: trajectory path /nonexistent does not exist":
            lambda: agentevol.run_config(agentevol_config(base_trajectories=["/nonexistent"])),
        "agentevol: agentevol.base_trajectories required": lambda: agentevol.run_config(agentevol_config()),
        "agentevol.iterations must be an integer >= 1; got 0":
            lambda: agentevol.run_config(agentevol_config("iterations=0", base_trajectories=[str(RECORDED)])),
        "agentevol.backend='gpu' is not valid; choose one of":
            lambda: agentevol.run_config(agentevol_config("backend=gpu", base_trajectories=[str(RECORDED)])),
        "agentevol.explore_tasks:": lambda: agentevol.run_config(agentevol_config(
            "explore_tasks=a:b", base_trajectories=[str(RECORDED)])),
        "agent_r.replay/replay_weight: a trajectory weight must be an integer >= 1; got -1":
            lambda: agent_r_loop.run_config(agent_r_config("replay_weight=-1", replay=[str(RECORDED)])),
        f"agent_r.reflections: {empty} holds no sentence":
            lambda: agent_r_loop.run_config(agent_r_config(reflections=str(empty))),
        "agent_r.pairing='best' is not valid; choose one of all, one_to_one":
            lambda: agent_r_loop.run_config(agent_r_config("pairing=best")),
    }
    for message, call in refused.items():
        with pytest.raises(SystemExit) as refusal:
            call()
        assert message in str(refusal.value), (message, str(refusal.value))


def test_a_loops_iterations_are_kept_in_json_and_printed_one_row_each(tmp_path, capsys):
    figures = [{"iteration": 0, "eval_success": 0.25}, {"iteration": 1, "pairs": 3, "eval_success": 0.3125}]
    report_iterations(figures, tmp_path / "loop.json", 0.0, "loop", (("iteration", "iteration", "d"),
                      ("pairs", "pairs", "d"), ("eval success", "eval_success", ".1%")))
    assert json.loads((tmp_path / "loop.json").read_text())["iterations"] == figures
    assert capsys.readouterr().out.splitlines() == ["[loop] iteration  pairs  eval success",
                                                    "[loop]         0      -         25.0%",
                                                    "[loop]         1      3         31.2%"]


def test_observation_tokens_carry_no_gradient_in_verls_sft_loss(tiny_model_dir):
    """verl's sft_loss on our rows: d loss / d log p(token) is non-zero exactly on tokens the policy wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator
    from verl.workers.utils.losses import sft_loss

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = TrajectorySFTDataset([str(RECORDED / "step_1.jsonl")], tokenizer, data_config())
    batch = SFTTensorCollator("no_padding")([dataset[0], dataset[1]])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    # Per-token log-probabilities as verl's engine computes them: position i scores the token at i + 1.
    per_row = []
    for ids in batch["input_ids"].unbind():
        logits = model(input_ids=ids[None]).logits[0]  # [seq, vocab]
        next_ids = torch.roll(ids, -1)
        per_row.append(torch.log_softmax(logits, -1).gather(-1, next_ids[:, None])[:, 0])
    values = torch.cat(per_row).detach().requires_grad_(True)
    log_probs = torch.nested.nested_tensor_from_jagged(values, batch["input_ids"].offsets())
    loss_mask = batch["loss_mask"]
    trained_tokens = int(loss_mask.values().sum())
    data = tu.get_tensordict(tensor_dict=dict(batch), non_tensor_dict={"pad_mode": "no_padding"})
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=trained_tokens)

    loss, _ = sft_loss(None, {"log_probs": log_probs}, data)
    loss.backward()

    mask = loss_mask.values()
    scores_a_trained_token = torch.roll(mask, -1).bool()  # position i predicts token i + 1
    assert (values.grad[~scores_a_trained_token] == 0).all()  # prompt, observation and template tokens
    assert (values.grad[scores_a_trained_token] == -1.0 / trained_tokens).all()
    # ... and the loss is the mean negative log-likelihood of exactly the tokens the policy wrote.
    assert loss.item() == pytest.approx(-values[scores_a_trained_token].mean().item(), rel=1e-5)
    assert 0 < trained_tokens < int((~mask.bool()).sum())


@pytest.mark.training
def test_verls_sft_trainer_trains_a_lora_adapter_two_steps_on_trajectories_on_cpu(tiny_model_dir, tmp_path):
    """verl's SFT trainer with LoRA (`model.lora_rank`); the full-model SFT runs in the trainer tests' fixture
    `move_writing_model` and in the AgentEvol / Agent-R loops."""
    out = tmp_path / "sft"
    command, env = sft_command([
        f"data.train_files={RECORDED}", "data.trajectory_filter.kinds=[train]", f"model.path={tiny_model_dir}",
        "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=2",
        "optim.lr=1e-3", f"trainer.default_local_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}",
        "model.lora_rank=8", "model.lora_alpha=16",
    ], "recipe.sft.main", cpu=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1, 2]
    for entry in logged:
        assert math.isfinite(entry["data"]["train/loss"]) and entry["data"]["train/loss"] > 0
        assert entry["data"]["train/grad_norm"] > 0
    # verl's huggingface/ folder holds PEFT's state; the model we hand on is the adapter merged into the base
    # (bf16, as verl's model merger writes): only the targeted modules moved, each by the adapter's change.
    model_dir = hf_model_dir(out)
    assert model_dir == out / "global_step_2" / "lora_export" / "merged"
    assert hf_model_dir(out) == model_dir  # exported once, read back
    adapter = load_file(str(out / "global_step_2" / "lora_export" / "lora_adapter" / "adapter_model.safetensors"))
    merged, initial = load_file(str(model_dir / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(merged) == set(initial)
    changed = set()
    for name in adapter:
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            change = 2.0 * adapter[name.replace("lora_A", "lora_B")].float() @ adapter[name].float()
            moved = merged[module + ".weight"].float() - initial[module + ".weight"].bfloat16().float()
            assert change.norm() > 0 and (moved - change).norm() < 0.25 * change.norm(), module
            changed.add(module + ".weight")
    assert len(changed) == 14  # q, k, v, o, gate, up, down in 2 layers
    assert all(torch.equal(merged[name], initial[name].to(merged[name].dtype)) for name in set(initial) - changed)
