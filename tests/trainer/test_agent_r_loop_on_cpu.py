"""One Agent-R iteration end to end with the tiny model on CPU (recipe/agent_r/main.py).

The random-weight tiny model never writes a move, so a search over its proposals could never find a path
worth revising. The test therefore first teaches it the action words: verl's SFT trainer (our sft.py) for
60 steps on oracle FrozenLake episodes of other maps (conftest's `move_writing_model`, shared with the
AgentEvol test). Then the real loop runs once: MCTS over a real
envservice with that model proposing (Hugging Face generate, `--backend hf`), pairing, the model's own
judgement of the first wrong step (with the fallback rule), revision records, verl SFT on them, and a greedy
evaluation before and after. ~2 min on 2 cores.
"""

from __future__ import annotations

import json
import math

import pytest

from recipe.agent_r.main import run_config
from beyond_agent.sft import hf_model_dir
from beyond_agent.trajectories import read_dump, write_dump

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(1200)]


def test_one_agent_r_iteration_searches_revises_trains_and_evaluates(move_writing_model, frozenlake_episodes,
                                                                    tmp_path, recipe_config):
    out = tmp_path / "agent_r"
    reflections = tmp_path / "reflections.txt"
    reflections.write_text("Wrong way.\n\nBack to the path.\n")
    replay = tmp_path / "replay"  # expert episodes of other maps, replayed in every SFT (twice each)
    write_dump(replay, 0, "train", frozenlake_episodes(range(300, 303), ["oracle"]))
    run_config(recipe_config("agent_r", "agent_r", [
        "env=frozenlake", "tasks=0:4", "iterations=1", "mcts_iterations=12", "n_gen=3", "max_depth=6", "max_tokens=6",
        "backend=hf", "eval_tasks=0:4", "eval_split=test", "max_prompt_length=256", "max_response_length=2048",
        "replay_weight=2"], model=str(move_writing_model), out=str(out), reflections=str(reflections),
        replay=[str(replay)], sft=["data.train_batch_size=2", "data.micro_batch_size_per_gpu=2",
                                   "trainer.total_training_steps=2", "trainer.total_epochs=10"]))

    figures = json.loads((out / "agent_r.json").read_text())["iterations"]
    assert [row["iteration"] for row in figures] == [0, 1]
    searched = figures[1]
    assert searched["tasks"] == 4 and searched["nodes"] >= 4 * 12 // 3
    assert searched["pairs"] >= 1, searched  # a move-writing model finds goals and holes on these maps
    assert searched["env_resets"] > searched["nodes"]
    assert all(0.0 <= row["eval_success"] <= 1.0 for row in figures)
    assert searched["replay_episodes"] == 2 * 3

    revisions = list(read_dump(out / "iter_1" / "revisions" / "step_0.jsonl"))
    assert len(revisions) == searched["pairs"]
    for record in revisions:
        trained = record.extra["agent_r"]["trained_turns"]
        first_wrong = record.extra["agent_r"]["first_wrong_step"]
        # Bad prefix up to and including the first wrong step: off; the reflection and what follows: on.
        assert trained == [False] * (first_wrong + 1) + [True] * (len(trained) - first_wrong - 1)
        assert record.extra["agent_r"]["found_by"] in ("judge", "fallback")
        for (start, end), on in zip(record.extra["agent_r"]["turn_spans"], trained):
            assert set(record.response_mask[start:end + 1]) == {int(on)}
        # The reflection turn (right after the first wrong step) says one of the file's sentences.
        replies = [message["content"] for message in record.messages if message["role"] == "assistant"]
        assert replies[first_wrong + 1] in ("Wrong way.", "Back to the path.")
    goods = list(read_dump(out / "iter_1" / "good_paths" / "step_0.jsonl"))
    # pairing "all": a good path in several pairs is written once
    assert len(revisions) >= len(goods) >= 1 and all(g.success for g in goods)
    assert len({tuple(g.response_ids) for g in goods}) == len(goods)

    # verl's SFT trained the model on them, and the evaluation used the new model.
    logged = [json.loads(line)["data"] for line in (out / "iter_1" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2 and all(math.isfinite(entry["train/loss"]) for entry in logged)
    assert searched["model"] == str(hf_model_dir(out / "iter_1" / "sft"))
