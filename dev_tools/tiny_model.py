"""Build a tiny Qwen2 model and a ChatML tokenizer offline, deterministically.

    python -m dev_tools.tiny_model --out ~/.cache/beyond_agent/tiny-qwen2

Tests and the CPU quickstart use it instead of downloading a model: a 2-layer Qwen2 with random weights
and a byte-level BPE tokenizer trained here on a generated corpus, with a ChatML chat template that knows
tools. The folder is an ordinary Hugging Face checkpoint: `AutoTokenizer`, `AutoModelForCausalLM` and
vLLM load it. The same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# <|im_end|> ends every turn, so it is the model's end-of-sequence; <|endoftext|> pads.
END_OF_TURN = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, "<|im_start|>", END_OF_TURN]
# Markers the chat template writes around tool calls and results; single tokens make parsing exact.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Our own ChatML template with tool support (Qwen2.5-style wire format, written for this project).
# It renders every message from its own fields only, so rendering a prefix of a conversation gives a
# prefix of the full rendering: RolloutHandler relies on that to append observations as deltas.
def _survive_trim_blocks(template: str) -> str:
    """Write each newline that directly follows a block tag as an expression.

    Why: transformers renders chat templates with Jinja's `trim_blocks`, which drops the first newline
    after a `{% ... %}` tag; ChatML needs those newlines, and `{{ '\\n' }}` is not trimmed.
    """
    return template.replace("%}\n", "%}{{ '\\n' }}")


CHATML_TOOL_TEMPLATE = _survive_trim_blocks(
    # No whitespace control ({%- -%}) anywhere: the string has no stray whitespace between tags, and a
    # trimming tag would also eat the literal newlines ChatML needs.
    "{% if messages and messages[0].role == 'system' %}"
    "{% set system_text = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set system_text = 'You are a helpful agent.' %}{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ system_text }}"
    "{% if tools %}\n\n# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    " Available tools:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>{% endif %}"
    "<|im_end|>\n"
    "{% for message in rest %}"
    "{% if message.role == 'tool' %}"
    # Consecutive tool results share one user turn, one <tool_response> block each.
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content if message.content else '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "go to the red green blue purple yellow grey ball box key door open close pick up drop put next "
    "turn left right forward toggle done you see a wall in front of behind your room goal reach "
    "craft get inventory from using with stick planks log iron ingot crafting table minecraft "
    "look around take place heat cool clean slice examine fridge microwave drawer cabinet countertop "
    "search answer question who what where when which why how is was the capital of born in city "
    "task success reward step action observation think tool call result error valid invalid north "
    "south east west room kitchen living bedroom apple egg mug knife lamp book pencil plate cup"
).split()
_PUNCTUATION = [".", ",", ":", "?", "!", "\n", " ", "\"", "'", "(", ")", "[", "]", "{", "}", "<", ">", "/"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. vLLM on CPU needs a head size of at least 32 (hidden / heads)."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0


def training_corpus(seed: int, lines: int = 2000) -> list[str]:
    """A deterministic text corpus: env-like sentences, chat markup, JSON and numbers."""
    rng = random.Random(seed)
    corpus = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words) + rng.choice(_PUNCTUATION)
        if i % 5 == 0:
            sentence = json.dumps({"name": rng.choice(_WORDS), "arguments": {"x": rng.randint(0, 999)}})
        if i % 7 == 0:
            sentence = f"<|im_start|>{rng.choice(['user', 'assistant', 'system'])}\n{sentence}<|im_end|>\n"
        corpus.append(sentence)
    corpus.append("0123456789 " * 4)
    return corpus


def train_tokenizer(spec: TinyModelSpec) -> Tokenizer:
    """A byte-level BPE trained on `training_corpus`; every byte is in the vocabulary, so any text encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(spec.seed), trainer=trainer)
    tokenizer.add_tokens(TOOL_TOKENS)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """Save as a transformers fast tokenizer with the ChatML template in tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TURN,
        pad_token=PAD,
        bos_token=None,
        model_max_length=TinyModelSpec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = CHATML_TOOL_TEMPLATE
    hf_tokenizer.save_pretrained(str(out))


def build_model(spec: TinyModelSpec, tokenizer: Tokenizer, out: Path) -> None:
    """Random-weight Qwen2 (float32) whose vocabulary matches the tokenizer exactly."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.token_to_id(END_OF_TURN)
    pad_id = tokenizer.token_to_id(PAD)
    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id).save_pretrained(str(out))


def build_tiny_model(out: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write tokenizer, chat template, config and weights to `out`; return the folder."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec)
    save_tokenizer(tokenizer, out)
    build_model(spec, tokenizer, out)
    (out / "beyond_agent_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


SHAPES = {"tiny": None, "0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "1.5b": "Qwen/Qwen2.5-1.5B-Instruct"}
"""Shape name -> the hub model whose shape (beyond_agent.gpu_plan.KNOWN_MODELS) a random model takes (hidden size,
layers, heads, MLP; the vocabulary stays the offline tokenizer's ~1k entries); tiny: TinyModelSpec's own."""


def build_shaped_model(shape: str, folder: Path) -> Path:
    """A random-weight Qwen2 of the named shape (`SHAPES`) with the offline tokenizer, built once into `folder`
    (a folder holding one already is returned as it is). Raises ValueError naming the valid shapes."""
    if shape not in SHAPES:
        raise ValueError(f"model shape {shape!r} is not valid; choose one of {', '.join(SHAPES)}")
    if (folder / "config.json").exists():
        return folder
    # Built beside and moved into place whole: a build cut short (a device call's time limit) leaves no folder
    # that a later call would take for a model.
    building = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    for leftover in (*folder.parent.glob(f"{folder.name}.building-*"), folder):  # builds cut short (no config.json)
        shutil.rmtree(leftover, ignore_errors=True)
    spec = TinyModelSpec()
    if SHAPES[shape]:
        from beyond_agent.gpu_plan import KNOWN_MODELS

        known = KNOWN_MODELS[SHAPES[shape]]
        spec = TinyModelSpec(hidden_size=known.hidden_size, intermediate_size=known.intermediate_size,
                             num_hidden_layers=known.num_hidden_layers, num_attention_heads=known.num_attention_heads,
                             num_key_value_heads=known.num_key_value_heads)
    build_tiny_model(building, spec)
    building.replace(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seeds both the corpus and the weights")
    parser.add_argument("--vocab-size", type=int, default=TinyModelSpec.vocab_size)
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                        help="another model's shape with random weights (0.5b, 1.5b: Qwen2.5's); built once")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.shape != "tiny":
        out = build_shaped_model(args.shape, Path(args.out).expanduser())
    else:
        out = build_tiny_model(args.out, TinyModelSpec(vocab_size=args.vocab_size, seed=args.seed))
    print(f"model written to {out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
