"""Fixtures of the envservice tests: in-process apps, throw-away test environments and a live service.

Helpers are fixtures (not an importable package): verl's wheel installs a top-level `tests` package.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from envservice import registry
from envservice.process import EnvServiceProcess
from envservice.envs.base import StepResult, Task, TextEnv, clip_text
from envservice.server import EnvServiceConfig, create_app



class CountingEnv(TextEnv):
    """A tiny deterministic env: 'inc' adds one; reaching 3 ends the task; 'boom' raises (an env bug)."""

    description = "test env: count to three"
    splits = {"train": ["count"]}
    params = {}
    closes = 0

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.value = 0
        return "value 0", {}

    def close(self) -> None:
        type(self).closes += 1

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("simulated crash inside the env")
        if action != "inc":
            return f"Invalid action {clip_text(action)!r}. Valid actions: inc.", 0.0, False, False, {}
        self.value += 1
        done = self.value >= 3
        return f"value {self.value}", float(done), done, False, {}

    def evaluate(self) -> tuple[float, bool]:
        return (1.0 if self.value >= 3 else 0.0), self.value >= 3


class NondeterministicEnv(CountingEnv):
    """Breaks the contract: every reset shows a different observation."""

    description = "test env: broken determinism"
    _resets = 0

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        NondeterministicEnv._resets += 1
        self.value = 0
        return f"reset number {NondeterministicEnv._resets}", {}


class NumpyRewardEnv(CountingEnv):
    """Breaks the contract: returns an int flag instead of bool."""

    description = "test env: wrong step types"

    def step(self, action: str) -> StepResult:
        return "x", 0.0, 0, False, {}  # type: ignore[return-value]


class GatedEnv(CountingEnv):
    """A slow env: 'wait' blocks until the test opens `gate` (or 10 s pass)."""

    description = "test env: blocks on a gate"
    gate = threading.Event()
    entered = threading.Event()

    def step(self, action: str) -> StepResult:
        if action == "wait":
            GatedEnv.entered.set()
            GatedEnv.gate.wait(10)
        return super().step(action)


class CrashOnResetEnv(CountingEnv):
    """Breaks in reset (an env bug at create time)."""

    description = "test env: reset raises"

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        raise ValueError("simulated crash in reset")


TEST_ENVS = {
    "counting": CountingEnv,
    "nondeterministic": NondeterministicEnv,
    "wrongtypes": NumpyRewardEnv,
    "gated": GatedEnv,
    "crashonreset": CrashOnResetEnv,
}


@pytest.fixture
def test_envs() -> Iterator[dict[str, type[TextEnv]]]:
    """Register the throw-away test envs (max_steps 5, 3 sessions each) for one test, then remove them."""
    for env_id, cls in TEST_ENVS.items():
        registry.register(env_id, cls, max_steps=5, max_sessions=3)
    yield TEST_ENVS
    for env_id in TEST_ENVS:
        registry.unregister(env_id)


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    """Build an in-process service (`make_client(**EnvServiceConfig fields)`); its lifespan ends with the test."""
    opened: list[TestClient] = []

    def factory(**settings: Any) -> TestClient:
        client = TestClient(create_app(EnvServiceConfig(**settings)), raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        return client

    yield factory
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def live_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real `python -m envservice --port 0` subprocess on loopback; yields its url, port, envs and process."""
    log = tmp_path_factory.mktemp("envservice") / "service.log"
    with EnvServiceProcess(["babyai", "frozenlake"], extra_args=["--max-sessions", "4"], log_path=log,
                           startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""}) as service:
        port = int(service.url.rsplit(":", 1)[1])
        yield {"url": service.url, "port": port, "envs": service.envs, "proc": service.process}


@pytest.fixture
def wait_for() -> Callable[[Callable[[], bool], float], bool]:
    """Poll a condition until it holds or a deadline passes; returns whether it held."""

    def poll(condition: Callable[[], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if condition():
                return True
            time.sleep(0.02)
        return condition()

    return poll


@pytest.fixture
def play_frozenlake_oracle() -> Callable[[Any], tuple[Any, Any]]:
    """Plays FrozenLake map 9 (6x6) with the BFS oracle through an EnvClient; returns (last step, evaluation)."""
    from envservice.envs.frozenlake import shortest_path_actions

    def play(client: Any) -> tuple[Any, Any]:
        created = client.create("frozenlake", task_id=9, seed=0, params={"size": 6})
        for action in shortest_path_actions(created.info["map"]):
            step = client.step(created.session_id, action)
        evaluation = client.evaluate(created.session_id)
        client.release(created.session_id)
        return step, evaluation

    return play


@pytest.fixture
def step_all_at_once() -> Callable[..., tuple[list, list[str]]]:
    """step_all_at_once(backend, env_id, sessions=4): build that many envs on `backend`, reset them, then step
    each with "inc" at the same time; the envs and their observations (the step-limit tests of #33 finding 4)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(backend, env_id: str, sessions: int = 4) -> tuple[list, list[str]]:
        envs = [backend.build(registry.get(env_id)) for _ in range(sessions)]
        for env in envs:
            env.reset(Task(split="train", index=0, name="count", seed=0))
        with ThreadPoolExecutor(sessions) as pool:
            return envs, list(pool.map(lambda env: env.step("inc")[0], envs))

    return run


@pytest.fixture
def play_in_threads():
    """`play_in_threads(env_class, tasks, actions)`: one session per task (each reset, then the actions), four at
    once in threads as the service runs them; each session's outcome, "ok" or its traceback."""
    import traceback
    from concurrent.futures import ThreadPoolExecutor

    def play_all(env_class: type[TextEnv], tasks: list[Task], actions: tuple[str, ...]) -> list[str]:
        def play(task: Task) -> str:
            env = env_class()
            try:
                env.reset(task)
                for action in actions:
                    env.step(action)
                return "ok"
            except Exception:
                return traceback.format_exc()
            finally:
                env.close()

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(play, tasks))

    return play_all
