"""AppWorld (appworld 0.1.3.post1): day-to-day tasks over nine simulated apps, solved by writing Python code.

AppWorld needs data that users download themselves (`appworld install && appworld download data`) into its
root folder (`$APPWORLD_ROOT`, else `$APPWORLD_PATH`, else the working directory, as AppWorld itself does).
Without the data (or without the package) the env id stays registered, so a launcher can start the service,
and `reset` fails with an `env_error` that says what to run. Task names are AppWorld's task ids when the data
is present when this module is imported; otherwise placeholders `<split>-<i>` with the datasets' sizes.

Actions are Python code run in AppWorld's shell (`apis.spotify.login(...)`, `print(...)`); the observation is
its output. The episode ends when the code calls `apis.supervisor.complete_task(...)`. Score: the fraction of
AppWorld's tests that pass; success when all pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from envservice.envs.base import Param, StepResult, Task, TextEnv, content_digest
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

DATASET_SIZES = {"train": 90, "dev": 57, "test_normal": 168, "test_challenge": 417}
"""AppWorld's datasets and their number of tasks."""

APPWORLD_REQUIREMENT = "appworld==0.1.3.post1"
DEFAULT_EXPERIMENT = "beyond_agent"


def appworld_root() -> Path:
    """AppWorld's root folder (the one holding `data/`)."""
    return Path(os.environ.get("APPWORLD_ROOT") or os.environ.get("APPWORLD_PATH") or os.getcwd())


def data_dir() -> Path:
    """Where AppWorld's data is expected."""
    return appworld_root() / "data"


def _dataset_ids(name: str) -> list[str] | None:
    """Task ids of a dataset from the data folder, or None without data."""
    path = data_dir() / "datasets" / f"{name}.txt"
    if not path.is_file():
        return None
    return [line.strip().split(":")[0] for line in path.read_text().splitlines() if line.strip()]


def _splits() -> dict[str, list[str]]:
    splits = {}
    for name, size in DATASET_SIZES.items():
        ids = _dataset_ids(name)
        splits[name] = ids if ids else [f"{name}-{i}" for i in range(size)]
    return splits


def require_data() -> None:
    """Raise an `env_error` naming the path and the commands to run when AppWorld's data is missing."""
    tasks = data_dir() / "tasks"
    if not tasks.is_dir():
        raise EnvServiceError(
            ErrorCode.env_error,
            f"AppWorld data not found at {data_dir()}; run `appworld install && appworld download data` "
            f"in {appworld_root()} (or set APPWORLD_ROOT to the folder that holds data/), then restart the service",
        )


def _appworld_class():
    """AppWorld's `AppWorld` class, or an `env_error` saying how to install it."""
    try:
        from appworld import AppWorld
    except ImportError as exc:
        raise EnvServiceError(
            ErrorCode.env_error,
            f"AppWorld is not installed ({exc}); install `{APPWORLD_REQUIREMENT}` in the service's Python "
            "environment (it pins pydantic 1.x and older fastapi/starlette, so give it its own venv)",
        ) from exc
    return AppWorld


def _is_placeholder(task: Task) -> bool:
    """Whether the task name is a `<split>-<i>` placeholder rather than an AppWorld task id."""
    return task.name.startswith(f"{task.split}-")


class AppWorldEnv(TextEnv):
    """An AppWorld task: write Python against the apps' APIs until `apis.supervisor.complete_task()`."""

    description = ("AppWorld (appworld 0.1.3.post1, user-downloaded data): tasks over simulated apps solved by "
                   "Python code actions run in AppWorld's shell; ends with apis.supervisor.complete_task().")
    splits = _splits()
    params = {"experiment_name": Param(f"AppWorld experiment folder for outputs (default {DEFAULT_EXPERIMENT!r}).", str)}

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """AppWorld's task id (the dataset's own content id); None for a placeholder name (no data when the
        module was imported: which task it stands for is unknown)."""
        if _is_placeholder(task):
            return None
        return content_digest("appworld", task.name)

    def __init__(self) -> None:
        self._world: Any = None
        self._result: tuple[float, bool] | None = None

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Open the task's world; the observation is the supervisor and the instruction."""
        require_data()
        app_world = _appworld_class()
        if _is_placeholder(task):
            raise EnvServiceError(ErrorCode.env_error, f"AppWorld's data appeared after the service started "
                                  f"(task {task.name!r} is a placeholder); restart the service")
        self.close()
        experiment = str(task.params.get("experiment_name", DEFAULT_EXPERIMENT))
        self._world = app_world(task_id=task.name, experiment_name=experiment)
        self._result = None
        supervisor = self._world.task.supervisor
        who = f"{supervisor['first_name']} {supervisor['last_name']} ({supervisor['email']})"
        observation = f"Supervisor: {who}\nTask: {self._world.task.instruction}"
        return observation, {"task_id": task.name, "instruction": self._world.task.instruction}

    def step(self, action: str) -> StepResult:
        """Run one code cell; the episode ends when the task was marked complete."""
        output = str(self._world.execute(action))
        done = bool(self._world.task_completed())
        reward = self.evaluate()[0] if done else 0.0
        return output, reward, done, False, {}

    def evaluate(self) -> tuple[float, bool]:
        """Fraction of AppWorld's tests that pass (computed once the task is complete); success when all pass."""
        if self._result is None and self._world is not None and self._world.task_completed():
            tracker = self._world.evaluate()
            self._result = (tracker.pass_count / max(1, tracker.num_tests), bool(tracker.success))
        return self._result or (0.0, False)

    def close(self) -> None:
        """Close the world (AppWorld's in-memory databases and time freeze)."""
        if self._world is not None:
            world, self._world = self._world, None
            world.close()
