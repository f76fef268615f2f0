"""`EnvClient`: a typed, thread-safe HTTP client of the environment service.

Responses are validated with the protocol models; error responses raise `EnvServiceError` with the
server's code, message, status and valid choices. Retries (bounded, exponential backoff) happen only when
repeating the call cannot apply an action twice: on 503 (the server refused before doing anything), on a
connection that could not be opened, and, for the read-only or idempotent calls, on any connection error.
An env call that ran past the service's `--step-timeout` raises `EnvTimeoutError` (code `env_timeout`,
HTTP 504) and is never retried: the step may have been applied, and the service closed the session.

A pooled connection idle for `IDLE_EXPIRY_S` is not reused (`IdleExpiringAdapter`): a server closes an idle
keep-alive connection after its own timeout (uvicorn: 5 s by default, envservice: `transport.KEEP_ALIVE_S`), and a
request sent at that moment meets the close and fails with "Connection reset by peer". A step cannot be retried
(it may have been applied), so the episode ended as an `env_error`: 5 of 120 requests sent within +-10 ms of a
1 s server timeout were reset, 0 of 120 with the expiry. The client gives up a connection well before any such
server would.

Steps go to POST /steps (`envservice.step_batch`) through a `Coalescer`: the steps that threads ask for while
earlier requests are in flight leave together in one request, and each thread gets its own step's answer or
error, as from /step. A server without /steps (404) is then stepped through /step.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeVar

import requests
from pydantic import BaseModel, ValidationError
from requests.adapters import DEFAULT_POOLBLOCK, HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from envservice.coalesce import Coalescer
from envservice.errors import EnvServiceError
from envservice.protocol import (
    MAX_BATCH_STEPS,
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
    StepBatchResponse,
    StepRequest,
    StepResponse,
)

M = TypeVar("M", bound=BaseModel)

IDLE_EXPIRY_S = 2.0
"""Seconds a pooled connection may stay idle and still be reused: below uvicorn's default keep-alive timeout (5 s)
by more than any scheduling delay between the client's check and its send, so it holds for servers we do not run."""
MAX_BATCH_BYTES = 256 * 1024
"""Most bytes of steps one POST /steps carries by default: well below the service's 1 MiB body limit."""


class EnvClient:
    """Client of one envservice instance; share one across threads (its connection pool is thread-safe).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        token: bearer token when the service requires one.
        timeout: seconds per request (connect and read); keep it above the service's --step-timeout (60 s by
            default) so that a hung env comes back as the service's `EnvTimeoutError`, not as a read timeout.
        retries: extra attempts after a retryable failure.
        backoff_s: first retry delay; doubled each attempt.
        pool_size: connections kept per host (size it to the number of threads using the client).
        idle_expiry_s: a pooled connection idle this long is replaced, not reused; keep it below the server's
            keep-alive timeout (module docstring).
        batch_steps: send steps through POST /steps, several threads' steps in one request (module docstring);
            False sends each step alone to /step.
        max_batch_steps: most steps in one /steps request (the service takes up to `MAX_BATCH_STEPS`).
        max_batch_bytes: most bytes of steps in one /steps request; keep it below the service's
            --max-request-bytes (a step larger alone goes alone).
        max_batches_in_flight: /steps requests out at once (each for less than `batch_hold_s`); steps asked for
            meanwhile wait and leave together.
        batch_hold_s: seconds a /steps request out holds the next steps back; after it, a slow env's batch lets the
            next one leave (`envservice.coalesce`): batching adds at most this to a step.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 90.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        pool_size: int = 64,
        idle_expiry_s: float = IDLE_EXPIRY_S,
        batch_steps: bool = True,
        max_batch_steps: int = MAX_BATCH_STEPS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_batches_in_flight: int = 1,
        batch_hold_s: float = 0.05,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = requests.Session()
        adapter = IdleExpiringAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0,
                                      idle_expiry_s=idle_expiry_s)
        self._http.mount("http://", adapter)
        self._http.mount("https://", adapter)
        if token:
            self._http.headers["Authorization"] = f"Bearer {token}"
        self._read_environment_once(token)
        self.steps: Coalescer[bytes] | None = (
            Coalescer(self._send_steps, max_batch_steps, max_batch_bytes, max_batches_in_flight, batch_hold_s)
            if batch_steps else None)
        """Where steps are batched (its `batches` and `items` count them); None: each step goes alone to /step."""

    # ---- protocol calls ----------------------------------------------------------------------------

    def create(
        self,
        env_id: str,
        task_id: int | str | None = None,
        seed: int | None = None,
        split: str = "train",
        params: dict[str, Any] | None = None,
    ) -> CreateResponse:
        """Open a session; returns its id and first observation. NumPy scalars (what a parquet row often holds)
        are sent as the plain JSON values they stand for: the protocol's types are strict on the wire."""
        body = CreateRequest(env_id=env_id, task_id=_plain(task_id), seed=_plain(seed), split=split,
                             params={name: _plain(value) for name, value in (params or {}).items()})
        return self._call("POST", "/create", CreateResponse, body, idempotent=False)

    def step(self, session_id: str, action: str) -> StepResponse:
        """Apply one action (in a /steps batch with other threads' steps, or alone; module docstring)."""
        body = StepRequest(session_id=session_id, action=action)
        steps = self.steps
        if steps is not None:
            try:
                return self._step_in_batch(steps, body.model_dump_json().encode())
            except _NoStepsRoute:
                self.steps = None  # an older service: every step from now on goes to /step
        return self._call("POST", "/step", StepResponse, body, idempotent=False)

    def evaluate(self, session_id: str) -> EvaluateResponse:
        """Score the episode."""
        return self._call("POST", "/evaluate", EvaluateResponse, EvaluateRequest(session_id=session_id))

    def release(self, session_id: str) -> ReleaseResponse:
        """Close the session. Idempotent, so it is retried on a lost reply: a session that is closed already
        (by that first attempt, the reaper or an env failure) comes back with `already_closed` and `closed_by`."""
        return self._call("POST", "/release", ReleaseResponse, ReleaseRequest(session_id=session_id))

    def envs(self) -> list[EnvSpec]:
        """The served environments."""
        return self._call("GET", "/envs", EnvList).envs

    def health(self) -> Health:
        """Liveness and load."""
        return self._call("GET", "/healthz", Health)

    def wait_until_healthy(self, deadline_s: float = 60.0, poll_s: float = 0.2) -> Health:
        """Poll /healthz until it answers or `deadline_s` passes (then raise TimeoutError with the last error)."""
        end = time.monotonic() + deadline_s
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                return self._call("GET", "/healthz", Health, retries=0, timeout=min(self.timeout, 5.0))
            except (requests.RequestException, EnvServiceError) as exc:
                last = exc
            time.sleep(poll_s)
        raise TimeoutError(f"envservice at {self.base_url} not healthy after {deadline_s} s (last error: {last!r})")

    def close(self) -> None:
        """Close pooled connections."""
        self._http.close()

    def __enter__(self) -> "EnvClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- transport ---------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        body: BaseModel | None = None,
        idempotent: bool = True,
        retries: int | None = None,
        timeout: float | None = None,
    ) -> M:
        payload = body.model_dump(mode="json") if body is not None else None
        return _parse(self._request(method, path, idempotent, retries, timeout, json=payload), model)

    def _request(self, method: str, path: str, idempotent: bool = True, retries: int | None = None,
                 timeout: float | None = None, **send: Any) -> requests.Response:
        """The response to the request, asked again (module docstring) while that cannot act twice."""
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            last_attempt = attempt == attempts - 1
            try:
                response = self._http.request(method, self.base_url + path, timeout=timeout or self.timeout, **send)
            except requests.ConnectionError as exc:
                if last_attempt or not (idempotent or _not_sent(exc)):
                    raise
            else:
                if not _retryable(response) or last_attempt:
                    return response
            time.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _read_environment_once(self, token: str | None) -> None:
        """Take the proxy, CA bundle and .netrc settings for this service from the environment now, once: requests
        reads them on every request otherwise (11 % of the load generator's CPU at 1 000 sessions)."""
        self._http.proxies.update(requests.utils.get_environ_proxies(self.base_url))
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        if bundle:
            self._http.verify = bundle
        netrc_auth = None if token else requests.utils.get_netrc_auth(self.base_url)
        if netrc_auth:
            self._http.auth = netrc_auth
        self._http.trust_env = False

    def _step_in_batch(self, steps: Coalescer[bytes], encoded: bytes) -> StepResponse:
        """One encoded `StepRequest` through the coalescer; `busy` ran nothing, so it is asked again as /step's is."""
        attempts = 1 + self.retries
        for attempt in range(attempts):
            try:
                return steps.call(encoded, len(encoded))
            except EnvServiceError as exc:
                if exc.code != ErrorCode.busy or attempt == attempts - 1:
                    raise
            time.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _send_steps(self, encoded: list[bytes]) -> list[StepResponse | EnvServiceError]:
        """One POST /steps of these encoded `StepRequest`s: each one's response, or the error /step would raise."""
        body = b'{"steps":[' + b",".join(encoded) + b"]}"
        response = self._request("POST", "/steps", idempotent=False, data=body,
                                 headers={"Content-Type": "application/json"})
        if response.status_code == 404:
            raise _NoStepsRoute()
        batch = _parse(response, StepBatchResponse)
        return [outcome.step if outcome.error is None else EnvServiceError.from_response(outcome.error, outcome.status)
                for outcome in batch.results]


class _NoStepsRoute(Exception):
    """The service has no POST /steps (it predates it): nothing was applied, the step goes to /step."""


class _IdleExpiring:
    """A urllib3 connection that reports itself dropped once idle for `idle_expiry_s`, so that its pool opens a
    new one (the pool asks `is_connected` before it reuses a connection, and closes it when False)."""

    idle_expiry_s: float = IDLE_EXPIRY_S
    _answered_at: float | None = None

    def getresponse(self):  # type: ignore[no-untyped-def]
        response = super().getresponse()  # type: ignore[misc]
        self._answered_at = time.monotonic()  # the server's idle timer starts about now (slightly before)
        return response

    @property
    def is_connected(self) -> bool:
        if self._answered_at is not None and time.monotonic() - self._answered_at >= self.idle_expiry_s:
            return False
        return super().is_connected  # type: ignore[misc]


class IdleExpiringAdapter(HTTPAdapter):
    """requests' `HTTPAdapter` whose pooled connections are not reused after `idle_expiry_s` seconds idle (module
    docstring); every other argument is `HTTPAdapter`'s."""

    __attrs__ = [*HTTPAdapter.__attrs__, "idle_expiry_s"]  # what a pickled adapter keeps (its pools are rebuilt)

    def __init__(self, *args: Any, idle_expiry_s: float = IDLE_EXPIRY_S, **kwargs: Any) -> None:
        if not idle_expiry_s > 0:
            raise ValueError(f"idle_expiry_s must be > 0, got {idle_expiry_s}")
        self.idle_expiry_s = idle_expiry_s
        super().__init__(*args, **kwargs)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = DEFAULT_POOLBLOCK,
                         **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        expiry = {"idle_expiry_s": self.idle_expiry_s}
        http = type("IdleExpiringHTTPConnection", (_IdleExpiring, HTTPConnection), expiry)
        https = type("IdleExpiringHTTPSConnection", (_IdleExpiring, HTTPSConnection), expiry)
        self.poolmanager.pool_classes_by_scheme = {
            "http": type("IdleExpiringHTTPConnectionPool", (HTTPConnectionPool,), {"ConnectionCls": http}),
            "https": type("IdleExpiringHTTPSConnectionPool", (HTTPSConnectionPool,), {"ConnectionCls": https}),
        }


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python value it holds (`numpy.int64(3)` -> 3); anything else unchanged."""
    item = getattr(value, "item", None)
    return item() if callable(item) and type(value).__module__ == "numpy" else value


def _not_sent(exc: requests.ConnectionError) -> bool:
    """Whether the request surely never reached the server (so repeating it cannot act twice)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    text = repr(exc.args[0]) if exc.args else ""
    return "NewConnectionError" in text or "Connection refused" in text


def _parse(response: requests.Response, model: type[M]) -> M:
    """The validated response model, or `EnvServiceError` for an error status."""
    if response.ok:
        return model.model_validate(response.json())
    try:
        error = ErrorResponse.model_validate(response.json())
    except (ValueError, ValidationError):
        raise EnvServiceError(
            ErrorCode.bad_request, f"HTTP {response.status_code} without an envservice error body: "
            f"{response.text[:200]!r}", status=response.status_code,
        ) from None
    raise EnvServiceError.from_response(error, response.status_code)


def _retryable(response: requests.Response) -> bool:
    """503 (`capacity`), or 409 `busy`: refused before anything ran, so asking again is safe."""
    if response.status_code == 503:
        return True
    if response.status_code != 409:
        return False
    try:
        return response.json().get("code") == ErrorCode.busy.value
    except ValueError:
        return False
