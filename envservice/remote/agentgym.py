"""AgentGym env servers as envservice envs: `kind: agentgym` in an env-config file.

AgentGym (and AgentGym-RL, Agent-R) run one HTTP server per env type: WebShop, WebArena, SciWorld,
TextCraft, BabyAI, ALFWorld. They share the route names (`/create`, `/reset`, `/step`, `/close`,
`/observation`) but not the payloads: WebShop and WebArena name a server-side env `env_idx`, the others
`id`; WebShop's `/create` answers a bare id and its `/reset` takes `session_id`, the others answer an
object and take `data_idx` (ALFWorld: `game`, WebArena: `idx` and `seed`); WebShop's step observation is
`state`, WebArena's end flag is `terminated`; SciWorld's score runs to 100. `DIALECTS` holds one row per
env type with exactly those differences, read from AgentGym's server and client code.

    webshop:
      kind: agentgym
      config: {url: "http://127.0.0.1:36001", env_type: webshop, splits: {train: "500:6500", test: "0:500"}}
      max_steps: 10

Our sessions, limits, time limits, error codes and `check_env` stand in front of the server. Every
remote env is closed when its session ends (release, idle reaping, an env error, service shutdown):
AgentGym issue #62 is a WebShop server that ran out of memory after 2.5 h because clients never closed
theirs. Servers with no `/close` route (BabyAI, SciWorld) get their envs back through a pool instead: an
ended session's remote env is reset for the next session, so the server never holds more envs than the
most sessions we had open at once.

Failures of the server (unreachable, a time-out, an HTTP error, AgentGym's `{"error": ...}` answers) raise
`AgentGymServerError`, which the service reports as `env_error`: never a reward.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import requests

from envservice.client import IdleExpiringAdapter
from envservice.envs.base import Param, StepResult, Task, TextEnv

logger = logging.getLogger("envservice")


class AgentGymServerError(RuntimeError):
    """The AgentGym server failed or answered out of protocol; the message names the URL and the route."""


def _text(value: Any) -> str:
    """An observation as text (WebArena sends `{"text": ...}` objects; lists are joined)."""
    if isinstance(value, dict) and "text" in value:
        return str(value["text"])
    if isinstance(value, list):
        return "\n".join(map(str, value))
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Dialect:
    """How one AgentGym env type speaks: its id field, reset payload and response keys."""

    id_field: str
    """The request key that names the server-side env: `env_idx` or `id`."""
    create_id_key: str | None
    """The key of the new env's id in `/create`'s answer; None: the answer is the bare id."""
    index_field: str
    """The `/reset` field that carries the data index (`session_id`, `data_idx`, `game`, `idx`)."""
    observation_key: str
    """The key of the observation in `/step`'s answer (and `/reset`'s unless `observe_after_reset`)."""
    done_key: str = "done"
    """The key of the episode-ended flag in `/step`'s answer."""
    score_key: str = "reward"
    """The key whose last value is the episode's score."""
    score_scale: float = 1.0
    """What a perfect score is on this server (SciWorld: 100)."""
    has_close: bool = True
    """Whether the server has a `/close` route (without one, ended envs are pooled for reuse)."""
    observe_after_reset: bool = False
    """Read the first observation from `GET /observation` (WebShop's `/reset` answers `[text, null]`)."""
    reset_prefix_key: str | None = None
    """A `/reset` answer key shown before the observation (SciWorld's `task_description`)."""
    actions_key: str | None = None
    """A key listing the valid actions, appended to observations (ALFWorld's `available_actions`)."""
    reset_extra: Mapping[str, Any] = field(default_factory=dict)
    """Fixed `/reset` fields besides the id and the index (WebArena's `seed`, ALFWorld's `world_type`)."""

    def reset_payload(self, data_idx: int) -> dict[str, Any]:
        """The `/reset` payload (besides the id) that loads data index `data_idx`."""
        return {self.index_field: data_idx, **self.reset_extra}


DIALECTS: Mapping[str, Dialect] = {
    "webshop": Dialect("env_idx", None, "session_id", "state", observe_after_reset=True),
    "webarena": Dialect("env_idx", "env_idx", "idx", "observation", done_key="terminated", reset_extra={"seed": 0}),
    "sciworld": Dialect("id", "id", "data_idx", "observation", score_key="score", score_scale=100.0,
                        has_close=False, reset_prefix_key="task_description"),
    "babyai": Dialect("id", "id", "data_idx", "observation", score_key="score", has_close=False),
    "textcraft": Dialect("id", "id", "data_idx", "observation"),
    "alfworld": Dialect("id", "id", "game", "observation", actions_key="available_actions",
                        reset_extra={"world_type": "Text"}),
}
"""The AgentGym env types we speak, by the `env_type` a config names."""


@dataclass
class _Pool:
    """Idle remote env ids of one server without `/close`, handed to the next session (see module docstring)."""

    idle: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_POOLS: dict[str, _Pool] = {}
_POOLS_LOCK = threading.Lock()
_HTTP = requests.Session()
# AgentGym's servers are uvicorn's with its 5 s keep-alive: a connection is replaced before that (envservice.client).
_HTTP.mount("http://", IdleExpiringAdapter(pool_connections=16, pool_maxsize=256))
_HTTP.mount("https://", IdleExpiringAdapter(pool_connections=16, pool_maxsize=256))
_WARNED_NO_CLOSE: set[str] = set()


def _pool(url: str) -> _Pool:
    with _POOLS_LOCK:
        return _POOLS.setdefault(url, _Pool())


def task_indices(splits: Mapping[str, Any]) -> dict[str, list[int]]:
    """The server's data indices per split: `"first:end"` (a half-open range, as the data CLI's
    `--train-tasks 0:10`) or an explicit list of indices."""
    result = {}
    for split, spec in splits.items():
        indices = _range(spec) if isinstance(spec, str) else spec
        if not (isinstance(indices, list) and indices
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in indices)):
            raise ValueError(f"AgentGymEnv: config.splits.{split}={spec!r} must be 'first:end' (0 <= first < end) "
                             "or a non-empty list of the server's data indices (ints >= 0)")
        result[str(split)] = indices
    if not result:
        raise ValueError("AgentGymEnv: config.splits is empty; give e.g. {train: '0:1000', test: '1000:1200'}")
    return result


def _range(spec: str) -> list[int] | None:
    first, sep, end = spec.partition(":")
    if not sep or not first.strip().isdigit() or not end.strip().isdigit() or int(first) >= int(end):
        return None
    return list(range(int(first), int(end)))


class AgentGymEnv(TextEnv):
    """One session on an AgentGym env server; configure it with `url`, `env_type` and `splits`.

    A task name is the server's data index (WebShop's session id, SciWorld's variation index, ...), so
    task `"17"` of any split is data index 17 on the server. It gives no `task_fingerprint`: only the server
    knows what an index holds (two indices may be one task), so its splits are not known to be held out.
    """

    description = "an AgentGym env server (configure url, env_type and splits)"
    config_fields = {
        "url": Param("the server's base URL, e.g. http://127.0.0.1:36001"),
        "env_type": Param(f"which AgentGym server it is: {', '.join(DIALECTS)}"),
        "splits": Param("the server's data indices per split: {train: 'first:end', test: [3, 7, 9]}", dict),
        "timeout_s": Param("seconds one request may take (default 60)", float),
        "success_threshold": Param("score (0-1) at or above which an ended episode is a success (default 1.0)",
                                   float),
        "description": Param("one line for GET /envs"),
    }
    required_config = ("url", "env_type", "splits")

    @classmethod
    def configured_attributes(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """Splits from `splits`, a description naming the server, after checking `env_type` and `url`."""
        env_type = config["env_type"]
        if env_type not in DIALECTS:
            raise ValueError(f"AgentGymEnv: config.env_type={env_type!r} is unknown; valid env types: "
                             f"{', '.join(DIALECTS)}")
        if not str(config["url"]).startswith(("http://", "https://")):
            raise ValueError(f"AgentGymEnv: config.url={config['url']!r} must start with http:// or https://")
        splits = {split: [str(i) for i in indices] for split, indices in task_indices(config["splits"]).items()}
        description = config.get("description") or f"AgentGym {env_type} server at {config['url']}"
        return {"splits": splits, "description": description}

    def __init__(self) -> None:
        self.url = str(self.config.get("url", "")).rstrip("/")
        self.dialect = DIALECTS.get(self.config.get("env_type", ""))
        self.timeout_s = float(self.config.get("timeout_s", 60.0))
        self.remote_id: Any = None
        self.score, self.done, self._usable = 0.0, False, True

    # ---- the TextEnv contract ------------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Create (or reuse) a remote env, load the task's data index on it, return its first observation."""
        if self.dialect is None:
            raise AgentGymServerError("AgentGymEnv is not configured: register it with kind: agentgym and a config")
        if self.remote_id is None:
            self.remote_id = self._acquire()
        answer = self._post("reset", self.dialect.reset_payload(int(task.name)))
        self.score, self.done = 0.0, False
        if self.dialect.observe_after_reset:
            observation = _text(self._get("observation"))
        else:
            observation = _text(self._field(answer, self.dialect.observation_key, "reset"))
            if self.dialect.reset_prefix_key:
                observation = f"{_text(answer.get(self.dialect.reset_prefix_key))}\n{observation}"
        return self._with_actions(observation, answer), {"remote_id": self.remote_id, "data_idx": int(task.name)}

    def step(self, action: str) -> StepResult:
        """Send the action as it is (the server parses it), and map the answer onto (obs, reward, ...)."""
        # Lone surrogates cannot be encoded as UTF-8 by most servers' JSON encoders: send U+FFFD instead.
        action = action.encode("utf-8", "replace").decode("utf-8")
        answer = self._post("step", {"action": action})
        observation = _text(self._field(answer, self.dialect.observation_key, "step"))
        reward = float(answer.get("reward") or 0.0)
        score = answer.get(self.dialect.score_key)
        if isinstance(score, (int, float)) and not isinstance(score, bool):
            self.score = float(score)
        terminated = bool(self._field(answer, self.dialect.done_key, "step"))
        truncated = bool(answer.get("truncated", False)) and not terminated
        self.done = terminated or truncated
        return self._with_actions(observation, answer), reward, terminated, truncated, {"remote_id": self.remote_id}

    def evaluate(self) -> tuple[float, bool]:
        """The last score the server reported, scaled to [0, 1]; a success once it reaches the threshold."""
        score = min(1.0, max(0.0, self.score / self.dialect.score_scale)) if self.dialect else 0.0
        return score, self.done and score >= float(self.config.get("success_threshold", 1.0))

    def close(self) -> None:
        """End the remote env: `/close` it, or pool it for reuse on a server that has no `/close`."""
        remote_id, self.remote_id = self.remote_id, None
        if remote_id is None:
            return
        if not self.dialect.has_close:
            if self._usable:  # an env that failed mid-call is in an unknown state: never hand it on
                pool = _pool(self.url)
                with pool.lock:
                    pool.idle.append(remote_id)
            return
        try:
            self._request("post", "close", {self.dialect.id_field: remote_id}, remote_id)
        except AgentGymServerError as exc:  # the session ends anyway; say the remote env may be left open
            logger.warning("AgentGym env %s at %s could not be closed: %s", remote_id, self.url, exc)

    # ---- HTTP ----------------------------------------------------------------------------------------

    def _acquire(self) -> Any:
        """A remote env id: an idle pooled one (servers without `/close`), else a new one from `/create`."""
        if not self.dialect.has_close:
            pool = _pool(self.url)
            with pool.lock:
                if pool.idle:
                    return pool.idle.pop()
            self._warn_no_close()
        answer = self._request("post", "create", None, None)
        if self.dialect.create_id_key is None:
            return answer
        return self._field(answer, self.dialect.create_id_key, "create")

    def _warn_no_close(self) -> None:
        if self.url not in _WARNED_NO_CLOSE:
            _WARNED_NO_CLOSE.add(self.url)
            logger.info("AgentGym %s server at %s has no /close route: ended envs are pooled and reset for the "
                        "next session", self.config["env_type"], self.url)

    def _post(self, route: str, payload: dict[str, Any]) -> Any:
        return self._request("post", route, {**payload, self.dialect.id_field: self.remote_id}, self.remote_id)

    def _get(self, route: str) -> Any:
        return self._request("get", route, None, self.remote_id)

    def _request(self, method: str, route: str, payload: dict | None, remote_id: Any) -> Any:
        """One request; any failure raises `AgentGymServerError` naming the URL and route (never a reward)."""
        url = f"{self.url}/{route}"
        params = {self.dialect.id_field: remote_id} if method == "get" else None
        try:
            response = _HTTP.request(method, url, json=payload, params=params, timeout=self.timeout_s)
        except requests.RequestException as exc:
            self._usable = False
            raise AgentGymServerError(f"{method.upper()} {url} failed: {exc.__class__.__name__}: {exc}") from None
        if response.status_code != 200:
            self._usable = False
            raise AgentGymServerError(f"{method.upper()} {url} answered HTTP {response.status_code}: "
                                      f"{response.text[:300]}")
        try:
            answer = response.json()
        except ValueError:
            self._usable = False
            raise AgentGymServerError(f"{method.upper()} {url} answered non-JSON: {response.text[:300]!r}") from None
        if isinstance(answer, dict) and "error" in answer:  # AgentGym servers report failures as 200 + {"error"}
            self._usable = False
            raise AgentGymServerError(f"{method.upper()} {url} reported an error: {str(answer['error'])[:300]}")
        return answer

    def _field(self, answer: Any, key: str, route: str) -> Any:
        if not isinstance(answer, dict) or key not in answer:
            self._usable = False
            raise AgentGymServerError(f"{self.url}/{route} answered without {key!r} (env_type "
                                      f"{self.config['env_type']}): {str(answer)[:300]}")
        return answer[key]

    def _with_actions(self, observation: str, answer: Any) -> str:
        """The observation, followed by the valid actions when the server lists them (ALFWorld)."""
        key = self.dialect.actions_key
        if key and isinstance(answer, dict) and isinstance(answer.get(key), list):
            return f"{observation}\nAVAILABLE ACTIONS: {', '.join(map(str, answer[key]))}"
        return observation
