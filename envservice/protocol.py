"""The wire protocol of the environment service: the single definition used by server and client.

Every request and response is a pydantic v2 model that forbids unknown fields, so a typo in a field
name is a 422 on the server and a validation error on the client instead of a silently ignored key.
Errors never travel inside a 200: they are an `ErrorResponse` with the HTTP status in `ERROR_STATUS`.

Types are strict (an int is not a string, a boolean is not an int) and bounded: every id and name is at
most `MAX_NAME_CHARS` characters, an action at most `MAX_ACTION_CHARS`, seeds and task indices are >= 0,
and no string may hold a lone UTF-16 surrogate (JSON can spell one, `\\ud800`, but it is not text: it
could not be written back out as UTF-8). A request that breaks any of these is a 422 that never reaches
an environment.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

MAX_NAME_CHARS = 512
"""Longest env id, task name, split or session id a request may carry."""
MAX_ACTION_CHARS = 100_000
"""Longest action text (about 25 000 tokens: far beyond any one turn of an agent)."""
MAX_SEED = 2**32 - 1
"""Largest seed: what numpy's seeding accepts, so every env can take every valid seed."""
MAX_BATCH_STEPS = 256
"""Most steps one POST /steps may carry (the body limit, 1 MiB by default, bounds their actions' text too)."""


def _no_lone_surrogates(value: str) -> str:
    """Refuse a string that holds a lone surrogate: it is not text (it cannot be written out as UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid text") from None
    return value


Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_no_lone_surrogates)]
"""An id or name: 1..MAX_NAME_CHARS characters of real text."""
ActionText = Annotated[StrictStr, Field(max_length=MAX_ACTION_CHARS), AfterValidator(_no_lone_surrogates)]
"""An action: up to MAX_ACTION_CHARS characters of real text (empty is allowed: the env answers it)."""
ParamValue = Union[
    StrictBool, StrictInt, StrictFloat,
    Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS), AfterValidator(_no_lone_surrogates)], None,
]
"""The value of an env option: a JSON scalar (the types a `Param` can declare), never a nested structure."""
TaskIndex = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=0, le=MAX_SEED)]


class _Model(BaseModel):
    """Base of every protocol model: unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")


class ErrorCode(str, Enum):
    """Machine-readable error codes; each maps to one HTTP status in `ERROR_STATUS`.

    `env_error`: the env raised or its worker died; `env_timeout`: an env call ran past the service's
    `--step-timeout`. Both close that session only (a timed-out step may have been applied: not retried).
    `not_found` / `method_not_allowed`: no such route or method; `too_large`: the body is over the service's
    `--max-request-bytes`; `internal_error`: a bug in the service itself (logged with the response's request id);
    `busy`: the session is answering another call of its own (nothing was done; retry once that call is back);
    `request_timeout`: the request head or body did not arrive whole in time (envservice/transport.py).
    """

    bad_request = "bad_request"
    invalid_request = "invalid_request"
    unknown_env = "unknown_env"
    unknown_task = "unknown_task"
    unknown_session = "unknown_session"
    capacity = "capacity"
    env_error = "env_error"
    env_timeout = "env_timeout"
    episode_over = "episode_over"
    unauthorized = "unauthorized"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    too_large = "too_large"
    internal_error = "internal_error"
    busy = "busy"
    request_timeout = "request_timeout"


ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.bad_request: 400,
    ErrorCode.invalid_request: 422,
    ErrorCode.unknown_env: 404,
    ErrorCode.unknown_task: 400,
    ErrorCode.unknown_session: 404,
    ErrorCode.capacity: 503,
    ErrorCode.env_error: 500,
    ErrorCode.env_timeout: 504,
    ErrorCode.episode_over: 409,
    ErrorCode.unauthorized: 401,
    ErrorCode.not_found: 404,
    ErrorCode.method_not_allowed: 405,
    ErrorCode.too_large: 413,
    ErrorCode.internal_error: 500,
    ErrorCode.busy: 409,
    ErrorCode.request_timeout: 408,
}
"""HTTP status of each error code."""


class CreateRequest(_Model):
    """Open a session: build an environment and reset it to one task."""

    env_id: Name = Field(description="Registered environment id, e.g. 'babyai' (GET /envs lists them).")
    task_id: Union[TaskIndex, Name, None] = Field(
        default=None,
        description="Task within the split: an index (int >= 0) or a task name (str); None draws one at random.",
    )
    seed: Seed | None = Field(
        default=None, description=f"Seed of the episode, 0..{MAX_SEED}; None draws one (the response reports it)."
    )
    split: Name = Field(default="train", description="Task split, e.g. 'train' or 'test'.")
    params: dict[Name, ParamValue] = Field(
        default_factory=dict,
        description="Environment-specific options, each a JSON scalar; GET /envs lists the valid names and the "
        "JSON type of each.",
    )


class CreateResponse(_Model):
    """The new session and the first observation."""

    session_id: str = Field(description="Server-created id to pass to /step, /evaluate and /release.")
    env_id: str = Field(description="The environment id of the session.")
    task_id: str = Field(description="Name of the task that was reset (pass it back to replay the task).")
    seed: int = Field(description="The seed actually used (drawn when the request gave none).")
    observation: str = Field(description="First observation text.")
    info: dict[str, Any] = Field(default_factory=dict, description="Extra environment information.")


class StepRequest(_Model):
    """Apply one text action to a session."""

    session_id: Name = Field(description="Session id from /create.")
    action: ActionText = Field(description=f"The action text, e.g. 'go forward' (at most {MAX_ACTION_CHARS} characters).")


class StepResponse(_Model):
    """The outcome of one action (Gymnasium's step tuple)."""

    observation: str = Field(description="Observation text after the action.")
    reward: float = Field(description="Reward of this step.")
    terminated: bool = Field(description="The task ended (success or failure); no more steps.")
    truncated: bool = Field(description="We stopped the episode (e.g. max_steps reached); no more steps.")
    info: dict[str, Any] = Field(default_factory=dict, description="Extra information, e.g. 'steps'.")


class StepBatchRequest(_Model):
    """Several sessions' steps in one request (POST /steps): each is what a POST /step with that body would do."""

    steps: list[StepRequest] = Field(
        min_length=1, max_length=MAX_BATCH_STEPS,
        description=f"1..{MAX_BATCH_STEPS} steps, at most one per session (a session's second step in the same "
        "batch answers `busy`, as a concurrent /step would).",
    )


class StepOutcome(_Model):
    """What one step of a batch answered: the /step response, or the error /step would have answered."""

    status: int = Field(description="The HTTP status /step would have answered: 200, or the error's status.")
    step: StepResponse | None = Field(default=None, description="The step's outcome, when `status` is 200.")
    error: ErrorResponse | None = Field(default=None, description="Why the step was not applied, otherwise.")


class StepBatchResponse(_Model):
    """Response of POST /steps: one outcome per requested step, in the request's order."""

    results: list[StepOutcome] = Field(description="The outcome of each step, in the order they were sent.")


class EvaluateRequest(_Model):
    """Ask for the episode's score (allowed during and after the episode)."""

    session_id: Name = Field(description="Session id from /create.")


class EvaluateResponse(_Model):
    """The episode's score."""

    score: float = Field(ge=0.0, le=1.0, description="Episode score in [0, 1].")
    success: bool = Field(description="Whether the task was solved.")


class ReleaseRequest(_Model):
    """Close a session and free its environment."""

    session_id: Name = Field(description="Session id from /create.")


class ReleaseResponse(_Model):
    """Confirmation that a session was released."""

    session_id: str = Field(description="The released session id.")
    released: bool = Field(description="Always true: the session is closed (a session never created is a 404).")
    already_closed: bool = Field(
        default=False,
        description="True when the session had been closed before this call: by an earlier release (a retry "
        "whose first reply was lost), by the idle reaper, or after an env failure; `closed_by` says which.",
    )
    closed_by: str | None = Field(
        default=None, description="With `already_closed`: 'release', 'reaper', 'env_error', 'env_timeout', "
        "'worker_lost' or 'shutdown'.",
    )


class EnvSpec(_Model):
    """One served environment as listed by GET /envs."""

    id: str = Field(description="Environment id used in /create.")
    description: str = Field(description="One-line description of the environment.")
    tasks: dict[str, int] = Field(description="Number of tasks per split.")
    max_steps: int = Field(description="Steps after which the service truncates an episode.")
    max_sessions: int = Field(description="Most sessions of this environment open at once.")
    params: dict[str, str] = Field(description="Valid `params` names of /create and what each means.")
    param_types: dict[str, str] = Field(
        default_factory=dict,
        description="JSON type of each `params` name: 'boolean', 'integer', 'number', 'string' or 'any'.",
    )


class EnvList(_Model):
    """Response of GET /envs."""

    envs: list[EnvSpec] = Field(description="The environments this service serves.")


class Health(_Model):
    """Response of GET /healthz."""

    status: str = Field(description="'ok' when the service accepts requests.")
    sessions: int = Field(description="Sessions currently open.")
    max_sessions: int = Field(description="Most sessions open at once, all environments together.")
    envs: list[str] = Field(description="Ids of the served environments.")
    created: int = Field(default=0, description="Sessions created since the service started.")
    closed: dict[str, int] = Field(
        default_factory=dict,
        description="Sessions closed since the service started, by how ('release', 'reaper', 'env_error', "
        "'env_timeout', 'worker_lost', 'shutdown'); created = sessions + the sum of these.",
    )


class ErrorResponse(_Model):
    """Body of every non-2xx response."""

    code: ErrorCode = Field(description="Machine-readable error code.")
    message: str = Field(description="A sentence naming the bad field or the failing part.")
    valid_choices: list[Any] | None = Field(
        default=None, description="The accepted values, when the error is a wrong choice."
    )
    detail: list[dict[str, Any]] | None = Field(
        default=None,
        description="Per-field validation errors (422 only), as FastAPI reports them, with long inputs cut.",
    )
    request_id: str | None = Field(
        default=None, description="The request's id (also the X-Request-ID header), to find it in the service log.",
    )
