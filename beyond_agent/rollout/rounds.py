"""How many interaction rounds an episode may use at each training step.

    rounds = from_section(RoundsConfig, {"type": "stepwise", "rounds": [10, 20, 30], "every": 100}, "rounds")
    rounds.max_rounds(global_step)

Step convention: verl 0.9's `RayPPOTrainer.fit` sets `self.global_steps = 0`, validates before training
with step 0, then `self.global_steps += 1` ("we start from step 1") before the first training step
(verl/trainer/ppo/ray_trainer.py:1401 and :1426); a resumed run restores the checkpoint's step and also
adds 1. So training steps are 1, 2, 3, ... and stage k of `stepwise` covers steps
`k * every + 1 .. (k + 1) * every`: with every=100, steps 1..100 get rounds[0], 101..200 rounds[1], and
201.. the last value. Step 0 (validation before training) belongs to the first stage.
AgentGym-RL's `StepRoundsScheduler` gives its stages the same steps while it counts them itself (steps 1..100
first, with `steps_scaling_inter=100`); only its resume path, `global_steps // steps_scaling_inter`, puts the
last step of a stage (step 100) in the next one. Here the stage follows from the step alone, resumed or not.

Because the value depends on the step only, a resumed run continues the same schedule.

`adaptive` moves to the next value of `rounds` when the agent has outgrown the current one, judged from the
episodes each training step trained on, averaged over the last `window` steps at this limit:
    signal: truncated   the share of episodes cut by the run's limits (the round limit, the token budget, the
                        gateway's call limit) fell to `threshold` or below: the agent's episodes stopped being
                        cut (they end by themselves, won or lost, or by the env's own step limit);
    signal: success     the success rate reached `threshold` or above.
It never lowers the limit, never goes past the last value, and with `every` set it is never behind the
stepwise schedule of the same values (a stage may start early, never late). Why `every` matters: a first
limit too short for any success (4 rounds on a map that needs 10 moves) cuts every episode, and only the
schedule then moves it on. The rollout manager keeps the adaptive state in a `RoundLimit` (below), which also
records each step's signal in `horizon.json` in the run's checkpoint folder, so that a resumed run goes on
from the limit it had reached.

Keys of `beyond_agent.rounds` (`RoundsConfig`), including AgentGym-RL's names (its `rounds_ctrl.*`):
    type:   "fixed" | "stepwise" | "scaling_inter_stepwise" (alias of stepwise) | "adaptive"
    rounds: int for fixed; strictly increasing list of positive ints for stepwise and adaptive
    every:  steps per stage for stepwise (alias: steps_scaling_inter; give only one of them); for adaptive
            the longest a stage lasts (null: as long as the signal says)
    signal, threshold, window: adaptive only (above)
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from beyond_agent.rollout.episode_loop import EpisodeResult

SCHEDULE_TYPES = ("fixed", "stepwise", "scaling_inter_stepwise", "adaptive")
SIGNALS = ("truncated", "success")
CUT_BY_OUR_LIMITS = ("max_rounds", "length", "max_calls")
"""Terminations of an episode that did not end by itself but was cut by a limit of the run: the round limit, the
token budget, the gateway's call limit. An env's own step limit (`truncated`) is the env's: raising the round limit
cannot lift it, so it counts as an end."""
HORIZON_RECORD = "horizon.json"
"""The adaptive horizon's record of each training step's signal, in the run's checkpoint folder."""
_TYPE_ALIASES = {"scaling_inter_stepwise": "stepwise"}
SECTION = "beyond_agent.rounds"
"""The config path named in errors."""


@dataclass(frozen=True)
class RoundsConfig:
    """`beyond_agent.rounds`: the round limit per training step, `fixed` (one value), `stepwise`
    (ScalingInter-RL stages) or `adaptive` (module docstring). Read by `sections.from_section` as it is written
    in the YAML, AgentGym-RL's key names included, and validated here once; the same object answers
    `max_rounds(step)`."""

    rounds: Any
    """An int for fixed; a strictly increasing list of positive ints for stepwise and adaptive (stored as a
    tuple, fixed's one value as a 1-tuple)."""
    type: str = "fixed"
    """One of SCHEDULE_TYPES; "scaling_inter_stepwise" (AgentGym-RL's name) is stored as "stepwise"."""
    every: int | None = None
    """Training steps per stage (stepwise); the longest a stage lasts (adaptive, optional)."""
    steps_scaling_inter: int | None = None
    """AgentGym-RL's name of `every`; give only one of them (read into `every`, then None)."""
    signal: str = "truncated"
    """adaptive: what says the agent outgrew the limit (SIGNALS; see the module docstring)."""
    threshold: float | None = None
    """adaptive (required): the limit rises when the signal's window mean is <= it (truncated) or >= it
    (success); a fraction in [0, 1]."""
    window: int = 1
    """adaptive: training steps at the current limit whose signals are averaged."""

    def __post_init__(self) -> None:
        if self.every is not None and self.steps_scaling_inter is not None:
            raise ValueError(f"{SECTION} gives both 'every' and 'steps_scaling_inter' (aliases): give only one")
        if self.type not in SCHEDULE_TYPES:
            raise ValueError(f"{SECTION}.type={self.type!r} is not valid; choose one of {SCHEDULE_TYPES}")
        kind = _TYPE_ALIASES.get(self.type, self.type)
        every = self.every if self.every is not None else self.steps_scaling_inter
        rounds = _normalise_rounds(kind, self.rounds)
        if kind == "fixed":
            _check_fixed(rounds, every)
        elif kind == "stepwise":
            _check_stepwise(rounds, every)
        else:
            _check_adaptive(rounds, every, self.signal, self.threshold, self.window)
        if kind != "adaptive" and self.threshold is not None:
            raise ValueError(f"{SECTION}.threshold only applies to type 'adaptive', not {self.type!r}")
        # Frozen dataclass: store the canonical type, the tuple and `every` once, after validation, so that a
        # config written with AgentGym-RL's names equals the one written with ours.
        object.__setattr__(self, "type", kind)
        object.__setattr__(self, "rounds", rounds)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "steps_scaling_inter", None)

    def max_rounds(self, global_step: int) -> int:
        """The round limit for training step `global_step` (verl counts 1, 2, ...; 0 = before training); for
        adaptive the least it can be at that step (`RoundLimit` raises it from what the agent did)."""
        return self.rounds[self.stage(global_step)]

    def stage(self, global_step: int) -> int:
        """The index in `rounds` the step is at by the schedule alone (adaptive: at least)."""
        if not _is_int(global_step) or global_step < 0:
            raise ValueError(f"global_step must be an int >= 0, got {global_step!r}")
        if self.type == "fixed" or self.every is None:
            return 0
        return min(max(global_step - 1, 0) // self.every, len(self.rounds) - 1)


def _normalise_rounds(kind: str, rounds: Any) -> Any:
    """Lists (also OmegaConf's) become tuples; fixed's single int becomes a 1-tuple; anything else is kept
    as given so that validation can name it."""
    if _is_sequence(rounds):
        if kind == "fixed":
            raise ValueError(f"{SECTION}.rounds must be one int for type 'fixed', got the list {list(rounds)}")
        return tuple(rounds)
    return (rounds,) if kind == "fixed" else rounds


def _check_fixed(rounds: tuple, every: Any) -> None:
    _check_positive_round(rounds[0])
    if every is not None:
        raise ValueError(f"{SECTION}.every/steps_scaling_inter only applies to type 'stepwise', not 'fixed'")


def _check_stepwise(rounds: Any, every: Any) -> None:
    if not isinstance(rounds, tuple):
        raise ValueError(
            f"{SECTION}.rounds must be a list of ints for type 'stepwise', got {rounds!r} "
            "(use type 'fixed' for one value)"
        )
    if not rounds:
        raise ValueError(f"{SECTION}.rounds is an empty list; stepwise needs at least one stage")
    for value in rounds:
        _check_positive_round(value)
    if any(later <= earlier for earlier, later in zip(rounds, rounds[1:])):
        raise ValueError(f"{SECTION}.rounds must be strictly increasing for type 'stepwise', got {list(rounds)}")
    if every is None:
        raise ValueError(f"{SECTION}.every (or steps_scaling_inter) is missing; stepwise needs steps per stage")
    if not _is_int(every) or every <= 0:
        raise ValueError(f"{SECTION}.every (steps_scaling_inter) must be a positive int, got {every!r}")


def _check_adaptive(rounds: Any, every: Any, signal: Any, threshold: Any, window: Any) -> None:
    if not isinstance(rounds, tuple) or len(rounds) < 2:
        raise ValueError(f"{SECTION}.rounds must be a list of at least two ints for type 'adaptive' (the limits it "
                         f"moves through), got {rounds!r}")
    for value in rounds:
        _check_positive_round(value)
    if any(later <= earlier for earlier, later in zip(rounds, rounds[1:])):
        raise ValueError(f"{SECTION}.rounds must be strictly increasing for type 'adaptive', got {list(rounds)}")
    if every is not None and (not _is_int(every) or every <= 0):
        raise ValueError(f"{SECTION}.every must be a positive int or null for type 'adaptive', got {every!r}")
    if signal not in SIGNALS:
        raise ValueError(f"{SECTION}.signal={signal!r} is not valid; choose one of {', '.join(SIGNALS)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise ValueError(f"{SECTION}.threshold must be a fraction in [0, 1] for type 'adaptive', got {threshold!r}")
    if not _is_int(window) or window <= 0:
        raise ValueError(f"{SECTION}.window must be a positive int, got {window!r}")


def _check_positive_round(value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{SECTION}.rounds values must be positive ints, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    """OmegaConf ListConfig and similar: iterable, sized, not a string or mapping."""
    return hasattr(value, "__len__") and hasattr(value, "__iter__") and not isinstance(value, (str, bytes, Mapping))


def step_signal(results: Sequence[EpisodeResult], signal: str) -> float | None:
    """One training step's signal over its scored episodes (infrastructure failures are not the agent's):
    the share cut by the run's limits (`CUT_BY_OUR_LIMITS`), or the success rate; None when no episode was scored."""
    scored = [result for result in results if not result.infra_failure]
    if not scored:
        return None
    if signal == "truncated":
        return sum(result.termination in CUT_BY_OUR_LIMITS for result in scored) / len(scored)
    return sum(result.success for result in scored) / len(scored)


class RoundLimit:
    """The round limit the rollout plays each step with: the schedule's value, raised by the agent's own
    episodes for `adaptive` (module docstring). Thread-safe (the async pool asks from its feeder thread).

    `record_dir`: where `horizon.json` keeps each observed step (adaptive only; None keeps nothing). A run that
    resumes from a checkpoint replays the record up to its step and goes on from there.
    """

    def __init__(self, rounds: RoundsConfig, record_dir: str | Path | None = None):
        self.rounds = rounds
        self._record = Path(record_dir) / HORIZON_RECORD if record_dir and rounds.type == "adaptive" else None
        self._lock = threading.Lock()
        self._loaded = self._record is None
        self._observed: list[dict[str, Any]] = []
        self._stage = 0
        self._window: list[float] = []

    def max_rounds(self, global_step: int, validate: bool = False) -> int:
        """The limit for training step `global_step` (validation at a step: the limit that step trained with)."""
        with self._lock:
            self._load_once(global_step, validate)
            if self.rounds.type != "adaptive":
                return self.rounds.max_rounds(global_step)
            return self.rounds.rounds[max(self._stage, self.rounds.stage(global_step))]

    def observe(self, global_step: int, results: Sequence[EpisodeResult]) -> dict[str, float]:
        """Take in the episodes training step `global_step` trained on; its metrics (`max_rounds`, and for
        adaptive `horizon/signal` when any episode was scored)."""
        limit = self.max_rounds(global_step)
        metrics = {"max_rounds": float(limit)}
        if self.rounds.type != "adaptive":
            return metrics
        signal = step_signal(results, self.rounds.signal)
        with self._lock:
            entry = {"step": global_step, "max_rounds": limit, "signal": signal}
            self._observed = [e for e in self._observed if e["step"] < global_step] + [entry]
            self._advance(entry)
            self._save()
        if signal is not None:
            metrics["horizon/signal"] = signal
        return metrics

    # ---- adaptive state ------------------------------------------------------------------------

    def _advance(self, entry: dict[str, Any]) -> None:
        """The stage after one observed step (called with the lock held, steps in order)."""
        rounds = self.rounds
        floor = rounds.stage(entry["step"])
        if floor > self._stage:  # the schedule moved the limit on: a new stage, a new window
            self._stage, self._window = floor, []
        if entry["signal"] is None:
            return
        self._window = (self._window + [entry["signal"]])[-rounds.window:]
        if len(self._window) < rounds.window or self._stage == len(rounds.rounds) - 1:
            return
        mean = sum(self._window) / len(self._window)
        outgrown = mean <= rounds.threshold if rounds.signal == "truncated" else mean >= rounds.threshold
        if outgrown:
            self._stage, self._window = self._stage + 1, []

    def _load_once(self, global_step: int, validate: bool) -> None:
        """Replay the record of the steps before this one (a resumed run): training step s keeps the steps < s,
        validation at step k (verl validates a resumed run at its checkpoint's step) the steps <= k."""
        if self._loaded:
            return
        self._loaded = True
        if not self._record.exists():
            return
        last = global_step if validate else global_step - 1
        try:
            entries = json.loads(self._record.read_text())["observed"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{self._record} is not a horizon record ({error}); move it away to start the "
                             "adaptive horizon afresh") from None
        for entry in sorted((e for e in entries if e["step"] <= last), key=lambda e: e["step"]):
            self._observed.append(entry)
            self._advance(entry)

    def _save(self) -> None:
        if self._record is None:
            return
        self._record.parent.mkdir(parents=True, exist_ok=True)
        partial = self._record.with_suffix(".json.partial")
        partial.write_text(json.dumps({"schedule": {"rounds": list(self.rounds.rounds),
                                                    "signal": self.rounds.signal,
                                                    "threshold": self.rounds.threshold,
                                                    "window": self.rounds.window, "every": self.rounds.every},
                                       "observed": self._observed}, indent=1))
        os.replace(partial, self._record)  # a crash mid-write leaves the previous record whole
