"""How many interaction rounds an episode may use, as a pure function of the training step.

    scheduler = RoundScheduler.from_config({"type": "stepwise", "rounds": [10, 20, 30], "every": 100})
    scheduler.max_rounds(global_step)

Step convention: verl 0.9's `RayPPOTrainer.fit` sets `self.global_steps = 0`, validates before training
with step 0, then `self.global_steps += 1` ("we start from step 1") before the first training step
(verl/trainer/ppo/ray_trainer.py:1401 and :1426); a resumed run restores the checkpoint's step and also
adds 1. So training steps are 1, 2, 3, ... and stage k of `stepwise` covers steps
`k * every + 1 .. (k + 1) * every`: with every=100, steps 1..100 get rounds[0], 101..200 rounds[1], and
201.. the last value. Step 0 (validation before training) belongs to the first stage.
(AgentGym-RL computes `global_steps // steps_scaling_inter`, which gives its first stage only 99
training steps; we keep every stage exactly `every` steps long.)

Because the value depends on the step only, a resumed run continues the same schedule.
Accepted keys of `beyond_agent.rounds` (`RoundsSection`), including AgentGym-RL's names (its `rounds_ctrl.*`):
    type:   "fixed" | "stepwise" | "scaling_inter_stepwise" (alias of stepwise)
    rounds: int for fixed; strictly increasing list of positive ints for stepwise
    every:  steps per stage for stepwise (alias: steps_scaling_inter; give only one of them)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from beyond_agent.sections import from_section

SCHEDULE_TYPES = ("fixed", "stepwise", "scaling_inter_stepwise")
_TYPE_ALIASES = {"scaling_inter_stepwise": "stepwise"}
SECTION = "beyond_agent.rounds"
"""The config path named in errors."""


@dataclass(frozen=True)
class RoundsSection:
    """`beyond_agent.rounds` as written in the YAML (read by `sections.from_section`)."""

    rounds: Any
    """An int for fixed; a strictly increasing list of positive ints for stepwise (required)."""
    type: str = "fixed"
    """fixed | stepwise | scaling_inter_stepwise (AgentGym-RL's name of stepwise)."""
    every: int | None = None
    """Training steps per stage (stepwise only)."""
    steps_scaling_inter: int | None = None
    """AgentGym-RL's name of `every`; give only one of them."""


@dataclass(frozen=True)
class RoundScheduler:
    """Round limit per training step: `fixed` (one value) or `stepwise` (ScalingInter-RL stages)."""

    type: str
    """Schedule type; "scaling_inter_stepwise" is stored as its canonical name "stepwise"."""
    rounds: tuple[int, ...]
    """One value for fixed; the per-stage values, increasing, for stepwise (an int or list is accepted)."""
    every: int | None = None
    """Training steps per stage (stepwise only)."""

    def __post_init__(self) -> None:
        if self.type not in SCHEDULE_TYPES:
            raise ValueError(f"{SECTION}.type={self.type!r} is not valid; choose one of {SCHEDULE_TYPES}")
        kind = _TYPE_ALIASES.get(self.type, self.type)
        rounds = _normalise_rounds(kind, self.rounds)
        if kind == "fixed":
            _check_fixed(rounds, self.every)
        else:
            _check_stepwise(rounds, self.every)
        # Frozen dataclass: store the canonical type and the tuple form once, after validation.
        object.__setattr__(self, "type", kind)
        object.__setattr__(self, "rounds", rounds)

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> "RoundScheduler":
        """Build from the `beyond_agent.rounds` section (AgentGym-RL's key names accepted)."""
        written = from_section(RoundsSection, section, SECTION)
        if written.every is not None and written.steps_scaling_inter is not None:
            raise ValueError(f"{SECTION} gives both 'every' and 'steps_scaling_inter' (aliases): give only one")
        every = written.every if written.every is not None else written.steps_scaling_inter
        return cls(type=written.type, rounds=written.rounds, every=every)

    def max_rounds(self, global_step: int) -> int:
        """The round limit for training step `global_step` (verl counts 1, 2, ...; 0 = before training)."""
        if not _is_int(global_step) or global_step < 0:
            raise ValueError(f"global_step must be an int >= 0, got {global_step!r}")
        if self.type == "fixed":
            return self.rounds[0]
        stage = max(global_step - 1, 0) // self.every
        return self.rounds[min(stage, len(self.rounds) - 1)]


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


def _check_positive_round(value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{SECTION}.rounds values must be positive ints, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    """OmegaConf ListConfig and similar: iterable, sized, not a string or mapping."""
    return hasattr(value, "__len__") and hasattr(value, "__iter__") and not isinstance(value, (str, bytes, Mapping))
