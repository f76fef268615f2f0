"""The offline tiny model: deterministic, loadable by transformers, with a working ChatML template."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dev_tools.tiny_model import TinyModelSpec, build_tiny_model


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_arguments_give_identical_files_and_another_seed_other_weights(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    assert folder_digest(again) == folder_digest(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    assert folder_digest(other)["model.safetensors"] != folder_digest(tiny_model_dir)["model.safetensors"]


def test_tokenizer_round_trips_any_text_and_knows_its_special_tokens(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "go to the red ball! ünïcødé ✓ {\"x\": 1}\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    # Chat markers and tool markers are single tokens, so turn boundaries and tool calls parse exactly.
    for marker in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"]:
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


def test_chat_template_renders_chatml_with_tools(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "move", "arguments": {"d": "left"}}}]},
        {"role": "tool", "content": "moved"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function"' in text
    assert text.endswith(
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"move\", \"arguments\": {\"d\": \"left\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nmoved\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_model_matches_tokenizer_and_generates(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.num_hidden_layers == 2
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = torch.tensor([tokenizer.encode("go to the red ball", add_special_tokens=False)])
    torch.manual_seed(0)
    output = model.generate(prompt, max_new_tokens=12, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    new_tokens = output[0, prompt.shape[1]:]
    assert len(new_tokens) in range(1, 13)
    assert int(new_tokens.max()) < len(tokenizer)
