"""Fixtures for the rollout tests: two tokenizers with different chat templates, and golden helpers.

Helpers are fixtures (not an importable module) because verl's wheel installs its own `tests` package.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer


# A Llama-3-like template written for these tests: headers around the role, <|eot_id|> ends each turn,
# and no newline after it (unlike ChatML), so the observation delta starts directly with a header.
# Newlines are written as expressions because transformers renders with Jinja's trim_blocks.
LLAMA_LIKE_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message.role == 'tool' else message.role %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>{{ '\\n\\n' }}{{ message.content }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)
LLAMA_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]


@pytest.fixture(scope="session")
def chatml_tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer with its ChatML-with-tools template; eos is <|im_end|>."""
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def llama_tokenizer(tiny_model_dir: Path):
    """A separate copy of the tiny tokenizer with Llama-3-like header tokens and template; eos is <|eot_id|>."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.add_tokens(LLAMA_SPECIAL_TOKENS, special_tokens=True)
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA_LIKE_TEMPLATE
    return tokenizer


@pytest.fixture(params=["chatml", "llama"])
def tokenizer(request, chatml_tokenizer, llama_tokenizer):
    """Each golden test runs once per chat template."""
    return chatml_tokenizer if request.param == "chatml" else llama_tokenizer


@pytest.fixture(scope="session")
def tools() -> list[dict]:
    """One tool schema, rendered into the ChatML system prompt."""
    return TOOLS


@pytest.fixture
def sample():
    """Simulate the LLM server: the tokenizer's own ids for `text`, then the end-of-turn id."""

    def _sample(tokenizer, text: str, end_of_turn: bool = True) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids + [tokenizer.eos_token_id] if end_of_turn else ids

    return _sample


@pytest.fixture
def render_ids():
    """Golden reference: encode the template's full rendering of a conversation."""

    def _render_ids(tokenizer, messages, tools=None, add_generation_prompt=True) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return tokenizer.encode(text, add_special_tokens=False)

    return _render_ids


@pytest.fixture(scope="module")
def frozenlake_url(serve_app):
    """A real envservice serving FrozenLake in this process over loopback (16 sessions); its URL."""
    from envservice.server import EnvServiceConfig, create_app

    with serve_app(create_app(EnvServiceConfig(env_ids=["frozenlake"], max_sessions=16))) as url:
        yield url
