"""Agent-R's model-free parts (beyond_agent/algorithms/agent_r.py): UCT, root-to-leaf paths, pairing, the first wrong
step and the spliced revision trajectory with its masks, on a hand-built FrozenLake-like tree.

The splice is tokenised by the real tiny model's tokenizer and chat template through RolloutHandler, and
the record it returns goes through our SFT dataset, as revision data does in training.
"""

from __future__ import annotations

import math

import pytest

from beyond_agent.algorithms.agent_r import (
    JUDGE_FAILED,
    REFLECTION_REPLY,
    SearchNode,
    backpropagate,
    first_wrong_step,
    leaf_paths,
    pair_paths,
    revision_record,
    select_leaf,
    shared_prefix,
    uct_score,
)
from beyond_agent.trajectory_data import training_row

REFLECTION = "I realize my approach was flawed. I need to revise it."


def hand_built_tree() -> tuple[SearchNode, dict[str, SearchNode]]:
    """root -down-> A -right-> G (success, 1.0)
                     A -left-> B -down-> H (hole, 0.0)
       root -up-> W (wall, depth limit, 0.0)"""
    root = SearchNode(observation="You are at the start.")
    a = root.add_child("down", "You moved down.")
    g = a.add_child("right", "You reached the goal.", terminal=True, score=1.0)
    b = a.add_child("left", "You moved left.")
    h = b.add_child("down", "You fell into a hole.", terminal=True, score=0.0)
    w = root.add_child("up", "A wall.", terminal=True, score=0.0)
    for leaf, value in ((g, 1.0), (g, 1.0), (h, 0.0), (w, 0.0)):
        backpropagate(leaf, value)
    return root, {"A": a, "G": g, "B": b, "H": h, "W": w}


def test_backup_and_uct_follow_the_formula():
    root, nodes = hand_built_tree()
    assert (root.visits, root.value) == (4, 0.5)
    assert (nodes["A"].visits, nodes["A"].value) == (3, pytest.approx(2 / 3))
    assert uct_score(nodes["A"], root.visits) == pytest.approx(2 / 3 + 0.25 * math.sqrt(math.log(4) / 3))
    assert uct_score(nodes["A"], root.visits, exploration=0.0) == pytest.approx(2 / 3)
    fresh = nodes["B"].add_child("right", "You moved right.")
    assert uct_score(fresh, nodes["B"].visits) == math.inf  # unvisited first
    # From the root: A (0.67 + 0.25 * 0.68) beats W (0 + 0.25 * 1.18); under A, G (1 + ...) beats B (0 + ...).
    assert select_leaf(root) is nodes["G"]
    assert select_leaf(nodes["B"]) is fresh and fresh.actions() == ["down", "left", "right"]


def test_paths_are_ranked_and_paired_by_alpha_and_beta():
    root, nodes = hand_built_tree()
    paths = leaf_paths(root)
    assert [p.actions for p in paths] == [["down", "right"], ["up"], ["down", "left", "down"]]
    assert [p.value for p in paths] == [1.0, 0.0, 0.0]
    # Agent-R's rule (the default): the good path with every bad path worse by more than beta, worst first.
    pairs = pair_paths(paths, alpha=0.5, beta=0.5)
    assert [(good.actions, bad.actions) for good, bad in pairs] == [
        (["down", "right"], ["down", "left", "down"]), (["down", "right"], ["up"])]
    # One to one: the longest zero-value path gets the one good path; the other bad one has none left.
    pairs = pair_paths(paths, alpha=0.5, beta=0.5, pairing="one_to_one")
    assert [(good.actions, bad.actions) for good, bad in pairs] == [(["down", "right"], ["down", "left", "down"])]
    for pairing in ("all", "one_to_one"):
        assert pair_paths(paths, alpha=1.0, beta=0.5, pairing=pairing) == []  # value(good) must exceed alpha
        assert pair_paths(paths, alpha=0.5, beta=1.0, pairing=pairing) == []  # the gap must exceed beta
    with pytest.raises(ValueError, match=r"pairing='each' is not a pairing rule; valid choices: \['all', 'one_to_one'\]"):
        pair_paths(paths, 0.5, 0.5, pairing="each")


def test_with_three_good_and_two_bad_paths_every_pair_past_beta_is_made():
    """Agent-R pairs every good path with every bad one whose value is lower by more than beta."""
    root = SearchNode(observation="start")
    leaves = {}
    for action, score in (("a", 1.0), ("b", 0.9), ("c", 0.6), ("d", 0.2), ("e", 0.0)):
        leaves[action] = root.add_child(action, f"after {action}", terminal=True, score=score)
    pairs = pair_paths(leaf_paths(root), alpha=0.5, beta=0.5)
    assert [(g.actions[0], b.actions[0]) for g, b in pairs] == [("a", "e"), ("a", "d"), ("b", "e"), ("b", "d"),
                                                                 ("c", "e")]  # 0.6 - 0.2 is not past beta
    assert len(pair_paths(leaf_paths(root), alpha=0.5, beta=0.5, pairing="one_to_one")) == 2


def test_the_first_wrong_step_comes_from_the_judge_or_else_from_where_the_paths_part():
    root, _ = hand_built_tree()
    good, bad = pair_paths(leaf_paths(root), 0.5, 0.5)[0]
    assert shared_prefix(good, bad) == 1  # both start with "down"
    asked = []

    def judge(nodes, index):
        asked.append(index)
        return "bad" if nodes[index].action == "down" else "uncertain"

    assert first_wrong_step(good, bad, judge) == (2, "judge")
    assert asked == [1, 2]  # the shared step is never judged
    assert first_wrong_step(good, bad, lambda nodes, index: "good") == (1, "fallback")
    assert first_wrong_step(good, bad, lambda nodes, index: "perhaps") == (1, "fallback")
    assert first_wrong_step(good, bad, None) == (1, "fallback")


def test_a_judge_that_raises_is_logged_and_counted_not_silent(caplog):
    root, _ = hand_built_tree()
    good, bad = pair_paths(leaf_paths(root), 0.5, 0.5)[0]
    with caplog.at_level("WARNING", logger="beyond_agent.algorithms.agent_r"):
        assert first_wrong_step(good, bad, lambda nodes, index: 1 / 0) == (1, JUDGE_FAILED)
    assert "Agent-R judge failed on step 1 ('left'): ZeroDivisionError: division by zero; the fallback rule picks " \
           "step 1" in caplog.text


def test_the_revision_trains_on_the_reflection_and_the_good_continuation_only(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    root, _ = hand_built_tree()
    good, bad = pair_paths(leaf_paths(root), 0.5, 0.5)[0]
    task = {"env": "frozenlake", "task": 3, "split": "train", "seed": 3, "first_observation": root.observation}
    record = revision_record(good, bad, 2, "judge", REFLECTION, task, tokenizer)

    # Turns: bad prefix down, left, down (off); reflection (on) + "ok."; the good path after the shared
    # "down": right (on).
    assistant = [m["content"] for m in record.messages if m["role"] == "assistant"]
    assert assistant == ["down", "left", "down", REFLECTION, "right"]
    users = [m["content"] for m in record.messages if m["role"] == "user"]
    assert users == [root.observation, "You moved down.", "You moved left.", "You fell into a hole.", REFLECTION_REPLY]
    assert record.extra["agent_r"]["trained_turns"] == [False, False, False, True, True]

    spans = [tuple(span) for span in record.extra["agent_r"]["turn_spans"]]
    assert [end for _start, end in spans] == record.turn_ends
    for (start, end), text, trained in zip(spans, assistant, [False, False, False, True, True]):
        assert record.response_mask[start:end + 1] == [int(trained)] * (end + 1 - start), text
        assert tokenizer.decode(record.response_ids[start:end + 1], skip_special_tokens=True).strip() == text
    in_a_turn = {i for start, end in spans for i in range(start, end + 1)}
    assert all(bit == 0 for i, bit in enumerate(record.response_mask) if i not in in_a_turn)  # observations

    # The SFT dataset trains on exactly those tokens.
    row = training_row(record)
    trained_ids = [t for t, bit in zip(row.input_ids, row.loss_mask) if bit]
    expected = [t for (start, end), trained in zip(spans, [False, False, False, True, True]) if trained
                for t in record.response_ids[start:end + 1]]
    assert trained_ids == expected


def test_a_revision_longer_than_the_limit_is_refused_not_cut(tiny_model_dir):
    from transformers import AutoTokenizer

    from beyond_agent.algorithms.agent_r import RevisionTooLong

    root, _ = hand_built_tree()
    good, bad = pair_paths(leaf_paths(root), 0.5, 0.5)[0]
    task = {"env": "frozenlake", "task": 3, "split": "train", "seed": 3, "first_observation": root.observation}
    with pytest.raises(RevisionTooLong, match="exceed max_response_length 40"):
        revision_record(good, bad, 2, "judge", REFLECTION, task, AutoTokenizer.from_pretrained(tiny_model_dir),
                        max_response_length=40)


def test_the_model_judge_reads_the_first_word_of_the_models_chat_templated_answer(tiny_model_dir):
    """The loop's judge (recipe.agent_r.main.model_judge) with the real tokenizer and chat template; the model's reply
    is scripted text, so the verdict path a capable model takes (the tiny one never answers validly) is checked."""
    from transformers import AutoTokenizer

    from recipe.agent_r.main import model_judge
    from beyond_agent.rollout.scripted import ScriptedTurn, reply_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    root, _ = hand_built_tree()
    good, bad = pair_paths(leaf_paths(root), 0.5, 0.5)[0]
    prompts, answers = [], {1: " Uncertain, I think", 2: "Bad."}

    def generate(request_id, prompt_ids, max_tokens):
        prompts.append(tokenizer.decode(prompt_ids))
        step = len(prompts)  # steps 1 and 2 of the bad path are asked, in order
        return ScriptedTurn(reply_ids(tokenizer, answers.get(step, "")))

    assert first_wrong_step(good, bad, model_judge(generate, tokenizer)) == (2, "judge")
    assert len(prompts) == 2
    assert "Was step 2 (down) a good step" in prompts[1] and "Step 1: action 'left'" in prompts[1]
    # As Agent-R's verifier: the task and the path up to the judged step with its result, nothing after it.
    assert "Task: You are at the start." in prompts[0] and "Step 1: action 'left', result: You moved left." in prompts[0]
    assert "Step 2" not in prompts[0] and "fell into a hole" not in prompts[0]
    assert "Step 2: action 'down', result: You fell into a hole." in prompts[1]
    after_user_turn = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                    tokenize=False).split("x")[-1]
    assert prompts[1].endswith(after_user_turn)  # asked as a user turn, with the assistant's turn opened
    silent = model_judge(lambda *_: ScriptedTurn([]), tokenizer)
    assert silent(bad.nodes, 2) == "uncertain"
