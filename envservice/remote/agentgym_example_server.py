"""A small server that speaks an AgentGym env server's protocol over one of our offline envs.

    python -m envservice.remote.agentgym_example_server --env-type webshop --port 36001 [--env frozenlake]

AgentGym's own servers (WebShop, WebArena, SciWorld, ...) need their data, Java, browsers or a web stack
and cannot be installed here, so the tests of `envservice.remote.agentgym` play against this server, and
a user can try `kind: agentgym` with it before pointing the config at a real one. For each `--env-type`
it serves the routes and payloads of that AgentGym server (read from their code): the id field
(`env_idx` or `id`), `/create`'s answer (a bare id, `{"id"}` or `{"env_idx"}`), `/reset`'s fields
(`session_id`, `data_idx`, `game`, `seed`+`idx`) and answer, `/step`'s keys (`state`/`observation`,
`done`/`terminated`, `score`), `/observation`, and `/close` only where AgentGym's server has one (not
BabyAI's or SciWorld's); failures are `{"error": ...}` with HTTP 200 where theirs do that (BabyAI,
SciWorld), else HTTP 500. The game behind it is an envservice env (`--env`, default `frozenlake`): data
index i is task i % N of its first split; SciWorld's scores are reported out of 100 as theirs are.

One addition of ours on every env type: `GET /list_envs` (WebShop's and WebArena's servers have it)
lists the envs the server holds, so tests can count what a client left open.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request

from envservice import registry
from envservice.envs.base import TextEnv
from envservice.remote.agentgym import DIALECTS, Dialect

ERROR_AS_200 = {"sciworld", "babyai"}
"""Env types whose AgentGym servers answer failures with HTTP 200 and `{"error": ...}`."""


class EnvTable:
    """The server's envs by id, each an envservice env instance, with AgentGym's id numbering."""

    def __init__(self, env_id: str) -> None:
        self.registration = registry.get(env_id)
        self.cls = self.registration.env_class()
        self.split = next(iter(self.cls.splits))
        self.envs: dict[int, TextEnv] = {}
        self.last: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def create(self) -> int:
        """A new env; its id."""
        with self._lock:
            env_id = next(self._ids)
            self.envs[env_id] = self.cls()
        return env_id

    def env(self, env_id: Any) -> TextEnv:
        """The env of `env_id`; an unknown id is a `KeyError` naming it."""
        with self._lock:
            if env_id not in self.envs:
                raise KeyError(f"The id {env_id} is not valid.")
            return self.envs[env_id]

    def reset(self, env_id: Any, data_idx: int) -> tuple[str, float, bool]:
        """Load data index `data_idx` on env `env_id`; (observation, score, done)."""
        names = self.cls.splits[self.split]
        task = self.cls.resolve_task(int(data_idx) % len(names), self.split, 0, {})
        observation, _ = self.env(env_id).reset(task)
        self.last[env_id] = {"observation": observation, "score": 0.0, "done": False}
        return observation, 0.0, False

    def step(self, env_id: Any, action: str) -> tuple[str, float, float, bool, bool]:
        """(observation, reward, score in [0, 1], terminated, truncated) of one action."""
        env = self.env(env_id)
        observation, reward, terminated, truncated, _ = env.step(action)
        score, _ = env.evaluate()
        self.last[env_id] = {"observation": observation, "score": score, "done": terminated or truncated}
        return observation, reward, score, terminated, truncated

    def close(self, env_id: Any) -> bool:
        """Drop env `env_id`; False when there was none."""
        with self._lock:
            env = self.envs.pop(env_id, None)
        self.last.pop(env_id, None)
        if env is None:
            return False
        env.close()
        return True


def create_app(env_type: str, env_id: str = "frozenlake") -> FastAPI:
    """The FastAPI app of one AgentGym env type (`DIALECTS` key) over the envservice env `env_id`."""
    dialect = DIALECTS[env_type]
    table = EnvTable(env_id)
    app = FastAPI(title=f"AgentGym-protocol {env_type} server over {env_id}")
    app.state.table = table

    @app.get("/")
    def hello() -> str:
        return "ok" if dialect.id_field == "env_idx" else f"This is environment {env_type}."

    @app.get("/list_envs")
    def list_envs() -> list[int]:
        return sorted(table.envs)

    @app.post("/create")
    def create() -> Any:
        new_id = table.create()
        if dialect.create_id_key is None:
            return new_id
        answer = {dialect.create_id_key: new_id}
        if env_type == "textcraft":  # TextCraft's /create also answers the (empty) first observation
            answer["observation"] = ""
        return answer

    @app.post("/reset")
    async def reset(request: Request) -> Any:
        body = await _body(request, dialect.id_field, dialect.index_field)
        return _guarded(env_type, lambda: _reset_answer(env_type, dialect, table, body))

    @app.post("/step")
    async def step(request: Request) -> Any:
        body = await _body(request, dialect.id_field, "action")
        return _guarded(env_type, lambda: _step_answer(env_type, dialect, table, body))

    @app.get("/observation")
    def observation(request: Request) -> Any:
        raw_id = request.query_params.get(dialect.id_field)
        if raw_id is None or not raw_id.lstrip("-").isdigit():
            raise HTTPException(422, f"query parameter {dialect.id_field} (an integer) is required")
        return _guarded(env_type, lambda: _observation_of(table, int(raw_id)))

    if dialect.has_close:
        @app.post("/close")
        async def close(request: Request) -> Any:
            body = await _body(request, dialect.id_field)
            closed = table.close(body[dialect.id_field])
            if env_type == "webarena":
                return "closed"
            return {"closed": closed}

    return app


async def _body(request: Request, *required: str) -> dict[str, Any]:
    """The JSON body, with FastAPI's 422 when a required field is missing or not an int where one is due."""
    try:
        body = await request.json()
    except ValueError:
        raise HTTPException(422, "the body must be JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(422, "the body must be a JSON object")
    for name in required:
        value = body.get(name)
        wants_str = name == "action"
        if value is None or (wants_str and not isinstance(value, str)) or (not wants_str and not isinstance(value, int)):
            raise HTTPException(422, f"field {name!r} is required ({'a string' if wants_str else 'an integer'})")
    return body


def _guarded(env_type: str, call) -> Any:
    """Run `call`; a failure is `{"error"}` with 200 on the env types whose servers do that, else a 500."""
    try:
        return call()
    except Exception as exc:
        if env_type in ERROR_AS_200:
            return {"error": str(exc)}
        raise HTTPException(500, f"{type(exc).__name__}: {exc}") from None


def _score(env_type: str, score: float) -> float:
    return score * 100.0 if env_type == "sciworld" else score


def _observation_of(table: EnvTable, env_id: int) -> str:
    table.env(env_id)
    return table.last.get(env_id, {}).get("observation", "")


def _reset_answer(env_type: str, dialect: Dialect, table: EnvTable, body: dict[str, Any]) -> Any:
    env_id = body[dialect.id_field]
    observation, score, done = table.reset(env_id, body[dialect.index_field])
    if env_type == "webshop":
        return [observation, None]
    if env_type == "webarena":
        return {"observation": observation}
    answer: dict[str, Any] = {"observation": observation, "reward": 0.0, "score": _score(env_type, score), "done": done}
    if env_type == "sciworld":
        answer["observation"] = "You are in the lake."
        answer["task_description"] = observation
    if env_type == "alfworld":
        answer["available_actions"] = ["left", "down", "right", "up"]
    return answer


def _step_answer(env_type: str, dialect: Dialect, table: EnvTable, body: dict[str, Any]) -> Any:
    env_id = body[dialect.id_field]
    if table.last.get(env_id, {}).get("done") and env_type in ERROR_AS_200:
        raise ValueError(f"The task with environment {env_id} has finished.")
    observation, reward, score, terminated, truncated = table.step(env_id, body["action"])
    if env_type == "webshop":  # WebShop's reward is the purchase's score, given when the episode ends
        return {"state": observation, "reward": score if terminated else 0.0, "done": terminated, "info": None}
    if env_type == "webarena":
        return {"observation": observation, "reward": score if terminated else 0.0, "terminated": terminated,
                "truncated": truncated, "info": {}}
    answer = {"observation": observation, "reward": reward, "score": _score(env_type, score), "done": terminated}
    if env_type == "alfworld":
        answer["available_actions"] = ["left", "down", "right", "up"]
    return answer


def main(argv: list[str] | None = None) -> int:
    """Serve one env type on --host/--port; prints `agentgym server ready on URL` once it accepts requests."""
    parser = argparse.ArgumentParser(prog="python -m envservice.remote.agentgym_example_server",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--env-type", required=True, choices=sorted(DIALECTS))
    parser.add_argument("--env", default="frozenlake", help="the envservice env played behind it (default frozenlake)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (the ready line shows it)")
    args = parser.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(create_app(args.env_type, args.env), log_level="warning"))
    url = f"http://{args.host}:{sock.getsockname()[1]}"

    def announce() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.02)
        if server.started:
            print(f"agentgym server ready on {url} (env_type {args.env_type}, playing {args.env})", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
