"""The FastAPI application of the environment service (`create_app(settings)`).

Routes: POST /create, /step, /evaluate, /release; GET /envs, /healthz. Errors are `ErrorResponse`
bodies with the status of their code (`protocol.ERROR_STATUS`); malformed bodies are 422 with FastAPI's
per-field details. When a token is set every route but /healthz needs `Authorization: Bearer <token>`.

At start-up (before the server reports ready) the served envs' classes are imported, here and on the
backend's workers (`preload_envs`), so that the first /create of an env does not stall on its import.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from envservice import registry
from envservice.errors import EnvServiceError
from envservice.host import entry_point_of
from envservice.protocol import (
    CreateRequest,
    CreateResponse,
    EnvList,
    EnvSpec,
    ErrorCode,
    ErrorResponse,
    EvaluateRequest,
    EvaluateResponse,
    Health,
    ReleaseRequest,
    ReleaseResponse,
    StepRequest,
    StepResponse,
)
from envservice.sessions import EnvBackend, SessionManager

logger = logging.getLogger("envservice")


@dataclass(frozen=True)
class Settings:
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
    """Where environments run and how long one env call may take (`envservice.backends.make_backend`);
    None: in this process with the default 60 s limit. The app shuts the backend down when it stops."""
    preload: bool = True
    """Import the served envs' classes at start-up, here and on every worker, before the service reports
    ready (`preload_envs`); False starts faster and leaves each import to the env's first /create."""


@dataclass(frozen=True)
class Preload:
    """What the start-up preload did (`app.state.preload`; None when `Settings.preload` is False)."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Env id -> seconds its class took to import in the service process, for the envs that imported."""
    failures: dict[str, str] = field(default_factory=dict)
    """Env id -> why it could not be imported, in the service process or on a worker."""


_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 422, 500, 503, 504)}


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the idle reaper runs while the app's lifespan is active."""
    settings = settings or Settings()
    env_ids = list(settings.env_ids) if settings.env_ids is not None else registry.registered_ids()
    manager = SessionManager(
        env_ids, max_sessions=settings.max_sessions, idle_timeout_s=settings.idle_timeout_s, backend=settings.backend
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.preload:
            # Before `yield`: uvicorn says "started" (and so prints our ready line) only once this returned.
            # Inline, not in a thread: nothing is served yet, and under `python -m envservice` this is the
            # main thread, where packages that install signal handlers at import expect to be imported.
            app.state.preload = preload_envs(env_ids, manager.backend)
        manager.start_reaper(settings.reap_interval_s)
        yield
        manager.shutdown()

    app = FastAPI(title="BeyondAgent envservice", lifespan=lifespan, responses=_ERROR_RESPONSES)
    app.state.sessions = manager
    app.state.preload = None
    _add_error_handlers(app)
    _add_routes(app, manager, env_ids, _auth_dependency(settings.token))
    return app


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


def _auth_dependency(token: str | None):
    def check_token(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise EnvServiceError(ErrorCode.unauthorized, "missing or wrong 'Authorization: Bearer <token>' header")

    return Depends(check_token)


def _add_routes(app: FastAPI, manager: SessionManager, env_ids: list[str], auth) -> None:
    @app.post("/create", response_model=CreateResponse, dependencies=[auth])
    def create(request: CreateRequest) -> CreateResponse:
        """Open a session and return its first observation."""
        return manager.create(request)

    @app.post("/step", response_model=StepResponse, dependencies=[auth])
    def step(request: StepRequest) -> StepResponse:
        """Apply one action."""
        return manager.step(request.session_id, request.action)

    @app.post("/evaluate", response_model=EvaluateResponse, dependencies=[auth])
    def evaluate(request: EvaluateRequest) -> EvaluateResponse:
        """Score the episode."""
        return manager.evaluate(request.session_id)

    @app.post("/release", response_model=ReleaseResponse, dependencies=[auth])
    def release(request: ReleaseRequest) -> ReleaseResponse:
        """Close a session."""
        return manager.release(request.session_id)

    @app.get("/envs", response_model=EnvList, dependencies=[auth])
    def envs() -> EnvList:
        """The served environments with their tasks and limits; one whose package cannot be loaded is left
        out (its /create answers env_error saying why), so one missing optional package does not hide the rest."""
        return EnvList(envs=[spec for spec in map(_loadable_spec, env_ids) if spec is not None])

    @app.get("/healthz", response_model=Health)
    def healthz() -> Health:
        """Liveness and load (no token needed)."""
        return Health(status="ok", sessions=manager.count(), max_sessions=manager.max_sessions, envs=env_ids)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EnvServiceError)
    async def service_error(_request: Request, exc: EnvServiceError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content=jsonable_encoder(exc.to_response()))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors())
        fields = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors)
        body = ErrorResponse(code=ErrorCode.invalid_request, message=f"invalid request: {fields}", detail=errors)
        return JSONResponse(status_code=422, content=jsonable_encoder(body))
