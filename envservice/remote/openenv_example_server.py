"""A real OpenEnv server that plays our FrozenLake, to try the `openenv` env kind and to test it.

    python -m envservice.remote.openenv_example_server --port 0 [--host 127.0.0.1] [--max-sessions 64]

prints `openenv example server ready on http://HOST:PORT` once it serves. It is built the way any OpenEnv
environment is (needs `openenv-core`): an `Environment` subclass with its own `Action`/`Observation`
types, served by the SDK's app factory (`openenv.core.env_server.http_server.create_app`), which gives
the SDK's routes: the WebSocket `/ws` (one session per connection), the stateless `/reset` and `/step`,
`/schema`, `/health`. The game itself is `envservice.envs.frozenlake.FrozenLakeEnv`, reused as it is.

Serve it to envservice with an env-config entry (see `envservice.remote.openenv_env`):

    frozenlake-openenv:
      kind: openenv
      config:
        url: http://127.0.0.1:PORT
        splits: {train: 1000, test: 200}
        task_kwarg: task_index
        split_kwarg: split
        reset_params: {size: "Side of the square map, 3..12 (default 4)."}
        info_fields: [map]

One extra route, `GET /open_envs` -> `{"open_envs": N, "max_sessions": M}`, counts the environment
instances that are alive on the server (built and not yet closed): the tests read it to prove that every
session an envservice opened here was closed again.
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
import uuid
from typing import Any, Optional

import uvicorn
from pydantic import Field

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from envservice.envs.base import Task
from envservice.envs.frozenlake import ACTIONS, FrozenLakeEnv

READY_PREFIX = "openenv example server ready on "
"""Start of the line printed on stdout once the server accepts connections (the URL follows)."""


class FrozenLakeAction(Action):
    """One move of the agent, as text."""

    command: str = Field(description=f"The move: one of {', '.join(ACTIONS)} (anything else is answered as "
                                     "invalid, the agent stays put).")


class FrozenLakeObservation(Observation):
    """What the agent sees: the text of the env, and the map (for oracles and the viewer)."""

    text: str = Field(default="", description="The observation text: the map with the agent on it, or what "
                                              "happened.")
    map: list[str] = Field(default_factory=list, description="Rows of the map: S start, F frozen, H hole, G goal.")
    score: float = Field(default=0.0, description="1.0 once the goal was reached in this episode, else 0.0.")


class FrozenLakeOpenEnv(Environment[FrozenLakeAction, FrozenLakeObservation, State]):
    """FrozenLake (our offline `FrozenLakeEnv`) as an OpenEnv environment; one instance per session.

    `reset(seed, episode_id, split="train", task_index=0, size=4, slippery=False)` picks the map
    (`split` and `task_index` as in `FrozenLakeEnv`) and seeds the episode; `step` takes a
    `FrozenLakeAction`. Instances share nothing, so the server may run many sessions at once.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    _open = 0
    _open_lock = threading.Lock()

    def __init__(self) -> None:
        """Build an idle game (it is counted as open until `close`)."""
        super().__init__()
        self._game = FrozenLakeEnv()
        self._state = State(episode_id=None, step_count=0)
        self._map: list[str] = []
        self._closed = False
        with FrozenLakeOpenEnv._open_lock:
            FrozenLakeOpenEnv._open += 1

    @classmethod
    def open_count(cls) -> int:
        """Instances built and not yet closed, on this server."""
        with cls._open_lock:
            return cls._open

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, split: str = "train",
              task_index: int = 0, size: int = 4, slippery: bool = False, **kwargs: Any) -> FrozenLakeObservation:
        """Start an episode on map `task_index` of `split` (maps of `size` x `size`); unknown kwargs are refused."""
        if kwargs:
            raise ValueError(f"reset got unknown argument(s) {sorted(kwargs)}; valid: seed, episode_id, split, "
                             "task_index, size, slippery")
        if split not in FrozenLakeEnv.splits:
            raise ValueError(f"split={split!r} is unknown; valid splits: {sorted(FrozenLakeEnv.splits)}")
        names = FrozenLakeEnv.splits[split]
        if not isinstance(task_index, int) or not 0 <= task_index < len(names):
            raise ValueError(f"task_index={task_index!r} is out of range 0..{len(names) - 1} for split {split!r}")
        task = Task(split=split, index=task_index, name=names[task_index],
                    seed=random.randrange(2**31) if seed is None else seed,
                    params={"size": size, "slippery": slippery})
        text, info = self._game.reset(task)
        self._map = list(info["map"])
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return FrozenLakeObservation(text=text, map=self._map, score=0.0, done=False, reward=0.0)

    def step(self, action: FrozenLakeAction, timeout_s: Optional[float] = None, **kwargs: Any) -> FrozenLakeObservation:
        """Apply one move; the episode ends in the goal (reward 1) or in a hole (reward 0)."""
        if not self._map:
            raise RuntimeError("step before reset: send a reset message first")
        text, reward, terminated, truncated, _ = self._game.step(action.command)
        self._state.step_count += 1
        score, _ = self._game.evaluate()
        return FrozenLakeObservation(text=text, map=self._map, score=score, done=terminated or truncated,
                                     reward=reward)

    @property
    def state(self) -> State:
        """The episode id and the steps taken in it."""
        return self._state

    def close(self) -> None:
        """Close the game; counted once, however often it is called."""
        if self._closed:
            return
        self._closed = True
        self._game.close()
        with FrozenLakeOpenEnv._open_lock:
            FrozenLakeOpenEnv._open -= 1


def build_app(max_sessions: int = 64, session_timeout_s: float | None = None) -> Any:
    """The SDK's app for `FrozenLakeOpenEnv` plus `GET /open_envs` (live instances and the session limit)."""
    from openenv.core.env_server.types import ConcurrencyConfig

    app = create_app(FrozenLakeOpenEnv, FrozenLakeAction, FrozenLakeObservation, env_name="frozenlake",
                     concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions,
                                                          session_timeout=session_timeout_s))

    @app.get("/open_envs")
    def open_envs() -> dict[str, int]:
        """Environment instances alive on this server (sessions open, plus any stateless call in flight)."""
        return {"open_envs": FrozenLakeOpenEnv.open_count(), "max_sessions": max_sessions}

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C; print the ready line (with the real port) once serving."""
    parser = argparse.ArgumentParser(prog="python -m envservice.remote.openenv_example_server",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--max-sessions", type=int, default=64,
                        help="WebSocket sessions open at once at most (the SDK's max_concurrent_envs; default 64)")
    parser.add_argument("--session-timeout", type=float, default=None,
                        help="seconds after which the SDK closes an idle session itself (default: never)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    args = parser.parse_args(argv)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(args.max_sessions, args.session_timeout),
                                           log_level=args.log_level))

    def announce() -> None:
        """Print the ready line once uvicorn serves (nothing if it stops first)."""
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.02)
        print(f"{READY_PREFIX}{url}", flush=True)

    threading.Thread(target=announce, name="announce-ready", daemon=True).start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
