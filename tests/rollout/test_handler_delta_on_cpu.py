"""The handler's observation delta against the full rendering: a differential test over random conversations
for both chat templates, templates it handles exactly, and templates it must refuse."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from beyond_agent.rollout.handler import RolloutHandler

PIECES = [
    "go", "to the red ball", "you see a wall", "ünïcödé", "中文", "🙂", "\u00a0", "'s", "12", "!?",
    "<|im_end|>", "<|im_start|>user", "<|eot_id|>", "<|start_header_id|>", "<tool_response>", "</tool_call>",
    "{{ x }}", "{% if %}", '"quoted"', "back\\slash",
]
WHITESPACE = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n"]


def random_content(rng: random.Random, strip: bool = False, empty: bool = True) -> str:
    """Text with whitespace at the ends, newlines, unicode and special-token look-alikes; sometimes empty."""
    if empty and rng.random() < 0.08:
        return ""
    body = "".join(rng.choice(PIECES) + rng.choice(WHITESPACE + [" "] * 6) for _ in range(rng.randrange(1, 7)))
    text = rng.choice(WHITESPACE) + body + rng.choice(WHITESPACE)
    return text.strip() if strip else text


def random_script(rng: random.Random, tokenizer, tools_choice, strip: bool = False, empty_turns: bool = True) -> dict:
    """One episode: initial messages, tools, and turns (sampled ids as a server returns them: the tokenizer's
    own encoding of a text, ended by the end-of-turn token or stopped by a length limit)."""
    content = lambda: random_content(rng, strip)  # noqa: E731
    first = [{"role": "user", "content": content()}]
    if rng.random() < 0.2:  # a few-shot exchange before the task
        first = [{"role": "user", "content": content()}, {"role": "assistant", "content": content()}] + first
    if rng.random() < 0.7:
        first = [{"role": "system", "content": content()}] + first
    turns = []
    for _ in range(rng.randrange(1, 7)):
        ids = tokenizer.encode(random_content(rng, strip, empty_turns), add_special_tokens=False)
        if rng.random() < 0.8:
            ids = ids + [tokenizer.eos_token_id]  # otherwise the turn was stopped by its length limit
        observations = [{"role": rng.choice(["user", "tool"]), "content": content()}
                        for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        turns.append((ids, observations))
    return {"messages": first, "tools": rng.choice(tools_choice), "turns": turns}


def play(tokenizer, script: dict) -> RolloutHandler:
    """The script on a handler with limits that never cut it; ends with an observation delta."""
    handler = RolloutHandler(tokenizer, script["messages"], 4096, 8192, tools=script["tools"])
    for ids, observations in script["turns"]:
        handler.add_assistant(ids, [-0.25] * len(ids))
        handler.add_observations(observations)
    return handler


def assert_spells_the_full_rendering(tokenizer, script: dict) -> None:
    handler = play(tokenizer, script)
    # The ids, read back as text, are exactly the template's rendering of the whole chat: every delta is
    # what the template writes there (decoding is exact for this byte-level tokenizer).
    text = tokenizer.decode(handler.prompt_ids_for_next_turn(), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    assert text == tokenizer.apply_chat_template(handler.messages, tools=script["tools"], tokenize=False,
                                                 add_generation_prompt=True), script
    # Mask 1 selects exactly the sampled ids, in order, with their log-probs; everything else is mask 0.
    trained = [t for t, m in zip(handler.response_ids, handler.response_mask) if m == 1]
    assert trained == [t for ids, _ in script["turns"] for t in ids]
    assert {lp for lp, m in zip(handler.response_logprobs, handler.response_mask) if m == 1} <= {-0.25}


@pytest.mark.parametrize("seed", range(4))
def test_ids_spell_the_full_rendering_of_random_conversations(tokenizer, tools, seed):
    rng = random.Random(seed)
    tools_choice = [None, tools] if tokenizer.eos_token == "<|im_end|>" else [None]
    for _ in range(25):
        assert_spells_the_full_rendering(tokenizer, random_script(rng, tokenizer, tools_choice))


def test_lazily_decoded_messages_are_the_decoded_turns(tokenizer, sample):
    turns = [sample(tokenizer, "go left"), sample(tokenizer, "  pick up \n", end_of_turn=False), []]
    handler = RolloutHandler(tokenizer, [{"role": "user", "content": "Find the key."}], 64, 256)
    for ids in turns:
        handler.add_assistant(ids)
        handler.add_observation("ok")
    contents = [m["content"] for m in handler.messages if m["role"] == "assistant"]
    eos = tokenizer.eos_token_id
    assert contents == [tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids) for ids in turns]
    assert handler.messages is handler.messages  # one list, as when it was a plain attribute


# ----- other templates: handled exactly, or refused -------------------------------------------------

# Llama-like (see conftest.py), with the content expression as a parameter.
LLAMA_LIKE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>{{ '\\n\\n' }}CONTENT<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)
HANDLED = {
    "plain": LLAMA_LIKE.replace("CONTENT", "{{ message.content }}"),
    # Empty observations too; an empty *assistant* turn is rendered "(nothing)" where the model wrote nothing,
    # and the ids keep what was sampled (see test_an_empty_turn_keeps_its_sampled_ids below).
    "tests emptiness": LLAMA_LIKE.replace(
        "CONTENT", "{% if message.content %}{{ message.content }}{% else %}(nothing){% endif %}"),
    # The task is always a user message of the initial ones, so the first user turn is never an observation.
    "marks the first user turn": "{% set ns = namespace(seen=false) %}" + LLAMA_LIKE.replace(
        "CONTENT", "{% if message.role == 'user' and not ns.seen %}[first] {% set ns.seen = true %}{% endif %}"
        "{{ message.content }}"),
    "trims (stripped contents)": LLAMA_LIKE.replace("CONTENT", "{{ message.content | trim }}"),
}
REFUSED = {
    "counts messages in a header": ("{{ messages | length }} messages" + LLAMA_LIKE.replace(
        "CONTENT", "{{ message.content }}"), "rewrote earlier turns"),
    "strips past reasoning (Qwen3-like)": (LLAMA_LIKE.replace(
        "CONTENT", "{% if message.role == 'assistant' and not loop.last %}{{ message.content.split('</think>')[-1] }}"
                   "{% else %}{{ message.content }}{% endif %}"), "rewrote earlier turns"),
    "alternates markers": (LLAMA_LIKE.replace(
        "CONTENT", "{{ 'odd ' if loop.index is odd else 'even ' }}{{ message.content }}"), "by its position"),
    "numbers the turns": (LLAMA_LIKE.replace("CONTENT", "{{ loop.index }}. {{ message.content }}"), "by its position"),
}


def fresh_tokenizer(tiny_model_dir, template: str):
    """A Llama-like tokenizer of its own (the session fixtures must not change) with `template`."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         special_tokens=True)
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_templates_that_only_append_are_exact(tiny_model_dir, name):
    tokenizer = fresh_tokenizer(tiny_model_dir, HANDLED[name])
    rng = random.Random(1)
    for _ in range(12):
        script = random_script(rng, tokenizer, [None], strip="trims" in name, empty_turns="emptiness" not in name)
        assert_spells_the_full_rendering(tokenizer, script)


def test_an_empty_turn_keeps_its_sampled_ids_under_a_template_that_fills_it(tiny_model_dir):
    tokenizer = fresh_tokenizer(tiny_model_dir, HANDLED["tests emptiness"])
    handler = RolloutHandler(tokenizer, [{"role": "user", "content": "Find the key."}], 256, 256)
    handler.add_assistant([tokenizer.eos_token_id])  # the model ended its turn at once
    handler.add_observation("")
    delta = handler.response_ids[1:]
    # What follows the end-of-turn token is the template's text after a turn: the (empty) observation, filled.
    assert handler.response_mask == [1] + [0] * len(delta)
    assert tokenizer.decode(delta) == ("<|start_header_id|>user<|end_header_id|>\n\n(nothing)<|eot_id|>"
                                       "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_templates_that_rewrite_or_depend_on_position_are_refused_at_the_first_observation(
        tiny_model_dir, sample, name):
    template, message = REFUSED[name]
    tokenizer = fresh_tokenizer(tiny_model_dir, template)
    handler = RolloutHandler(tokenizer, [{"role": "user", "content": "Find the key."}], 256, 256)
    handler.add_assistant(sample(tokenizer, "<think>look around</think>go"))
    with pytest.raises(ValueError, match=message):
        handler.add_observation("ok")


def test_the_initial_messages_must_hold_the_task_as_a_user_message(tokenizer):
    with pytest.raises(ValueError, match="no user message: give the task as a user message"):
        RolloutHandler(tokenizer, [{"role": "system", "content": "You are an agent."}], 64, 64)
