r"""GiGPO: group-in-group policy optimisation, step-level credit without a critic (verl-agent, arXiv 2505.10978).

GRPO gives every token of an episode one advantage, its episode's return against the group's. GiGPO adds a
step-level advantage from *anchor states*: within one group (the episodes of one task in one step), the
steps that start from the same environment state are compared with each other.

Definitions, for the episodes i of one group G with returns R_i, and their turns t:

- episode advantage  A^E_i = (R_i - mean_{j in G} R_j) / F_G, with F_G = std_{j in G} R_j + eps (`norm: std`)
  or 1 (`norm: mean`); 0 in a group of one;
- step return  R_{i,t} = sum_{k >= t} gamma^(k - t) r_{i,k}, over the env's step rewards r from turn t on, to
  the episode's end (a per_call agent's episode trains as several rows, its segments: a segment's returns run on
  through the later segments' turns, and the episode counts once in its group's A^E statistics);
- a cut episode (a limit ended it; rollout/episode_loop.py adds its forfeit to its last turn's step reward):
  R_{i,t} = sum_{k >= t} gamma^(k - t) r_{i,k} over its real rewards, plus the forfeit undiscounted, at every
  turn (of every segment). Why: discounted like a step reward, the forfeit of a state held until the limit L
  weighs gamma^(L-1-t) times as much, so in a game (forfeit -1) holding a state, -gamma^(L-1-t), beats losing
  from it sooner, -gamma^(m-1), whenever L > m; counted whole, holding a state is worth -1 and a loss from it
  -gamma^(m-1) >= -1: stalling never beats losing;
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
from typing import Any, Sequence

import torch
from verl.trainer.ppo.core_algos import register_adv_est

from beyond_agent.algorithms.estimators import declare_estimator
from beyond_agent.rollout.episode_loop import TEXT_ANCHOR_PREFIX, EpisodeResult
from beyond_agent.rollout.dynamic_sampling import EQUAL_REWARD_TOLERANCE

GIGPO_NORMS = ("std", "mean")
"""Normalisations: divide by the group's standard deviation, or only subtract its mean. Which one a run uses
is verl's own `algorithm.norm_adv_by_std_in_grpo` (true: std), for both kinds of group."""
EPSILON = 1e-6
"""Added to a group's standard deviation (as verl's GRPO does)."""


@dataclass(frozen=True)
class GiGPOConfig:
    """`beyond_agent.gigpo`: the step-level part of `algorithm.adv_estimator=gigpo`."""

    gamma: float = 0.95
    """Discount of later step rewards in a step's return (verl-agent's scripts use 0.95)."""
    omega: float = 1.0
    """Weight of the step-level advantage added to the episode-level one."""

    def __post_init__(self) -> None:
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"beyond_agent.gigpo.gamma must be a number in [0, 1], got {self.gamma!r}")
        if isinstance(self.omega, bool) or not isinstance(self.omega, (int, float)) or self.omega < 0:
            raise ValueError(f"beyond_agent.gigpo.omega must be a number >= 0, got {self.omega!r}")


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
    later_rewards: tuple[float, ...] = ()
    """The step rewards of the episode's turns after these (a per_call agent's later segments): a turn's step
    return runs on through them to the episode's end."""
    forfeit: float | None = None
    """When a limit cut the episode: the forfeit already added to its last turn's step reward (the last of
    `step_rewards + later_rewards`), counted undiscounted at every turn instead (`step_returns`); None otherwise."""


@dataclass
class GiGPOAdvantages:
    """The advantages of a batch of episodes, in the order given, with the metrics users watch."""

    episode: list[float]
    """A^E per episode."""
    step: list[list[float]]
    """A^S per episode and turn."""
    turns: list[list[float]]
    """A^E + omega * A^S per episode and turn: what each turn's trained tokens get."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`anchor_groups` (step groups in the batch), `mean_group_size` (turns per step group),
    `singleton_fraction` (share of turns alone in their step group, whose A^S is 0), `text_anchor_fraction` (share
    of turns whose anchor is the observation text, not a state key the env gave: such a text also holds the
    feedback on the last action, so one state reached two ways may split into two groups)."""


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k - t) r_k for every t."""
    returns, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def step_returns(episode: EpisodeSteps, gamma: float) -> list[float]:
    """R_t of each of the episode's turns, to the episode's end (its later rows' turns included); in a cut episode,
    over its real rewards plus its forfeit, undiscounted (module docstring)."""
    rewards = [*episode.step_rewards, *episode.later_rewards]
    turns = len(episode.step_rewards)
    if episode.forfeit is None or not rewards:
        return discounted_returns(rewards, gamma)[:turns]
    # Rule: the forfeit counts whole at every turn, so holding a state until the limit (a game's -1) never beats
    # losing from it (-gamma^k >= -1); the rollout added it to the episode's last turn, which keeps its real reward.
    rewards[-1] -= episode.forfeit
    return [value + episode.forfeit for value in discounted_returns(rewards, gamma)[:turns]]


def normalized(values: Sequence[float], norm: str, epsilon: float = EPSILON) -> list[float]:
    """(x - mean) / (std + eps) or x - mean over one group; zeros for a group of one."""
    if norm not in GIGPO_NORMS:
        raise ValueError(f"norm must be one of {list(GIGPO_NORMS)}, got {norm!r}")
    if len(values) < 2:
        return [0.0] * len(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    centred = tensor - tensor.mean()
    if norm == "std":
        centred = centred / (tensor.std() + epsilon)
    return centred.tolist()


def episode_advantages(rewards: Sequence[float], groups: Sequence[str], norm: str,
                       epsilon: float = EPSILON) -> list[float]:
    """A^E of every episode: its return against its group's."""
    found = [0.0] * len(rewards)
    for members in _members(range(len(rewards)), lambda i: groups[i]).values():
        for i, value in zip(members, normalized([rewards[i] for i in members], norm, epsilon)):
            found[i] = value
    return found


def leave_one_out(values: Sequence[float]) -> list[float]:
    """RLOO's advantage over one group of two or more: each value less the mean of the others."""
    if len(values) < 2:
        raise ValueError(f"leave_one_out needs a group of two or more; got {len(values)}")
    total, count = sum(values), len(values)
    return [value - (total - value) / (count - 1) for value in values]


RECOUNTED_ESTIMATORS = ("grpo", "gigpo", "rloo", "rloo_vectorized")
"""verl estimators whose groups `count_each_episode_once` redoes (group mean and std for grpo and gigpo's A^E,
leave-one-out for rloo); with other group-based estimators a per_call agent's segments each count."""


def count_each_episode_once(batch: Any, norm: str, epsilon: float = EPSILON, estimator: str = "grpo") -> int:
    """Redo the group-relative episode advantage (`estimator`'s: GRPO's, which is GiGPO's A^E, or RLOO's) of each
    group in which an episode trains as several rows: a per_call agent's segments share its `uid` and reward, and
    verl's estimator counted each as a sample of the group. Here each episode (our rollout's `episode_key`) counts
    once in the group's statistics, and all its rows get its value on their trained tokens. Groups without such an
    episode, or of one episode, keep what they had. Returns how many groups were redone."""
    if estimator not in RECOUNTED_ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(RECOUNTED_ESTIMATORS)}; got {estimator!r}")
    rows = batch.non_tensor_batch
    keys = rows.get("episode_key")
    if keys is None:
        return 0
    uids = [str(uid) for uid in rows["uid"]]
    advantages, mask = batch.batch["advantages"], batch.batch["response_mask"]
    scores: list[float] = []
    redone = 0
    for members in _members(range(len(uids)), lambda i: uids[i]).values():
        episodes = _members(members, lambda i: keys[i])  # episode -> its rows, in first-seen order
        if len(episodes) == len(members) or len(episodes) < 2:
            continue
        scores = scores or batch.batch["token_level_rewards"].sum(dim=-1).tolist()
        # Rule: an episode counts once in its group's statistics, however many rows its segments train on.
        episode_scores = [scores[episode_rows[0]] for episode_rows in episodes.values()]
        values = (leave_one_out(episode_scores) if estimator.startswith("rloo")
                  else normalized(episode_scores, norm, epsilon))
        for episode_rows, value in zip(episodes.values(), values):
            for row in episode_rows:
                advantages[row] = value * mask[row].to(advantages.dtype)
        redone += 1
    return redone


def step_advantages(episodes: Sequence[EpisodeSteps], gamma: float, norm: str,
                    epsilon: float = EPSILON) -> tuple[list[list[float]], dict[str, float]]:
    """A^S of every episode's turns, and the anchor-group metrics (see `GiGPOAdvantages.metrics`)."""
    for index, episode in enumerate(episodes):
        if len(episode.step_rewards) != len(episode.anchors):
            raise ValueError(f"episode {index}: {len(episode.step_rewards)} step rewards for "
                             f"{len(episode.anchors)} anchor states (one of each per turn)")
    returns = [step_returns(e, gamma) for e in episodes]
    found = [[0.0] * len(e.step_rewards) for e in episodes]
    turns = [(i, t) for i, e in enumerate(episodes) for t in range(len(e.step_rewards))]
    anchor_groups = _members(turns, lambda turn: (episodes[turn[0]].group, episodes[turn[0]].anchors[turn[1]]))
    for members in anchor_groups.values():
        for (i, t), value in zip(members, normalized([returns[i][t] for i, t in members], norm, epsilon)):
            found[i][t] = value
    sizes = [len(members) for members in anchor_groups.values()]
    metrics = {"anchor_groups": float(len(sizes)),
               "mean_group_size": sum(sizes) / len(sizes) if sizes else 0.0,
               "singleton_fraction": sum(1 for size in sizes if size == 1) / len(turns) if turns else 0.0,
               "text_anchor_fraction": (sum(episodes[i].anchors[t].startswith(TEXT_ANCHOR_PREFIX) for i, t in turns)
                                        / len(turns) if turns else 0.0)}
    return found, metrics


def gigpo_advantages(episodes: Sequence[EpisodeSteps], config: GiGPOConfig, norm: str = "std",
                     epsilon: float = EPSILON) -> GiGPOAdvantages:
    """A^E, A^S and their combination for every episode and turn (see the module docstring)."""
    episode = episode_advantages([e.reward for e in episodes], [e.group for e in episodes], norm, epsilon)
    step, metrics = step_advantages(episodes, config.gamma, norm, epsilon)
    turns = [[episode[i] + config.omega * a for a in step[i]] for i in range(len(episodes))]
    return GiGPOAdvantages(episode=episode, step=step, turns=turns, metrics=metrics)


def group_has_step_signal(results: Sequence[EpisodeResult], config: GiGPOConfig) -> bool:
    """Whether any turn of one group's episodes (a per_call agent's segments included) gets a non-zero step
    advantage A^S: turns that start from the same state with different step returns. Dynamic sampling asks this
    of a group whose episode returns are all equal (rollout/dynamic_sampling.py), which GiGPO still trains on."""
    # A per_call agent's segments carry their episode's forfeit (rollout.batch._extra_rows).
    rows = [(row, result.forfeit) for result in results for row in (*result.earlier_segments, result)]
    episodes = [EpisodeSteps(group="", reward=row.reward, step_rewards=tuple(row.step_rewards),
                             anchors=tuple(row.anchors), later_rewards=tuple(row.later_step_rewards), forfeit=forfeit)
                for row, forfeit in rows]
    step, _ = step_advantages(episodes, config.gamma, "mean")
    # Step advantages closer to 0 than dynamic sampling's tolerance for equal rewards count as none.
    return any(abs(value) > EQUAL_REWARD_TOLERANCE for turns in step for value in turns)


def _members(items, key) -> dict:
    """Items grouped by key, in first-seen order."""
    groups: dict = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups


def spread_over_turns(response_mask: torch.Tensor, turn_ends: Sequence[int], turn_values: Sequence[float]) -> torch.Tensor:
    """One row's token advantages: turn t's value on the trained tokens (mask 1) of that turn, which ends at
    response position `turn_ends[t]` (inclusive) and starts after the previous turn's end; every other token
    0. A turn that kept no token (end -1, or not after the previous end) gets none. Why only mask-1 tokens:
    observations and template tokens between turns are context, never trained."""
    if len(turn_ends) != len(turn_values):
        raise ValueError(f"{len(turn_values)} turn advantages for {len(turn_ends)} turns")
    values = torch.zeros(response_mask.shape, dtype=torch.float32)
    start = 0
    for end, value in zip(turn_ends, turn_values):
        stop = min(int(end) + 1, response_mask.shape[0])
        if stop <= start:
            continue
        values[start:stop] = float(value)
        start = stop
    return values * (response_mask > 0)


# ---- verl's seams ---------------------------------------------------------------------------------

METRIC_PREFIX = "beyond_agent/gigpo/"


def norm_of(algorithm_config: Any) -> str:
    """The normalisation a run uses: verl's `algorithm.norm_adv_by_std_in_grpo` (true: std, false: mean)."""
    getter = getattr(algorithm_config, "get", None)
    flag = getter("norm_adv_by_std_in_grpo", True) if getter else getattr(algorithm_config, "norm_adv_by_std_in_grpo",
                                                                           True)
    return "std" if flag else "mean"


@register_adv_est("gigpo")
def compute_gigpo_episode_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                    index: Any = None, config: Any = None, **kwargs: Any):
    """verl's estimator seam for `algorithm.adv_estimator=gigpo`: the episode part A^E on every response
    token (verl passes only rewards, masks and the group ids). The step part needs each turn's anchor state
    and is added by the trainer before the actor update (`add_step_advantages`), since verl hands custom
    estimators no per-turn data. Returns (advantages, returns) as verl's estimators do."""
    if index is None:
        raise ValueError("adv_estimator=gigpo needs verl's group ids (non_tensor_batch['uid'])")
    scores = token_level_rewards.sum(dim=-1).tolist()
    values = episode_advantages(scores, [str(group) for group in index], norm_of(config))
    advantages = torch.tensor(values, dtype=token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


declare_estimator("gigpo", group_based=True)


def add_step_advantages(batch: Any, config: GiGPOConfig, norm: str) -> dict[str, float]:
    """Add omega * A^S to `batch.batch["advantages"]` (which holds A^E from `compute_gigpo_episode_advantage`),
    turn by turn on each turn's trained tokens; the anchor-group metrics (`beyond_agent/gigpo/...`).

    Reads per row: verl's `uid` (the group), and from our rollout `anchors`, `turn_rewards`, `turn_ends`,
    `later_turn_rewards`, `forfeit` (a cut episode's) and `episode_key`. Where one episode has several rows (a per_call agent's segments, which
    verl's estimator counted as that many samples of the group), A^E is redone with each episode once
    (`count_each_episode_once`).
    """
    rows = batch.non_tensor_batch
    missing = [key for key in ("uid", "anchors", "turn_rewards", "turn_ends") if key not in rows]
    if missing:
        raise ValueError(f"adv_estimator=gigpo needs the per-turn fields {missing} that BeyondAgent's rollout "
                         "writes; this batch comes from another rollout")
    later = rows.get("later_turn_rewards", [()] * len(rows["uid"]))
    forfeits = rows.get("forfeit", [None] * len(rows["uid"]))
    episodes = [EpisodeSteps(group=str(uid), reward=0.0, step_rewards=tuple(rewards), anchors=tuple(anchors),
                             later_rewards=tuple(after), forfeit=None if forfeit is None else float(forfeit))
                for uid, rewards, anchors, after, forfeit in zip(rows["uid"], rows["turn_rewards"], rows["anchors"],
                                                                 later, forfeits)]
    step, metrics = step_advantages(episodes, config.gamma, norm)
    mask = batch.batch["response_mask"]
    count_each_episode_once(batch, norm)
    added = torch.stack([spread_over_turns(mask[row], rows["turn_ends"][row], step[row])
                         for row in range(len(episodes))]).to(batch.batch["advantages"].dtype)
    batch.batch["advantages"] = batch.batch["advantages"] + config.omega * added
    batch.batch["returns"] = batch.batch["advantages"]
    return {METRIC_PREFIX + name: value for name, value in metrics.items()}


