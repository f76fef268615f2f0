"""The offline dataset and reward of the CPU smoke run (scripts/verl_cpu_smoke.sh)."""

from __future__ import annotations

import pandas as pd

from verl_cpu.overrides import CPU_ENV, cpu_overrides
from verl_cpu.smoke_data import make_row, write_split
from verl_cpu.smoke_reward import MENTION_CREDIT, compute_score


def test_reward_checks_the_last_integer():
    assert compute_score("s", "so 3 + 5 = 8", "8") == 1.0
    assert compute_score("s", "8, no wait, 9", "8") == MENTION_CREDIT
    assert compute_score("s", "maybe 7", "8") == 0.0


def test_rows_follow_verl_gsm8k_schema(tmp_path):
    row = make_row(2, "train")
    assert row["prompt"] == [{"role": "user", "content": "What is 5 + 5? Answer with the number."}]
    assert row["reward_model"]["ground_truth"] == "10"
    frame = pd.read_parquet(write_split(tmp_path, "train", 4))
    assert len(frame) == 4 and set(frame.columns) >= {"prompt", "data_source", "reward_model", "extra_info"}


def test_cpu_overrides_select_the_cpu_pieces():
    overrides = cpu_overrides()
    assert "+ray_kwargs.ray_init.num_gpus=1" in overrides
    assert "actor_rollout_ref.actor.strategy=fsdp2" in overrides
    assert CPU_ENV["VERL_PLATFORM"] == "cpu"
