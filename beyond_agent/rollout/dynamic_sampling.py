"""Dynamic sampling: groups that carry no learning signal are dropped and replaced by new rows.

A GRPO-style advantage compares each episode with the other episodes of its group (the n episodes of one
dataset row). When every episode of a group got the same reward, every advantage in it is zero: the group
costs a training step's compute and teaches nothing (DAPO's "dynamic sampling"; prime-rl and OpenRLHF
drop such groups too). With `beyond_agent.dynamic_sampling.drop` set, a training step's rows are sieved:

    drop: zero_variance   every group whose scored episodes all got the same reward
          all_success     only those whose episodes all succeeded (too easy for now)
          all_failure     only those whose episodes all failed (too hard for now)
          none            nothing is dropped (the default)

and a dropped group's place in the batch goes to a newly drawn row. The extra generation is bounded: a step
drops at most `ceil(max_extra_batches * batch_size)` groups; past that, groups are kept even without signal
(counted as `kept_without_signal_groups`), so a step never waits for ever on a task set that is all solved or
all unsolved. The batch size verl trains on stays the same.

One rule, two modes: the synchronous loop in the rollout manager (`BeyondAgentLoopManager.take_rows`, rows
played on the spot) and the asynchronous pool (rollout/async_pool.py, rows played ahead) both offer each
finished group to a `GroupSieve`, one per training step. A group holding an infrastructure failure has no
signal: dynamic sampling runs only with group-based estimators, and with those such a group is kept out of
training whole (rollout/batch.py's `excluded_rows`), so it would fill a batch slot and train nothing.

With GiGPO (`algorithm.adv_estimator=gigpo`) a group whose episode returns are all equal may still carry signal:
its turns that start from the same state can differ in their step returns. The caller gives the sieve GiGPO's
test (`step_signal`, algorithms/gigpo.py's `group_has_step_signal`), and such a group counts as having signal.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from beyond_agent.rollout.episode_loop import EpisodeResult

DROP_RULES = ("none", "zero_variance", "all_success", "all_failure")
SECTION = "beyond_agent.dynamic_sampling"
SIEVE_PREFIX = "dynamic_sampling/"
EQUAL_REWARD_TOLERANCE = 1e-9
"""Rewards closer than this count as equal (sums of float step rewards rarely match exactly)."""


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """`beyond_agent.dynamic_sampling`: which groups a training step drops, and how many it may replace."""

    drop: str = "none"
    """One of DROP_RULES: none | zero_variance | all_success | all_failure (see the module docstring)."""
    max_extra_batches: float = 1.0
    """Groups dropped per step at most, as a multiple of the batch size (1.0: up to one batch of extra rows,
    i.e. at most twice the generation of a step without dropping)."""

    def __post_init__(self) -> None:
        if self.drop not in DROP_RULES:
            raise ValueError(f"{SECTION}.drop={self.drop!r} is not valid; choose one of {', '.join(DROP_RULES)}")
        extra = self.max_extra_batches
        if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not 0 <= extra < math.inf:
            raise ValueError(f"{SECTION}.max_extra_batches must be a number >= 0, got {extra!r}")

    @property
    def active(self) -> bool:
        """Whether any group is ever dropped."""
        return self.drop != "none"

    def drop_budget(self, batch_size: int) -> int:
        """Groups one step may drop (and draw again)."""
        return math.ceil(self.max_extra_batches * batch_size) if self.active else 0


StepSignal = Callable[[Sequence[EpisodeResult]], bool]
"""Whether a group's turns get any non-zero step-level advantage (GiGPO's; None for episode-level estimators)."""


def group_has_signal(results: Sequence[EpisodeResult], drop: str, step_signal: StepSignal | None = None) -> bool:
    """False when `drop`'s rule removes this group: it trains nothing (an infrastructure failure in it), or its
    episodes' rewards are all equal, no turn gets a step-level advantage (`step_signal`, with GiGPO), and, for
    all_success / all_failure, all succeeded / none did."""
    if drop == "none":
        return True
    # Rule: a group with an infrastructure failure is masked whole with a group-based estimator (the only kind
    # dynamic sampling runs with; see the module docstring), so it has no signal whatever its other rewards.
    if any(result.infra_failure for result in results):
        return False
    if len(results) < 2:  # nothing to compare an episode with: every advantage would be zero
        return False
    rewards = [result.reward for result in results]
    if max(rewards) - min(rewards) > EQUAL_REWARD_TOLERANCE:
        return True
    if step_signal is not None and step_signal(results):
        return True
    if drop == "all_success":
        return not all(result.success for result in results)
    if drop == "all_failure":
        return any(result.success for result in results)
    return False


def groups_with_signal(results: Sequence[EpisodeResult], group_based: bool,
                       step_signal: StepSignal | None = None) -> tuple[int, int]:
    """(groups that carry a learning signal, groups) in one training batch, by `group_has_signal`'s zero-variance
    rule: a group is the episodes of one `group_id` with a group-based estimator, else the batch's scored episodes
    (a batch-wide baseline is as blind to equal rewards as a group's)."""
    if group_based:
        groups: dict[str, list[EpisodeResult]] = {}
        for result in results:
            groups.setdefault(result.spec.group_id, []).append(result)
        batches = list(groups.values())
    else:
        scored = [result for result in results if not result.infra_failure]
        batches = [scored] if scored else []
    return sum(group_has_signal(group, "zero_variance", step_signal) for group in batches), len(batches)


class GroupSieve:
    """One training step's sieve: `offer` each finished group in turn; it says whether the group trains.

    A group without signal is dropped while the step's drop budget lasts, and kept after that. The sieve
    counts what it saw for the step's metrics (`metrics`), the dropped groups by the task label given.
    """

    def __init__(self, config: DynamicSamplingConfig, batch_size: int, step_signal: StepSignal | None = None):
        self.config = config
        self.step_signal = step_signal
        """GiGPO's step-level test (see `group_has_signal`); None for episode-level estimators."""
        self.budget = config.drop_budget(batch_size)
        self.dropped_groups = 0
        self.dropped_episodes = 0
        """Episodes played and not trained (the extra generation this step cost)."""
        self.dropped_tasks: Counter = Counter()
        self.kept_without_signal = 0
        self.groups_with_failures = 0
        """Groups offered with an infrastructure failure in them (no signal: dropped while the budget lasts)."""
        self._played: list[EpisodeResult] = []

    def offer(self, results: Sequence[EpisodeResult], task: str) -> bool:
        """True: the group (of dataset task `task`) trains this step; False: it is dropped (the caller draws
        another row)."""
        self._played.extend(results)
        self.groups_with_failures += any(result.infra_failure for result in results)
        if group_has_signal(results, self.config.drop, self.step_signal):
            return True
        if self.dropped_groups < self.budget:
            self.dropped_groups += 1
            self.dropped_episodes += len(results)
            self.dropped_tasks[task] += 1
            return False
        self.kept_without_signal += 1
        return True

    def metrics(self) -> dict[str, float]:
        """This step's metrics (`dynamic_sampling/...`; the rollout manager puts them under `beyond_agent/`)."""
        if not self.config.active:
            return {}
        scored = [result for result in self._played if not result.infra_failure]
        metrics = {
            "dropped_groups": float(self.dropped_groups),
            "extra_episodes": float(self.dropped_episodes),
            "kept_without_signal_groups": float(self.kept_without_signal),
            "groups_with_failures": float(self.groups_with_failures),
            # Success over every episode played, dropped ones included: the trained batch's own success rate
            # is biased by what the sieve removed.
            "played_success_rate": sum(r.success for r in scored) / len(scored) if scored else 0.0,
        }
        metrics.update({f"dropped/{task}": float(count) for task, count in self.dropped_tasks.items()})
        return {SIEVE_PREFIX + key: value for key, value in metrics.items()}
