"""How many of GiGPO's turns share an anchor state with another turn, anchored on the observation text (as before
issue #53) and on the env's state key (since): the share of turns in step groups of two or more, whose step
advantage can be non-zero (a turn alone in its state gets A^S = 0).

    .venv/bin/python bench/gigpo_anchors.py [--tasks 16] [--episodes 4] [--rounds 10] [--invalid 0.2] [--seed 0]

Episodes are played in-process by a random policy, not a model: each turn picks one of the env's actions
uniformly, or with probability `--invalid` a reply that is not an action (as an untrained model often gives).
A group is the `--episodes` episodes of one train task (GRPO's group; task i is train task i, or i mod the
number of train tasks, with seed `--seed` + i); both anchorings are computed over the same
turns with `algorithms.gigpo.step_advantages`, whose `singleton_fraction` is the share of turns alone in their
state. Prints one line per env; seconds on one core.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from beyond_agent.algorithms.gigpo import EpisodeSteps, step_advantages  # noqa: E402
from beyond_agent.rollout.episode_loop import state_anchor  # noqa: E402
from envservice.envs import babyai, frozenlake, sokoban, terminal_env, two_player  # noqa: E402

TERMINAL_COMMANDS = ("ls", "cat *.txt", "wc -l *", "echo done > out.txt", "rm -f out.txt", "mkdir -p tmp",
                     "touch notes.txt", "sort words.txt > unique.txt")
"""The terminal's random policy: reads, and writes that later commands undo or repeat."""
ENVS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "frozenlake": (frozenlake.FrozenLakeEnv, frozenlake.ACTIONS),
    "sokoban": (sokoban.SokobanEnv, sokoban.ACTIONS),
    "babyai": (babyai.BabyAIEnv, babyai.ACTIONS),
    "tictactoe": (two_player.TicTacToeEnv, tuple(f"[{cell}]" for cell in range(9))),  # against its random player
    "terminal": (terminal_env.TerminalEnv, TERMINAL_COMMANDS),
}
NOT_AN_ACTION = "I think I should look around first."


def play(env_class: Any, actions: tuple[str, ...], task: Any, rng: random.Random, rounds: int,
         invalid: float) -> tuple[list[float], list[str], list[str]]:
    """One episode: (step rewards, text anchors, key anchors), one of each per turn (the state the turn saw)."""
    env = env_class()
    with contextlib.redirect_stdout(io.StringIO()):  # minigrid prints the layouts it rejects
        observation, info = env.reset(task)
    rewards, by_text, by_key = [], [], []
    for _ in range(rounds):
        by_text.append(state_anchor(observation, None))
        by_key.append(state_anchor(observation, info))
        action = NOT_AN_ACTION if rng.random() < invalid else rng.choice(actions)
        observation, reward, terminated, truncated, info = env.step(action)
        rewards.append(float(reward))
        if terminated or truncated:
            break
    env.close()
    return rewards, by_text, by_key


def measure(name: str, tasks: int, episodes: int, rounds: int, invalid: float, seed: int) -> dict[str, float]:
    """The share of turns in step groups of two or more, by text and by state key, over `tasks` groups."""
    env_class, actions = ENVS[name]
    rng = random.Random(seed)
    by_text, by_key = [], []
    count = env_class.task_counts()["train"]
    for index in range(tasks):  # BabyAI's train tasks are its 10 levels: the seed draws each one's layout
        task = env_class.resolve_task(index % count, "train", seed + index, {})
        for _ in range(episodes):
            rewards, text, key = play(env_class, actions, task, rng, rounds, invalid)
            by_text.append(EpisodeSteps(group=str(index), reward=0.0, step_rewards=tuple(rewards), anchors=tuple(text)))
            by_key.append(EpisodeSteps(group=str(index), reward=0.0, step_rewards=tuple(rewards), anchors=tuple(key)))
    _, text_figures = step_advantages(by_text, 0.95, "mean")
    _, key_figures = step_advantages(by_key, 0.95, "mean")
    return {"turns": float(sum(len(e.anchors) for e in by_key)),
            "grouped_by_text": 1.0 - text_figures["singleton_fraction"],
            "grouped_by_key": 1.0 - key_figures["singleton_fraction"],
            "groups_by_text": text_figures["anchor_groups"], "groups_by_key": key_figures["anchor_groups"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--invalid", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.tasks} groups of {args.episodes} random-policy episodes, up to {args.rounds} turns, "
          f"{args.invalid:.0%} of replies not an action, seed {args.seed}")
    print(f"{'env':<11} {'turns':>6} {'in groups of 2+: by text':>25} {'by state key':>13}")
    for name in ENVS:
        found = measure(name, args.tasks, args.episodes, args.rounds, args.invalid, args.seed)
        print(f"{name:<11} {found['turns']:>6.0f} {found['grouped_by_text']:>25.1%} {found['grouped_by_key']:>13.1%}")


if __name__ == "__main__":
    main()
