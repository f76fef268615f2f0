"""Golden tests: incremental assembly equals the template's full rendering, token for token, for two
chat templates (ChatML with tools, Llama-3-like headers); generated ids are kept exactly as sampled."""

from __future__ import annotations

import pytest

from beyond_agent.rollout.handler import RolloutHandler

TASK = [
    {"role": "system", "content": "You are an agent in a grid world."},
    {"role": "user", "content": "Task: go to the red ball."},
]
LONG_OBSERVATION = " ".join(["you see a wall in front of you, a red ball to the left."] * 40)


def play(handler, tokenizer, sample, turns):
    """Run (assistant text, observation) turns; return the sampled id lists in order."""
    sampled = []
    for text, observation in turns:
        ids = sample(tokenizer, text)
        handler.add_assistant(ids, [-0.5] * len(ids))
        sampled.append(ids)
        if observation is not None:
            handler.add_observation(observation)
    return sampled


def assistant_ids(handler) -> list[int]:
    """The response ids the loss mask selects."""
    return [t for t, m in zip(handler.response_ids, handler.response_mask) if m == 1]


def test_multi_turn_equals_full_rendering(tokenizer, sample, render_ids):
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=2048)
    turns = [
        ("I turn left.", "You see a red ball."),
        ("I go forward.", ""),  # an empty observation still renders its own turn
        ("I pick up the ball.", LONG_OBSERVATION),
        ("done", None),
    ]
    sampled = play(handler, tokenizer, sample, turns)

    assert handler.prompt_ids == render_ids(tokenizer, TASK)
    # The conversation ends with an assistant turn: the rendering without a generation prompt ends with
    # the end-of-turn text (ChatML adds "\n" after it, which belongs to a next turn we never appended).
    golden = render_ids(tokenizer, handler.messages, add_generation_prompt=False)
    sequence = handler.prompt_ids_for_next_turn()
    assert sequence == golden[: len(sequence)]
    assert tokenizer.decode(golden[len(sequence):]) in ("", "\n")
    assert assistant_ids(handler) == [t for ids in sampled for t in ids]
    assert handler.num_turns == 4


def test_each_observation_leaves_the_prompt_for_the_next_turn(tokenizer, sample, render_ids):
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=2048)
    for text, observation in [("look", "a door"), ("open door", "it opens"), ("go", "a key")]:
        handler.add_assistant(sample(tokenizer, text))
        handler.add_observation(observation)
        assert handler.prompt_ids_for_next_turn() == render_ids(tokenizer, handler.messages)


def test_mask_marks_exactly_the_assistant_segments(tokenizer, sample):
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=2048)
    first, second = sample(tokenizer, "go left"), sample(tokenizer, "go right")
    handler.add_assistant(first, [-0.1] * len(first))
    before = len(handler.response_ids)
    handler.add_observation("You see a key.")
    delta = len(handler.response_ids) - before
    handler.add_assistant(second, [-0.2] * len(second))

    assert handler.response_mask == [1] * len(first) + [0] * delta + [1] * len(second)
    assert handler.response_ids[: len(first)] == first
    assert handler.response_ids[-len(second):] == second
    assert handler.response_logprobs == [-0.1] * len(first) + [0.0] * delta + [-0.2] * len(second)


def test_ids_that_do_not_retokenise_are_kept_as_sampled(tokenizer, render_ids):
    # "left" spelled one byte-token per letter: decodes to the same text but is not the tokenizer's encoding.
    split = [t for ch in "left" for t in tokenizer.encode(ch, add_special_tokens=False)]
    assert split != tokenizer.encode("left", add_special_tokens=False)
    sampled = tokenizer.encode("turn ", add_special_tokens=False) + split + [tokenizer.eos_token_id]
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=2048)
    handler.add_assistant(sampled)
    handler.add_observation("You turned left.")

    assert handler.response_ids[: len(sampled)] == sampled
    assert handler.messages[-2] == {"role": "assistant", "content": "turn left"}
    # Around the generated ids, the sequence is the template's own: prompt before, observation delta after.
    golden = render_ids(tokenizer, handler.messages)
    canonical = tokenizer.encode("turn left", add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(handler.prompt_ids)
    assert golden[start: start + len(canonical)] == canonical
    assert handler.prompt_ids_for_next_turn()[start + len(sampled):] == golden[start + len(canonical):]


def test_length_stopped_turn_is_closed_by_the_observation_delta(tokenizer, sample, render_ids):
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=2048)
    cut = sample(tokenizer, "I will go to the", end_of_turn=False)  # per-turn max_tokens hit, no eos
    handler.add_assistant(cut, [-1.0] * len(cut))
    handler.add_observation("Invalid action.")

    delta_start = len(cut)
    # The template closes every assistant turn, so the delta starts with the end-of-turn id, mask 0.
    assert handler.response_ids[delta_start] == tokenizer.eos_token_id
    assert handler.response_mask[delta_start] == 0
    assert handler.response_mask.count(1) == len(cut)
    assert handler.prompt_ids_for_next_turn() == render_ids(tokenizer, handler.messages)


def test_tool_results_share_one_user_turn_in_chatml(chatml_tokenizer, sample, render_ids, tools):
    tokenizer = chatml_tokenizer
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=512, max_response_length=2048, tools=tools)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1+2"}}\n</tool_call>'
    handler.add_assistant(sample(tokenizer, call))
    handler.add_observations([{"role": "tool", "content": "3"}, {"role": "tool", "content": "ok"}])
    handler.add_assistant(sample(tokenizer, "The answer is 3."))
    handler.add_observation("Correct.", role="tool")

    assert handler.prompt_ids == render_ids(tokenizer, TASK, tools=tools)
    assert handler.prompt_ids_for_next_turn() == render_ids(tokenizer, handler.messages, tools=tools)
    text = tokenizer.decode(handler.response_ids, skip_special_tokens=False)
    assert text.count("<|im_start|>user") == 2 and text.count("<tool_response>") == 3


def test_template_that_rewrites_earlier_turns_is_refused(chatml_tokenizer, sample):
    tokenizer = chatml_tokenizer.__class__.from_pretrained(chatml_tokenizer.name_or_path)
    # A header that depends on the number of messages changes the beginning of every rendering.
    tokenizer.chat_template = (
        "{{ messages | length }} messages{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}|assistant:{% endif %}"
    )
    handler = RolloutHandler(tokenizer, TASK, max_prompt_length=256, max_response_length=256)
    handler.add_assistant(sample(tokenizer, "go"))
    with pytest.raises(ValueError, match="rewrote earlier turns"):
        handler.add_observation("ok")
