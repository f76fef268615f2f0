r"""GiGPO: group-in-group policy optimisation, step-level credit without a critic (verl-agent, arXiv 2505.10978).

GRPO gives every token of an episode one advantage, its episode's return against the group's. GiGPO adds a
step-level advantage from *anchor states*: within one group (the episodes of one task in one step), the
steps that start from the same environment state are compared with each other.

Definitions, for the episodes i of one group G with returns R_i, and their turns t:

- episode advantage  A^E_i = (R_i - mean_{j in G} R_j) / F_G, with F_G = std_{j in G} R_j + eps (`norm: std`)
  or 1 (`norm: mean`); 0 in a group of one;
- step return  R_{i,t} = sum_{k >= t} gamma^(k - t) r_{i,k}, over the env's step rewards r from turn t on;
- anchor group  S(s) = the turns (i, t) of the episodes of G whose state before the turn is s (the exact
  observation text, or a key the env supplies instead); a state seen once is its own group;
- step advantage  A^S_{i,t} = (R_{i,t} - mean_{S(s)} R) / F_{S(s)}, F as above; 0 in a group of one;
- advantage of turn t  A_{i,t} = A^E_i + omega * A^S_{i,t}, given to that turn's trained tokens only (the
  observation and template tokens between turns are never trained).

Standard deviations are the unbiased sample ones (torch.std), as verl's GRPO uses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

GIGPO_NORMS = ("std", "mean")
"""Valid values of `norm`: divide by the group's standard deviation, or only subtract its mean."""


@dataclass(frozen=True)
class GiGPOConfig:
    """The estimator's settings (`beyond_agent.gigpo`)."""

    gamma: float = 0.95
    """Discount of later step rewards in a step's return (verl-agent's scripts use 0.95)."""
    omega: float = 1.0
    """Weight of the step-level advantage added to the episode-level one."""
    norm: str = "std"
    """std: (x - mean) / (std + eps) in both kinds of group; mean: x - mean."""
    epsilon: float = 1e-6
    """Added to the standard deviation."""

    def __post_init__(self) -> None:
        if self.norm not in GIGPO_NORMS:
            raise ValueError(f"beyond_agent.gigpo.norm must be one of {list(GIGPO_NORMS)}, got {self.norm!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"beyond_agent.gigpo.gamma must be in [0, 1], got {self.gamma!r}")
        if self.omega < 0:
            raise ValueError(f"beyond_agent.gigpo.omega must be >= 0, got {self.omega!r}")


@dataclass(frozen=True)
class EpisodeSteps:
    """What GiGPO reads of one episode."""

    group: str
    """Its group (verl's `uid`: the episodes of one task in one step)."""
    reward: float
    """Its return R (the task's reward for the episode)."""
    step_rewards: tuple[float, ...]
    """The env's reward for each turn's action (0 where the env did not step, e.g. a turn cut by length)."""
    anchors: tuple[str, ...]
    """The state before each turn (one per turn): the observation the turn answered, or the env's own key."""


@dataclass
class GiGPOAdvantages:
    """The advantages of a batch of episodes, in the order given, with the figures users watch."""

    episode: list[float]
    """A^E per episode."""
    step: list[list[float]]
    """A^S per episode and turn."""
    turns: list[list[float]]
    """A^E + omega * A^S per episode and turn: what each turn's trained tokens get."""
    figures: dict[str, float] = field(default_factory=dict)
    """`anchor_groups` (step groups in the batch), `mean_group_size` (turns per step group),
    `singleton_fraction` (share of turns alone in their step group, whose A^S is 0)."""


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k - t) r_k for every t."""
    returns, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def normalized(values: Sequence[float], norm: str, epsilon: float) -> list[float]:
    """(x - mean) / (std + eps) or x - mean over one group; zeros for a group of one."""
    if len(values) < 2:
        return [0.0] * len(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    centred = tensor - tensor.mean()
    if norm == "std":
        centred = centred / (tensor.std() + epsilon)
    return centred.tolist()


def gigpo_advantages(episodes: Sequence[EpisodeSteps], config: GiGPOConfig) -> GiGPOAdvantages:
    """A^E, A^S and their combination for every episode and turn (see the module docstring)."""
    for index, episode in enumerate(episodes):
        if len(episode.step_rewards) != len(episode.anchors):
            raise ValueError(f"episode {index}: {len(episode.step_rewards)} step rewards for "
                             f"{len(episode.anchors)} anchor states (one of each per turn)")
    episode_adv = [0.0] * len(episodes)
    for members in _members(range(len(episodes)), lambda i: episodes[i].group).values():
        for i, value in zip(members, normalized([episodes[i].reward for i in members], config.norm, config.epsilon)):
            episode_adv[i] = value
    returns = [discounted_returns(e.step_rewards, config.gamma) for e in episodes]
    step_adv = [[0.0] * len(e.step_rewards) for e in episodes]
    turns = [(i, t) for i, e in enumerate(episodes) for t in range(len(e.step_rewards))]
    anchor_groups = _members(turns, lambda turn: (episodes[turn[0]].group, episodes[turn[0]].anchors[turn[1]]))
    for members in anchor_groups.values():
        for (i, t), value in zip(members, normalized([returns[i][t] for i, t in members], config.norm,
                                                     config.epsilon)):
            step_adv[i][t] = value
    combined = [[episode_adv[i] + config.omega * a for a in step_adv[i]] for i in range(len(episodes))]
    sizes = [len(members) for members in anchor_groups.values()]
    figures = {"anchor_groups": float(len(sizes)),
               "mean_group_size": sum(sizes) / len(sizes) if sizes else 0.0,
               "singleton_fraction": sum(1 for size in sizes if size == 1) / len(turns) if turns else 0.0}
    return GiGPOAdvantages(episode=episode_adv, step=step_adv, turns=combined, figures=figures)


def _members(items, key) -> dict:
    """Items grouped by key, in first-seen order."""
    groups: dict = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups


def spread_over_turns(response_mask: torch.Tensor, turn_ends: Sequence[int], turn_values: Sequence[float]) -> torch.Tensor:
    """One row's token advantages: turn t's value on the trained tokens (mask 1) of that turn, which ends at
    response position `turn_ends[t]` (inclusive) and starts after the previous turn's end; every other token
    0. Why only mask-1 tokens: observations and template tokens between turns are context, never trained."""
    if len(turn_ends) != len(turn_values):
        raise ValueError(f"{len(turn_values)} turn advantages for {len(turn_ends)} turns")
    values = torch.zeros(response_mask.shape, dtype=torch.float32)
    start = 0
    for end, value in zip(turn_ends, turn_values):
        stop = min(int(end) + 1, response_mask.shape[0])
        values[start:stop] = float(value)
        start = stop
    return values * (response_mask > 0)

