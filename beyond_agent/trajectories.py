"""The trajectory dump: one JSON line per episode, its schema, and the one writer and reader of it.

During training the rollout manager writes, every `beyond_agent.trajectories.every` steps,

    <trajectories.dir>/step_<N>.jsonl        training episodes of global step N
    <trajectories.dir>/val_step_<N>.jsonl    validation episodes run at global step N

each line a `TrajectoryRecord` (`schema: 1`). A file is written under a temporary name and renamed, so
a reader (the viewer on a run in progress) never sees half a step. Records are in batch order, so the
episodes of one GRPO group (same `group`) are adjacent; at most `trajectories.max_per_step` are kept.

Token fields follow verl's batch exactly: `prompt_ids` is the first prompt (system + first observation,
rendered by the chat template), `response_ids` everything after it; `response_mask[i]` is 1 where token i
was sampled by the policy (trained on) and 0 where it came from the environment or the chat template
(kept as context, never trained on). `response_logprobs[i]` is the sampler's log-probability of token i
(0.0 where the mask is 0: nobody sampled that token).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator

SCHEMA_VERSION = 1
"""Bumped whenever a field changes meaning or disappears (new optional fields keep the version)."""
KINDS = ("train", "val")
OPTIONAL_FIELDS = ("policy_version", "sampling_seed", "extra")
"""Fields a reader fills with their defaults when a line lacks them."""
FILE_PATTERN = re.compile(r"^(?P<prefix>val_)?step_(?P<step>\d+)\.jsonl$")


class TrajectoryFormatError(ValueError):
    """A dump line is not a trajectory record; the message names the file, the line and the field."""


@dataclass
class TrajectoryRecord:
    """One episode as dumped: what happened, every token the model saw or produced, and how it scored."""

    schema: int
    """`SCHEMA_VERSION` of the writer."""
    step: int
    """verl's global step whose rollout (or validation) played this episode."""
    kind: str
    """"train" (a training rollout) or "val" (a validation rollout)."""
    index: int
    """Row of the episode in its batch."""
    env: str
    """envservice env id, e.g. "babyai"."""
    task: int | str | None
    """The env's task index or name (None: the env chose one from the seed)."""
    split: str
    """The env's task split, e.g. "train"."""
    seed: int | None
    """The task's seed (None: the service drew one)."""
    agent_task: str
    """Label of the AgentTask that prompted, parsed and scored the episode (beyond_agent/tasks.py)."""
    group: str
    """verl's `uid`: episodes with the same group sampled the same task and are compared by GRPO."""
    messages: list[dict]
    """The chat as the model saw it: system, user (observations) and assistant (actions) messages."""
    prompt_ids: list[int]
    """Token ids of the first prompt."""
    response_ids: list[int]
    """Token ids after the prompt: assistant turns and the observations between them."""
    response_mask: list[int]
    """1: sampled by the policy and trained on; 0: environment or template tokens (context only)."""
    response_logprobs: list[float]
    """The sampler's log-probability per response token (empty when the sampler returned none)."""
    turn_ends: list[int]
    """Response position of each assistant turn's last token (-1: that turn kept no token)."""
    step_rewards: list[float]
    """One per assistant turn: the env's reward for that turn's action."""
    reward: float
    """The episode's reward (the AgentTask's; 0.0 for an infrastructure failure)."""
    score: float
    """The env's final evaluate() score."""
    success: bool
    """Whether the env judged the task solved."""
    rounds: int
    """Assistant turns played."""
    termination: str
    """Why it ended: one of `rollout.handler.TERMINATION_REASONS` (done, max_rounds, truncated, length, ...)."""
    error: str | None
    """What went wrong, for an infrastructure failure."""
    env_time_s: float
    """Seconds spent in env calls."""
    llm_time_s: float
    """Seconds spent waiting for generations."""
    wall_time_s: float
    """Seconds from session creation to release."""
    policy_version: int | None = None
    """Version (verl global step) of the oldest weights that sampled it, when the rollout knows it
    (asynchronous rollout; `extra["turn_policy_versions"]` then has one version per assistant turn, and
    `extra["token_policy_versions"]` one per response token, as [[version, count], ...] runs, -1 on observations)."""
    sampling_seed: int | None = None
    """The seed its turns' sampling seeds derived from (`rollout.episode_loop.seeded`; None: the server drew them)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else a writer wants to keep; readers ignore what they do not know."""

    def to_json(self) -> dict[str, Any]:
        """The record as one JSON object (the dump's line)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "record") -> "TrajectoryRecord":
        """Check and build a record; a missing or mistyped field is a `TrajectoryFormatError` naming it."""
        if not isinstance(data, dict):
            raise TrajectoryFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        missing = [name for name in known if name not in data and name not in OPTIONAL_FIELDS]
        if missing:
            raise TrajectoryFormatError(f"{where}: missing field(s) {', '.join(sorted(missing))}")
        if data["schema"] != SCHEMA_VERSION:
            raise TrajectoryFormatError(f"{where}: schema {data['schema']!r}; this reader knows {SCHEMA_VERSION}")
        if data["kind"] not in KINDS:
            raise TrajectoryFormatError(f"{where}: kind {data['kind']!r}; valid: {', '.join(KINDS)}")
        lengths = {len(data["response_ids"]), len(data["response_mask"])}
        if len(lengths) != 1 or (data["response_logprobs"] and len(data["response_logprobs"]) not in lengths):
            raise TrajectoryFormatError(f"{where}: response_ids, response_mask and response_logprobs differ "
                                        "in length")
        return cls(**{key: value for key, value in data.items() if key in known})


def version_runs(versions: list[int]) -> list[list[int]]:
    """[[version, count], ...]: runs of equal versions (a response's per-token versions, compactly)."""
    return [[version, len(list(run))] for version, run in itertools.groupby(versions)]


def episode_record(result: Any, step: int, kind: str, policy_version: int | None = None) -> TrajectoryRecord:
    """The record of a finished `EpisodeResult` (rollout/episode_loop.py); the policy version, unless given,
    is the oldest of its turns' versions (async rollout tags each turn)."""
    spec, episode = result.spec, result.episode
    turn_versions = list(getattr(episode, "turn_policy_versions", None) or [])
    known = [version for version in turn_versions if version is not None]
    if policy_version is None and known:
        policy_version = min(known)
    extra: dict[str, Any] = {"turn_policy_versions": turn_versions} if known else {}
    token_versions = getattr(episode, "token_policy_versions", None) if episode else None
    if token_versions:  # per response token, -1 on observation tokens: [[version, tokens], ...] runs
        extra["token_policy_versions"] = version_runs(token_versions)
    if getattr(result, "agent_mode", None) is not None:  # played by a user's agent behind the gateway
        extra.update(agent_mode=result.agent_mode, earlier_segments=len(result.earlier_segments))
    if getattr(spec, "seat", None) is not None:  # one seat of a game of several (rollout/seats.py)
        extra.update(seat=spec.seat, opponent=spec.opponent)
    return TrajectoryRecord(
        schema=SCHEMA_VERSION, step=step, kind=kind, index=spec.index, env=spec.env_id, task=spec.task_id,
        split=spec.split, seed=spec.seed, agent_task=spec.agent_task.label, group=spec.group_id,
        messages=result.messages,
        prompt_ids=list(episode.prompt_ids) if episode else [],
        response_ids=list(episode.response_ids) if episode else [],
        response_mask=list(episode.response_mask) if episode else [],
        response_logprobs=list(episode.response_logprobs or []) if episode else [],
        turn_ends=list(episode.turn_ends) if episode else [],
        step_rewards=list(result.step_rewards), reward=result.reward, score=result.score, success=result.success,
        rounds=result.rounds, termination=result.termination, error=result.error,
        env_time_s=round(result.env_time_s, 4), llm_time_s=round(result.llm_time_s, 4),
        wall_time_s=round(result.wall_time_s, 4), policy_version=policy_version,
        sampling_seed=getattr(spec, "sampling_seed", None), extra=extra)


def dump_file_name(step: int, kind: str) -> str:
    """`step_<N>.jsonl` for training episodes, `val_step_<N>.jsonl` for validation ones."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}; valid: {', '.join(KINDS)}")
    return f"{'val_' if kind == 'val' else ''}step_{step}.jsonl"


def parse_dump_file_name(name: str) -> tuple[int, str] | None:
    """(step, kind) of a dump file's name, or None for any other file."""
    match = FILE_PATTERN.match(name)
    if not match:
        return None
    return int(match.group("step")), "val" if match.group("prefix") else "train"


def write_dump(folder: Path, step: int, kind: str, records: Iterable[TrajectoryRecord], append: bool = False) -> Path:
    """Write one step's records atomically (temporary file, then rename); returns the file's path.

    `append` keeps the file's earlier lines first (validation comes in several batches per step).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dump_file_name(step, kind)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as out:
        if append and path.exists():
            out.write(path.read_text())
        for record in records:
            out.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path


def read_dump(path: Path) -> Iterator[TrajectoryRecord]:
    """The records of one dump file, checked; a bad line raises `TrajectoryFormatError` naming it."""
    with Path(path).open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield parse_line(line, f"{path}:{number}")


def parse_line(line: str | bytes, where: str) -> TrajectoryRecord:
    """One dump line as a record."""
    try:
        data = json.loads(line)
    except ValueError as error:
        raise TrajectoryFormatError(f"{where}: not JSON ({error})") from None
    return TrajectoryRecord.from_json(data, where)
