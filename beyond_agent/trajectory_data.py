"""Trajectory records as training data: find dump files, filter episodes, and turn one into a training row.

Every learning-from-trajectories method (SFT, DPO, AgentEvol, Agent-R) reads the one episode format we
write: `TrajectoryRecord` lines (beyond_agent/trajectories.py), from training dumps
(`<run>/trajectories/step_N.jsonl`) or from `python -m beyond_agent.collect --out F.jsonl`.

A training row is the record's exact token ids, never re-tokenised text: `input_ids` = `prompt_ids` +
`response_ids`, `loss_mask` = 0 over the prompt, then `response_mask`. So the loss falls on the tokens the
policy wrote (what RL would train on) and nothing else, whatever the chat template does to a re-rendered
conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from beyond_agent.sections import from_section
from beyond_agent.trajectories import TrajectoryRecord, read_dump

INFRA_TERMINATIONS = ("env_error", "llm_error", "timeout", "agent_error")
"""Terminations caused by infrastructure, not by the policy: such an episode never becomes training data."""
TRUNCATIONS = ("error", "left", "right")


class TrajectoryDataError(ValueError):
    """Bad trajectory input or filter; the message names the file, record or field and the valid choices."""


@dataclass(frozen=True)
class TrajectoryFilter:
    """Which episodes become training data. Every set condition must hold; None / empty means "any".

    Episodes that ended in an infrastructure failure (`INFRA_TERMINATIONS`) are always dropped.
    """

    success: bool | None = None
    """Keep only successful (True) or only failed (False) episodes."""
    min_reward: float | None = None
    """Keep episodes whose reward is at least this."""
    terminations: tuple[str, ...] = ()
    """Keep episodes that ended this way, e.g. ("done",)."""
    envs: tuple[str, ...] = ()
    """Keep episodes of these envservice env ids."""
    agent_tasks: tuple[str, ...] = ()
    """Keep episodes scored by these AgentTask labels."""
    kinds: tuple[str, ...] = ()
    """Keep "train" and/or "val" episodes (a training dump holds both kinds in separate files)."""

    def __post_init__(self) -> None:
        # Frozen: the lists a YAML gives (or one name) are stored as tuples, once, after the type check.
        for key in ("terminations", "envs", "agent_tasks", "kinds"):
            object.__setattr__(self, key, _as_tuple(getattr(self, key)))
        if self.success is not None and not isinstance(self.success, bool):
            raise TrajectoryDataError(f"trajectory filter: success must be true, false or null; got {self.success!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, where: str = "trajectory filter") -> "TrajectoryFilter":
        """Build from a config section (`sections.from_section`); an unknown key is an error listing the valid ones."""
        try:
            return from_section(cls, values, where)
        except TrajectoryDataError:
            raise
        except ValueError as error:
            raise TrajectoryDataError(str(error)) from None

    def keeps(self, record: TrajectoryRecord) -> bool:
        """True when the record passes every condition."""
        if record.termination in INFRA_TERMINATIONS or not record.response_ids:
            return False
        return ((self.success is None or record.success == self.success)
                and (self.min_reward is None or record.reward >= self.min_reward)
                and (not self.terminations or record.termination in self.terminations)
                and (not self.envs or record.env in self.envs)
                and (not self.agent_tasks or record.agent_task in self.agent_tasks)
                and (not self.kinds or record.kind in self.kinds))


def _as_tuple(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)


def trajectory_files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """The .jsonl files named, or found (sorted, recursively) in the folders named."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found.extend(sorted(path.rglob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            raise TrajectoryDataError(f"trajectory path {path} does not exist (give .jsonl files or folders of them)")
    if not found:
        raise TrajectoryDataError(f"no .jsonl trajectory files in {', '.join(map(str, paths))}")
    return found


def read_trajectories(paths: str | Path | Iterable[str | Path],
                      keep: TrajectoryFilter = TrajectoryFilter()) -> list[TrajectoryRecord]:
    """Every record of the files (or folders) that the filter keeps, in file and line order."""
    return [record for path in trajectory_files(paths) for record in read_dump(path) if keep.keeps(record)]


@dataclass(frozen=True)
class TrainingRow:
    """One episode as a language-model training sequence (exact token ids)."""

    input_ids: list[int]
    """prompt_ids + response_ids."""
    loss_mask: list[int]
    """1 on tokens the policy wrote (trained on), 0 on prompt, observation and template tokens."""


def training_row(record: TrajectoryRecord, max_length: int | None = None, truncation: str = "error") -> TrainingRow:
    """The record's tokens and loss mask, cut to `max_length` tokens by `truncation` (error | left | right)."""
    if truncation not in TRUNCATIONS:
        raise TrajectoryDataError(f"truncation {truncation!r}; valid: {', '.join(TRUNCATIONS)}")
    input_ids = list(record.prompt_ids) + list(record.response_ids)
    # The first prompt (system + first observation) is context: the policy never wrote it.
    loss_mask = [0] * len(record.prompt_ids) + [1 if bit else 0 for bit in record.response_mask]
    if max_length is not None and len(input_ids) > max_length:
        if truncation == "error":
            raise TrajectoryDataError(f"episode {record.env}/{record.task} (step {record.step}, index {record.index}) "
                                      f"has {len(input_ids)} tokens > max_length {max_length}; raise max_length or "
                                      "set truncation to left or right")
        cut = slice(-max_length, None) if truncation == "left" else slice(None, max_length)
        input_ids, loss_mask = input_ids[cut], loss_mask[cut]
    return TrainingRow(input_ids, loss_mask)
