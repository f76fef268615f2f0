"""One AgentEvol iteration end to end with the tiny model on CPU (recipe/agentevol/main.py).

The model that explores is conftest's `move_writing_model` (the tiny model after 60 SFT steps on oracle
FrozenLake maps: it writes moves and sometimes reaches the goal). The real loop runs once with the model in
this process (`--backend hf`, the collect CLI's machinery): evaluation of the start model, exploration on
train maps, verl's SFT trainer on the base set's and the exploration's successful episodes, starting from the
base model, and evaluation of the new model. ~1 min on 2 cores after the shared fixture.
"""

from __future__ import annotations

import json
import math

import pytest

from recipe.agentevol.main import run_config
from beyond_agent.sft import hf_model_dir
from beyond_agent.trajectories import read_dump, write_dump

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(900)]


def test_one_agentevol_iteration_explores_keeps_successes_trains_and_evaluates(
        move_writing_model, frozenlake_episodes, tmp_path, capsys, recipe_config):
    base_set = tmp_path / "base_set"
    # The base set: oracle episodes (successes) and walks into the wall (failures, which must be left out).
    write_dump(base_set, 0, "train", frozenlake_episodes(range(200, 206), ["oracle", lambda path: ["left"] * 6]))
    out = tmp_path / "agentevol"
    run_config(recipe_config("agentevol", "agentevol", [
        "env=frozenlake", "base_weight=2", "explore_tasks=0:6", "n=3", "eval_tasks=0:4", "eval_split=test",
        "iterations=1", "backend=hf", "max_rounds=6", "max_tokens_per_turn=6", "max_prompt_length=256",
        "max_response_length=256"], base_model=str(move_writing_model), base_trajectories=[str(base_set)],
        out=str(out), sft=["data.train_batch_size=2", "data.micro_batch_size_per_gpu=2",
                           "trainer.total_training_steps=2", "trainer.total_epochs=10"]))

    figures = json.loads((out / "agentevol.json").read_text())["iterations"]
    assert [row["iteration"] for row in figures] == [0, 1]
    explored = list(read_dump(out / "iter_1" / "explore.jsonl"))
    assert len(explored) == 6 * 3 and {(r.split, r.task) for r in explored} == {("train", t) for t in range(6)}
    wins = [record for record in explored if record.success]
    assert figures[1]["explore_kept"] == len(wins)
    assert figures[1]["explore_success"] == pytest.approx(len(wins) / len(explored))
    for iteration in (0, 1):  # each iteration's figure is its evaluation file's success rate
        evaluated = list(read_dump(out / f"iter_{iteration}" / "eval.jsonl"))
        assert len(evaluated) == 4 and all(r.split == "test" for r in evaluated)
        assert figures[iteration]["eval_success"] == pytest.approx(sum(r.success for r in evaluated) / 4)

    # verl's SFT trained the base model on the base set's 6 successes, twice each (--base-weight 2), plus the
    # exploration's, and the evaluation of iteration 1 used the trained model.
    assert f"[agentevol] SFT on {2 * 6 + len(wins)} successful episodes from 3 file(s)" in capsys.readouterr().out
    logged = [json.loads(line)["data"] for line in (out / "iter_1" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2 and all(math.isfinite(entry["train/loss"]) for entry in logged)
    assert figures[1]["model"] == str(hf_model_dir(out / "iter_1" / "sft"))
    assert figures[0]["model"] == str(move_writing_model)


def test_collect_with_the_model_in_process_writes_records_reproducibly(move_writing_model, tmp_path, capsys):
    """`collect --backend hf` (what AgentEvol explores with on CPU): one record per episode, the env's
    parameters applied, policy tokens masked in, and the same seed gives the same sampled episodes."""
    from beyond_agent.collect import main as collect_main

    def run(name: str) -> list:
        out = tmp_path / f"{name}.jsonl"
        collect_main(["--env", "frozenlake", "--tasks", "0:3", "--n", "2", "--max-rounds", "6", "--backend", "hf",
                      "--model", str(move_writing_model), "--max-tokens-per-turn", "6", "--temperature", "1.0",
                      "--params", '{"around": true}', "--seed", "7", "--out", str(out)])
        return list(read_dump(out))

    first, again = run("first"), run("again")
    assert [(r.task, r.group, r.seed) for r in first] == [(t, f"frozenlake:{t}", 7 + t) for t in range(3) for _ in range(2)]
    assert all("Around you: " in record.messages[1]["content"] for record in first)
    for record in first:
        assert record.termination in ("done", "max_rounds", "length") and 1 in record.response_mask
        assert len(record.response_ids) == len(record.response_mask)
    assert [r.response_ids for r in first] == [r.response_ids for r in again]
    printed = capsys.readouterr()
    assert "model served by hf" in printed.err and "success rate" in printed.out
