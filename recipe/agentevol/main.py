"""AgentEvol (AgentGym): explore with the current model, keep the successful episodes, SFT the base model on
them plus the base set, explore again; success on evaluation tasks is reported per iteration.

    python -m recipe.agentevol.main env=frozenlake 'params={around: true}' base_model=MODEL \\
        'base_trajectories=[expert/]' explore_tasks=0:480 n=4 eval_tasks=0:64 eval_split=test iterations=2 \\
        out=outputs/agentevol 'sft=[trainer.total_epochs=3,optim.lr=1e-4]'

The config is Hydra YAML like the other recipes' (config/agentevol.yaml: every key, its default and what it does).
Every iteration k (folder `<out>/iter_<k>/`):
  1. explore  `beyond_agent.collect` with the current model (`n` samples per task at
              `temperature`; vLLM, or `backend=hf`: the model in this process): `explore.jsonl`;
  2. SFT      verl's SFT trainer (the `recipe/sft` program, started by `beyond_agent.sft.run_sft`) on the
              successful episodes of the base set and of every exploration so far, starting from the base
              model each time, as AgentGym does (so errors do not compound; `base_weight=K` repeats the
              base set K times, so the model's own successes cannot outweigh the expert's): `sft/`, the
              model in `sft/global_step_<N>/huggingface`;
  3. evaluate greedy episodes of the new model on the evaluation tasks: `eval.jsonl`.
The starting model is evaluated first (iteration 0). `<out>/agentevol.json` has every iteration's figures,
rewritten after each one, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import hydra

from beyond_agent.cli_args import DRY_RUN_MARKER, is_dry_run
from beyond_agent.collect import collect
from beyond_agent.evaluation import POLICY_BACKENDS, EvaluationConfig, PolicyConfig
from beyond_agent.rollout.episode_loop import EpisodeConfig
from beyond_agent.sft import hf_model_dir, loop_args, repeated_files, report_iterations, run_sft
from beyond_agent.trajectory_data import TrajectoryDataError, TrajectoryFilter, read_trajectories
from envservice.contamination import TaskSet


def collect_episodes(args: SimpleNamespace, model: str, tasks: list[int], split: str, n: int,
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


def sft_on_successes(args: SimpleNamespace, sources: list[str], out: Path) -> Path:
    """SFT of the base model on the successful episodes of `sources`; the trained model's folder."""
    kept = read_trajectories(sources, TrajectoryFilter(success=True))
    print(f"[agentevol] SFT on {len(kept)} successful episodes from {len(sources)} file(s)", flush=True)
    files = ",".join(sources)
    run_sft([f"data.train_files=[{files}]", f"model.path={args.base_model}", "data.trajectory_filter.success=true",
             f"trainer.default_local_dir={out}", f"hydra.run.dir={out / 'hydra'}", *args.sft],
            args.sft_program, log_path=out.parent / "sft.log")
    return hf_model_dir(out)


def run(args: SimpleNamespace) -> list[dict]:
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


@hydra.main(config_path="config", config_name="agentevol", version_base=None)
def main(config) -> None:
    """Check the config (config/agentevol.yaml), then run every iteration (in a dry run, stop after the checks)."""
    run_config(config)


def run_config(config) -> list[dict] | None:
    """The loop for a composed config: checked (keys, task ranges, the base set's paths and weight) before any
    model starts; None in a dry run."""
    args = loop_args(config, "agentevol", ("explore_tasks", "eval_tasks"), {"backend": POLICY_BACKENDS})
    try:  # the base set is resolved (paths, weight) before any model starts
        args.base_set = repeated_files(list(args.base_trajectories), args.base_weight)
    except TrajectoryDataError as error:
        raise SystemExit(f"agentevol.base_trajectories/base_weight: {error}") from None
    if is_dry_run():
        print(DRY_RUN_MARKER, flush=True)
        return None
    return run(args)


if __name__ == "__main__":
    main()
