"""The one LLM front shared by every episode loop's thread.

Environment threads do blocking I/O; LLM calls are coroutines on one asyncio loop that this module owns
(STYLE.md, habit 5). `AsyncLLMServerManager.generate` is the blocking bridge: it submits a coroutine to
the loop with `asyncio.run_coroutine_threadsafe` and waits for it. The loop bounds the requests in flight
with a semaphore, applies a per-request timeout, turns every failure into one `LLMError`, and keeps the
metrics the trainer reports (requests, failures, tokens, and the time during which at least one request
was in flight, for "wall time / LLM busy time").

Backends are tiny async objects with `generate(request_id, prompt_ids, max_tokens, sampling) -> GenerationResult`:
- `HttpVLLMBackend` talks to vLLM OpenAI servers (`/v1/completions`, token ids in and out);
- `VerlLLMServerBackend` wraps verl 0.9's async `LLMServerClient` (inside a verl trainer).

`request_id` is the caller's: use ONE stable id per episode (e.g. `f"{uid}-{sample_index}"`) for every
turn of it, so that routing sends all its turns to the same server and that server's prefix cache hits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from envservice.client import IDLE_EXPIRY_S

STOP_REASONS = ("stop", "length", "aborted")
"""Why a generation ended: a stop/eos token, the `max_tokens` limit, or the server aborted it."""

LLM_ERROR_KINDS = ("connection", "timeout", "server", "rejected", "malformed", "backend", "closed")
"""`LLMError.kind` values: the server could not be reached; it did not answer in time; it answered 5xx;
it answered 4xx (e.g. the prompt is too long); its answer could not be read; the backend raised something
else; the manager was closed."""


class LLMError(RuntimeError):
    """A generation failed for an infrastructure reason; `kind` is one of `LLM_ERROR_KINDS`.

    An episode loop ends its episode with `termination` ("timeout" or "llm_error"); such episodes are not reward.
    """

    def __init__(self, kind: str, message: str, status: int | None = None):
        if kind not in LLM_ERROR_KINDS:
            raise ValueError(f"LLMError.kind must be one of {LLM_ERROR_KINDS}; got {kind!r}")
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.message = message
        self.status = status
        """The server's HTTP status, when it answered with an error."""

    @property
    def termination(self) -> str:
        """The episode termination reason this failure maps to."""
        return "timeout" if self.kind == "timeout" else "llm_error"


SEED_RANGE = 2**53
"""Request seeds are in [0, SEED_RANGE): vLLM takes any int64, but a JSON reader that reads numbers as doubles (the
viewer's browser) keeps ints exact only below 2**53."""


def request_seed(base: int, *place: object) -> int:
    """The sampling seed of one request: the run's `base` seed mixed with the request's place (e.g. the step, the
    row, the sample, the turn). The same place gets the same seed in every run and process (a hash of the values'
    reprs, not Python's salted `hash`); neighbouring places get unrelated ones."""
    digest = hashlib.blake2b(repr((int(base), *place)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_RANGE


@dataclass(frozen=True)
class SamplingParams:
    """How to sample assistant turns (how many tokens one turn may have is each request's `max_tokens`)."""

    temperature: float = 1.0
    """Softmax temperature (>= 0; 0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    seed: int | None = None
    """Per-request sampling seed, for reproducible samples; None lets the server choose."""
    stop_token_ids: tuple[int, ...] | None = None
    """Extra token ids that end the turn (the eos token always does); None for none."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0; got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1]; got {self.top_p!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def optional_fields(self) -> dict[str, Any]:
        """The request fields that are sent only when set: `seed` and `stop_token_ids`."""
        fields: dict[str, Any] = {}
        if self.seed is not None:
            fields["seed"] = self.seed
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        return fields


@dataclass(frozen=True)
class GenerationResult:
    """One generated assistant turn, as token ids (never text to re-tokenise)."""

    token_ids: list[int]
    """The sampled token ids, in order (vLLM includes the eos token when it stopped on it)."""
    logprobs: list[float]
    """The log-probability of each sampled token under the rollout policy; same length as token_ids."""
    stop_reason: str
    """One of STOP_REASONS."""
    latency_s: float
    """Seconds the backend call took (after the request got a slot, excluding queueing)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"GenerationResult has {len(self.token_ids)} token_ids but {len(self.logprobs)} "
                             "logprobs; they must have the same length")
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"GenerationResult.stop_reason must be one of {STOP_REASONS}; "
                             f"got {self.stop_reason!r}")


class LLMBackend(Protocol):
    """What the manager needs from a backend. Called only on the manager's loop. Raise `LLMError` for
    failures you can classify; anything else becomes kind "backend". An optional `async aclose()` is
    awaited when the manager closes."""

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingParams) -> GenerationResult:
        """Generate one turn (at most `max_tokens` new tokens) for the episode `request_id`."""
        ...


# ----------------------------------------------------------------------------------------------- manager


@dataclass
class LLMManagerConfig:
    """Limits of the shared LLM front."""

    max_in_flight: int = 64
    """Most requests sent to the backend at once; the rest wait for a slot on the loop."""
    request_timeout_s: float = 300.0
    """Deadline of one backend call (after it got a slot)."""
    queue_timeout_s: float | None = None
    """Deadline for getting a slot; None waits as long as it takes."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"LLMManagerConfig.max_in_flight must be an int >= 1; got {self.max_in_flight!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"LLMManagerConfig.request_timeout_s must be > 0; got {self.request_timeout_s!r}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"LLMManagerConfig.queue_timeout_s must be > 0 or None; got {self.queue_timeout_s!r}")


@dataclass(frozen=True)
class LLMMetrics:
    """A snapshot of the manager's counters."""

    requests: int
    """Requests submitted (successful or not)."""
    failures: int
    """Requests that raised LLMError."""
    failures_by_kind: dict[str, int]
    """Failures per LLMError.kind."""
    tokens_generated: int
    """Sum of len(token_ids) over successful requests."""
    busy_time_s: float
    """Seconds during which at least one request was in flight (the union of their intervals)."""
    in_flight: int
    """Requests at the backend right now."""
    peak_in_flight: int
    """Most requests ever at the backend at once (never above max_in_flight)."""
    first_request_at: float | None = None
    """`time.monotonic()` when the first request reached the backend (None before any did)."""
    last_response_at: float | None = None
    """`time.monotonic()` when the latest request left the backend (None before any did)."""


class _MetricsRecorder:
    """Counters updated on the loop thread and read from any thread, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = self._failures = self._tokens = self._in_flight = self._peak = 0
        self._by_kind: dict[str, int] = {}
        self._busy_s = 0.0
        self._busy_since = 0.0
        self._first_started: float | None = None
        self._last_finished: float | None = None

    def submitted(self) -> None:
        with self._lock:
            self._requests += 1

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
                if self._first_started is None:
                    self._first_started = self._busy_since
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)

    def finished(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._last_finished = time.monotonic()
            if self._in_flight == 0:
                self._busy_s += self._last_finished - self._busy_since

    def succeeded(self, result: GenerationResult) -> None:
        with self._lock:
            self._tokens += len(result.token_ids)

    def failed(self, kind: str) -> None:
        with self._lock:
            self._failures += 1
            self._by_kind[kind] = self._by_kind.get(kind, 0) + 1

    def snapshot(self) -> LLMMetrics:
        with self._lock:
            busy = self._busy_s + (time.monotonic() - self._busy_since if self._in_flight else 0.0)
            return LLMMetrics(self._requests, self._failures, dict(self._by_kind), self._tokens, busy,
                              self._in_flight, self._peak, self._first_started, self._last_finished)


class AsyncLLMServerManager:
    """The thread-safe LLM front: one asyncio loop in a daemon thread, a blocking `generate` for threads.

    Use as a context manager (or call `close()`) so the loop thread and the backend's connections end.
    """

    def __init__(self, backend: LLMBackend, config: LLMManagerConfig | None = None):
        self.backend = backend
        self.config = config or LLMManagerConfig()
        self._metrics = _MetricsRecorder()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="llm-manager-loop", daemon=True)
        self._thread.start()
        self._slots = self._call_on_loop(self._make_semaphore())

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call_on_loop(self, coro, timeout_s: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.config.max_in_flight)

    def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                 sampling: SamplingParams = SamplingParams()) -> GenerationResult:
        """Block until the turn (at most `max_tokens` new tokens) is generated; raise LLMError on any failure.
        Safe from any thread except the manager's own loop. `request_id` must be stable for the whole episode
        (see module doc)."""
        _check_request(request_id, prompt_ids, max_tokens, sampling)
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncLLMServerManager.generate blocks; call it from an episode loop's thread, "
                               "not from the manager's own loop (await backend.generate there instead)")
        if self._closed:
            raise LLMError("closed", "the AsyncLLMServerManager is closed")
        self._metrics.submitted()
        coro = self._generate(request_id, list(prompt_ids), max_tokens, sampling)
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # close() finished between the check above and here
            coro.close()
            raise self._record(LLMError("closed", "the AsyncLLMServerManager is closed")) from None
        try:
            return future.result(self._outer_timeout_s())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._record(LLMError("timeout", f"request {request_id!r} got no answer in time")) from None
        except concurrent.futures.CancelledError:
            raise self._record(LLMError("closed", f"request {request_id!r} was cancelled by close()")) from None

    def _outer_timeout_s(self) -> float | None:
        """A safety net for the waiting thread; the loop's own deadlines normally fire first."""
        if self.config.queue_timeout_s is None:
            return None
        return self.config.queue_timeout_s + self.config.request_timeout_s + 5.0

    async def _generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                        sampling: SamplingParams) -> GenerationResult:
        try:
            await asyncio.wait_for(self._slots.acquire(), self.config.queue_timeout_s)
        except asyncio.TimeoutError:
            raise self._record(LLMError("timeout", f"request {request_id!r} waited "
                                                   f"{self.config.queue_timeout_s} s for a slot")) from None
        self._metrics.started()
        try:
            result = await self._call_backend(request_id, prompt_ids, max_tokens, sampling)
        finally:
            self._metrics.finished()
            self._slots.release()
        self._metrics.succeeded(result)
        return result

    async def _call_backend(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                            sampling: SamplingParams) -> GenerationResult:
        timeout_s = self.config.request_timeout_s
        try:
            return await asyncio.wait_for(self.backend.generate(request_id, prompt_ids, max_tokens, sampling),
                                          timeout_s)
        except LLMError as err:
            raise self._record(err) from err
        except asyncio.TimeoutError:
            raise self._record(LLMError("timeout", f"request {request_id!r} took longer than {timeout_s} s")) \
                from None
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the backend's own bugs and transport errors: one typed failure
            raise self._record(LLMError("backend", f"{type(err).__name__}: {err}")) from err

    def _record(self, err: LLMError) -> LLMError:
        self._metrics.failed(err.kind)
        return err

    def with_sampling(self, sampling: SamplingParams):
        """An episode loop's `generate(request_id, prompt_ids, max_tokens, seed=None, keep_aborted=False)` that
        samples with `sampling`; a `seed` replaces `sampling.seed` for that request (`rollout.episode_loop.seeded`
        gives each turn its own). A turn the server aborted raises LLMError("server") unless `keep_aborted` (the
        version gate's token mode, which continues it)."""

        def generate(request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None = None,
                     keep_aborted: bool = False):
            chosen = sampling if seed is None else dataclasses.replace(sampling, seed=seed)
            result = self.generate(request_id, prompt_ids, max_tokens, chosen)
            if result.stop_reason == "aborted" and not keep_aborted:
                # Rule: the server cut this reply, the model did not end it: never a turn an env steps on or a
                # gateway agent reads as the model's answer; the episode fails as infrastructure, not reward.
                raise self._record(LLMError("server", f"request {request_id!r} was aborted by the server after "
                                                      f"{len(result.token_ids)} tokens"))
            return result

        return generate

    @property
    def can_interrupt(self) -> bool:
        """Whether the backend can interrupt its requests (`interrupt`)."""
        return callable(getattr(self.backend, "interrupt", None))

    def interrupt(self, timeout_s: float = 30.0) -> None:
        """Abort every request in flight at the backend's servers: each comes back at once with the tokens it sampled
        so far and stop reason "aborted" (asynchronous rollout's token-level partial rollout continues them)."""
        self._call_on_loop(self.backend.interrupt(), timeout_s)

    def metrics(self) -> LLMMetrics:
        """A consistent snapshot of the counters (safe from any thread)."""
        return self._metrics.snapshot()

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what is still running (its callers get LLMError("closed")), close the backend, and stop
        and join the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call_on_loop(self._shutdown(), timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        aclose = getattr(self.backend, "aclose", None)
        if aclose is not None:
            await aclose()

    def __enter__(self) -> "AsyncLLMServerManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_request(request_id: str, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams) -> None:
    """Caller mistakes are programming errors (ValueError), not LLM failures."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str (one per episode); got {request_id!r}")
    if not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
        raise ValueError(f"prompt_ids must be a non-empty list of int token ids; got {str(prompt_ids)[:80]}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1; got {max_tokens!r}")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams; got {type(sampling).__name__}")


# ------------------------------------------------------------------------------------------------ routing


class StickyLeastLoadedRouter:
    """Chooses a server index per request: the server an episode used before (sticky, for its prefix
    cache), else the one with the fewest requests in flight (lowest index on ties). Not thread-safe: it
    lives on the manager's loop. The sticky map keeps the `max_sticky` most recently used request ids."""

    def __init__(self, num_servers: int, max_sticky: int = 100_000):
        if num_servers < 1:
            raise ValueError(f"StickyLeastLoadedRouter.num_servers must be >= 1; got {num_servers}")
        self.in_flight = [0] * num_servers
        """Requests currently routed to each server."""
        self.max_sticky = max_sticky
        """How many request ids the sticky map remembers (least recently used are forgotten)."""
        self._sticky: OrderedDict[str, int] = OrderedDict()

    def acquire(self, request_id: str) -> int:
        """The server for this request; counts it as in flight there until `release`."""
        server = self._sticky.get(request_id)
        if server is None:
            server = min(range(len(self.in_flight)), key=lambda i: (self.in_flight[i], i))
        self._sticky[request_id] = server
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self.max_sticky:
            self._sticky.popitem(last=False)
        self.in_flight[server] += 1
        return server

    def release(self, server: int) -> None:
        """The request routed to `server` has finished."""
        if self.in_flight[server] <= 0:
            raise ValueError(f"release({server}) without a matching acquire")
        self.in_flight[server] -= 1


# ----------------------------------------------------------------------------------------------- backends


class HttpVLLMBackend:
    """vLLM OpenAI-compatible servers over HTTP: POST `/v1/completions` with a token-id prompt,
    `return_token_ids` and `logprobs: 0`, so ids and their log-probs come back without re-tokenising.
    Requests are routed by `StickyLeastLoadedRouter`; the episode's request_id is used only for routing
    (vLLM gets its own fresh id per request)."""

    def __init__(self, base_urls: list[str], model: str, connect_timeout_s: float = 10.0):
        if not base_urls:
            raise ValueError("HttpVLLMBackend.base_urls must name at least one server, e.g. http://127.0.0.1:8000")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        """The servers, e.g. ["http://127.0.0.1:8000"]."""
        self.model = model
        """The model name the servers serve (vLLM's --model / --served-model-name)."""
        self.connect_timeout_s = connect_timeout_s
        """Deadline for opening a connection; reading is bounded by the manager's request timeout."""
        self.router = StickyLeastLoadedRouter(len(self.base_urls))
        """Routing state (read it for tests or metrics)."""
        self._client: httpx.AsyncClient | None = None

    def request_body(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams) -> dict[str, Any]:
        """The JSON body of one `/v1/completions` request."""
        return {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "logprobs": 0, "return_token_ids": True, **sampling.optional_fields()}

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingParams) -> GenerationResult:
        """Route, post, and read one completion."""
        server = self.router.acquire(request_id)
        started = time.perf_counter()
        try:
            payload = await self._post(f"{self.base_urls[server]}/v1/completions",
                                       self.request_body(prompt_ids, max_tokens, sampling))
        finally:
            self.router.release(server)
        return parse_completion(payload, latency_s=time.perf_counter() - started)

    async def interrupt(self) -> None:
        """Abort every request at every server (vLLM's `/abort_requests`, which vLLM serves when started with
        VLLM_SERVER_DEV_MODE=1): each answers at once with finish_reason "abort" and the tokens sampled so far."""
        for base_url in self.base_urls:
            url = f"{base_url}/abort_requests"
            try:
                await self._post(url, {"request_ids": []})
            except LLMError as error:
                if error.status == 404:
                    raise LLMError("rejected", f"{url} is not served: start vLLM with VLLM_SERVER_DEV_MODE=1 to let "
                                               "a weight update interrupt its requests") from None
                raise

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        if self._client is None:  # created on the loop that uses it
            timeout = httpx.Timeout(None, connect=self.connect_timeout_s)
            # A connection idle for vLLM's keep-alive timeout (5 s) is being closed by the server: httpx's own expiry is
            # also 5 s, so a request could be sent on it as it closed (envservice.client's docstring).
            limits = httpx.Limits(max_connections=None, keepalive_expiry=IDLE_EXPIRY_S)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        try:
            response = await self._client.post(url, json=body)
        except httpx.TimeoutException as err:
            raise LLMError("timeout", f"{url}: {type(err).__name__}") from err
        except httpx.TransportError as err:
            raise LLMError("connection", f"{url}: {type(err).__name__}: {err}") from err
        if response.status_code != 200:
            kind = "server" if response.status_code >= 500 else "rejected"
            raise LLMError(kind, f"{url} answered {response.status_code}: {response.text[:300]}", response.status_code)
        try:
            return response.json()
        except ValueError as err:
            raise LLMError("malformed", f"{url} answered 200 with a body that is not JSON: "
                                        f"{response.text[:200]!r}") from err

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


_VLLM_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted"}


def parse_completion(payload: Any, latency_s: float) -> GenerationResult:
    """Read vLLM's `/v1/completions` answer (one choice); LLMError("malformed") names what is missing."""
    try:
        choice = payload["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        finish_reason = choice["finish_reason"]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise LLMError("malformed", f"completion without choices[0].token_ids/logprobs.token_logprobs/"
                                    f"finish_reason ({type(err).__name__}: {err}): {str(payload)[:200]}") from err
    if finish_reason not in _VLLM_FINISH_REASONS:
        raise LLMError("malformed", f"unknown finish_reason {finish_reason!r}; expected one of "
                                    f"{sorted(_VLLM_FINISH_REASONS)}")
    if len(token_ids) != len(logprobs):
        raise LLMError("malformed", f"{len(token_ids)} token_ids but {len(logprobs)} logprobs")
    return GenerationResult(token_ids, logprobs, _VLLM_FINISH_REASONS[finish_reason], latency_s)


class VerlLLMServerBackend:
    """verl 0.9's async `LLMServerClient` (verl/workers/rollout/llm_server.py), as handed to agent-loop
    managers by `RayPPOTrainer.init_workers()`. verl's own `GlobalRequestLoadBalancer` does the routing
    (sticky by request_id, else least in flight), so nothing is routed here.

    Called as `await llm_client.generate(request_id=..., prompt_ids=..., sampling_params={...})`; the answer
    is a verl `TokenOutput` with `token_ids`, `log_probs` and `stop_reason` ("completed" | "aborted" |
    other). verl's vLLM server folds vLLM's "stop" and "length" into "completed", so "length" is inferred
    here when the turn used all of `max_tokens` (a stop token sampled as exactly the last allowed token
    is then reported as "length"; the token ids are right either way).
    """

    def __init__(self, llm_client: Any):
        self.llm_client = llm_client
        """verl's LLMServerClient (or anything with its async `generate` signature)."""

    @staticmethod
    def sampling_params(max_tokens: int, sampling: SamplingParams) -> dict[str, Any]:
        """The `sampling_params` dict verl's server turns into vLLM SamplingParams (`logprobs=True`
        becomes vLLM's `logprobs=0`: the sampled token's log-prob)."""
        return {"max_tokens": max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "logprobs": True, **sampling.optional_fields()}

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingParams) -> GenerationResult:
        """One verl generation, mapped to a GenerationResult."""
        started = time.perf_counter()
        output = await self.llm_client.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                sampling_params=self.sampling_params(max_tokens, sampling))
        return token_output_to_result(output, max_tokens, latency_s=time.perf_counter() - started)


def token_output_to_result(output: Any, max_tokens: int, latency_s: float) -> GenerationResult:
    """Map a verl `TokenOutput` to a GenerationResult; LLMError("malformed") when log-probs are missing
    or the stop reason is unknown."""
    token_ids = list(output.token_ids)
    if output.stop_reason == "aborted" and not token_ids:  # aborted before its first token: verl sends no log-probs
        return GenerationResult([], [], "aborted", latency_s)
    if output.log_probs is None or len(output.log_probs) != len(token_ids):
        got = None if output.log_probs is None else len(output.log_probs)
        raise LLMError("malformed", f"verl TokenOutput has {len(token_ids)} token_ids but log_probs={got}; "
                                    "the rollout must return log-probs (sampling_params['logprobs']=True)")
    if output.stop_reason == "aborted":
        stop_reason = "aborted"
    elif output.stop_reason in ("completed", "stop", "length", None):
        stop_reason = "length" if len(token_ids) >= max_tokens else "stop"
    else:
        raise LLMError("malformed", f"unknown verl stop_reason {output.stop_reason!r}; expected 'completed' "
                                    "or 'aborted'")
    return GenerationResult(token_ids, [float(x) for x in output.log_probs], stop_reason, latency_s)
