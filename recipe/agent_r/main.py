"""Agent-R's iterative self-training: search each task with the current model, revise bad paths, SFT, repeat.

    python -m recipe.agent_r.main env=frozenlake 'params={around: true}' tasks=0:64 model=MODEL iterations=2 \\
        out=outputs/agent_r mcts_iterations=16 n_gen=3 max_depth=8 alpha=0.5 beta=0.5 eval_tasks=0:64 \\
        eval_split=test 'sft=[trainer.total_epochs=3]'

The config is Hydra YAML like the other recipes' (config/agent_r.yaml: every key, its default and what it does).
Every iteration k (folder `<out>/iter_<k>/`), for each task of `tasks` (progress bar):
  1. MCTS (beyond_agent/algorithms/mcts.py) with the current model proposing `n_gen` actions per expansion at
     `temperature`; states by reset + replay over envservice;
  2. pairs of a good and a bad root-to-leaf path (value(good) > alpha, gap > beta): every such pair, as Agent-R
     does (`pairing=one_to_one`: each path in at most one pair);
  3. the first wrong step of the bad path, judged by the current model (good / bad / uncertain per step, shown
     the path only up to that step; the fallback when it cannot: the step where the paths part; a judge that
     raises is logged and counted as `judge_failed`);
  4. the revision trajectory (bad prefix, loss off; a reflection, loss on; the good continuation, loss on)
     and the good path itself, as trajectory records: `revisions.jsonl`, `good_paths.jsonl`;
then SFT of the current model on them plus the `replay` episodes (e.g. the expert episodes the model was
warmed up on, `replay_weight` times each, so self-training does not forget them; the recipe/sft program,
started by beyond_agent.sft.run_sft; `sft` adds overrides), and a greedy
evaluation of the new model on `eval_tasks` (before the first iteration too). `<out>/agent_r.json` holds
every iteration's figures, rewritten after each one.

`reflections=FILE` replaces Agent-R's reflection sentences (one per line), e.g. with text in the
words the model already writes.

`backend=hf` runs the model in this process with Hugging Face `generate` (small models on CPU); `vllm`
(default) starts a vLLM server per model, as the collect CLI does.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import hydra

from beyond_agent.algorithms.agent_r import (
    JUDGE_FAILED,
    PAIRINGS,
    REFLECTIONS,
    RevisionTooLong,
    SearchNode,
    first_wrong_step,
    good_path_record,
    leaf_paths,
    pair_paths,
    revision_record,
)
from beyond_agent.algorithms.mcts import EnvReplayer, MCTSConfig, TaskRef, mcts_search, tree_nodes
from beyond_agent.cli_args import DRY_RUN_MARKER, is_dry_run
from beyond_agent.evaluation import (
    POLICY_BACKENDS,
    EvaluationConfig,
    Policy,
    PolicyConfig,
    evaluate,
    serve_policy,
)
from beyond_agent.rollout.episode_loop import EpisodeConfig, GenerateFn
from beyond_agent.rollout.handler import RolloutHandler
from beyond_agent.rollout.scripted import reply_ids
from beyond_agent.sft import hf_model_dir, loop_args, repeated_files, report_iterations, run_sft
from beyond_agent.tasks import AgentTask, EnvTask
from beyond_agent.trajectories import write_dump
from beyond_agent.trajectory_data import TrajectoryDataError, read_trajectories
from envservice.contamination import TaskSet

@dataclass(frozen=True)
class AgentRConfig:
    """One Agent-R run's options, read once from its config (`checked_config`) and passed to every step."""

    env: str
    """The env id searched and evaluated."""
    params: dict[str, Any]
    """Env task parameters of every task."""
    tasks: tuple[int, ...]
    """Train tasks searched each iteration."""
    model: str
    """The Hugging Face model folder the first iteration starts from."""
    iterations: int
    """Search -> revise -> SFT rounds."""
    search: MCTSConfig
    """The tree search of each task (its depth is also the evaluation's round limit)."""
    alpha: float
    """A good path's value must exceed this."""
    beta: float
    """value(good) - value(bad) must exceed this."""
    pairing: str
    """One of PAIRINGS: which good and bad paths form revision pairs."""
    action_format: str
    """How the model writes an action (the task's parser)."""
    eval_tasks: tuple[int, ...]
    eval_split: str
    seed: int
    """Task seed = seed + task index; also the sampling seed and each iteration's random choices."""
    limits: EpisodeConfig
    """Prompt and response lengths of every record and evaluation episode (`max_tokens`: a proposed action's)."""
    max_model_len: int
    """The context of a vLLM server the loop starts."""
    backend: str
    """One of POLICY_BACKENDS."""
    reflections: tuple[str, ...]
    """The sentences a revision's reflection is drawn from."""
    replay_files: tuple[str, ...]
    """Trajectory files added to every SFT run (each repeated `replay_weight` times)."""
    sft: tuple[str, ...]
    """Hydra overrides of every SFT run."""
    sft_program: str
    """The SFT recipe run as a program (`python -m`), never imported: the library names no recipe, and a fork of
    this folder may point it at its own."""
    envservice_url: str | None
    """A running envservice (None: the loop starts one)."""
    out: Path
    """Where each iteration's records, SFT run and `agent_r.json` go."""


JUDGE_PROMPT = (
    "You are checking an agent's steps in a task.\nTask: {task}\n{history}\n"
    "Was step {step} ({action}) a good step, a bad step, or are you uncertain? Answer with one word: good, bad or uncertain."
)


def history_handler(node: SearchNode, tokenizer, agent_task: AgentTask, limits: EpisodeConfig) -> RolloutHandler:
    """The chat up to `node` as a rollout would hold it: first prompt, then each action and observation."""
    path = node.path()
    root = path[0].parent if path else node
    handler = RolloutHandler(tokenizer, agent_task.first_messages(root.observation), limits.max_prompt_length,
                             limits.max_response_length)
    for step in path:
        handler.add_assistant(reply_ids(tokenizer, step.action))
        handler.add_observation(step.observation)
    return handler


def model_proposer(generate: GenerateFn, tokenizer, agent_task: AgentTask, limits: EpisodeConfig,
                   max_tokens: int) -> Callable[[SearchNode, int], list[str]]:
    """propose(node, n): n samples of the model's next reply at `node`, parsed by the task's parser
    (replies it cannot parse are dropped)."""

    def propose(node: SearchNode, n: int) -> list[str]:
        prompt_ids = history_handler(node, tokenizer, agent_task, limits).prompt_ids_for_next_turn()
        actions = []
        for sample in range(n):
            reply = generate(f"mcts-{id(node)}-{sample}", prompt_ids, max_tokens)
            text = tokenizer.decode(reply.token_ids, skip_special_tokens=True)
            parsed = agent_task.parse(text)
            if parsed.action:
                actions.append(parsed.action)
        return actions

    return propose


def model_judge(generate: GenerateFn, tokenizer, max_tokens: int = 8):
    """judge(nodes, index): the model's one-word verdict on step `index` of a path (chat-templated prompt).

    The model sees the task (the first observation) and the path up to and including the judged step, with
    that step's result, as Agent-R's verifier does: never the later steps or how the episode ended, which
    would give the verdict away."""

    def judge(nodes, index: int) -> str:
        task = nodes[0].parent.observation if nodes[0].parent is not None else ""
        history = "\n".join(f"Step {i}: action {n.action!r}, result: {n.observation}"
                            for i, n in enumerate(nodes[:index + 1]))
        prompt = JUDGE_PROMPT.format(task=task, history=history, step=index, action=nodes[index].action)
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   tokenize=True)
        if not isinstance(prompt_ids, list):  # newer transformers return a BatchEncoding
            prompt_ids = list(prompt_ids["input_ids"])
        reply = generate(f"judge-{id(nodes[index])}", prompt_ids, max_tokens)
        words = tokenizer.decode(reply.token_ids, skip_special_tokens=True).strip().lower().split()
        return words[0].strip(".,!:") if words else "uncertain"

    return judge


def revise_task(task: TaskRef, client, generate: GenerateFn, tokenizer, config: AgentRConfig,
                rng: random.Random) -> dict:
    """Search one task and build its revision and good-path records; figures of the tree."""
    limits, search = config.limits, config.search
    agent_task = EnvTask(action_format=config.action_format)
    replayer = EnvReplayer(client, task)
    root = mcts_search(replayer, model_proposer(generate, tokenizer, agent_task, limits, search.max_tokens), search)
    paths = leaf_paths(root)
    pairs = pair_paths(paths, config.alpha, config.beta, config.pairing)
    judge = model_judge(generate, tokenizer)
    described = {"env": task.env_id, "task": task.task_id, "split": task.split, "seed": task.seed,
                 "first_observation": root.observation}
    revisions, goods, found_by, too_long = [], {}, [], 0
    for good, bad in pairs:
        wrong, how = first_wrong_step(good, bad, judge)
        try:
            revision = revision_record(good, bad, wrong, how, rng.choice(config.reflections), described, tokenizer,
                                       max_prompt_length=limits.max_prompt_length,
                                       max_response_length=limits.max_response_length)
            good_path = goods.get(id(good)) or good_path_record(
                good, described, tokenizer, max_prompt_length=limits.max_prompt_length,
                max_response_length=limits.max_response_length)
        except RevisionTooLong:
            too_long += 1  # counted and reported: raise --max-response-length to keep such pairs
            continue
        found_by.append(how)
        revisions.append(revision)
        goods[id(good)] = good_path  # a good path in several pairs is one record (pairing "all")
    goods = list(goods.values())
    return {"revisions": revisions, "goods": goods, "nodes": len(tree_nodes(root)), "pairs": len(revisions),
            "pairs_too_long": too_long,
            "best_value": paths[0].value if paths else 0.0, "judged": found_by.count("judge"),
            "judge_failed": found_by.count(JUDGE_FAILED),
            "resets": replayer.resets, "env_steps": replayer.steps}


@contextlib.contextmanager
def served_model(config: AgentRConfig, model: str, temperature: float) -> Iterator[Policy]:
    """`model` served for the `with` block: in-process Hugging Face, or a vLLM server we start and stop."""
    policy = PolicyConfig(model=model, backend=config.backend, temperature=temperature, seed=config.seed,
                          max_model_len=config.max_model_len, max_in_flight=8)
    with serve_policy(policy, lambda message: print(f"[agent-r] {message}", file=sys.stderr, flush=True)) as served:
        yield served


@contextlib.contextmanager
def model_generate(config: AgentRConfig, model: str, temperature: float) -> Iterator[GenerateFn]:
    """A generate function for `model` (see `served_model`)."""
    with served_model(config, model, temperature) as served:
        yield served.generate


def evaluate_model(config: AgentRConfig, model: str, client, tokenizer) -> float:
    """Greedy success of `model` on the evaluation tasks (an env or LLM failure stops the loop: it is never a
    failed episode)."""
    tasks = TaskSet.of("evaluation", config.env, config.eval_split, list(config.eval_tasks), seed_offset=config.seed,
                       params=config.params)
    with served_model(config, model, 0.0) as served:
        evaluation = evaluate(served, client, tasks, EvaluationConfig(config.limits, config.search.max_depth),
                              tokenizer)
    return evaluation.require_complete().success_rate


def run_iteration(config: AgentRConfig, iteration: int, model: str, client, tokenizer) -> tuple[str, dict]:
    """Search + revise every task with `model`, SFT it on the records; the new model and the figures."""
    from tqdm import tqdm

    folder = config.out / f"iter_{iteration}"
    rng = random.Random(config.seed * 1000 + iteration)
    revisions, goods, trees, failed = [], [], [], []
    with model_generate(config, model, config.search.temperature) as generate:
        for task in tqdm(config.tasks, desc=f"agent-r iteration {iteration}", unit="task", file=sys.stderr):
            ref = TaskRef(config.env, task_id=task, seed=config.seed + task, split="train", params=config.params)
            try:
                figures = revise_task(ref, client, generate, tokenizer, config, rng)
            except Exception as error:  # an env or model failure costs this task's tree, not the iteration
                print(f"[agent-r] task {task}: search failed ({type(error).__name__}: {error}); skipped",
                      file=sys.stderr, flush=True)
                failed.append(task)
                continue
            revisions += figures.pop("revisions")
            goods += figures.pop("goods")
            trees.append(figures)
    write_dump(folder / "revisions", 0, "train", revisions)
    write_dump(folder / "good_paths", 0, "train", goods)
    row = {"iteration": iteration, "tasks": len(trees) + len(failed), "pairs": sum(t["pairs"] for t in trees),
           "pairs_too_long": sum(t["pairs_too_long"] for t in trees), "tasks_failed": failed,
           "judged_by_model": sum(t["judged"] for t in trees), "judge_failed": sum(t["judge_failed"] for t in trees),
           "nodes": sum(t["nodes"] for t in trees),
           "env_resets": sum(t["resets"] for t in trees), "env_steps": sum(t["env_steps"] for t in trees),
           "tasks_with_success_in_tree": sum(t["best_value"] > 0 for t in trees)}
    if not revisions:
        print(f"[agent-r] iteration {iteration}: no pair in any tree; the model is kept", flush=True)
        return model, row
    files = ",".join([str(folder / "revisions"), str(folder / "good_paths"), *config.replay_files])
    row["replay_episodes"] = len(read_trajectories(list(config.replay_files))) if config.replay_files else 0
    run_sft([f"data.train_files=[{files}]", f"model.path={model}",
             f"trainer.default_local_dir={folder / 'sft'}", f"hydra.run.dir={folder / 'sft' / 'hydra'}", *config.sft],
            config.sft_program, log_path=folder / "sft.log")
    return str(hf_model_dir(folder / "sft")), row


def run(config: AgentRConfig) -> list[dict]:
    """Evaluate, then `iterations` times search, revise, SFT and evaluate; the figures per iteration."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.process import envservice_url

    config.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    started, model = time.monotonic(), config.model
    with envservice_url([config.env], config.envservice_url) as url, EnvClient(url) as client:
        figures = [{"iteration": 0, "model": model, "eval_success": evaluate_model(config, model, client, tokenizer)}]
        report_iterations(figures, config.out / "agent_r.json", started, "agent-r", AGENT_R_COLUMNS)
        for iteration in range(1, config.iterations + 1):
            model, row = run_iteration(config, iteration, model, client, tokenizer)
            row.update(model=model, eval_success=evaluate_model(config, model, client, tokenizer))
            figures.append(row)
            report_iterations(figures, config.out / "agent_r.json", started, "agent-r", AGENT_R_COLUMNS)
    return figures


AGENT_R_COLUMNS = (("iteration", "iteration", "d"), ("pairs", "pairs", "d"), ("judged", "judged_by_model", "d"),
                   ("tasks with a success", "tasks_with_success_in_tree", "d"),
                   ("eval success (greedy)", "eval_success", ".1%"))


def read_reflections(path: str) -> tuple[str, ...]:
    """The non-empty lines of a text file: the reflection sentences one of which each revision gets."""
    try:
        sentences = tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())
    except OSError as error:
        raise SystemExit(f"agent_r.reflections: cannot read {path}: {error.strerror}") from error
    if not sentences:
        raise SystemExit(f"agent_r.reflections: {path} holds no sentence (one reflection per line)")
    return sentences


def checked_config(config) -> AgentRConfig:
    """The run's options from its composed config (config/agent_r.yaml), checked before any model starts (keys,
    task ranges, the replay set and its weight, the reflections file, the search's values)."""
    args = loop_args(config, "agent_r", ("tasks", "eval_tasks"), {"backend": POLICY_BACKENDS, "pairing": PAIRINGS})
    try:
        args.reflections = read_reflections(args.reflections) if args.reflections else REFLECTIONS
        replay_files = repeated_files(list(args.replay), args.replay_weight) if args.replay else []
        return from_args(args, replay_files)
    except TrajectoryDataError as error:
        raise SystemExit(f"agent_r.replay/replay_weight: {error}") from None
    except ValueError as error:
        raise SystemExit(f"agent_r: {error}") from None


def from_args(args: SimpleNamespace, replay_files: list[str]) -> AgentRConfig:
    """`AgentRConfig` from the config's checked keys (`loop_args`)."""
    search = MCTSConfig(exploration=args.exploration, iterations=args.mcts_iterations, n_gen=args.n_gen,
                        max_depth=args.max_depth, temperature=args.temperature, max_tokens=args.max_tokens)
    limits = EpisodeConfig(max_prompt_length=args.max_prompt_length, max_response_length=args.max_response_length,
                            max_tokens_per_turn=args.max_tokens)
    return AgentRConfig(
        env=args.env, params=dict(args.params), tasks=tuple(args.tasks), model=args.model, iterations=args.iterations,
        search=search, alpha=args.alpha, beta=args.beta, pairing=args.pairing, action_format=args.action_format,
        eval_tasks=tuple(args.eval_tasks), eval_split=args.eval_split, seed=args.seed, limits=limits,
        max_model_len=args.max_model_len, backend=args.backend, reflections=tuple(args.reflections),
        replay_files=tuple(replay_files), sft=tuple(args.sft), sft_program=args.sft_program,
        envservice_url=args.envservice_url, out=args.out)


@hydra.main(config_path="config", config_name="agent_r", version_base=None)
def main(config) -> None:
    """Check the config (config/agent_r.yaml), then run every iteration (in a dry run, stop after the checks)."""
    run_config(config)


def run_config(config) -> list[dict] | None:
    """The loop for a composed config, checked first; None in a dry run."""
    checked = checked_config(config)
    if is_dry_run():
        print(DRY_RUN_MARKER, flush=True)
        return None
    return run(checked)


if __name__ == "__main__":
    main()
