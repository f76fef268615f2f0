"""AgentEvol (AgentGym): explore with the current model, keep the successful episodes, SFT the base model on
them plus the base set, explore again; success on evaluation tasks is reported per iteration.

    python -m recipe.agentevol.main --env frozenlake --params '{"around": true}' \\
        --base-model MODEL --base-trajectories expert/ --explore-tasks 0:480 --n 4 \\
        --eval-tasks 0:64 --eval-split test --iterations 2 --out outputs/agentevol \\
        --sft trainer.total_epochs=3 --sft optim.lr=1e-4

Every iteration k (folder `<out>/iter_<k>/`):
  1. explore  `beyond_agent.collect` with the current model (`--n` samples per task at
              `--temperature`; vLLM, or `--backend hf`: the model in this process): `explore.jsonl`;
  2. SFT      verl's SFT trainer (the `recipe/sft` program, started by `beyond_agent.sft.run_sft`) on the
              successful episodes of the base set and of every exploration so far, starting from the base
              model each time, as AgentGym does (so errors do not compound; `--base-weight K` repeats the
              base set K times, so the model's own successes cannot outweigh the expert's): `sft/`, the
              model in `sft/global_step_<N>/huggingface`;
  3. evaluate greedy episodes of the new model on the evaluation tasks: `eval.jsonl`.
The starting model is evaluated first (iteration 0). `<out>/agentevol.json` has every iteration's figures,
rewritten after each one, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from beyond_agent.cli_args import json_object
from beyond_agent.collect import collect
from beyond_agent.evaluation import POLICY_BACKENDS, EvaluationConfig, PolicyConfig
from beyond_agent.rollout.episode_loop import EpisodeConfig
from beyond_agent.sft import add_loop_options, hf_model_dir, parse_loop_args, repeated_files, report_iterations, run_sft
from beyond_agent.trajectory_data import TrajectoryDataError, TrajectoryFilter, read_trajectories
from envservice.contamination import TaskSet


SFT_PROGRAM = "recipe.sft.main"
"""The SFT recipe this loop trains with, run as a program (`python -m`), never imported: the library names no
recipe, and a fork of this folder may point it at its own SFT program."""


def collect_episodes(args: argparse.Namespace, model: str, tasks: list[int], split: str, n: int,
                     temperature: float, out: Path) -> float:
    """Play `tasks` of `split` with `model` (`n` samples each), write them to `out`; the success rate of the
    scored episodes."""
    policy = PolicyConfig(model=model, backend=args.backend, temperature=temperature, seed=args.seed)
    task_set = TaskSet.of(f"{split} tasks", args.env, split, tasks, seed_offset=args.seed, params=args.params)
    limits = EpisodeConfig(max_prompt_length=args.max_prompt_length,
                            max_response_length=args.max_response_length,
                            max_tokens_per_turn=args.max_tokens_per_turn)
    evaluation = collect(policy, task_set, EvaluationConfig(limits, args.max_rounds, samples=n), out, args.envservice_url)
    return evaluation.success_rate


def sft_on_successes(args: argparse.Namespace, sources: list[str], out: Path) -> Path:
    """SFT of the base model on the successful episodes of `sources`; the trained model's folder."""
    kept = read_trajectories(sources, TrajectoryFilter(success=True))
    print(f"[agentevol] SFT on {len(kept)} successful episodes from {len(sources)} file(s)", flush=True)
    files = ",".join(sources)
    run_sft([f"data.train_files=[{files}]", f"model.path={args.base_model}", "data.trajectory_filter.success=true",
             f"trainer.default_local_dir={out}", f"hydra.run.dir={out / 'hydra'}", *args.sft],
            SFT_PROGRAM, log_path=out.parent / "sft.log")
    return hf_model_dir(out)


def run(args: argparse.Namespace) -> list[dict]:
    """All iterations; returns (and keeps writing) the per-iteration figures."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "agentevol.json"
    started = time.monotonic()
    figures = [{"iteration": 0, "model": args.base_model,
                "eval_success": collect_episodes(args, args.base_model, args.eval_tasks, args.eval_split, 1, 0.0,
                                                 args.out / "iter_0" / "eval.jsonl")}]
    report_iterations(figures, summary_path, started, "agentevol", AGENTEVOL_COLUMNS)
    model, explored = args.base_model, []
    for iteration in range(1, args.iterations + 1):
        folder = args.out / f"iter_{iteration}"
        explore_success = collect_episodes(args, model, args.explore_tasks, "train", args.n, args.temperature,
                                           folder / "explore.jsonl")
        explored.append(str(folder / "explore.jsonl"))
        model = str(sft_on_successes(args, [*args.base_set, *explored], folder / "sft"))
        eval_success = collect_episodes(args, model, args.eval_tasks, args.eval_split, 1, 0.0, folder / "eval.jsonl")
        kept = len(read_trajectories(explored[-1], TrajectoryFilter(success=True)))
        figures.append({"iteration": iteration, "model": model, "explore_success": explore_success,
                        "explore_kept": kept, "eval_success": eval_success})
        report_iterations(figures, summary_path, started, "agentevol", AGENTEVOL_COLUMNS)
    return figures


AGENTEVOL_COLUMNS = (("iteration", "iteration", "d"), ("explore success", "explore_success", ".1%"),
                     ("kept", "explore_kept", "d"), ("eval success (greedy)", "eval_success", ".1%"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.agentevol.main", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="envservice env id")
    parser.add_argument("--params", type=json_object, default={}, help="env task parameters as JSON")
    parser.add_argument("--base-model", required=True, help="Hugging Face model folder: explored first, SFT'd each time")
    parser.add_argument("--base-trajectories", nargs="+", required=True, type=Path,
                        help="the base set: trajectory .jsonl files or folders (their successful episodes are kept)")
    parser.add_argument("--base-weight", type=int, default=1,
                        help="times each base-set episode is repeated in every SFT (up-weights the expert data)")
    parser.add_argument("--explore-tasks", default="0:64", help="train tasks explored each iteration (0:64 or 3,5,7)")
    parser.add_argument("--eval-tasks", default="0:32", help="tasks of --eval-split scored greedily after each SFT")
    parser.add_argument("--eval-split", default="test")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--n", type=int, default=4, help="exploration samples per task")
    parser.add_argument("--temperature", type=float, default=1.0, help="exploration sampling temperature")
    parser.add_argument("--seed", type=int, default=0, help="task seed = seed + task index")
    parser.add_argument("--max-rounds", type=int, default=8)
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--backend", choices=POLICY_BACKENDS, default="vllm",
                        help="vllm: a server per model; hf: the model in this process (small models on CPU)")
    add_loop_options(parser, "outputs/agentevol")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_loop_args(parser, argv, ("explore_tasks", "eval_tasks"))
    try:  # the base set is resolved (paths, weight) before any model starts
        args.base_set = repeated_files(args.base_trajectories, args.base_weight)
    except TrajectoryDataError as error:
        parser.error(f"--base-trajectories/--base-weight: {error}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
