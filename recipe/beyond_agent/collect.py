"""Collect (or evaluate) multi-turn episodes of a model on an environment, one JSON line per episode.

    python -m recipe.beyond_agent.collect --env babyai --tasks 0:64 --model PATH --n 4 \\
        --max-rounds 8 --out episodes.jsonl

It starts a vLLM server and an envservice itself unless given their URLs (`--vllm-url`,
`--envservice-url`), runs every episode through the same ParallelEnvManager that training uses, and
prints the success rate and throughput. Each line is a `TrajectoryRecord` (recipe/beyond_agent/trajectories.py,
the schema of training's dumps, with step 0): env, task, agent_task, the chat messages, prompt_ids,
response_ids, response_mask, response_logprobs, turn_ends, reward (the task's), score (the env's), success,
step_rewards, rounds, termination (and error), timings. `read_dump` reads the file back, checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterator

from recipe.beyond_agent.rollout.actions import ACTION_PARSERS
from recipe.beyond_agent.rollout.dataflow import DataflowConfig, EpisodeResult, EpisodeSpec
from recipe.beyond_agent.rollout.env_manager import ParallelEnvManager
from recipe.beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, LLMManagerConfig, SamplingParams
from recipe.beyond_agent.tasks import TASKS, AgentTask, build_task


def parse_tasks(text: str) -> list[int]:
    """Task indices from "START:STOP" (half-open) or "I,J,K"."""
    try:
        if ":" in text:
            start, stop = (int(part) for part in text.split(":"))
            tasks = list(range(start, stop))
        else:
            tasks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tasks must look like 0:64 or 3,5,7; got {text!r}") from None
    if not tasks or min(tasks) < 0:
        raise argparse.ArgumentTypeError(f"--tasks must name at least one task index >= 0; got {text!r}")
    return tasks


def collection_specs(env_id: str, split: str, tasks: list[int], n: int, seed: int,
                     agent_task: AgentTask, params: dict | None = None) -> list[EpisodeSpec]:
    """n episodes per task; the n samples of one task form one group and share its seed."""
    return [EpisodeSpec(env_id, task_id=task, seed=seed + task, split=split, group_id=f"{env_id}:{task}",
                        index=i * n + k, agent_task=agent_task, params=dict(params or {}))
            for i, task in enumerate(tasks) for k in range(n)]


def parse_params(text: str) -> dict:
    """--params: a JSON object of env task parameters, e.g. '{"around": true}'."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--params must be a JSON object; got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--params must be a JSON object; got {text!r}")
    return value


@contextlib.contextmanager
def vllm_urls(args: argparse.Namespace) -> Iterator[list[str]]:
    """The given vLLM URLs, or one server we start (and stop) for --model."""
    if args.vllm_url:
        yield args.vllm_url
        return
    from dev_tools.vllm_server import VLLMServer, VLLMServerConfig

    print(f"[collect] starting vLLM for {args.model} ...", file=sys.stderr, flush=True)
    with VLLMServer(VLLMServerConfig(model=args.model, max_model_len=args.max_model_len)) as server:
        print(f"[collect] vLLM ready at {server.base_url} after {server.startup_seconds:.0f} s", file=sys.stderr)
        yield [server.base_url]


def collect(args: argparse.Namespace) -> list[EpisodeResult]:
    """Run the episodes and write the JSONL file; returns the results (args: `build_parser()`'s options)."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.process import envservice_url

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    agent_task = build_task({"name": args.agent_task, "action_format": args.action_format}, "--agent-task")
    specs = collection_specs(args.env, args.split, args.tasks, args.n, args.seed, agent_task, args.params)
    config = DataflowConfig(max_rounds=args.max_rounds, max_prompt_length=args.max_prompt_length,
                            max_response_length=args.max_response_length,
                            max_tokens_per_turn=args.max_tokens_per_turn)
    service_args = ["--max-sessions", str(max(64, args.concurrency * 2))]
    with envservice_url([args.env], args.envservice_url, extra_args=service_args) as env_url, \
            EnvClient(env_url, pool_size=args.concurrency) as env_client, \
            episode_generator(args) as (generate, llm):
        print(f"[collect] envservice at {env_url}, model served by {args.backend}", file=sys.stderr)
        # In-process generation serves one episode at a time; a vLLM server batches many.
        workers = 1 if args.backend == "hf" else args.concurrency
        manager = ParallelEnvManager(env_client, generate, tokenizer, config, max_workers=workers)
        output = _run_with_progress(manager, specs)
    _write_jsonl(args.out, output.results)
    _print_summary(output, llm.metrics() if llm is not None else None)
    return output.results


@contextlib.contextmanager
def episode_generator(args: argparse.Namespace) -> Iterator[tuple[object, AsyncLLMServerManager | None]]:
    """(generate function, its LLM manager or None): vLLM server(s) we use or start, or `--backend hf`, the
    model in this process (Hugging Face generate; small models on CPU), sampled from a torch seed `--seed`."""
    if args.backend == "hf":
        import torch

        from recipe.beyond_agent.rollout.hf_policy import TransformersPolicy

        torch.manual_seed(args.seed)
        yield TransformersPolicy.from_pretrained(args.model, args.temperature), None
        return
    with vllm_urls(args) as llm_urls, \
            AsyncLLMServerManager(HttpVLLMBackend(llm_urls, args.served_model_name or args.model),
                                  LLMManagerConfig(max_in_flight=args.concurrency)) as llm:
        print(f"[collect] vLLM at {', '.join(llm_urls)}", file=sys.stderr)
        yield llm.with_sampling(SamplingParams(temperature=args.temperature)), llm


def _run_with_progress(manager: ParallelEnvManager, specs: list[EpisodeSpec]):
    from tqdm import tqdm

    with tqdm(total=len(specs), desc="episodes", unit="ep", file=sys.stderr) as bar:
        return manager.run(specs, on_result=lambda result: bar.update(1))


def _write_jsonl(path: Path, results: list[EpisodeResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for result in results:
            out.write(json.dumps(result.to_record()) + "\n")
    print(f"[collect] wrote {len(results)} episodes to {path}", file=sys.stderr)


def _print_summary(output, llm_metrics) -> None:
    m = output.metrics
    steps = sum(r.rounds for r in output.results)
    print(f"[collect] success rate {m.success_rate:.3f} over {m.episodes - m.infra_failures} scored episodes; "
          f"terminations {m.terminations}")
    served = (f", {llm_metrics.tokens_generated / m.wall_time_s:.0f} generated tokens/s, LLM busy "
              f"{llm_metrics.busy_time_s:.1f} s" if llm_metrics is not None else "")
    print(f"[collect] {m.episodes / m.wall_time_s:.2f} episodes/s, {steps / m.wall_time_s:.1f} rounds/s, "
          f"wall {m.wall_time_s:.1f} s{served}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.beyond_agent.collect", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="envservice env id, e.g. babyai")
    parser.add_argument("--tasks", type=parse_tasks, default=parse_tasks("0:8"), help="0:64 or 3,5,7 (task indices)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--params", type=parse_params, default={}, help='env task parameters as JSON, e.g. \'{"around": true}\'')
    parser.add_argument("--model", required=True, help="Hugging Face model folder (its tokenizer builds prompts)")
    parser.add_argument("--served-model-name", default=None, help="model name on --vllm-url servers (default: --model)")
    parser.add_argument("--n", type=int, default=1, help="episodes per task (one group)")
    parser.add_argument("--max-rounds", type=int, default=8)
    parser.add_argument("--max-prompt-length", type=int, default=1024)
    parser.add_argument("--max-response-length", type=int, default=2048)
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096, help="context of a vLLM server we start")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--action-format", default="plain", choices=sorted(ACTION_PARSERS))
    parser.add_argument("--agent-task", default="env", choices=sorted(TASKS),
                        help="the registered AgentTask that prompts and scores the episodes (default: env)")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes in flight")
    parser.add_argument("--seed", type=int, default=0, help="task seed = seed + task index")
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm",
                        help="vllm: a server (--vllm-url, or one we start); hf: the model in this process (CPU, small)")
    parser.add_argument("--vllm-url", action="append", help="use running vLLM server(s) instead of starting one")
    parser.add_argument("--envservice-url", default=None, help="use a running envservice instead of starting one")
    parser.add_argument("--out", type=Path, default=Path("episodes.jsonl"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    collect(args)
    print(f"[collect] done in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
