"""The gateway: an OpenAI-compatible chat-completions server in front of the rollout's LLM servers.

An agent written against the OpenAI API is pointed at one episode's base URL,
`http://HOST:PORT/episodes/<episode_id>/v1`, and runs unchanged. For every call the gateway renders the
messages with the model's chat template on our side (`RolloutHandler`), asks the LLM for token ids (never
text), and records the exact prompt ids, the sampled ids, their log-probs, the reply's parsed tool calls and
the policy version (`episodes.CallRecord`). The reply the agent gets is the sampled ids decoded, with
`<tool_call>` blocks (Hermes / Qwen2.5 format) turned into OpenAI `tool_calls`.

    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, llm.generate)
    app = create_gateway_app(gateway)          # serve with uvicorn
    episode_id = gateway.open_episode()
    ... the agent calls f"{url}/episodes/{episode_id}/v1/chat/completions" ...
    episode = gateway.close_episode(episode_id)  # its calls and segments

An episode may also carry its env session (`attach_env`, done by agent mode for every episode), for agents that
run in another process (`beyond_agent.agent.command`): `GET /episodes/<id>/env` answers the current observation,
`POST /episodes/<id>/env/step` with `{"action": "..."}` applies one action through that session, so its step
limit, wall-clock budget and bookkeeping (which call a step's reward belongs to) hold as for an in-process agent.

An episode opened with a key (agent mode opens every episode with a fresh one, given to its agent as
`OPENAI_API_KEY`) answers only requests that carry it (`Authorization: Bearer <key>`, which OpenAI SDKs send
by themselves): an agent that learned another episode's URL cannot call its LLM or step its env.

The server listens on a loopback port and on a Unix socket (`GatewayServer.socket_path`), which is how an agent
in the sandbox reaches it (the sandbox has no other network).

Errors are OpenAI's format with the matching status: 400 for a request the gateway cannot serve (naming the
parameter), 401 for a request without its episode's key, 404 for an unknown episode or model, 409 for a second call on an episode that is still answering
one (or a step on an episode that is over), 502 when the LLM or the env failed (an infrastructure failure: the
episode is not to be scored).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import shutil
import logging
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from anyio import CapacityLimiter, to_thread
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from envservice.asgi_body import BodyTooLarge, read_body, replay_body
from envservice.childproc import host_allowed
from envservice.protocol import ActionText
from envservice.transport import server_options

from beyond_agent.gateway.episodes import MERGE_POLICIES, CallRecord, GatewayEpisode
from beyond_agent.gateway.wire import (ChatRequest, chat_response, error_body, longest_message, reply_message,
                                       stream_events, token_logprobs, unsupported)
from beyond_agent.rollout.episode_loop import GenerateFn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway serves and the limits of its episodes."""

    model_name: str = "policy"
    """The model name agents send (`/v1/models` lists it); requests naming another are refused."""
    max_prompt_length: int = 4096
    """Cap on a segment's first prompt, in tokens (the head is dropped beyond it, as in our rollout)."""
    max_response_length: int = 8192
    """Cap on a segment's response (replies and the observations between them), in tokens."""
    max_tokens_per_turn: int = 1024
    """Cap on one reply, whatever the request's `max_tokens`."""
    merge: str = "auto"
    """`auto`: calls that extend the previous one form one multi-turn sample; `never`: one sample per call."""
    max_request_bytes: int = 1 << 20
    """Largest request body; a larger one is refused (413) before any of it is parsed."""
    max_message_chars: int = 100_000
    """Longest message (its text, or a tool call's arguments); a longer one is refused (400) before tokenizing."""
    max_calls: int = 256
    """Chat-completions calls one episode may make; past it calls are refused (429) and the episode ends as
    `max_calls` (the agent's doing: scored, like a round limit)."""
    body_timeout_s: float = 10.0
    """Seconds a request body may take to arrive whole (408 past it)."""
    max_concurrent_calls: int = 64
    """Calls (chat completions and env steps) the gateway answers at once, all episodes together: the run's
    `beyond_agent.concurrency`, since each episode's calls are answered one at a time."""

    def __post_init__(self) -> None:
        check_episode_limits("gateway", self.merge, self.max_calls)
        for name in ("max_prompt_length", "max_response_length", "max_tokens_per_turn", "max_request_bytes",
                     "max_message_chars", "max_concurrent_calls"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"gateway.{name} must be an integer >= 1, got {getattr(self, name)!r}")


def check_episode_limits(where: str, merge: Any, max_calls: Any) -> None:
    """The limits a run sets on its agents' episodes (`beyond_agent.agent.merge`, `.max_calls`), checked here for
    the run's section and the gateway's own config alike: ValueError naming `where`'s key."""
    if merge not in MERGE_POLICIES:
        raise ValueError(f"{where}.merge={merge!r} is not valid; choose one of {', '.join(MERGE_POLICIES)}")
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        raise ValueError(f"{where}.max_calls must be an integer >= 1, got {max_calls!r}")


class GatewayError(Exception):
    """A call the gateway answers with an OpenAI error (status, message, type, param)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class Gateway:
    """Episodes and their calls (module docstring). Thread-safe: episodes are opened, answered and closed from
    any thread."""

    def __init__(self, config: GatewayConfig, tokenizer: Any, generate: GenerateFn | None = None,
                 policy_version: Callable[[], int | None] = lambda: None) -> None:
        """`generate(request_id, prompt_ids, max_tokens)` samples with the rollout's sampling (e.g.
        `AsyncLLMServerManager.with_sampling(...)`): a request's `temperature`, `top_p` and `seed` are not the
        agent's to choose, since the log-probs trained on must be the behaviour policy's. An episode may bring
        its own (`open_episode`); with none here, each must."""
        self.config, self.tokenizer, self._generate, self._policy_version = config, tokenizer, generate, policy_version
        self._episodes: dict[str, GatewayEpisode] = {}
        self._lock = threading.Lock()

    def open_episode(self, episode_id: str | None = None, generate: GenerateFn | None = None,
                     key: str | None = None) -> str:
        """Start an episode; its calls go to `/episodes/<id>/v1/chat/completions` and are sampled by `generate`
        (default: the gateway's). With a `key`, only requests carrying it are answered (`authorize`)."""
        episode_id = episode_id or uuid.uuid4().hex
        episode = GatewayEpisode(episode_id, self.tokenizer, self.config.max_prompt_length,
                                 self.config.max_response_length, self.config.merge)
        episode.generate = generate or self._generate
        episode.key = key
        if episode.generate is None:
            raise ValueError("open_episode needs a generate function: the gateway was built without one")
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is already open")
            self._episodes[episode_id] = episode
        return episode_id

    def authorize(self, episode_id: str, authorization: str | None) -> None:
        """Refuse (401) a request that carries a key unless it is the key of an open episode of that id; an episode
        opened without a key answers any request. Why one answer for a wrong key and an unknown id: a 404 for the
        one and a 401 for the other told an agent which ids are open."""
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is not None and episode.key is None:
            return
        if episode is None and not authorization:
            return  # no key shown: the route says the episode is not open (404)
        if episode is None or not hmac.compare_digest((authorization or "").encode(),
                                                      f"Bearer {episode.key}".encode()):
            raise GatewayError(401, "the request's key is not the key of an open episode of this id (the "
                               "OPENAI_API_KEY its agent was given, sent as 'Authorization: Bearer <key>')",
                               "authentication_error")

    def attach_env(self, episode_id: str, env: Any) -> None:
        """Serve `env` (an `agents.EnvSession`: `observation`, `done`, `max_steps`, `step(action)`) under the open
        episode's `/env` routes."""
        self._open(episode_id).env = env

    def env_state(self, episode_id: str) -> dict[str, Any]:
        """What `GET /episodes/<id>/env` answers: the latest observation, whether the episode is over, the limit."""
        env = self._env(episode_id)
        return {"observation": env.observation, "done": env.done, "max_steps": env.max_steps}

    def env_step(self, episode_id: str, action: str) -> dict[str, Any]:
        """Apply one action through the episode's env session (what `POST /episodes/<id>/env/step` answers)."""
        env = self._env(episode_id)
        try:
            step = env.step(action)
        except RuntimeError as error:
            if env.failure is not None:  # the env failed: infrastructure, recorded on the session already
                raise GatewayError(502, str(error), "server_error") from None
            raise GatewayError(409, str(error), "conflict_error") from None
        return {"observation": step.observation, "reward": step.reward, "terminated": step.terminated,
                "truncated": step.truncated, "done": env.done, "info": step.info}

    def _open(self, episode_id: str) -> GatewayEpisode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise GatewayError(404, f"episode {episode_id!r} is not open (never opened, or closed)", param="episode_id")
        return episode

    def _env(self, episode_id: str) -> Any:
        env = self._open(episode_id).env
        if env is None:
            raise GatewayError(404, f"episode {episode_id!r} has no env session attached", param="episode_id")
        return env

    def limit_reached(self, episode_id: str) -> str | None:
        """`max_calls` when an open episode had a call refused for its call cap, else None."""
        with self._lock:
            episode = self._episodes.get(episode_id)
        return episode.limit_reached if episode is not None else None

    def calls_answered(self, episode_id: str) -> int:
        """How many calls of an open episode have been answered (0 for an episode that is not open)."""
        with self._lock:
            episode = self._episodes.get(episode_id)
        return len(episode.calls) if episode is not None else 0

    def close_episode(self, episode_id: str) -> GatewayEpisode:
        """End an episode (later calls on it get 404) and return what it recorded."""
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is None:
            raise KeyError(f"episode {episode_id!r} is not open")
        with episode.lock:  # a call still being answered finishes first
            return episode

    def complete(self, episode_id: str, request: ChatRequest) -> dict[str, Any]:
        """Answer one chat-completions call of `episode_id` (blocking: the LLM call waits)."""
        if request.model != self.config.model_name:
            raise GatewayError(404, f"model {request.model!r} is not served here; use {self.config.model_name!r}",
                               "invalid_request_error", "model")
        refused = unsupported(request)
        if refused is not None:
            raise GatewayError(400, refused[1], param=refused[0])
        index, length = longest_message(request.messages)
        if length > self.config.max_message_chars:  # refused before any tokenizing
            raise GatewayError(400, f"messages[{index}] holds {length} characters, over the gateway's limit of "
                               f"{self.config.max_message_chars} (gateway.max_message_chars)", param=f"messages.{index}")
        episode = self._open(episode_id)
        if not episode.lock.acquire(blocking=False):
            episode.refused_calls += 1  # why: a refusal counts toward max_calls, as an answered call does
            raise GatewayError(409, f"episode {episode_id!r} is answering another call; an episode's calls are "
                               "answered one at a time", "conflict_error")
        try:
            if len(episode.calls) + episode.refused_calls >= self.config.max_calls:
                episode.limit_reached = "max_calls"
                raise GatewayError(429, f"episode {episode_id!r} made its {self.config.max_calls} calls "
                                   "(gateway.max_calls): it is over, stop and return", "rate_limit_error")
            try:
                return self._answer(episode, request)
            except GatewayError as error:
                episode.refused_calls += error.status < 500  # the agent's bad request; not an LLM failure
                raise
        finally:
            episode.lock.release()

    def _answer(self, episode: GatewayEpisode, request: ChatRequest) -> dict[str, Any]:
        tools = request.shown_tools()
        try:
            handler, continued = episode.segment_for(request.messages, tools)
        except ValueError as error:  # the template cannot render these messages
            raise GatewayError(400, f"the messages cannot be rendered by the model's chat template: {error}",
                               param="messages") from None
        limit = min(self.config.max_tokens_per_turn, request.turn_limit() or self.config.max_tokens_per_turn,
                    handler.remaining_response_length)
        if limit < 1:
            if handler.remaining_response_length < 1:  # the episode's token budget is spent: that limit ends it
                episode.limit_reached = "length"
            raise GatewayError(400, "this episode's segment has no room left for a reply "
                               f"(max_response_length {self.config.max_response_length} tokens)", param="messages")
        prompt_ids = handler.prompt_ids_for_next_turn()
        try:
            result = episode.generate(episode.episode_id, prompt_ids, limit)
        except Exception as error:  # any failure of the LLM front: infrastructure, never the agent's doing
            episode.llm_failed(handler, str(error))
            raise GatewayError(502, f"the LLM failed on this call ({error}); it is an infrastructure failure, "
                               "not the agent's", "server_error") from None
        version = getattr(result, "policy_version", None)
        version = self._policy_version() if version is None else version
        handler.add_assistant(result.token_ids, result.logprobs, version, getattr(result, "token_versions", None))
        message, notes = reply_message(self._reply_text(result.token_ids, handler.end_of_turn_id))
        call = CallRecord(index=len(episode.calls), segment=len(episode.segments) - 1, continued=continued,
                          prompt_ids=prompt_ids, sampled_ids=list(result.token_ids), logprobs=list(result.logprobs),
                          stop_reason=getattr(result, "stop_reason", "stop"), policy_version=version, reply=message,
                          notes=notes, latency_s=getattr(result, "latency_s", 0.0))
        episode.record(request.messages, tools, call)
        return chat_response(self.config.model_name, message, call.stop_reason, len(prompt_ids),
                             len(result.token_ids), logprobs=self._logprobs(result, handler.end_of_turn_id)
                             if request.logprobs else None)

    def _logprobs(self, result: Any, end_of_turn_id: int) -> dict[str, Any]:
        """The reply's tokens (as the agent reads the reply: without the end-of-turn token) and their sampling
        log-probs, in OpenAI's format."""
        ids, logprobs = list(result.token_ids), list(result.logprobs)
        if ids and ids[-1] == end_of_turn_id:
            ids, logprobs = ids[:-1], logprobs[:-1]
        tokens = [self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                  for token in ids]
        return token_logprobs(tokens, logprobs)

    def _reply_text(self, token_ids: list[int], end_of_turn_id: int) -> str:
        """The reply as the agent reads it: the sampled ids decoded, without the end-of-turn token."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] == end_of_turn_id else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def create_gateway_app(gateway: Gateway) -> FastAPI:
    """The HTTP face of `gateway`: `/episodes/{episode_id}/v1/chat/completions` and `/v1/models` (also under
    each episode's base URL), every error in OpenAI's format."""
    app = FastAPI(title="BeyondAgent gateway", docs_url=None, redoc_url=None, openapi_url=None)
    # Calls answered at once, all episodes together (each episode's one at a time): the run's concurrency, in
    # threads of their own, not the default pool's 40 that every route of the process shares.
    calls = CapacityLimiter(gateway.config.max_concurrent_calls)

    @app.exception_handler(StarletteHTTPException)  # unknown routes and methods: OpenAI's format too
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.kind, error.param), status_code=error.status)

    @app.exception_handler(RecursionError)  # a body nested past the parser's depth: the client's doing
    async def too_deep(request: Request, error: RecursionError) -> JSONResponse:
        return JSONResponse(error_body("the request nests its JSON too deeply to be read"), status_code=400)

    @app.exception_handler(Exception)  # a bug of ours: OpenAI's format too, never a traceback
    async def failed(request: Request, error: Exception) -> JSONResponse:
        logger.exception("gateway: %s %s failed", request.method, request.url.path)
        return JSONResponse(error_body("the gateway failed on this request", "server_error"), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg')}", param=where), status_code=400)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions(episode_id: str, request: ChatRequest,
                               authorization: str | None = Header(None)) -> Response:
        gateway.authorize(episode_id, authorization)
        answer = await to_thread.run_sync(gateway.complete, episode_id, request, limiter=calls)
        if request.stream:
            include_usage = bool((request.stream_options or {}).get("include_usage"))
            return StreamingResponse(iter(stream_events(answer, include_usage)), media_type="text/event-stream")
        return JSONResponse(answer)

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "beyond_agent"}]}

    app.get("/v1/models")(models)
    app.get("/episodes/{episode_id}/v1/models")(models)

    @app.get("/episodes/{episode_id}/env")
    async def env_state(episode_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        gateway.authorize(episode_id, authorization)
        return gateway.env_state(episode_id)

    @app.post("/episodes/{episode_id}/env/step")
    async def env_step(episode_id: str, request: EnvAction, authorization: str | None = Header(None)
                       ) -> dict[str, Any]:
        gateway.authorize(episode_id, authorization)
        return await to_thread.run_sync(gateway.env_step, episode_id, request.action, limiter=calls)

    return app


class EnvAction(BaseModel):
    """The body of `POST /episodes/<id>/env/step`."""

    model_config = ConfigDict(extra="forbid")
    action: ActionText
    """The action, as the env's text protocol takes it (envservice's limits: at most 100 000 characters)."""


class RequestBounds:
    """The gateway's outermost ASGI layer: a request naming a foreign Host, or whose body is over
    `max_request_bytes` (by its Content-Length, or as it arrives), is refused before anything is parsed or
    tokenized; a body must arrive whole within `body_timeout_s`; an unexpected failure is answered in OpenAI's
    format (500), never as plain text."""

    def __init__(self, app: ASGIApp, config: GatewayConfig, allowed_hosts: tuple[str, ...]) -> None:
        self.app, self.config, self.allowed_hosts = app, config, allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(dict(scope["headers"]))
        if refusal is None:
            try:
                body = await asyncio.wait_for(read_body(receive, self.config.max_request_bytes),
                                              self.config.body_timeout_s)
            except BodyTooLarge:
                refusal = self._too_large()
            except asyncio.TimeoutError:  # a body sent slowly or half: its connection is not held for ever
                refusal = JSONResponse(error_body(f"the request body did not arrive whole within "
                                                  f"{self.config.body_timeout_s:g} s"), status_code=408)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay_body(body, receive), tracked)
        except Exception as error:  # noqa: BLE001 — the last word: OpenAI's format, whatever failed
            if started:
                raise  # half a response went out: only dropping the connection tells the client
            answer = JSONResponse(error_body(f"the gateway failed on this request ({type(error).__name__})",
                                             "server_error"), status_code=500)
            await answer(scope, receive, send)

    def _refusal(self, headers: dict[bytes, bytes]) -> JSONResponse | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.allowed_hosts):
            return JSONResponse(error_body(f"Host {host[:100]!r} is not a name this gateway answers to",
                                           param="host"), status_code=400)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.config.max_request_bytes):
            return self._too_large()
        return None

    def _too_large(self) -> JSONResponse:
        return JSONResponse(error_body(f"the request body is over the gateway's limit of "
                                       f"{self.config.max_request_bytes} bytes (gateway.max_request_bytes)"),
                            status_code=413)


class GatewayServer:
    """The gateway app served by uvicorn in a thread of this process (the trainer's), on a loopback port and on a
    Unix socket in a folder of its own (what sandboxed agents reach it through)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.gateway = gateway
        self._tcp = socket.create_server((host, port or 0))
        self.port = self._tcp.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        """Base of every episode's URL (`{url}/episodes/<id>/v1`, and its env's `{url}/episodes/<id>/env`)."""
        self._socket_dir = tempfile.mkdtemp(prefix="beyond-gateway-")
        self.socket_path = os.path.join(self._socket_dir, "gateway.sock")
        """The same server on a Unix socket (its folder is readable by this user only)."""
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.socket_path)
        self._unix.listen(128)
        app = RequestBounds(create_gateway_app(gateway), gateway.config, (host, "127.0.0.1", "localhost"))
        # envservice's connection guards: a deadline and a size cap on every request head, a connection cap.
        # No loop slots per client host: every sandboxed agent comes through one Unix socket, one "host", so 4 slots
        # held through each LLM call capped a whole run at 4 calls at once (and 4 half-sent heads of one agent held
        # up every other episode). Each episode is answered one call at a time instead (Gateway.complete), within
        # `max_concurrent_calls`, and a request head still has a deadline.
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                     **server_options(loop_slots_per_host=0)))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._tcp, self._unix]},
                                        name="beyond-agent-gateway", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "GatewayServer":
        """Serve, and return once the server is up (RuntimeError past `timeout_s`)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start on {self.url} within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        for listener in (self._tcp, self._unix):
            listener.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
