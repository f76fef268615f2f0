"""The FastAPI application of the environment service (`create_app(settings)`).

Routes: POST /create, /step, /steps, /evaluate, /release; GET /envs, /healthz (and FastAPI's /docs, /redoc,
/openapi.json). /steps carries several sessions' steps in one request (`envservice.step_batch`), each answered
as its own /step would be, errors included.

Every response that is not 2xx, whatever failed, is an `ErrorResponse` (`code`, `message`, details) with the
status of its code (`protocol.ERROR_STATUS`): our own errors, malformed bodies (422 naming each field, long
inputs cut), bodies that are not JSON (400), unknown routes and methods (404, 405), oversized bodies (413) and
bugs of the service itself (500 `internal_error`, logged with the request id every response carries in
`X-Request-ID`). Messages quote a caller's input clipped (`errors.clip`), never whole.

`RequestGuard`, the outermost layer, runs before anything reads the body: when a token is set every route
but /healthz (docs included) needs `Authorization: Bearer <token>` (401 with `WWW-Authenticate` otherwise);
then a body over `EnvServiceConfig.max_request_bytes` is refused with 413 (by its Content-Length, or while it streams).

At start-up (before the server reports ready) the served envs' classes are imported, here and on the
backend's workers (`preload_envs`), so that the first /create of an env does not stall on its import.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envservice import registry
from envservice.asgi_body import BodyTooLarge, read_body, replay_body
from envservice.body_check import LARGE_BODY_BYTES, LARGE_BODY_SHARE, BodyChecker
from envservice.childproc import host_allowed
from envservice.errors import CLIP_CHARS, EnvServiceError, clip
from envservice.host import entry_point_of
from envservice.host_slots import LOOP_SLOT_STATE, release_loop_slot, set_current_slot
from envservice.mcp_tools import MCP_PATH, mcp_app, mcp_server
from envservice.protocol import (
    CreateRequest,
    CreateResponse,
    EnvList,
    ERROR_STATUS,
    EnvSpec,
    ErrorCode,
    ErrorResponse,
    EvaluateRequest,
    EvaluateResponse,
    Health,
    ReleaseRequest,
    ReleaseResponse,
    StepBatchRequest,
    StepBatchResponse,
    StepRequest,
    StepResponse,
)
from envservice.sessions import EnvBackend, SessionManager
from envservice.step_batch import FAN_OUT_THREADS, StepCosts, run_steps

logger = logging.getLogger("envservice")

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""Largest request body accepted by default (1 MiB: ten of the longest actions the protocol allows)."""
UNAUTHENTICATED_PATHS = frozenset({"/healthz"})
"""Routes that answer without the token (liveness probes have none)."""
BODY_TIMEOUT_S = 30.0
"""Seconds a request body may take to arrive whole once its head has (a 1 MiB body needs well under one)."""
MAX_DETAIL_ITEMS = 20
"""Validation problems listed in one error answer at most (the message gives the count of the rest)."""


@dataclass(frozen=True)
class EnvServiceConfig:
    """How a service instance runs."""

    env_ids: Sequence[str] | None = None
    """Environment ids to serve; None serves every registered one."""
    max_sessions: int = 4096
    """Most sessions open at once, all environments together."""
    idle_timeout_s: float = 600.0
    """Sessions unused this long are released by the reaper."""
    reap_interval_s: float | None = None
    """Seconds between reaper passes; None: a quarter of the idle timeout."""
    token: str | None = None
    """When set, requests need `Authorization: Bearer <token>` (all routes but /healthz)."""
    backend: EnvBackend | None = None
    """Where environments run and how long one env call may take (`envservice.backend_factory.make_backend`);
    None: in this process with the default 60 s limit. The app shuts the backend down when it stops."""
    preload: bool = True
    """Import the served envs' classes at start-up, here and on every worker, before the service reports
    ready (`preload_envs`); False starts faster and leaves each import to the env's first /create."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body; a larger one is refused (413 `too_large`) before it is read."""
    body_timeout_s: float = BODY_TIMEOUT_S
    """Seconds a request body may take to arrive whole once its head has; past it, 408 `request_timeout`."""
    large_body_share: float = LARGE_BODY_SHARE
    """Share of the time one client host's large-body checks may keep the checking helper busy; the host's next
    large body waits for it (`envservice.body_check`); 0: no limit."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names answered (`childproc.allowed_hosts`: the loopback names for a loopback bind); None: any.
    Another Host gets 400 `bad_request` before anything else is read (DNS rebinding)."""


@dataclass(frozen=True)
class Preload:
    """What the start-up preload did (`app.state.preload`; None when `EnvServiceConfig.preload` is False)."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Env id -> seconds its class took to import in the service process, for the envs that imported."""
    failures: dict[str, str] = field(default_factory=dict)
    """Env id -> why it could not be imported, in the service process or on a worker."""


_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in sorted(set(ERROR_STATUS.values()))}


def create_app(settings: EnvServiceConfig | None = None) -> FastAPI:
    """Build the app; the idle reaper runs while the app's lifespan is active."""
    settings = settings or EnvServiceConfig()
    env_ids = list(settings.env_ids) if settings.env_ids is not None else registry.registered_ids()
    manager = SessionManager(
        env_ids, max_sessions=settings.max_sessions, idle_timeout_s=settings.idle_timeout_s, backend=settings.backend
    )

    body_checker = BodyChecker(settings.large_body_share)
    fan_out = ThreadPoolExecutor(FAN_OUT_THREADS, thread_name_prefix="envservice-steps")  # /steps' slow steps
    mcp = mcp_server(manager, env_ids)
    mounted_mcp = mcp_app(mcp)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.preload:
            # Before `yield`: uvicorn says "started" (and so prints our ready line) only once this returned.
            # Inline, not in a thread: nothing is served yet, and under `python -m envservice` this is the
            # main thread, where packages that install signal handlers at import expect to be imported.
            app.state.preload = preload_envs(env_ids, manager.backend)
        manager.start_reaper(settings.reap_interval_s)
        async with mcp.session_manager.run():  # the MCP endpoint's (envservice/mcp_tools.py)
            yield
        manager.shutdown()
        fan_out.shutdown(wait=False, cancel_futures=True)
        body_checker.close()
        logger.info("envservice stopped: %s", json.dumps(manager.ledger()))

    app = FastAPI(title="BeyondAgent envservice", lifespan=lifespan, responses=_ERROR_RESPONSES,
                  default_response_class=ProtocolJSONResponse)
    app.state.sessions = manager
    app.state.preload = None
    _add_error_handlers(app)
    _add_routes(app, manager, env_ids, fan_out)
    app.mount(MCP_PATH, mounted_mcp)
    _describe_in_openapi(app, env_ids, settings.token is not None)
    app.add_middleware(RequestGuard, token=settings.token, max_request_bytes=settings.max_request_bytes,
                       allowed_hosts=settings.allowed_hosts, body_timeout_s=settings.body_timeout_s,
                       body_checker=body_checker)
    return app


SESSION_ROUTES = ("/step", "/evaluate", "/release")
"""The routes that take the `session_id` a /create returns (OpenAPI links from /create's 200 to them)."""


def _describe_in_openapi(app: FastAPI, env_ids: list[str], token_required: bool) -> None:
    """Make /openapi.json say what this instance serves: the env ids it accepts (an enum), the session id's
    way from /create to the other calls (OpenAPI links, which clients and schema fuzzers follow), and the
    bearer token when one is required."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema["components"]["schemas"]["CreateRequest"]["properties"]["env_id"]["enum"] = list(env_ids)
        links = {path.lstrip("/"): {"operationId": schema["paths"][path]["post"]["operationId"],
                                    "requestBody": {"session_id": "$response.body#/session_id"},
                                    "description": f"The new session's id, for {path}."}
                 for path in SESSION_ROUTES}
        schema["paths"]["/create"]["post"]["responses"]["200"]["links"] = links
        if token_required:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path not in UNAUTHENTICATED_PATHS:
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class ProtocolJSONResponse(JSONResponse):
    """JSON responses that can always be written: text that UTF-8 cannot encode (a lone surrogate an env let
    through) is escaped as `\\uXXXX` instead of failing after the env call was made."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(error: EnvServiceError, request_id: str | None,
                   headers: dict[str, str] | None = None) -> ProtocolJSONResponse:
    """The wire form of `error` (`EnvServiceError.to_response`) with the request's id, at the error's status."""
    body = error.to_response().model_copy(update={"request_id": request_id})
    return ProtocolJSONResponse(jsonable_encoder(body, exclude_none=True), error.status, headers=headers)


class RequestGuard:
    """The outermost ASGI layer: request id, token, body size, and the last word on unexpected exceptions.

    It runs before FastAPI reads anything, so an unauthenticated or oversized upload is refused without being
    read; the body of an accepted request is read here (bounded) and replayed to the app.
    """

    def __init__(self, app: ASGIApp, token: str | None, max_request_bytes: int,
                 allowed_hosts: tuple[str, ...] | None = None, body_timeout_s: float = BODY_TIMEOUT_S,
                 body_checker: BodyChecker | None = None) -> None:
        self.app, self.token, self.max_request_bytes = app, token, max_request_bytes
        self.allowed_hosts, self.body_timeout_s = allowed_hosts, body_timeout_s
        self.body_checker = body_checker or BodyChecker()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        slot = state.get(LOOP_SLOT_STATE)
        set_current_slot(slot)  # this request's task only (envservice/host_slots.py)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if slot is not None:  # the answer is under way: a long one (a stream) must not keep the slot
                    slot.release()
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        refusal = self._refusal(scope, request_id)
        try:
            if refusal is None:
                body, reason = await self._checked_body(scope, receive)
                if reason is not None:
                    refusal = error_response(EnvServiceError(ErrorCode.bad_request, reason), request_id)
            if refusal is None:
                await self.app(scope, replay_body(body, receive), send_with_id)
                return
        except BodyTooLarge:
            refusal = self._too_large(request_id)
        except asyncio.TimeoutError:  # a body sent slowly or half: its connection is not held for ever
            refusal = error_response(EnvServiceError(ErrorCode.request_timeout, f"the request body did not arrive "
                                                     f"whole within {self.body_timeout_s:g} s"), request_id)
        except Exception:
            logger.exception("internal error answering %s %s (request %s)", scope["method"], scope["path"], request_id)
            if started:
                raise  # half a response went out: only dropping the connection tells the client
            refusal = error_response(EnvServiceError(ErrorCode.internal_error, "the service failed on this request; "
                                                     f"its log has the traceback under request id {request_id}"),
                                     request_id)
        await refusal(scope, receive, send_with_id)

    async def _checked_body(self, scope: Scope, receive: Receive) -> tuple[bytes, str | None]:
        """The body, read within the body deadline, and why it is refused before validation (or None); a large
        one, or one of unknown length (chunked), waits for its client host's turn (`BodyChecker`)."""
        headers = dict(scope["headers"])
        length = None if b"transfer-encoding" in headers else int(headers.get(b"content-length", b"0"))
        if length is not None and length <= LARGE_BODY_BYTES:  # the common case, without the turn's bookkeeping
            body = await asyncio.wait_for(read_body(receive, self.max_request_bytes), self.body_timeout_s)
            return body, await self.body_checker.reason(body)
        host = (scope.get("client") or ("?", 0))[0]
        # Waiting for its host's turn (one large body at a time per host, envservice/body_check.py), a request
        # leaves its loop slot, as an env call does: the turn bounds it, and a host whose large bodies wait for
        # their share must not also stall its other requests unread (envservice/host_slots.py).
        release_loop_slot()
        async with self.body_checker.turn(host, length):
            body = await asyncio.wait_for(read_body(receive, self.max_request_bytes), self.body_timeout_s)
            return body, await self.body_checker.reason(body, host)

    def _refusal(self, scope: Scope, request_id: str) -> ProtocolJSONResponse | None:
        """The answer to a request refused on its headers alone (foreign Host, no token, too large), or None."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.allowed_hosts):
            return error_response(EnvServiceError(
                ErrorCode.bad_request, f"Host {clip(host, 100)!r} is not a name this service answers to (allowed: "
                f"{', '.join(self.allowed_hosts)}); start it with --allowed-host NAME to add one"), request_id)
        if self.token is not None and scope["path"] not in UNAUTHENTICATED_PATHS and not self._authorised(headers):
            return error_response(EnvServiceError(ErrorCode.unauthorized,
                                                  "missing or wrong 'Authorization: Bearer <token>' header"),
                                  request_id, headers={"WWW-Authenticate": 'Bearer realm="envservice"'})
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return error_response(EnvServiceError(ErrorCode.bad_request, f"Content-Length "
                                                  f"{clip(length.decode('latin-1'))!r} is not a number"), request_id)
        if int(length) > self.max_request_bytes:
            return self._too_large(request_id)
        return None

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token.encode())

    def _too_large(self, request_id: str) -> ProtocolJSONResponse:
        return error_response(EnvServiceError(ErrorCode.too_large, f"the request body is over the service's limit "
                                              f"of {self.max_request_bytes} bytes (--max-request-bytes)"), request_id)


def preload_envs(env_ids: Sequence[str], backend: EnvBackend) -> Preload:
    """Import the class of each env id in this process, then on the backend's workers (`backend.preload`).

    A failure is logged and returned, never raised: a service that serves every registered env may lack
    optional packages (alfworld, appworld); it keeps serving the others and a /create of the broken env
    answers the same error it would without a preload.
    """
    seconds: dict[str, float] = {}
    failures: dict[str, str] = {}
    entry_points: dict[str, str] = {}
    for env_id in env_ids:
        started = time.perf_counter()
        try:
            entry_points[env_id] = entry_point_of(registry.get(env_id).env_class())
        except Exception as exc:
            failures[env_id] = repr(exc)
            logger.warning("preload: env %r could not be imported (%r); serving the other envs, a /create of "
                           "%r will fail", env_id, exc, env_id)
            continue
        seconds[env_id] = time.perf_counter() - started
        logger.info("preload: env %r imported in %.2f s", env_id, seconds[env_id])
    failures.update(_preload_backend(backend, entry_points))
    return Preload(seconds=seconds, failures=failures)


def _preload_backend(backend: EnvBackend, entry_points: dict[str, str]) -> dict[str, str]:
    """Preload the imported envs where the backend runs them; env id -> failure (the backend logs them)."""
    preload = getattr(backend, "preload", None)  # optional: a backend may define `build` only
    if preload is None or not entry_points:
        return {}
    started = time.perf_counter()
    failed = preload(list(entry_points.values()))
    logger.info("preload: backend %s imported %d of %d env(s) in %.2f s", backend.describe(),
                len(entry_points) - len(failed), len(entry_points), time.perf_counter() - started)
    return {env_id: failed[entry_point] for env_id, entry_point in entry_points.items() if entry_point in failed}


def _loadable_spec(env_id: str) -> EnvSpec | None:
    """The env's public description, or None (logged) when its package cannot be imported."""
    try:
        return registry.get(env_id).spec()
    except EnvServiceError as exc:
        if exc.code != ErrorCode.env_error:
            raise
        logger.warning("GET /envs leaves out %r: %s", env_id, exc.message)
        return None


def _answered(call: Any, *args: Any) -> ProtocolJSONResponse:
    """`call(*args)`'s response model as the finished HTTP answer (built in the calling pool thread)."""
    return ProtocolJSONResponse(call(*args).model_dump(mode="json"))


async def _in_pool(call: Any, *args: Any) -> Response:
    """`_answered(call, *args)` in the thread pool; the request first gives back its loop slot, since from here it
    waits off the event loop (envservice/host_slots.py)."""
    release_loop_slot()
    return await run_in_threadpool(_answered, call, *args)


def _add_routes(app: FastAPI, manager: SessionManager, env_ids: list[str], fan_out: ThreadPoolExecutor) -> None:
    # The env calls and their answers' serialisation run in the thread pool (serialising on the loop cost 6 % of
    # bench/envservice_load.py's steps/s), after the request gave back its loop slot (`_in_pool`). /step and
    # /evaluate refuse a busy or unknown session on the event loop first, without taking a pool thread
    # (`SessionManager.refuse_if_busy`).

    @app.post("/create", response_model=CreateResponse)
    async def create(request: CreateRequest) -> Response:
        """Open a session and return its first observation."""
        return await _in_pool(manager.create, request)

    @app.post("/step", response_model=StepResponse)
    async def step(request: StepRequest) -> Response:
        """Apply one action."""
        manager.refuse_if_busy(request.session_id, "step")
        return await _in_pool(manager.step, request.session_id, request.action)

    step_costs = StepCosts()

    @app.post("/steps", response_model=StepBatchResponse)
    async def steps(request: StepBatchRequest, http: Request) -> Response:
        """Apply one action to each of several sessions: every step answers what /step would (its outcome or
        its error, with that status), in the request's order; one step's failure never fails the others."""
        release_loop_slot()
        request_id = _request_id(http)
        return await run_in_threadpool(
            lambda: ProtocolJSONResponse(run_steps(manager, request.steps, fan_out, step_costs, request_id)))

    @app.post("/evaluate", response_model=EvaluateResponse)
    async def evaluate(request: EvaluateRequest) -> Response:
        """Score the episode."""
        manager.refuse_if_busy(request.session_id, "evaluate")
        return await _in_pool(manager.evaluate, request.session_id)

    @app.post("/release", response_model=ReleaseResponse)
    async def release(request: ReleaseRequest) -> Response:
        """Close a session."""
        return await _in_pool(manager.release, request.session_id)

    @app.get("/envs", response_model=EnvList)
    def envs() -> EnvList:
        """The served environments with their tasks and limits; one whose package cannot be loaded is left
        out (its /create answers env_error saying why), so one missing optional package does not hide the rest."""
        return EnvList(envs=[spec for spec in map(_loadable_spec, env_ids) if spec is not None])

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness and load (no token needed). On the event loop, not in the env calls' thread pool, so that a
        pool full of slow env calls never makes the service look dead (the ledger's lock is never held while an
        env runs)."""
        ledger = manager.ledger()
        return Health(status="ok", sessions=ledger["open"], max_sessions=manager.max_sessions, envs=env_ids,
                      created=ledger["created"], closed=ledger["closed"])


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EnvServiceError)
    async def service_error(request: Request, exc: EnvServiceError) -> JSONResponse:
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only the first MAX_DETAIL_ITEMS problems are encoded and sent, with the count: a body with 100 000
        # bad entries once cost 25 s of the event loop and a 49 MB answer.
        problems = exc.errors()
        errors = [_clipped_error(error) for error in jsonable_encoder(list(problems[:MAX_DETAIL_ITEMS]))]
        fields = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors)
        more = f" (and {len(problems) - len(errors)} more problems)" if len(problems) > len(errors) else ""
        return error_response(EnvServiceError(ErrorCode.invalid_request,
                                              f"invalid request: {clip(fields, 2000)}{more}", detail=errors),
                              _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """What Starlette/FastAPI answer themselves (no route, wrong method, a body that is not JSON)."""
        return error_response(EnvServiceError(*_framework_error(request, exc)), _request_id(request), exc.headers)


def _framework_error(request: Request, exc: StarletteHTTPException) -> tuple[ErrorCode, str]:
    """Our code and message for an error the framework raised."""
    route = f"{request.method} {clip(request.url.path, 100)}"
    if exc.status_code == 404:
        return ErrorCode.not_found, f"no route {route}; routes: POST /create, /step, /steps, /evaluate, /release; GET /envs, /healthz"
    if exc.status_code == 405:
        allowed = {key.lower(): value for key, value in (exc.headers or {}).items()}.get("allow", "?")
        return ErrorCode.method_not_allowed, f"{route} is not allowed; allowed: {allowed}"
    if exc.status_code == 400:
        cause = exc.__cause__
        reason = f": {clip(repr(cause), 300)}" if cause is not None else ""
        return ErrorCode.bad_request, f"the body of {route} could not be parsed as JSON{reason}"
    return ErrorCode.bad_request, f"{route}: {clip(str(exc.detail), 300)}"


def _clipped_error(error: dict[str, Any]) -> dict[str, Any]:
    """A validation error whose `input` (may be the whole body) is cut to a bounded quote."""
    if "input" in error:
        quoted = error["input"] if isinstance(error["input"], str) else json.dumps(error["input"], default=str)
        if len(quoted) > CLIP_CHARS:  # a short input keeps its JSON type
            error["input"] = clip(quoted)
    return error


def _request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")
