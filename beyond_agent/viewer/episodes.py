"""The episodes of a run, one step at a time: summaries to list and filter, and one whole episode to show.

A run of 1 000 steps x 128 episodes holds gigabytes of token ids, so nothing reads all of it: the step
list comes from file names, a step's summaries from that one file (indexed once per size and modification
time, with each line's byte offset), and an episode from one seek. The browser gets a page of summaries
and one episode at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beyond_agent.run_folder import within
from beyond_agent.trajectories import KINDS, parse_dump_file_name, parse_line

CACHED_STEPS = 64
"""Dump files whose summaries are kept in memory (least recently used ones are dropped)."""
MAX_PAGE = 200
FILTER_FIELDS = ("env", "task", "agent_task", "termination", "success", "min_reward", "max_reward", "group")


class EpisodeNotFound(LookupError):
    """No such step, kind or line in the run's dumps; the message says which and what exists."""


@dataclass(frozen=True)
class DumpFile:
    """One dump file: which step and kind it holds."""

    step: int
    kind: str
    path: Path


def summary_of(record: Any, line: int) -> dict[str, Any]:
    """What the episode list shows of one record (no token ids)."""
    return {
        "line": line, "index": record.index, "env": record.env, "task": record.task, "split": record.split,
        "seed": record.seed, "agent_task": record.agent_task, "group": record.group, "success": record.success,
        "reward": record.reward, "score": record.score, "rounds": record.rounds,
        "termination": record.termination, "error": record.error, "policy_version": record.policy_version,
        "response_tokens": len(record.response_ids), "trained_tokens": sum(record.response_mask),
        "wall_time_s": record.wall_time_s,
    }


class EpisodeFilter:
    """The list's filters, checked: bad values are errors naming the field and what is valid."""

    def __init__(self, params: dict[str, str]):
        unknown = sorted(set(params) - set(FILTER_FIELDS))
        if unknown:
            raise ValueError(f"unknown filter {', '.join(unknown)}; valid: {', '.join(FILTER_FIELDS)}")
        self.exact = {key: params[key] for key in ("env", "task", "agent_task", "termination", "group")
                      if params.get(key) not in (None, "")}
        success = params.get("success") or ""
        if success not in ("", "true", "false"):
            raise ValueError(f"filter success={success!r}; valid: true, false (or empty for both)")
        self.success = None if success == "" else success == "true"
        self.min_reward = _number(params, "min_reward")
        self.max_reward = _number(params, "max_reward")

    def __call__(self, summary: dict[str, Any]) -> bool:
        if any(str(summary[key]) != value for key, value in self.exact.items()):
            return False
        if self.success is not None and summary["success"] != self.success:
            return False
        if self.min_reward is not None and summary["reward"] < self.min_reward:
            return False
        return self.max_reward is None or summary["reward"] <= self.max_reward


def _number(params: dict[str, str], key: str) -> float | None:
    value = params.get(key)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"filter {key}={value!r}: expected a number") from None


class EpisodeStore:
    """The dump files under the run's trajectory folders, indexed lazily (see the module docstring)."""

    def __init__(self, folders: list[Path], root: Path | None = None):
        self.folders = folders
        self.root = root
        """The run folder: a dump file that links out of it is not read (None: no such check)."""
        self._index: OrderedDict[Path, tuple[tuple[int, float], list[tuple[int, dict]]]] = OrderedDict()

    def dump_files(self) -> list[DumpFile]:
        """Every dump file, by step then kind (later folders win for the same step and kind)."""
        found: dict[tuple[int, str], DumpFile] = {}
        for folder in self.folders:
            for path in folder.glob("*step_*.jsonl") if folder.is_dir() else []:
                if self.root is not None and not within(self.root, path):
                    continue
                parsed = parse_dump_file_name(path.name)
                if parsed:
                    found[parsed] = DumpFile(parsed[0], parsed[1], path)
        return [found[key] for key in sorted(found, key=lambda key: (key[0], KINDS.index(key[1])))]

    def steps(self) -> list[dict[str, Any]]:
        """[{step, kind}] for every dump, in step order (no file is opened)."""
        return [{"step": dump.step, "kind": dump.kind} for dump in self.dump_files()]

    def _file(self, step: int, kind: str) -> Path:
        for dump in self.dump_files():
            if (dump.step, dump.kind) == (step, kind):
                return dump.path
        kinds = ", ".join(KINDS)
        raise EpisodeNotFound(f"no {kind} dump for step {step} (kind is one of {kinds}; "
                              f"dumped: {self._dumped()})")

    def _dumped(self) -> str:
        dumps = self.dump_files()
        shown = ", ".join(f"{d.kind} {d.step}" for d in dumps[:20])
        return (shown + (f" and {len(dumps) - 20} more" if len(dumps) > 20 else "")) or "none yet"

    def _summaries(self, path: Path) -> list[tuple[int, dict]]:
        """[(byte offset, summary)] of a file's lines; rebuilt when the file changes."""
        stat = path.stat()
        key = (stat.st_size, stat.st_mtime)
        cached = self._index.get(path)
        if cached and cached[0] == key:
            self._index.move_to_end(path)
            return cached[1]
        entries, offset = [], 0
        with path.open("rb") as source:
            for number, raw in enumerate(source, start=1):
                if raw.strip():
                    record = parse_line(raw, f"{path.name}:{number}")
                    entries.append((offset, summary_of(record, number)))
                offset += len(raw)
        self._index[path] = (key, entries)
        while len(self._index) > CACHED_STEPS:
            self._index.popitem(last=False)
        return entries

    def page(self, step: int, kind: str, filters: dict[str, str], offset: int = 0, limit: int = 50) -> dict:
        """One page of a step's episodes that pass the filters, with the values each filter can take."""
        if limit < 1 or limit > MAX_PAGE or offset < 0:
            raise ValueError(f"limit must be 1..{MAX_PAGE} and offset >= 0; got limit={limit}, offset={offset}")
        keep = EpisodeFilter(filters)
        summaries = [summary for _, summary in self._summaries(self._file(step, kind))]
        matched = [summary for summary in summaries if keep(summary)]
        facets = {name: sorted({str(summary[name]) for summary in summaries})
                  for name in ("env", "task", "agent_task", "termination")}
        return {"step": step, "kind": kind, "total": len(summaries), "matched": len(matched), "offset": offset,
                "limit": limit, "facets": facets, "items": matched[offset: offset + limit]}

    def record(self, step: int, kind: str, line: int) -> Any:
        """The whole record on `line` (1-based) of a step's dump."""
        path = self._file(step, kind)
        for offset, summary in self._summaries(path):
            if summary["line"] == line:
                with path.open("rb") as source:
                    source.seek(offset)
                    return parse_line(source.readline(), f"{path.name}:{line}")
        raise EpisodeNotFound(f"{path.name} has no episode on line {line}")

    def group_lines(self, step: int, kind: str, group: str) -> list[int]:
        """Lines of a step's dump whose episodes share `group` (what GRPO compares)."""
        return [summary["line"] for _, summary in self._summaries(self._file(step, kind))
                if summary["group"] == group]

    def game_lines(self, step: int, kind: str, group: str, index: int) -> list[int]:
        """Lines of a step's dump holding the seats of one game (groups `<row>/seat<k>` of one row, the same
        sample index: beyond_agent/rollout/seats.py); [] for an episode of no game."""
        row, seat_mark, _ = group.rpartition("/seat")
        if not seat_mark:
            return []
        return [summary["line"] for _, summary in self._summaries(self._file(step, kind))
                if summary["group"].rpartition("/seat")[0] == row and summary["index"] == index]

