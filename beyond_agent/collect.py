"""Collect (or evaluate) multi-turn episodes of a model on an environment, one JSON line per episode.

    python -m beyond_agent.collect --env babyai --tasks 0:64 --model PATH --n 4 \\
        --max-rounds 8 --out episodes.jsonl

It starts a vLLM server and an envservice itself unless given their URLs (`--vllm-url`,
`--envservice-url`), runs every episode through the same ParallelEnvManager that training uses, and
prints the success rate and throughput. Each line is a `TrajectoryRecord` (beyond_agent/trajectories.py,
the schema of training's dumps, with step 0): env, task, agent_task, the chat messages, prompt_ids,
response_ids, response_mask, response_logprobs, turn_ends, reward (the task's), score (the env's), success,
step_rewards, rounds, termination (and error), timings. `read_dump` reads the file back, checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from beyond_agent.actions import ACTION_PARSERS
from beyond_agent.cli_args import json_object, task_indices
from beyond_agent.evaluation import (
    POLICY_BACKENDS,
    Evaluation,
    EvaluationConfig,
    PolicyConfig,
    evaluate,
    serve_policy,
)
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeResult
from beyond_agent.tasks import TASKS, build_task
from envservice.contamination import TaskSet


def log(message: str) -> None:
    print(f"[collect] {message}", file=sys.stderr, flush=True)


def collect(policy: PolicyConfig, tasks: TaskSet, settings: EvaluationConfig, out: Path,
            envservice_url: str | None = None) -> Evaluation:
    """Play `tasks` with `policy` (an envservice at `envservice_url`, or one we start), write one
    TrajectoryRecord per episode to `out` (JSONL), print the figures; returns the evaluation."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.process import envservice_url as running_envservice

    tokenizer = AutoTokenizer.from_pretrained(policy.model)
    service_args = ["--max-sessions", str(max(64, policy.max_in_flight * 2))]
    with running_envservice([tasks.env_id], envservice_url, extra_args=service_args) as env_url, \
            EnvClient(env_url, pool_size=policy.max_in_flight) as env_client, \
            serve_policy(policy, log) as served, \
            tqdm(total=len(tasks.tasks) * settings.samples, desc="episodes", unit="ep", file=sys.stderr) as bar:
        log(f"envservice at {env_url}, model served by {policy.backend}")
        evaluation = evaluate(served, env_client, tasks, settings, tokenizer, on_result=lambda _: bar.update(1))
        llm_metrics = served.llm.metrics() if served.llm is not None else None
    _write_jsonl(out, evaluation.results)
    _print_summary(evaluation, llm_metrics)
    return evaluation


def _write_jsonl(path: Path, results: list[EpisodeResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for result in results:
            out.write(json.dumps(result.to_record()) + "\n")
    log(f"wrote {len(results)} episodes to {path}")


def _print_summary(evaluation: Evaluation, llm_metrics) -> None:
    m = evaluation.metrics
    steps = sum(r.rounds for r in evaluation.results)
    print(f"[collect] success rate {m.success_rate:.3f} over {m.episodes - m.infra_failures} scored episodes; "
          f"terminations {m.terminations}")
    served = (f", {llm_metrics.tokens_generated / m.wall_time_s:.0f} generated tokens/s, LLM busy "
              f"{llm_metrics.busy_time_s:.1f} s" if llm_metrics is not None else "")
    print(f"[collect] {m.episodes / m.wall_time_s:.2f} episodes/s, {steps / m.wall_time_s:.1f} rounds/s, "
          f"wall {m.wall_time_s:.1f} s{served}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m beyond_agent.collect", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="envservice env id, e.g. babyai")
    parser.add_argument("--tasks", type=task_indices, default=task_indices("0:8"), help="0:64 or 3,5,7 (task indices)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--params", type=json_object, default={}, help='env task parameters as JSON, e.g. \'{"around": true}\'')
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
    parser.add_argument("--seed", type=int, default=0, help="task seed = seed + task index; the sampling seeds "
                        "derive from it too (collect again: sample alike)")
    parser.add_argument("--backend", choices=POLICY_BACKENDS, default="vllm",
                        help="vllm: a server (--vllm-url, or one we start); hf: the model in this process (CPU, small)")
    parser.add_argument("--vllm-url", action="append", help="use running vLLM server(s) instead of starting one")
    parser.add_argument("--envservice-url", default=None, help="use a running envservice instead of starting one")
    parser.add_argument("--out", type=Path, default=Path("episodes.jsonl"))
    return parser


def from_args(args: argparse.Namespace) -> tuple[PolicyConfig, TaskSet, EvaluationConfig]:
    """The library's parameters from `build_parser()`'s options."""
    policy = PolicyConfig(model=args.model, backend=args.backend, temperature=args.temperature, seed=args.seed,
                          vllm_urls=tuple(args.vllm_url or ()), served_model_name=args.served_model_name,
                          max_model_len=args.max_model_len, max_in_flight=args.concurrency)
    tasks = TaskSet.of("collect", args.env, args.split, args.tasks, seed_offset=args.seed, params=args.params)
    limits = EpisodeConfig(max_prompt_length=args.max_prompt_length,
                            max_response_length=args.max_response_length,
                            max_tokens_per_turn=args.max_tokens_per_turn)
    agent_task = build_task({"name": args.agent_task, "action_format": args.action_format}, "--agent-task")
    return policy, tasks, EvaluationConfig(limits, args.max_rounds, samples=args.n, agent_task=agent_task)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    collect(*from_args(args), out=args.out, envservice_url=args.envservice_url)
    log(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
