"""Any OpenEnv server as an envservice env, through config alone (`kind: openenv` in an env-config file).

    frozenlake-openenv:
      kind: openenv
      config:
        url: http://127.0.0.1:8001          # the server's base URL (http, https, ws or wss)
        splits: {train: 1000, test: 200}    # task counts, task names, or {start, stop} ranges per split
        task_kwarg: task_index              # the reset keyword that receives the task
        split_kwarg: split                  # the reset keyword that receives the split name
        reset_params: {size: "Side of the map, 3..12."}  # create-request params passed on to reset
      max_sessions: 64                      # at most the server's max_concurrent_envs

Wire protocol (openenv-core 0.3.0, `openenv/core/env_server/http_server.py`): a session is one WebSocket
connection to `{url}/ws`. The server builds one `Environment` for the connection when it opens
(`_create_session`), answers `{"type": "reset", "data": {kwargs}}` and `{"type": "step", "data": {action
fields}}` with `{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` or
`{"type": "error", "data": {"message", "code"}}`, and destroys the environment (`_destroy_session`, which
calls its `close`) when the client sends `{"type": "close"}` or the connection drops. The HTTP `/reset`
and `/step` routes cannot carry an episode: each builds a fresh environment and closes it after one call.

So each `OpenEnvEnv` instance (one envservice session) owns exactly one WebSocket, opened at the first
`reset` and closed by `close()`, which ends the remote session before it returns (it sends `close` and
waits, a few seconds at most, for the server to hang up). A connection that is lost, or a request that
times out, is closed at once; the instance then refuses further calls. A remote session can therefore
never outlive ours, and if our process dies the OS drops the connection, which ends it too.

Failures of the infrastructure (server down, handshake refused, timeout, a reply that breaks the
protocol, the remote env raising) raise `OpenEnvServerError`, whose message names the URL and what failed;
the service turns it into an `env_error` for that session, never into a reward. A server at its
`max_concurrent_envs` gives a `capacity` error (HTTP 503, which `EnvClient` retries).

The SDK's own client (`openenv.core.GenericEnvClient(...).sync()`) is not used: importing `openenv.core`
imports gradio (about 7 s and hundreds of MB in every worker process), it flattens the server's error
codes into one `RuntimeError` text (a rejected action could not be told from a broken server), its
`connect` rewrites `os.environ["NO_PROXY"]` around every connection (process-wide, racy with many sessions
on threads), and it runs an event-loop thread per session. This module speaks the same protocol with
`websockets` (>= 15, the library the SDK client uses), and needs no `openenv-core` on the client side.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

from envservice.childproc import is_loopback
from envservice.envs.base import Param, StepResult, Task, TextEnv
from envservice.errors import EnvServiceError, clip
from envservice.protocol import ErrorCode

logger = logging.getLogger("envservice")

SEED_MODES = ("episode", "task", "none")
"""How the remote reset gets its `seed`: the episode seed of the create request, the task's value, or none."""
STEP_ERROR_MODES = ("raise", "observe")
"""What a remote env's exception in `step` becomes: an `env_error`, or an observation quoting it."""
MAX_MESSAGE_BYTES = 100 * 1024 * 1024
"""Largest reply accepted from the server (as the SDK client: observations may carry screenshots)."""
CLOSE_WAIT_S = 5.0
"""How long `close()` waits at most for the server to end the session and hang up."""
_SURROGATES = re.compile("[\ud800-\udfff]")
_SCHEMA_CACHE: dict[tuple[str, str], dict[str, Any]] = {}  # (url, headers JSON) -> GET /schema of that server
_SCHEMA_LOCK = threading.Lock()


class OpenEnvServerError(RuntimeError):
    """The OpenEnv server or the way to it failed (down, timeout, protocol, remote exception); the message
    names the server's URL and what failed. The service reports it as the session's `env_error`."""


class OpenEnvEnv(TextEnv):
    """A text env played on a running OpenEnv server, one remote session (WebSocket) per envservice session.

    Configure it with `OpenEnvEnv.configure({...})` or an env-config entry `kind: openenv` (see the module
    docstring and `config_fields`). The text action goes into the server's action field `action_field`;
    the observation text is read from `observation_field` (or `observation_template`); `done` ends the
    episode (terminated); the score is the sum of the rewards (or `score_field`), clipped to [0, 1].
    It gives no `task_fingerprint`: only the server knows what a task value stands for, so its splits are not
    known to be held out.
    """

    description = "An OpenEnv server (configure it: kind openenv)"
    config_fields = {
        "url": Param("Base URL of the OpenEnv server, e.g. http://127.0.0.1:8000 (http, https, ws or wss; the "
                     "session WebSocket is {url}/ws).", str),
        "action_field": Param("Name of the field of the server's Action that receives the text action. Default: "
                              "read from GET {url}/schema, the action's only (required) string field.", str),
        "action_extra": Param("Fixed fields added to every action, e.g. {\"tool\": \"shell\"} (default none).",
                              dict),
        "observation_field": Param("Observation field holding the text (dots reach into nested objects, e.g. "
                                   "'result.text'; a non-string value is shown as JSON). Default: the only "
                                   "string field of the observation schema (GET {url}/schema), else the whole "
                                   "observation as JSON.", str),
        "observation_template": Param("Instead of observation_field: a str.format template over the observation's "
                                      "fields, e.g. '{board}\\nLegal moves: {legal_moves}'.", str),
        "info_fields": Param("Observation fields copied into each reset/step `info` (default none).", list),
        "splits": Param("Tasks per split: a count N (tasks 0..N-1), a list of task names (strings or ints), or "
                        "{start: A, stop: B} (tasks A..B-1). Default {train: [default]}: one task.", dict),
        "task_kwarg": Param("Reset keyword that receives the task (its int or name as listed in splits), e.g. "
                            "task_index. Default: the task is not sent (then use seed: task, or one task).", str),
        "split_kwarg": Param("Reset keyword that receives the split name (default: not sent).", str),
        "seed": Param("What reset gets as `seed`: 'episode' (the create request's seed, random when not given; "
                      "default), 'task' (the task's int: levels generated from a seed) or 'none'.", str),
        "reset_kwargs": Param("Fixed keyword arguments of every reset (default none).", dict),
        "reset_params": Param("Create-request params passed on to reset as keyword arguments: name -> what it "
                              "does (they become this env's `params`; default none).", dict),
        "score_field": Param("Observation field with the episode's score in [0, 1] (read from the last "
                             "observation). Default: the sum of the rewards, clipped to [0, 1].", str),
        "success_threshold": Param("Score at or above which the episode counts as a success (default 1.0).", float),
        "step_errors": Param("An exception of the remote env in step: 'raise' (the session ends with env_error; "
                             "default) or 'observe' (its message becomes the observation, reward 0).", str),
        "timeout_s": Param("Seconds to open the connection and to wait for each reply (default 30); past it the "
                           "session fails with a message naming the URL.", float),
        "headers": Param("HTTP headers of the WebSocket handshake and the schema request, e.g. "
                         "{Authorization: 'Bearer ...'} for a hosted server (default none).", dict),
        "description": Param("One line for GET /envs (default: 'OpenEnv server at {url}').", str),
    }
    required_config = ("url",)

    _ws_url: str = ""
    _http_url: str = ""
    _task_values: Mapping[str, Sequence[Any]] = {}

    def __init__(self) -> None:
        """An instance without a connection; the first `reset` opens its remote session."""
        self._state_lock = threading.Lock()  # guards _ws, _stack, _closed, _broken
        self._call_lock = threading.Lock()  # held while a request waits for its reply
        self._ws: Any = None
        self._stack: contextlib.ExitStack | None = None
        self._closed = False
        self._broken: str | None = None
        self._return = 0.0
        self._last_observation: dict[str, Any] = {}
        self._action_field = ""
        self._observation_field: str | None = None

    # ---- configuration -----------------------------------------------------------------------------

    @classmethod
    def configured_attributes(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """`splits`, `params`, `description` and the server's WebSocket and HTTP URLs, from a checked config.

        Raises `ValueError` naming the field for a bad URL, split, mode or threshold.
        """
        ws_url, http_url = _server_urls(config["url"])
        names, values = _splits(config.get("splits", {"train": ["default"]}))
        seed = config.get("seed", "episode")
        if seed not in SEED_MODES:
            raise ValueError(f"OpenEnvEnv: config.seed={seed!r} is unknown; valid values: {', '.join(SEED_MODES)}")
        if seed == "task" and not all(isinstance(v, int) and v >= 0 for vs in values.values() for v in vs):
            raise ValueError("OpenEnvEnv: config.seed='task' needs tasks that are ints >= 0 (a count, a range or a "
                             "list of ints in splits)")
        if not config.get("task_kwarg") and seed != "task" and any(len(vs) > 1 for vs in values.values()):
            raise ValueError("OpenEnvEnv: config.splits lists several tasks but nothing sends the task to the "
                             "server: set task_kwarg (the reset keyword that selects the task) or seed: task")
        step_errors = config.get("step_errors", "raise")
        if step_errors not in STEP_ERROR_MODES:
            raise ValueError(f"OpenEnvEnv: config.step_errors={step_errors!r} is unknown; valid values: "
                             f"{', '.join(STEP_ERROR_MODES)}")
        threshold = config.get("success_threshold", 1.0)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"OpenEnvEnv: config.success_threshold={threshold!r} must be in [0, 1]")
        if config.get("timeout_s", 30.0) <= 0:
            raise ValueError(f"OpenEnvEnv: config.timeout_s={config['timeout_s']!r} must be > 0 seconds")
        if config.get("observation_field") and config.get("observation_template"):
            raise ValueError("OpenEnvEnv: give observation_field or observation_template, not both")
        params = config.get("reset_params", {})
        if not all(isinstance(text, str) for text in params.values()):
            raise ValueError("OpenEnvEnv: config.reset_params maps each param name to its description (a string)")
        taken = {config.get("task_kwarg"), config.get("split_kwarg"), "seed"} & set(params)
        if taken:
            raise ValueError(f"OpenEnvEnv: config.reset_params {sorted(taken)} would override the task, split or "
                             "seed keyword; rename them")
        for name in ("info_fields",):
            if not all(isinstance(field, str) for field in config.get(name, [])):
                raise ValueError(f"OpenEnvEnv: config.{name} must be a list of field names (strings)")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in config.get("headers", {}).items()):
            raise ValueError("OpenEnvEnv: config.headers maps header names to string values")
        return {
            "splits": names,
            "params": dict(params),
            "description": config.get("description") or f"OpenEnv server at {config['url']}",
            "_ws_url": ws_url,
            "_http_url": http_url,
            "_task_values": values,
        }

    # ---- the TextEnv contract ----------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Open the remote session (first call only) and reset it on `task`; returns (observation, info)."""
        self._resolve_fields()
        kwargs: dict[str, Any] = dict(self.config.get("reset_kwargs", {}))
        kwargs.update(task.params)
        value = self._task_values[task.split][task.index]
        if self.config.get("task_kwarg"):
            kwargs[self.config["task_kwarg"]] = value
        if self.config.get("split_kwarg"):
            kwargs[self.config["split_kwarg"]] = task.split
        seed_mode = self.config.get("seed", "episode")
        if seed_mode != "none":
            kwargs["seed"] = value if seed_mode == "task" else task.seed
        kind, data = self._request({"type": "reset", "data": kwargs}, "reset")
        if kind == "error":
            raise self._failure(f"the remote env refused reset({_kwargs_text(kwargs)}): {_error_text(data)}")
        observation, reward, _ = self._observation(data, "reset")
        self._return = reward
        return self._text(observation), self._info(observation)

    def step(self, action: str) -> StepResult:
        """Send the text action in `action_field`; a value the server's Action type rejects comes back as an
        observation saying so (the remote session goes on)."""
        payload = {**self.config.get("action_extra", {}), self._action_field: _SURROGATES.sub("\ufffd", action)}
        kind, data = self._request({"type": "step", "data": payload}, "step")
        if kind == "error":
            return self._step_error(data, action)
        observation, reward, done = self._observation(data, "step")
        self._return += reward
        return self._text(observation), reward, done, False, self._info(observation)

    def evaluate(self) -> tuple[float, bool]:
        """(score, success): `score_field` of the last observation, else the sum of rewards; clipped to [0, 1]."""
        field = self.config.get("score_field")
        if field:
            value = _lookup(self._last_observation, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self._failure(f"score_field {field!r} of the last observation is {clip(repr(value))}, not a "
                                    f"number (observation fields: {sorted(self._last_observation)})")
            score = float(value)
        else:
            score = self._return
        score = min(1.0, max(0.0, score))
        return score, score >= self.config.get("success_threshold", 1.0)

    def close(self) -> None:
        """End the remote session: send `close`, wait (at most `CLOSE_WAIT_S`) for the server to destroy its env
        and hang up, then close the connection. Idempotent; never raises. A call still waiting for a reply on
        another thread is cut off instead (its connection is closed under it)."""
        with self._state_lock:
            self._closed = True
            stack, ws = self._stack, self._ws
            self._stack = self._ws = None
        if stack is None:
            return
        polite = self._call_lock.acquire(blocking=False)
        try:
            if polite:
                self._say_goodbye(ws)
        finally:
            if polite:
                self._call_lock.release()
            _close_stack(stack)

    # ---- protocol ----------------------------------------------------------------------------------

    def _request(self, message: dict[str, Any], what: str) -> tuple[str, dict[str, Any]]:
        """Send one message and return the reply's (type, data): 'observation' or 'error'. A lost connection,
        a timeout or a malformed reply closes the connection and raises `OpenEnvServerError`; a full server
        raises the `capacity` error."""
        import websockets

        with self._call_lock:
            ws = self._connection()
            try:
                ws.send(json.dumps(message))
                raw = ws.recv(timeout=self._timeout)
            except TimeoutError:
                raise self._break(f"no reply to {what} within {self._timeout:g} s (timeout_s)") from None
            except websockets.ConnectionClosed as exc:
                if self._closed:  # our own close() cut this call off (a release, the reaper, a shutdown)
                    raise self._failure(f"this session was closed during {what}") from None
                raise self._closed_by_server(ws, what, exc) from None
            except (OSError, websockets.WebSocketException) as exc:
                raise self._break(f"the connection failed during {what}: {exc!r}") from None
        reply = _parse_reply(raw)
        if reply is None:
            raise self._break(f"the reply to {what} is not an OpenEnv message: {clip(repr(raw))}")
        kind, data = reply
        if kind == "error" and data.get("code") == "CAPACITY_REACHED":
            self._break("it is full")
            raise EnvServiceError(ErrorCode.capacity, f"OpenEnv server {self.config['url']} is full: "
                                  f"{clip(str(data.get('message')))}; retry later, or lower this env's max_sessions "
                                  "to the server's max_concurrent_envs")
        if kind not in ("observation", "error"):
            raise self._break(f"the reply to {what} has type {clip(repr(kind))}, expected 'observation'")
        return kind, data

    def _connection(self) -> Any:
        """The session's WebSocket, opened on first use (the server creates the remote session on accept)."""
        from websockets.sync.client import connect

        with self._state_lock:
            if self._closed or self._broken:
                raise self._failure(f"this session is {'closed' if self._closed else 'broken: ' + self._broken}; "
                                    "create a new one")
            if self._ws is not None:
                return self._ws
        stack = contextlib.ExitStack()
        try:
            ws = stack.enter_context(connect(
                self._ws_url, open_timeout=self._timeout, close_timeout=CLOSE_WAIT_S, max_size=MAX_MESSAGE_BYTES,
                additional_headers=self.config.get("headers") or None,
                proxy=None if _is_loopback(self._ws_url) else True))
        except Exception as exc:
            stack.close()
            reason = f"timed out after {self._timeout:g} s" if isinstance(exc, TimeoutError) else repr(exc)
            raise self._failure(f"cannot open a session (WebSocket {self._ws_url}): {reason}; is the server "
                                "running at this URL?") from None
        with self._state_lock:
            if not self._closed:
                self._ws, self._stack = ws, stack
                return ws
        _close_stack(stack)  # closed while we connected: end the session we just opened
        raise self._failure("this session was closed while it connected")

    def _say_goodbye(self, ws: Any) -> None:
        """Send `close` and read until the server hangs up (it destroys the session first), `CLOSE_WAIT_S` at most."""
        import websockets

        deadline = time.monotonic() + min(CLOSE_WAIT_S, self._timeout)
        try:
            ws.send(json.dumps({"type": "close"}))
            while (left := deadline - time.monotonic()) > 0:
                reply = _parse_reply(ws.recv(timeout=left))
                if reply is not None and reply[0] == "error":  # a server that does not know `close`: hang up
                    break
        except (websockets.ConnectionClosed, TimeoutError):
            pass
        except Exception as exc:  # close must not raise: the connection is closed below in any case
            logger.debug("OpenEnv server %s: close message failed: %r", self.config.get("url"), exc)

    def _closed_by_server(self, ws: Any, what: str, exc: Exception) -> Exception:
        """The error for a connection the server closed: its last message when it said why (a full server
        sends CAPACITY_REACHED and hangs up), else the close code."""
        with contextlib.suppress(Exception):
            reply = _parse_reply(ws.recv(timeout=0.2))
            if reply and reply[0] == "error" and reply[1].get("code") == "CAPACITY_REACHED":
                self._break("it is full")
                return EnvServiceError(ErrorCode.capacity, f"OpenEnv server {self.config['url']} is full: "
                                       f"{clip(str(reply[1].get('message')))}; retry later, or lower this env's "
                                       "max_sessions to the server's max_concurrent_envs")
            if reply and reply[0] == "error":
                return self._break(f"it closed the session during {what}: {_error_text(reply[1])}")
        return self._break(f"it closed the connection during {what} ({exc})")

    def _break(self, reason: str) -> OpenEnvServerError:
        """Close the connection now (it cannot be trusted any more; this ends the remote session) and return
        the error to raise; later calls on this instance are refused."""
        with self._state_lock:
            self._broken = self._broken or reason
            stack = self._stack
            self._stack = self._ws = None
        if stack is not None:
            _close_stack(stack)
        return self._failure(reason)

    def _failure(self, reason: str) -> OpenEnvServerError:
        """The error for `reason`, naming the server's URL."""
        return OpenEnvServerError(f"OpenEnv server {self.config.get('url')}: {reason}")

    # ---- replies -----------------------------------------------------------------------------------

    def _observation(self, data: dict[str, Any], what: str) -> tuple[dict[str, Any], float, bool]:
        """(observation fields, reward, done) of an observation message."""
        observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
        if not isinstance(observation, dict):
            raise self._break(f"the {what} reply has no observation object: {clip(json.dumps(data))}")
        if reward is None:
            reward = 0.0
        if not isinstance(reward, (int, float)) or not math.isfinite(reward) or not isinstance(done, bool):
            raise self._break(f"the {what} reply has reward={clip(repr(reward))}, done={clip(repr(done))}; expected a "
                              "finite number (or null) and a boolean")
        self._last_observation = observation
        return observation, float(reward), done

    def _step_error(self, data: dict[str, Any], action: str) -> StepResult:
        """An error reply to a step: a rejected action value is an observation; a wrong action shape (our
        config) or a remote exception is an `OpenEnvServerError` (unless step_errors: observe)."""
        code, errors = data.get("code"), data.get("errors")
        if code == "VALIDATION_ERROR" and isinstance(errors, list):
            shape = [e for e in errors if isinstance(e, dict) and e.get("type") in ("missing", "extra_forbidden")]
            if shape:
                raise self._failure(f"the server's Action does not fit this config (action_field="
                                    f"{self._action_field!r}, action_extra={self.config.get('action_extra', {})}): "
                                    f"{_error_text(data)}")
            messages = "; ".join(str(e.get("msg", e)) for e in errors if isinstance(e, dict))
            return (f"Invalid action {clip(action)!r}: the environment rejected it ({clip(messages)}).", 0.0, False,
                    False, {"invalid": True})
        if code == "EXECUTION_ERROR" and self.config.get("step_errors", "raise") == "observe":
            return (f"The environment could not apply the action {clip(action)!r}: "
                    f"{clip(str(data.get('message')))}", 0.0, False, False, {"invalid": True})
        raise self._failure(f"step failed on the server: {_error_text(data)}")

    def _text(self, observation: dict[str, Any]) -> str:
        """The observation's text: `observation_template`, `observation_field`, or the whole of it as JSON."""
        template = self.config.get("observation_template")
        if template:
            try:
                return template.format_map(observation)
            except (KeyError, IndexError, AttributeError, ValueError) as exc:
                raise self._failure(f"observation_template {template!r} does not fit the observation ({exc!r}; "
                                    f"its fields: {sorted(observation)})") from None
        if self._observation_field is None:
            return json.dumps(observation, sort_keys=True, ensure_ascii=False)
        value = _lookup(observation, self._observation_field)
        if value is _MISSING:
            raise self._failure(f"the observation has no field {self._observation_field!r} (observation_field); "
                                f"its fields: {sorted(observation)}")
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)

    def _info(self, observation: dict[str, Any]) -> dict[str, Any]:
        """The `info_fields` of the observation that it has."""
        return {name: observation[name] for name in self.config.get("info_fields", []) if name in observation}

    def _resolve_fields(self) -> None:
        """The action and observation field names: configured, or read once per server from GET /schema."""
        action_field = self.config.get("action_field")
        observation_field = self.config.get("observation_field")
        needs_observation = not observation_field and not self.config.get("observation_template")
        if not action_field or needs_observation:
            schema = self._schema()
            if not action_field:
                action_field = _action_field(schema.get("action", {}), self._failure)
            if needs_observation:
                observation_field = _only_string_field(schema.get("observation", {}))
        self._action_field, self._observation_field = action_field, observation_field

    def _schema(self) -> dict[str, Any]:
        """GET {url}/schema (action and observation JSON schemas), fetched once per server and process."""
        import requests

        headers = self.config.get("headers", {})
        key = (self._http_url, json.dumps(headers, sort_keys=True))
        with _SCHEMA_LOCK:
            if key in _SCHEMA_CACHE:
                return _SCHEMA_CACHE[key]
        url = f"{self._http_url}/schema"
        try:
            with requests.Session() as http:
                http.trust_env = not _is_loopback(url)
                response = http.get(url, headers=headers, timeout=self._timeout)
                response.raise_for_status()
                schema = response.json()
        except (requests.RequestException, ValueError) as exc:
            raise self._failure(f"cannot read the action/observation schema (GET {url}): {exc!r}; is the server "
                                "running? (or set action_field and observation_field)") from None
        if not isinstance(schema, dict):
            raise self._failure(f"GET {url} answered {clip(repr(schema))}, not an object of schemas")
        with _SCHEMA_LOCK:
            _SCHEMA_CACHE[key] = schema
        return schema

    @property
    def _timeout(self) -> float:
        """Seconds to open the connection and to wait for each reply (`timeout_s`)."""
        return float(self.config.get("timeout_s", 30.0))


# ---- helpers ---------------------------------------------------------------------------------------

_MISSING = object()


def _server_urls(url: Any) -> tuple[str, str]:
    """(WebSocket URL of the session route, HTTP base URL) of a server's base URL; `ValueError` if malformed."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
        raise ValueError(f"OpenEnvEnv: config.url={url!r} must be the server's base URL, e.g. http://127.0.0.1:8000 "
                         "(schemes: http, https, ws, wss)")
    secure = parts.scheme in ("https", "wss")
    base = parts.path.rstrip("/")
    base = base[:-3] if base.endswith("/ws") else base
    ws_url = urlunsplit(("wss" if secure else "ws", parts.netloc, f"{base}/ws", parts.query, ""))
    http_url = urlunsplit(("https" if secure else "http", parts.netloc, base, "", ""))
    return ws_url, http_url


def _splits(config: Any) -> tuple[dict[str, list[str]], dict[str, list[Any]]]:
    """(task names, task values) per split from the `splits` config; `ValueError` naming a bad split."""
    if not isinstance(config, dict) or not config:
        raise ValueError(f"OpenEnvEnv: config.splits={config!r} must map split names to tasks")
    names: dict[str, list[str]] = {}
    values: dict[str, list[Any]] = {}
    for split, tasks in config.items():
        where = f"OpenEnvEnv: config.splits.{split}"
        if isinstance(tasks, int) and not isinstance(tasks, bool):
            if tasks < 1:
                raise ValueError(f"{where}={tasks} must be a count >= 1")
            entries: list[Any] = list(range(tasks))
        elif isinstance(tasks, dict):
            start, stop = tasks.get("start"), tasks.get("stop")
            if set(tasks) != {"start", "stop"} or not all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in (start, stop)) or stop <= start:
                raise ValueError(f"{where}={tasks!r}: a range is {{start: A, stop: B}} with ints A < B")
            entries = list(range(start, stop))
        elif isinstance(tasks, list) and tasks:
            if not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in tasks):
                raise ValueError(f"{where}: task names must be strings or ints")
            entries = list(tasks)
            if len({str(t) for t in entries}) != len(entries):
                raise ValueError(f"{where}: task names must be unique")
        else:
            raise ValueError(f"{where}={tasks!r} must be a count, a non-empty list of task names or {{start, stop}}")
        names[str(split)] = [str(t) for t in entries]
        values[str(split)] = entries
    return names, values


def _action_field(schema: dict[str, Any], failure: Any) -> str:
    """The action's text field: its only required string field, else its only string field."""
    strings = _string_fields(schema)
    required = [name for name in strings if name in schema.get("required", [])]
    for candidates in (required, strings):
        if len(candidates) == 1:
            return candidates[0]
    fields = sorted(set(schema.get("properties", {})) - {"metadata"})
    raise failure(f"cannot tell which field of the server's action takes the text (fields: {fields}); set "
                  "action_field in the config")


def _only_string_field(schema: dict[str, Any]) -> str | None:
    """The observation's only string field, or None (then the whole observation is shown as JSON)."""
    strings = _string_fields(schema)
    return strings[0] if len(strings) == 1 else None


def _string_fields(schema: dict[str, Any]) -> list[str]:
    """Properties of a JSON schema whose type is (or may be) string, `metadata` aside, in schema order."""
    def is_string(spec: Any) -> bool:
        if not isinstance(spec, dict):
            return False
        if spec.get("type") == "string":
            return True
        return any(is_string(option) for option in spec.get("anyOf", []) + spec.get("oneOf", []))

    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    return [name for name, spec in properties.items() if name != "metadata" and is_string(spec)]


def _lookup(observation: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of the observation, or `_MISSING`."""
    value: Any = observation
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _parse_reply(raw: Any) -> tuple[str, dict[str, Any]] | None:
    """(type, data) of a server message, or None when it is not one."""
    if not isinstance(raw, str):
        return None
    try:
        reply = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(reply, dict) or not isinstance(reply.get("type"), str):
        return None
    data = reply.get("data", {})
    return reply["type"], data if isinstance(data, dict) else {"message": data}


def _error_text(data: dict[str, Any]) -> str:
    """'message (code CODE)' of an error reply, with the validation errors when there are some."""
    text = f"{data.get('message', 'no message')} (code {data.get('code', 'none')})"
    if isinstance(data.get("errors"), list):
        text += f": {json.dumps(data['errors'], default=str)}"
    return clip(text, 600)


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    """'name=value, ...' of reset's keyword arguments, for a message (clipped)."""
    return clip(", ".join(f"{name}={value!r}" for name, value in kwargs.items()), 300)


def _is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine (no proxy is used for it)."""
    return is_loopback(urlsplit(url).hostname or "")


def _close_stack(stack: contextlib.ExitStack) -> None:
    """Close a connection's exit stack (the WebSocket), quietly: closing must not raise."""
    try:
        stack.close()
    except Exception as exc:
        logger.debug("closing an OpenEnv connection failed: %r", exc)
