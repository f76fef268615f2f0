"""Hand-worked limits of RolloutHandler: response truncation, prompt cap, termination, bad input."""

from __future__ import annotations

import pytest

from beyond_agent.rollout.handler import RolloutHandler

TASK = [{"role": "user", "content": "Task: open the door."}]
EOS = 2  # <|im_end|> in the tiny ChatML tokenizer


@pytest.fixture
def tok(chatml_tokenizer):
    """The tiny ChatML tokenizer; its eos (<|im_end|>) is id 2."""
    assert chatml_tokenizer.eos_token_id == EOS
    return chatml_tokenizer


def test_assistant_turn_over_budget_keeps_what_fits_and_records_length(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=3)
    handler.add_assistant([300, 301, 302, 303, EOS], [-0.1, -0.2, -0.3, -0.4, -0.5])

    assert handler.response_ids == [300, 301, 302]
    assert handler.response_mask == [1, 1, 1]
    assert handler.response_logprobs == [-0.1, -0.2, -0.3]
    assert handler.termination == "length" and handler.done
    assert handler.remaining_response_length == 0


def test_observation_over_budget_is_cut_and_stops_the_episode(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=8)
    handler.add_assistant([300, 301, 302, EOS], [-0.5, -0.5, -0.5, -0.5])
    handler.add_observation("a long observation that does not fit in the few tokens left")

    assert len(handler.response_ids) == 8
    assert handler.response_ids[:5] == [300, 301, 302, EOS, tok.encode("\n")[0]]
    assert handler.response_mask == [1, 1, 1, 1, 0, 0, 0, 0]
    assert handler.response_logprobs == [-0.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert handler.termination == "length"
    with pytest.raises(RuntimeError, match="termination='length'"):
        handler.add_assistant([300, EOS])


def test_exact_fit_is_not_a_truncation(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=4)
    handler.add_assistant([300, 301, 302, EOS])
    assert handler.termination is None and handler.remaining_response_length == 0
    handler.finish("done")
    assert handler.termination == "done"


def test_finish_keeps_an_earlier_length_truncation(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=2)
    handler.add_assistant([300, 301, 302])
    handler.finish("max_rounds")
    assert handler.termination == "length"


def test_attention_mask_and_positions_cover_prompt_and_response(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=16)
    prompt_len = len(handler.prompt_ids)
    handler.add_assistant([300, 301, EOS])
    assert handler.attention_mask == [1] * (prompt_len + 3)
    assert handler.position_ids == list(range(prompt_len + 3))
    assert handler.prompt_ids_for_next_turn() == handler.prompt_ids + [300, 301, EOS]


def test_long_prompt_keeps_its_tail_and_records_it(tok, render_ids):
    full = render_ids(tok, TASK)
    handler = RolloutHandler(tok, TASK, max_prompt_length=5, max_response_length=16)
    assert handler.prompt_ids == full[-5:]
    assert handler.prompt_truncated is True
    assert RolloutHandler(tok, TASK, max_prompt_length=len(full), max_response_length=16).prompt_truncated is False


def test_long_prompt_raises_under_error_policy(tok):
    with pytest.raises(ValueError, match=r"max_prompt_length=5 \(prompt_truncation='error'"):
        RolloutHandler(tok, TASK, max_prompt_length=5, max_response_length=16, prompt_truncation="error")


def test_missing_logprobs_are_reported_as_none(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=16)
    handler.add_assistant([300, EOS])
    assert handler.response_logprobs is None
    assert handler.to_episode().response_logprobs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_truncation": "middle"}, r"'middle' is not valid; choose one of \('left', 'error'\)"),
        ({"max_response_length": 0}, "max_response_length must be a positive int, got 0"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "user"}]}, "message 0 needs 'role' and 'content'"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "from 'assistant' but should be the task"),
    ],
)
def test_constructor_rejects_bad_arguments(tok, kwargs, message):
    args = {"messages": TASK, "max_prompt_length": 64, "max_response_length": 16} | kwargs
    with pytest.raises(ValueError, match=message):
        RolloutHandler(tok, **args)


def test_out_of_order_and_malformed_turns_are_rejected(tok):
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=64)
    with pytest.raises(ValueError, match="observation after a 'user' message"):
        handler.add_observation("too early")
    with pytest.raises(ValueError, match="logprobs has 1 values but token_ids has 2 tokens"):
        handler.add_assistant([300, EOS], [-0.1])
    handler.add_assistant([300, EOS])
    with pytest.raises(ValueError, match="add_assistant called twice in a row"):
        handler.add_assistant([301, EOS])
    with pytest.raises(ValueError, match=r"role 'assistant'; valid roles are \('user', 'tool'\)"):
        handler.add_observation("hi", role="assistant")
    with pytest.raises(ValueError, match="termination reason 'won' is not valid; choose one of"):
        handler.finish("won")


def test_turns_after_a_capped_prompt_still_follow_the_template(tok, render_ids):
    handler = RolloutHandler(tok, TASK, max_prompt_length=5, max_response_length=64)
    handler.add_assistant(tok.encode("open door", add_special_tokens=False) + [EOS])
    handler.add_observation("The door is open.")
    golden = render_ids(tok, handler.messages)
    # Only the prompt's head is gone; the deltas are computed from the full text, not from the kept ids.
    assert handler.prompt_ids_for_next_turn() == golden[len(golden) - 5 - len(handler.response_ids):]


def test_assistant_ids_from_numpy_or_torch_equal_a_list_and_non_integers_are_refused(tok):
    import numpy as np
    import torch

    sampled, logprobs = [300, 301, EOS], [-0.25, -0.5, -0.125]
    rows = []
    for ids in (sampled, np.array(sampled, dtype=np.int64), torch.tensor(sampled), tuple(sampled)):
        handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=16)
        handler.add_assistant(ids, np.array(logprobs))
        rows.append((handler.response_ids, handler.response_logprobs))
        assert all(type(i) is int for i in handler.response_ids)  # JSON- and verl-ready Python ints
    assert rows == [(sampled, logprobs)] * 4

    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=16)
    with pytest.raises(TypeError, match="token_ids must be integers"):
        handler.add_assistant([300.0, 2.0])
    assert handler.response_ids == [] and handler.num_turns == 0  # a refused turn leaves nothing behind


class CountingTokenizer:
    """The real tokenizer, recording how many characters each `encode` was given, through transformers or
    straight to its Rust backend (`backend_tokenizer`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.encoded = tokenizer, []
        self.backend_tokenizer = _Counting(tokenizer.backend_tokenizer, self.encoded)

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class _Counting:
    """A Rust tokenizer whose `encode` and `encode_batch` record each text's length in `encoded` and in its own
    `calls`."""

    def __init__(self, backend, encoded: list[int]) -> None:
        self.backend, self.encoded, self.calls = backend, encoded, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        self.calls.append(len(text))
        return self.backend.encode(text, **kwargs)

    def encode_batch(self, texts, **kwargs):
        self.encoded.extend(len(text) for text in texts)
        self.calls.extend(len(text) for text in texts)
        return self.backend.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_the_backend_encodes_as_transformers_does_and_is_skipped_when_another_caller_left_truncation_on(tok):
    """The handler encodes with the Rust tokenizer directly (without transformers' wrapper); its ids equal
    `tokenizer.encode`'s, special tokens written as text included. A truncation another caller left set on the
    backend must not cut an observation: the handler then goes through transformers, which resets it."""
    texts = ["<|im_end|>\n<|im_start|>user\nYou see a red door.<|im_end|>\n<|im_start|>assistant\n",
             "  spaces, ünïcödé, 数字 123 and\ttabs\n\n", "word " * 300]
    handler = RolloutHandler(tok, TASK, max_prompt_length=64, max_response_length=4096)
    counting = CountingTokenizer(tok)
    direct = RolloutHandler(counting, TASK, max_prompt_length=64, max_response_length=4096)
    for text in texts:
        assert handler._encode(text) == tok.encode(text, add_special_tokens=False)
    whole = len(tok.encode(texts[2], add_special_tokens=False))
    counting.encoded.clear()
    counting.backend_tokenizer.calls.clear()
    assert len(direct._encode(texts[2])) == whole
    assert counting.encoded == counting.backend_tokenizer.calls == [len(texts[2])]  # one call, straight to Rust
    tok("word " * 300, truncation=True, max_length=5)  # leaves truncation set on the shared backend
    assert tok.backend_tokenizer.truncation is not None
    assert len(handler._encode(texts[2])) == whole > 5
    assert tok.backend_tokenizer.truncation is None  # transformers reset it


def test_text_that_cannot_be_kept_is_never_tokenized(tok):
    """Issue #51: a 1 MB message was tokenized whole before the prompt cap dropped nearly all of it. Only
    `MAX_CHARS_PER_TOKEN` characters per token of room reach the tokenizer; the ids kept are what the model gets."""
    from beyond_agent.rollout.handler import MAX_CHARS_PER_TOKEN

    counting = CountingTokenizer(tok)
    handler = RolloutHandler(counting, [{"role": "user", "content": "word " * 200_000}], max_prompt_length=64,
                             max_response_length=16)
    assert counting.encoded[-1] == 64 * MAX_CHARS_PER_TOKEN
    assert len(handler.prompt_ids) == 64 and handler.prompt_truncated
    assert handler.prompt_ids[-3:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    handler.add_assistant([300, EOS], [-0.5, -0.5])
    handler.add_observation("more " * 200_000)
    assert counting.encoded[-1] == 14 * MAX_CHARS_PER_TOKEN  # 16 tokens of room, 2 used by the reply
    assert len(handler.response_ids) == 16 and handler.termination == "length"
