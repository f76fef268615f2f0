"""The template fast path gives the reference path's ids, token for token: a differential test over random
conversations for both chat templates, and templates the fast path must refuse (or handle) correctly."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from recipe.beyond_agent.rollout import handler as handler_module
from recipe.beyond_agent.rollout.handler import RolloutHandler
from recipe.beyond_agent.rollout.template_frames import PATH_STATS, analyse_template, encoder_for

PIECES = [
    "go", "to the red ball", "you see a wall", "ünïcödé", "中文", "🙂", "\u00a0", "'s", "12", "!?",
    "<|im_end|>", "<|im_start|>user", "<|eot_id|>", "<|start_header_id|>", "<tool_response>", "</tool_call>",
    "{{ x }}", "{% if %}", '"quoted"', "back\\slash",
]
WHITESPACE = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n"]


def random_content(rng: random.Random) -> str:
    """Text with whitespace at the ends, newlines, unicode and special-token look-alikes; sometimes empty."""
    if rng.random() < 0.08:
        return ""
    body = "".join(rng.choice(PIECES) + rng.choice(WHITESPACE + [" "] * 6) for _ in range(rng.randrange(1, 7)))
    return rng.choice(WHITESPACE) + body + rng.choice(WHITESPACE)


def random_turn(rng: random.Random, tokenizer) -> tuple[list[int], list[float] | None]:
    """Assistant ids as a server might return them: the tokenizer's encoding, arbitrary ids, or nothing."""
    kind = rng.random()
    if kind < 0.5:
        ids = tokenizer.encode(random_content(rng), add_special_tokens=False)
    elif kind < 0.9:
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
    else:
        ids = []
    if rng.random() < 0.8:
        ids = ids + [tokenizer.eos_token_id]  # otherwise the turn was stopped by its length limit
    return ids, [-rng.random() for _ in ids] if rng.random() < 0.9 else None


def random_script(rng: random.Random, tokenizer, tools_choice) -> dict:
    """One episode: initial messages, limits, and the turns to play."""
    first = [{"role": "user", "content": random_content(rng)}]
    if rng.random() < 0.2:  # a few-shot exchange before the task
        first = [{"role": "user", "content": random_content(rng)},
                 {"role": "assistant", "content": random_content(rng)}] + first
    if rng.random() < 0.7:
        first = [{"role": "system", "content": random_content(rng)}] + first
    turns = []
    for _ in range(rng.randrange(1, 7)):
        observations = [{"role": rng.choice(["user", "tool"]), "content": random_content(rng)}
                        for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        turns.append((random_turn(rng, tokenizer), observations))
    return {
        "messages": first,
        "max_prompt_length": rng.choice([8, 512, 512]),
        "max_response_length": rng.choice([16, 64, 4096, 4096, 4096]),
        "tools": rng.choice(tools_choice),
        "turns": turns,
    }


def play(tokenizer, script: dict, fast: bool, monkeypatch) -> dict:
    """Run the script on a handler (fast path on or off); return everything observable, errors included."""
    with monkeypatch.context() as patch:
        patch.setattr(handler_module, "USE_FAST_PATH", fast)
        handler = RolloutHandler(tokenizer, script["messages"], script["max_prompt_length"],
                                 script["max_response_length"], tools=script["tools"])
    error = None
    try:
        for (ids, logprobs), observations in script["turns"]:
            if handler.done:
                break
            handler.add_assistant(ids, logprobs)
            if handler.done:
                break
            handler.add_observations(observations)
    except ValueError as exc:
        error = str(exc)
    return {
        "prompt_ids": handler.prompt_ids, "response_ids": handler.response_ids,
        "response_mask": handler.response_mask, "response_logprobs": handler.response_logprobs,
        "termination": handler.termination, "num_turns": handler.num_turns,
        "prompt_truncated": handler.prompt_truncated, "messages": handler.messages, "error": error,
        "next_turn": handler.prompt_ids_for_next_turn(),
    }


def fresh_tokenizer(tiny_model_dir, template: str):
    """A Llama-like tokenizer of its own (the session fixtures must not change) with `template`."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         special_tokens=True)
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = template
    return tokenizer


def observation_counts() -> tuple[int, int]:
    return PATH_STATS["observation_fast"], PATH_STATS["observation_slow"]


# ----- differential: random conversations, both templates -------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_fast_path_equals_reference_on_random_conversations(tokenizer, tools, monkeypatch, seed):
    rng = random.Random(seed)
    tools_choice = [None, tools] if tokenizer.eos_token == "<|im_end|>" else [None]
    fast_before, _ = observation_counts()
    for _ in range(25):
        script = random_script(rng, tokenizer, tools_choice)
        fast = play(tokenizer, script, True, monkeypatch)
        reference = play(tokenizer, script, False, monkeypatch)
        assert fast == reference, script
    assert observation_counts()[0] > fast_before  # the fast path was exercised, not skipped


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


def test_cached_encoder_equals_tokenizer_encode(tokenizer):
    rng = random.Random(0)
    encode = encoder_for(tokenizer)
    for _ in range(200):
        text = random_content(rng)
        assert list(encode(text)) == tokenizer.encode(text, add_special_tokens=False)
        assert list(encode(text)) == tokenizer.encode(text, add_special_tokens=False)  # from the cache


def test_encoder_follows_tokenizer_changes(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "<|im_end|> and <|tag|>"
    before = encoder_for(tokenizer)(text)
    tokenizer.add_tokens(["<|tag|>"], special_tokens=True)
    assert list(encoder_for(tokenizer)(text)) == tokenizer.encode(text, add_special_tokens=False) != list(before)
    tokenizer.split_special_tokens = True
    assert list(encoder_for(tokenizer)(text)) == tokenizer.encode(text, add_special_tokens=False)


# ----- templates the fast path must refuse, or handle exactly ----------------------------------------

# Llama-like (see conftest.py), with the content expression as a parameter.
LLAMA_LIKE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>{{ '\\n\\n' }}CONTENT<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)
REFUSED = {
    "trims": LLAMA_LIKE.replace("CONTENT", "{{ message.content | trim }}"),
    "strips think (aliased)": LLAMA_LIKE.replace(
        "CONTENT", "{% set text = message.content %}{{ text.split('</think>')[-1] }}"),
    "transforms the first user turn": LLAMA_LIKE.replace(
        "CONTENT", "{% if loop.index0 == 1 %}{{ message.content | upper }}{% else %}{{ message.content }}{% endif %}"),
    "dates each turn": LLAMA_LIKE.replace("CONTENT", "{{ strftime_now('%Y') }} {{ message.content }}"),
    # Invisible to the AST (no content read); the probes catch them: markers get escaped or repeated, and
    # the awkward contents (whitespace at the ends, newlines, quotes) come out changed.
    "json-escapes the message": LLAMA_LIKE.replace("CONTENT", "{{ message | tojson }}"),
    "trims a content read through items()": LLAMA_LIKE.replace(
        "CONTENT", "{{ (message.items() | list)[1][1] | trim }}"),
    "repeats the content": LLAMA_LIKE.replace("CONTENT", "{{ message.content }} / {{ message.content }}"),
}
HANDLED = {
    # Position-dependent but content-independent: the frame of each exact shape is learned and exact.
    "marks the first user turn": "{% set ns = namespace(seen=false) %}" + LLAMA_LIKE.replace(
        "CONTENT", "{% if message.role == 'user' and not ns.seen %}[first] {% set ns.seen = true %}{% endif %}"
        "{{ message.content }}"),
    "tests emptiness": LLAMA_LIKE.replace(
        "CONTENT", "{% if message.content %}{{ message.content }}{% else %}(nothing){% endif %}"),
    "plain": LLAMA_LIKE.replace("CONTENT", "{{ message.content }}"),
}


def play_all(tokenizer, monkeypatch, seed=0, episodes=12, strip=False) -> list[dict]:
    """Random episodes (no tools), each played fast and by the reference; returns how many ran to the end."""
    rng = random.Random(seed)
    completed = 0
    for _ in range(episodes):
        script = random_script(rng, tokenizer, [None])
        if strip:  # contents a trimming template leaves as they are
            script = strip_contents(tokenizer, script)
        fast = play(tokenizer, script, True, monkeypatch)
        assert fast == play(tokenizer, script, False, monkeypatch), script
        completed += fast["error"] is None
    return completed


def strip_contents(tokenizer, script: dict) -> dict:
    """The script with stripped message contents and assistant turns that decode to stripped text."""
    turns = []
    for (_, logprobs), observations in script["turns"]:
        ids = tokenizer.encode("I go left.", add_special_tokens=False) + [tokenizer.eos_token_id]
        turns.append(((ids, None if logprobs is None else [-0.5] * len(ids)),
                      [m | {"content": m["content"].strip()} for m in observations]))
    return script | {"messages": [m | {"content": m["content"].strip()} for m in script["messages"]],
                     "turns": turns}


def path_counts() -> tuple[int, int]:
    """(fast, slow) counts of prompts and observations together."""
    return (PATH_STATS["prompt_fast"] + PATH_STATS["observation_fast"],
            PATH_STATS["prompt_slow"] + PATH_STATS["observation_slow"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_templates_that_transform_content_use_the_slow_path(tiny_model_dir, monkeypatch, name):
    # Most of these also make the reference refuse the episode (the assistant text is no longer what
    # follows the generation prompt): play_all checks that both paths then raise the same error.
    tokenizer = fresh_tokenizer(tiny_model_dir, REFUSED[name])
    fast_before, slow_before = path_counts()
    play_all(tokenizer, monkeypatch)
    fast_after, slow_after = path_counts()
    assert fast_after == fast_before and slow_after > slow_before


def test_trimming_template_serves_trimmed_contents_through_the_slow_path(tiny_model_dir, monkeypatch):
    tokenizer = fresh_tokenizer(tiny_model_dir, REFUSED["trims"])
    fast_before, _ = path_counts()
    assert play_all(tokenizer, monkeypatch, strip=True) > 6
    assert path_counts()[0] == fast_before


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_position_and_emptiness_dependent_templates_keep_the_fast_path(tiny_model_dir, monkeypatch, name):
    tokenizer = fresh_tokenizer(tiny_model_dir, HANDLED[name])
    fast_before, _ = observation_counts()
    assert play_all(tokenizer, monkeypatch) > 6  # most episodes run to the end
    assert observation_counts()[0] > fast_before


def test_first_observation_as_first_user_turn_gets_its_own_frame(tiny_model_dir, monkeypatch, sample):
    tokenizer = fresh_tokenizer(tiny_model_dir, HANDLED["marks the first user turn"])
    for first in ([{"role": "system", "content": "sys"}], [{"role": "user", "content": "task"}]):
        handlers = []
        for fast in (True, False):
            with monkeypatch.context() as patch:
                patch.setattr(handler_module, "USE_FAST_PATH", fast)
                handler = RolloutHandler(tokenizer, first, 64, 256)
            handler.add_assistant(sample(tokenizer, "look"))
            handler.add_observation("a door")
            handlers.append(handler)
        assert handlers[0].prompt_ids_for_next_turn() == handlers[1].prompt_ids_for_next_turn()
        text = tokenizer.decode(handlers[0].response_ids)
        assert ("[first] a door" in text) == (first[0]["role"] == "system")


def test_template_that_rewrites_earlier_turns_still_raises(tiny_model_dir, sample):
    tokenizer = fresh_tokenizer(tiny_model_dir, (
        "{{ messages | length }} messages{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}|assistant:{% endif %}"
    ))
    handler = RolloutHandler(tokenizer, [{"role": "user", "content": "task"}], 64, 64)
    handler.add_assistant(sample(tokenizer, "go"))
    with pytest.raises(ValueError, match="rewrote earlier turns"):
        handler.add_observation("ok")
    assert handler.messages[-1]["role"] == "assistant"  # the refused observation left no trace


@pytest.mark.parametrize(
    "content, verbatim, tests_emptiness",
    [
        ("{{ message.content }}", True, False),
        ("{{ '\\n' + message['content'] + '!' }}", True, False),
        ("{{ message.content if message.content else '' }}", True, False),
        ("{% set c = message.content %}{{ c }}", True, False),
        ("{% if message.content is string %}{{ message.content }}{% endif %}", True, False),
        ("{% if message.content and loop.first %}x{% endif %}{{ message.content }}", True, True),
        ("{{ message.content | trim }}", False, False),
        ("{{ message.content.strip() }}", False, False),
        ("{% if message.content == 'x' %}y{% endif %}", False, False),
        ("{% if '<think>' in message.content %}y{% endif %}", False, False),
        ("{{ message.content or 'none' }}", False, False),
        ("{% set c = message.content %}{{ c | upper }}", False, False),
        ("{% for ch in message.content %}{{ ch }}{% endfor %}", False, False),
        ("{% macro show(m) %}{{ m.content }}{% endmacro %}{{ show(message) | trim }}", False, False),
        ("{% filter trim %}{{ message.content }}{% endfilter %}", False, False),
        ("{{ message.get('content') }}", False, False),
    ],
)
def test_template_analysis(content, verbatim, tests_emptiness):
    flow = analyse_template("{% for message in messages %}" + content + "{% endfor %}")
    assert (flow.verbatim, flow.tests_emptiness if flow.verbatim else False) == (verbatim, tests_emptiness), flow
