"""Multi-task runs: one run trains on several environments at once (`beyond_agent.multitask`).

A "task" here is a training task in AgentRL's sense, one source of rows (usually one env), not an
`AgentTask` (which prompts, parses and scores episodes). A row's task is `task_name(row)`: its
`data_source`, which `beyond_agent.data` writes as the env id. It is the same name verl's validation
already groups by (`val-core/<data_source>/reward/mean@N`, `val-aux/<data_source>/success/mean@N`), so every
per-task metric of a run lines up under one name. Three parts use it:

- `WeightedTaskSampler`, the train sampler when `task_weights` is set: rows are drawn so that tasks appear in
  proportion to their weights, whatever each task's number of rows;
- `task_rollout_metrics`: each task's episodes, success rate, mean reward, mean rounds and terminations of a
  rollout, logged as `beyond_agent/task/<name>/...` (validation: `val-aux/beyond_agent/task/<name>/...`);
- `normalize_task_advantages`, AgentRL's task advantage normalisation (`task_advantage_norm: true`).

    beyond_agent:
      multitask:
        task_weights: {frozenlake: 2, babyai: 1}   # null: verl's sampler (rows drawn uniformly)
        task_advantage_norm: true                  # normalise advantages within each task before the update
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from beyond_agent.rollout.episode_loop import EpisodeResult
from beyond_agent.rollout.env_manager import summarize

UNKNOWN_TASK = "unknown"
"""The task of a row without `data_source` (verl's validation uses the same name for such rows)."""
TASK_COLUMNS = ("data_source",)
"""The row fields `task_name` reads (the sampler reads only these columns of the dataset)."""
TASK_METRICS = ("episodes", "success_rate", "mean_reward", "mean_rounds", "infra_failures")
"""The `RolloutMetrics` fields reported per task (plus `termination/<kind>` counts)."""
TRAIN_PREFIX = "beyond_agent/task/"
VAL_PREFIX = "val-aux/beyond_agent/task/"
WEIGHTS_KEY = "beyond_agent.multitask.task_weights"


def task_name(row: Mapping[str, Any]) -> str:
    """The task of one dataset row: its `data_source` (the env id for rows written by beyond_agent.data).

    The one definition of a row's task: the sampler, the per-task metrics and the advantage normalisation all
    call it, so they can never disagree about which task a row belongs to.
    """
    source = row.get("data_source")
    return str(source) if source not in (None, "") else UNKNOWN_TASK


def task_names(non_tensor_batch: Mapping[str, Any], size: int) -> list[str]:
    """`task_name` of every row of a batch (verl's `non_tensor_batch`, `size` rows)."""
    columns = {key: non_tensor_batch[key] for key in TASK_COLUMNS if key in non_tensor_batch}
    return [task_name({key: values[row] for key, values in columns.items()}) for row in range(size)]


def rows_by_task(tasks: Sequence[str]) -> dict[str, list[int]]:
    """Row indices of each task, tasks in sorted order."""
    rows: dict[str, list[int]] = {}
    for index, task in enumerate(tasks):
        rows.setdefault(task, []).append(index)
    return dict(sorted(rows.items()))


# ---- configuration ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MultitaskConfig:
    """`beyond_agent.multitask`: how several tasks share one run (see the module docstring)."""

    task_weights: Mapping[str, float] | None = None
    """Task name -> sampling weight (>= 0, not all 0); every task of data.train_files needs one (0 leaves it
    out). None: verl's own sampler, rows drawn uniformly, so a task appears in proportion to its rows."""
    task_advantage_norm: bool = False
    """Normalise advantages within each task before the actor update (`normalize_task_advantages`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.task_advantage_norm, bool):
            raise ValueError(f"beyond_agent.multitask.task_advantage_norm must be true or false, "
                             f"got {self.task_advantage_norm!r}")
        object.__setattr__(self, "task_weights", _weights(self.task_weights))


def _weights(value: Any) -> dict[str, float] | None:
    """The weights as {task: float}, checked on their own (the task names are checked against the data)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{WEIGHTS_KEY} must map task names to weights, e.g. {{frozenlake: 2, babyai: 1}}, "
                         f"or be null; got {value!r}")
    weights = {}
    for task, weight in value.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{WEIGHTS_KEY}.{task} must be a number >= 0, got {weight!r}")
        weights[str(task)] = float(weight)
    if not any(weights.values()):
        raise ValueError(f"{WEIGHTS_KEY} are all 0: give at least one task a weight > 0 "
                         f"(tasks named: {', '.join(weights)})")
    return weights


def check_task_weights(weights: Mapping[str, float], tasks: Sequence[str], where: str = "data.train_files") -> None:
    """Every weighted name is a task of the data and every task of the data has a weight; else ValueError
    naming the key and the data's task names."""
    present = sorted(set(tasks))
    unknown = sorted(set(weights) - set(present))
    missing = [task for task in present if task not in weights]
    if unknown:
        raise ValueError(f"{WEIGHTS_KEY} names unknown task(s) {unknown}; the tasks (data_source) of {where} are: "
                         f"{', '.join(present)}")
    if missing:
        raise ValueError(f"{WEIGHTS_KEY} gives no weight to task(s) {missing} of {where} (give 0 to leave a task "
                         f"out); the tasks are: {', '.join(present)}")


def parquet_task_names(files: Sequence[str]) -> list[str]:
    """`task_name` of every row of these parquet files, reading only the columns it needs."""
    import pyarrow.parquet as pq

    names = []
    for path in files:
        table = pq.read_table(path, columns=[c for c in TASK_COLUMNS if c in pq.read_schema(path).names])
        columns = table.to_pydict()
        names += task_names(columns, table.num_rows)
    return names


# ---- weighted sampling --------------------------------------------------------------------------

class WeightedTaskSampler(Sampler[int]):
    """Draws dataset rows so that tasks appear in proportion to their weights (`task_weights`).

    Each draw picks a task with probability weight / sum(weights), then that task's next row in a fresh
    permutation of its rows (cycled when a task is drawn more often than it has rows), so a task's rows are
    used evenly. An epoch is `num_samples` draws (default: the dataset's size, so verl's epochs keep their
    length); epoch e's draws are a function of (seed, e) alone. The sampler is stateful (`state_dict` /
    `load_state_dict`, which torchdata's StatefulDataLoader saves in verl's checkpoints): a resumed run
    continues with the very draws the interrupted one would have made.
    """

    def __init__(self, row_tasks: Sequence[str], weights: Mapping[str, float], seed: int = 0,
                 num_samples: int | None = None):
        weights = _weights(weights)
        check_task_weights(weights, row_tasks)
        rows = rows_by_task(row_tasks)
        self.tasks = [task for task in rows if weights[task] > 0]
        """The tasks that are drawn (weight > 0), sorted."""
        self.rows = [np.asarray(rows[task]) for task in self.tasks]
        total = sum(weights[task] for task in self.tasks)
        self.probabilities = np.array([weights[task] / total for task in self.tasks])
        self.seed = int(seed)
        self.num_samples = len(row_tasks) if num_samples is None else int(num_samples)
        self.epoch = 0
        """Epochs completed (the next `__iter__` draws epoch `epoch`)."""
        self.yielded = 0
        """Draws of the current epoch already handed out."""

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line: each drawn task's share of the draws and its rows."""
        shares = ", ".join(f"{task} {share:.2f} ({len(rows)} rows)"
                           for task, share, rows in zip(self.tasks, self.probabilities, self.rows))
        return f"weighted task sampler (seed {self.seed}, {self.num_samples} draws per epoch): {shares}"

    def epoch_indices(self, epoch: int) -> list[int]:
        """The row indices of one epoch, in order."""
        rng = np.random.default_rng([self.seed, epoch])  # (seed, epoch) -> its own stream, no overlap
        choices = rng.choice(len(self.tasks), size=self.num_samples, p=self.probabilities)
        orders = [rng.permutation(rows) for rows in self.rows]
        used = [0] * len(self.tasks)
        indices = []
        for choice in choices:
            order = orders[choice]
            indices.append(int(order[used[choice] % len(order)]))
            used[choice] += 1
        return indices

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices(self.epoch)
        while self.yielded < self.num_samples:
            index = indices[self.yielded]
            self.yielded += 1
            yield index
        self.epoch, self.yielded = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Where the draws stand: (epoch, draws of it handed out)."""
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict`; the next `__iter__` resumes there."""
        self.epoch, self.yielded = int(state["epoch"]), int(state["yielded"])


def dataset_task_names(dataset: Any) -> list[str]:
    """`task_name` of every row of verl's RLHFDataset (its `dataframe`, after verl's own filtering)."""
    frame = dataset.dataframe
    columns = [c for c in TASK_COLUMNS if c in frame.column_names]
    return task_names({c: list(frame[c]) for c in columns}, len(frame))


def task_sampler(multitask: MultitaskConfig, dataset: Any, seed: int | None) -> WeightedTaskSampler | None:
    """The train sampler for `task_weights`, or None (verl's own) when none are set. `seed`: data.seed (0 when
    null, so that the task mix of a run is reproducible)."""
    if multitask.task_weights is None:
        return None
    return WeightedTaskSampler(dataset_task_names(dataset), multitask.task_weights, seed=seed or 0)


# ---- per-task rollout metrics -------------------------------------------------------------------

def task_rollout_metrics(tasks: Sequence[str], results: Sequence[EpisodeResult],
                         prefix: str = TRAIN_PREFIX) -> dict[str, float]:
    """Per task: episodes, success rate, mean reward, mean rounds, infrastructure failures and termination
    counts (`summarize` over that task's episodes), as `<prefix><task>/<metric>`."""
    if len(tasks) != len(results):
        raise ValueError(f"{len(tasks)} task names for {len(results)} episodes")
    metrics: dict[str, float] = {}
    for task, rows in rows_by_task(tasks).items():
        summary = summarize([results[row] for row in rows], wall_time_s=0.0)
        flat = summary.as_dict(prefix="")
        metrics.update({f"{prefix}{task}/{key}": value for key, value in flat.items()
                        if key in TASK_METRICS or key.startswith("termination/")})
    return metrics


# ---- per-task advantage normalisation -----------------------------------------------------------

def normalize_task_advantages(advantages: torch.Tensor, response_mask: torch.Tensor, tasks: Sequence[str],
                              eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, float]]:
    """AgentRL's task advantage normalisation: within each task, over its rows' response tokens,
    A <- (A - mean) / (std + eps); the normalised advantages and per-task metrics before and after.

    Why: tasks differ in reward scale and spread (a 0/1 success here, a score in the hundreds there), and
    estimators that do not divide by a per-prompt std (RLOO, REINFORCE++, GRPO with
    norm_adv_by_std_in_grpo=false) pass that scale on to the advantages; the policy gradient sums A * grad
    log p over tokens, so the large-scale task would dominate the update and the others would barely train.
    Normalising within each task before the tasks are mixed gives every task unit-scale advantages.

    `advantages`, `response_mask`: [batch, response]; `tasks`: one name per row. Tokens outside the mask are
    left as they are (0 from verl's estimators; the loss ignores them). Statistics are over the task's masked
    tokens (population std). A task whose std is at most `eps` (a single token, or all advantages equal) only
    has its mean subtracted: there is no spread to scale, and dividing the rounding residue of `A - mean` by
    `eps` would turn float noise into large advantages.
    """
    if advantages.shape != response_mask.shape or len(tasks) != advantages.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)}, response_mask {tuple(response_mask.shape)} and "
                         f"{len(tasks)} task names do not describe the same [batch, response] rows")
    normalized = advantages.clone()
    mask = response_mask.bool()
    metrics: dict[str, float] = {}
    for task, rows in rows_by_task(tasks).items():
        selected = torch.zeros_like(mask)
        selected[rows] = mask[rows]  # [batch, response]: this task's response tokens
        values = advantages[selected].double()
        if values.numel() == 0:
            continue
        mean, std = values.mean(), values.std(unbiased=False)
        scaled = values - mean if std <= eps else (values - mean) / (std + eps)
        normalized[selected] = scaled.to(advantages.dtype)
        metrics.update(_advantage_metrics(task, values, scaled))
    return normalized, metrics


def _advantage_metrics(task: str, before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    key = f"{TRAIN_PREFIX}{task}/advantage"
    return {f"{key}_tokens": float(before.numel()),
            f"{key}_mean_before": before.mean().item(), f"{key}_std_before": before.std(unbiased=False).item(),
            f"{key}_mean_after": after.mean().item(), f"{key}_std_after": after.std(unbiased=False).item()}


def apply_task_advantage_norm(batch: Any) -> dict[str, float]:
    """`normalize_task_advantages` on a verl DataProto in place (`advantages` over `response_mask`, tasks
    from `task_name`); the per-task metrics."""
    tasks = task_names(batch.non_tensor_batch, len(batch))
    normalized, metrics = normalize_task_advantages(batch.batch["advantages"], batch.batch["response_mask"], tasks)
    batch.batch["advantages"] = normalized
    return metrics
