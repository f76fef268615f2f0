"""How many agents the gateway answers at once, and what it adds to a call (issue #70).

    .venv/bin/python bench/gateway_concurrency.py [--agents 8 64] [--generation-s 1.0] [--calls 20] [--out FILE]

Part 1: N agent episodes (each its own key) make one chat call each, at once, to a gateway whose model takes
`--generation-s` to answer, after one untimed call (the gateway's one-off start, printed apart); the wall time of
all N is printed (ideal: one generation, ~1 s). Part 2: 64 agents make
`--calls` calls each, one after another, to a model that answers at once: each call's latency is what the gateway
adds (HTTP, validation, the chat template, tokenizing, recording), printed as p50 / p99. The gateway's
`max_concurrent_calls` is the number of agents (the run's concurrency). The tiny model's tokenizer is built offline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.rollout.llm import GenerationResult
from dev_tools.tiny_model import build_tiny_model


class Model:
    """Answers "ok" after `seconds`; counts the calls answered at once (the most seen)."""

    def __init__(self, tokenizer, seconds: float) -> None:
        self.ids = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.seconds, self.now, self.most, self.lock = seconds, 0, 0, threading.Lock()

    def __call__(self, request_id, prompt_ids, max_tokens, **_):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.seconds)
        with self.lock:
            self.now -= 1
        return GenerationResult(list(self.ids), [-0.1] * len(self.ids), "stop", 0.0)


def call(url: str, episode: str, key: str, text: str = "hi") -> float:
    """One chat call's seconds (an error raises)."""
    started = time.perf_counter()
    answer = requests.post(f"{url}/episodes/{episode}/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "policy", "messages": [{"role": "user", "content": text}]})
    answer.raise_for_status()
    return time.perf_counter() - started


def side_by_side(tokenizer, agents: int, generation_s: float) -> dict:
    model = Model(tokenizer, generation_s)
    server = GatewayServer(Gateway(GatewayConfig(max_concurrent_calls=agents), tokenizer, model)).start()
    try:
        # One call first, untimed: a new gateway's first call also pays its one-off start (the chat template's
        # compilation, the first connection), which every later episode of a run does not.
        first_s = call(server.url, server.gateway.open_episode(key="warm-up"), "warm-up")
        episodes = [(server.gateway.open_episode(key=f"k{i}"), f"k{i}") for i in range(agents)]
        started = time.perf_counter()
        with ThreadPoolExecutor(agents) as pool:
            list(pool.map(lambda pair: call(server.url, *pair), episodes))
        return {"agents": agents, "generation_s": generation_s, "wall_s": time.perf_counter() - started,
                "most_at_once": model.most, "first_call_s": first_s}
    finally:
        server.stop()


def overhead(tokenizer, agents: int, calls: int) -> dict:
    model = Model(tokenizer, 0.0)
    server = GatewayServer(Gateway(GatewayConfig(max_concurrent_calls=agents, max_calls=calls + 1), tokenizer,
                                   model)).start()
    try:
        episodes = [(server.gateway.open_episode(key=f"k{i}"), f"k{i}") for i in range(agents)]

        def agent(pair) -> list[float]:  # each call a new history: one sample per call, as a history rewriter
            return [call(server.url, *pair, text=f"call {n}") for n in range(calls)]

        started = time.perf_counter()
        with ThreadPoolExecutor(agents) as pool:
            latencies = sorted(seconds for seconds_list in pool.map(agent, episodes) for seconds in seconds_list)
        wall_s = time.perf_counter() - started
        return {"agents": agents, "calls": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
                "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))], "calls_per_s": len(latencies) / wall_s}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--generation-s", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/gateway_concurrency.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")))))
    found = {"side_by_side": [side_by_side(tokenizer, n, args.generation_s) for n in args.agents],
             "overhead": overhead(tokenizer, 64, args.calls)}
    for row in found["side_by_side"]:
        print(f"{row['agents']} agents, one call each with a {row['generation_s']:g} s generation: "
              f"{row['wall_s']:.2f} s for all ({row['most_at_once']} answered at once; the gateway's first call, "
              f"before them: {row['first_call_s']:.2f} s)")
    row = found["overhead"]
    print(f"{row['agents']} agents x {args.calls} calls to a model that answers at once: the gateway adds "
          f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms a call ({row['calls_per_s']:.0f} calls/s in all: "
          "a call waits for the others' turns on the gateway's event loop and threads)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
