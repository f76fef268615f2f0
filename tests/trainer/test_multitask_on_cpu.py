"""Multi-task runs (beyond_agent/multitask.py): the weighted task sampler, per-task rollout figures and
AgentRL's per-task advantage normalisation, on hand-made inputs and real torchdata / verl / Hydra parts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from torchdata.stateful_dataloader import StatefulDataLoader

from recipe.multiturn_rl.main import check_config
from beyond_agent.multitask import (
    MultitaskConfig,
    WeightedTaskSampler,
    apply_task_advantage_norm,
    normalize_task_advantages,
    task_name,
    task_names,
    task_rollout_metrics,
)
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.sections import from_section

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe/multiturn_rl/config"
ROW_TASKS = ["frozenlake"] * 10 + ["babyai"] * 30  # the small task has a third of the big one's rows


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("beyond_agent_trainer", overrides=list(overrides))


# ---- a row's task -------------------------------------------------------------------------------

def test_a_row_s_task_is_its_data_source():
    assert task_name({"data_source": "babyai", "extra_info": {"env_id": "frozenlake"}}) == "babyai"
    assert task_name({"extra_info": {"env_id": "babyai"}}) == "unknown"  # verl's validation name for such rows
    batch = {"data_source": np.array(["babyai", "frozenlake", "babyai"], dtype=object), "uid": np.array(["a"] * 3)}
    assert task_names(batch, 3) == ["babyai", "frozenlake", "babyai"]
    assert task_names({"uid": np.array(["a", "b"])}, 2) == ["unknown", "unknown"]


# ---- weighted sampling --------------------------------------------------------------------------

def draws(sampler: WeightedTaskSampler, epochs: int) -> list[int]:
    return [index for _ in range(epochs) for index in sampler]


def test_tasks_appear_in_proportion_to_their_weights_not_their_rows():
    sampler = WeightedTaskSampler(ROW_TASKS, {"frozenlake": 2, "babyai": 1}, seed=0)
    assert len(sampler) == 40  # an epoch keeps the dataset's length
    drawn = draws(sampler, 100)
    share = Counter(ROW_TASKS[i] for i in drawn)["frozenlake"] / len(drawn)
    assert share == pytest.approx(2 / 3, abs=0.03)  # uniform rows would give it 1/4
    # Within one epoch a task's rows are used evenly: a fresh permutation, cycled.
    first_epoch = Counter(drawn[:40])
    for task in ("frozenlake", "babyai"):
        counts = [first_epoch[row] for row, name in enumerate(ROW_TASKS) if name == task]
        assert max(counts) - min(counts) <= 1, (task, counts)


def test_a_task_weighted_zero_is_never_drawn():
    sampler = WeightedTaskSampler(ROW_TASKS, {"frozenlake": 0, "babyai": 1}, seed=0)
    assert {ROW_TASKS[i] for i in draws(sampler, 5)} == {"babyai"}
    assert sampler.tasks == ["babyai"]


def test_draws_are_a_function_of_the_seed():
    weights = {"frozenlake": 1, "babyai": 1}
    first = draws(WeightedTaskSampler(ROW_TASKS, weights, seed=7), 3)
    assert first == draws(WeightedTaskSampler(ROW_TASKS, weights, seed=7), 3)
    assert first != draws(WeightedTaskSampler(ROW_TASKS, weights, seed=8), 3)
    assert first[:40] != first[40:80]  # each epoch draws anew


def loader(seed: int = 3) -> StatefulDataLoader:
    """A loader as verl builds it (torchdata's StatefulDataLoader, drop_last) over row indices."""
    sampler = WeightedTaskSampler(ROW_TASKS[:10] + ROW_TASKS[-10:], {"frozenlake": 3, "babyai": 1}, seed=seed)
    return StatefulDataLoader(list(range(20)), batch_size=6, sampler=sampler, drop_last=True,
                              collate_fn=lambda rows: rows)


def test_a_resumed_loader_continues_with_the_draws_of_the_uninterrupted_one():
    whole = loader()
    uninterrupted = [batch for _ in range(3) for batch in whole]  # 3 epochs of 3 batches (2 draws dropped each)
    first = loader()
    taken = list(first)  # epoch 0 ...
    epoch_1 = iter(first)
    taken.append(next(epoch_1))  # ... and one batch of epoch 1, then a checkpoint (what verl saves)
    state = first.state_dict()

    resumed = loader()  # a new process: fresh sampler and loader, the checkpoint loaded
    resumed.load_state_dict(state)
    taken += list(resumed)  # the rest of epoch 1
    taken += list(resumed)  # epoch 2
    assert taken == uninterrupted
    assert state["_sampler_iter_state"]["sampler_state"] == {"epoch": 1, "yielded": 6}


# ---- bad weights --------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "message"), [
    ({"task_weights": {"babyai": -1, "frozenlake": 1}},
     r"beyond_agent\.multitask\.task_weights\.babyai must be a number >= 0, got -1"),
    ({"task_weights": {"babyai": 0, "frozenlake": 0}},
     r"beyond_agent\.multitask\.task_weights are all 0: give at least one task a weight > 0 \(tasks named: babyai, "),
    ({"task_weights": {"babyai": "two"}}, r"task_weights\.babyai must be a number >= 0, got 'two'"),
    ({"task_weights": [1, 2]}, r"task_weights must map task names to weights"),
    ({"task_advantage_norm": "yes"}, r"task_advantage_norm must be true or false"),
    ({"task_weight": {"babyai": 1}}, r"multitask has unknown key\(s\) \['task_weight'\]; valid keys: task_weights, "),
])
def test_bad_multitask_settings_are_refused_naming_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        from_section(MultitaskConfig, section, "beyond_agent.multitask")


def test_weights_must_name_exactly_the_tasks_of_the_data():
    with pytest.raises(ValueError, match=r"task_weights names unknown task\(s\) \['babyia'\]; the tasks "
                                         r"\(data_source\) of data\.train_files are: babyai, frozenlake"):
        WeightedTaskSampler(ROW_TASKS, {"babyia": 1, "frozenlake": 1})
    with pytest.raises(ValueError, match=r"gives no weight to task\(s\) \['babyai'\] of data\.train_files \(give 0 "
                                         r"to leave a task out\); the tasks are: babyai, frozenlake"):
        WeightedTaskSampler(ROW_TASKS, {"frozenlake": 1})


@pytest.fixture
def train_files(tmp_path) -> str:
    """Two parquet files as beyond_agent.data writes them (only the column the task comes from)."""
    paths = []
    for env in ("babyai", "frozenlake"):
        paths.append(tmp_path / f"{env}.parquet")
        pd.DataFrame({"data_source": [env] * 3, "ability": ["agent"] * 3}).to_parquet(paths[-1])
    return f"data.train_files=[{paths[0]},{paths[1]}]"


def test_the_driver_checks_the_weights_against_the_train_files_before_ray_starts(train_files):
    good = composed(train_files, "beyond_agent.multitask.task_weights={frozenlake:2,babyai:1}",
                    "beyond_agent.multitask.task_advantage_norm=true")
    check_config(good)
    settings = BeyondAgentConfig.from_config(good).multitask
    assert settings == MultitaskConfig(task_weights={"frozenlake": 2.0, "babyai": 1.0}, task_advantage_norm=True)
    with pytest.raises(SystemExit, match=r"beyond_agent config: beyond_agent\.multitask\.task_weights names unknown "
                                         r"task\(s\) \['babyia'\]; the tasks \(data_source\) of data\.train_files "
                                         r"are: babyai, frozenlake"):
        check_config(composed(train_files, "beyond_agent.multitask.task_weights={frozenlake:2,babyia:1}"))
    assert BeyondAgentConfig.from_config(composed()).multitask == MultitaskConfig()  # the recipe's default: off


# ---- per-task rollout figures -------------------------------------------------------------------

def result(env: str, termination: str, reward: float = 0.0, success: bool = False, rounds: int = 2) -> EpisodeResult:
    return EpisodeResult(spec=EpisodeSpec(env_id=env), episode=None, termination=termination, reward=reward,
                         success=success, rounds=rounds)


def test_rollout_figures_are_reported_per_task_and_add_up():
    results = [result("babyai", "done", 1.0, True, 3), result("frozenlake", "max_rounds", 0.0, rounds=4),
               result("babyai", "max_rounds", 0.0, rounds=5), result("frozenlake", "env_error", rounds=1),
               result("frozenlake", "done", 0.5, True, 2)]
    figures = task_rollout_metrics(["babyai", "frozenlake", "babyai", "frozenlake", "frozenlake"], results)
    assert figures == {
        "beyond_agent/task/babyai/episodes": 2.0, "beyond_agent/task/babyai/success_rate": 0.5,
        "beyond_agent/task/babyai/mean_reward": 0.5, "beyond_agent/task/babyai/mean_rounds": 4.0,
        "beyond_agent/task/babyai/infra_failures": 0.0,
        "beyond_agent/task/babyai/termination/done": 1.0, "beyond_agent/task/babyai/termination/max_rounds": 1.0,
        # success and reward over the episodes that were not infrastructure failures (as for the whole batch)
        "beyond_agent/task/frozenlake/episodes": 3.0, "beyond_agent/task/frozenlake/success_rate": 0.5,
        "beyond_agent/task/frozenlake/mean_reward": 0.25, "beyond_agent/task/frozenlake/mean_rounds": 7 / 3,
        "beyond_agent/task/frozenlake/infra_failures": 1.0, "beyond_agent/task/frozenlake/termination/done": 1.0,
        "beyond_agent/task/frozenlake/termination/max_rounds": 1.0,
        "beyond_agent/task/frozenlake/termination/env_error": 1.0,
    }


# ---- per-task advantage normalisation -----------------------------------------------------------

# Two tasks with very different reward scales, and a third with a single response token. Columns are
# response tokens; 0 with mask 0 are observation tokens / padding (never trained on).
ADVANTAGES = torch.tensor([
    [100.0, 0.0, 300.0, 0.0],    # babyai      (scale ~100)
    [100.0, 300.0, 0.0, 0.0],    # babyai
    [0.01, 0.03, 0.0, 0.0],      # frozenlake  (scale ~0.01)
    [0.0, 0.01, 0.03, 0.0],      # frozenlake
    [5.0, 0.0, 0.0, 0.0],        # textcraft: one token
])
MASK = torch.tensor([
    [1, 0, 1, 0],
    [1, 1, 0, 0],
    [1, 1, 0, 0],
    [0, 1, 1, 0],
    [1, 0, 0, 0],
])
TASKS = ["babyai", "babyai", "frozenlake", "frozenlake", "textcraft"]


def share_of_gradient(advantages: torch.Tensor, task: str) -> float:
    """The task's part of sum |A| over response tokens: its weight in the policy gradient sum A * grad log p."""
    weight = (advantages.abs() * MASK).sum(dim=1)
    return (weight[[row for row, name in enumerate(TASKS) if name == task]].sum() / weight.sum()).item()


def test_each_task_gets_mean_0_std_1_over_its_response_tokens():
    normalized, figures = normalize_task_advantages(ADVANTAGES, MASK, TASKS)
    # Hand-worked: babyai's tokens 100, 300, 100, 300 have mean 200 and std 100; frozenlake's 0.01, 0.03,
    # 0.01, 0.03 mean 0.02 and std 0.01. Both become -1, 1, -1, 1 (eps = 1e-6 is negligible next to std).
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0], [-1.0, 1.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0],
                             [0.0, -1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(normalized, expected, atol=1e-3)
    assert (normalized[MASK == 0] == 0).all()  # observation and padding tokens stay 0
    for task in ("babyai", "frozenlake"):
        tokens = normalized[torch.tensor([name == task for name in TASKS])][MASK[[n == task for n in TASKS]].bool()]
        assert tokens.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert tokens.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
        assert figures[f"beyond_agent/task/{task}/advantage_mean_after"] == pytest.approx(0.0, abs=1e-6)
        assert figures[f"beyond_agent/task/{task}/advantage_std_after"] == pytest.approx(1.0, abs=1e-3)
    assert figures["beyond_agent/task/babyai/advantage_mean_before"] == pytest.approx(200.0)
    assert figures["beyond_agent/task/babyai/advantage_std_before"] == pytest.approx(100.0)
    assert figures["beyond_agent/task/frozenlake/advantage_std_before"] == pytest.approx(0.01)
    # A single token has no spread to scale by: its mean is subtracted, nothing is divided by eps.
    assert normalized[4, 0].item() == 0.0 and figures["beyond_agent/task/textcraft/advantage_tokens"] == 1.0


def test_without_the_option_the_large_scale_task_dominates_the_gradient():
    assert share_of_gradient(ADVANTAGES, "babyai") > 0.99
    assert share_of_gradient(ADVANTAGES, "frozenlake") < 1e-4  # frozenlake barely trains
    normalized, _ = normalize_task_advantages(ADVANTAGES, MASK, TASKS)
    # Normalised, each task weighs by its tokens: 4 of babyai, 4 of frozenlake (textcraft's one token is 0).
    assert share_of_gradient(normalized, "babyai") == pytest.approx(0.5, abs=1e-4)
    assert share_of_gradient(normalized, "frozenlake") == pytest.approx(0.5, abs=1e-4)


def test_equal_advantages_within_a_task_are_only_centred():
    advantages = torch.tensor([[0.3, 0.3], [0.3, 0.3]])
    normalized, figures = normalize_task_advantages(advantages, torch.ones(2, 2), ["babyai", "babyai"])
    assert (normalized == 0).all() and figures["beyond_agent/task/babyai/advantage_std_after"] == 0.0


def test_the_trainer_s_step_normalises_a_verl_batch_in_place():
    from verl import DataProto

    batch = DataProto.from_dict(tensors={"advantages": ADVANTAGES.clone(), "response_mask": MASK},
                                non_tensors={"data_source": np.array(TASKS, dtype=object)})
    figures = apply_task_advantage_norm(batch)
    assert torch.equal(batch.batch["advantages"], normalize_task_advantages(ADVANTAGES, MASK, TASKS)[0])
    assert set(figures) == {f"beyond_agent/task/{task}/advantage_{figure}" for task in set(TASKS)
                            for figure in ("tokens", "mean_before", "std_before", "mean_after", "std_after")}
