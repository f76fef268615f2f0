"""The wire protocol of the environment service: the single definition used by server and client.

Every request and response is a pydantic v2 model that forbids unknown fields, so a typo in a field
name is a 422 on the server and a validation error on the client instead of a silently ignored key.
Errors never travel inside a 200: they are an `ErrorResponse` with the HTTP status in `ERROR_STATUS`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    """Base of every protocol model: unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")


class ErrorCode(str, Enum):
    """Machine-readable error codes; each maps to one HTTP status in `ERROR_STATUS`.

    `env_error`: the env raised or its worker died; `env_timeout`: an env call ran past the service's
    `--step-timeout`. Both close that session only (a timed-out step may have been applied: not retried).
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
}
"""HTTP status of each error code."""


class CreateRequest(_Model):
    """Open a session: build an environment and reset it to one task."""

    env_id: str = Field(description="Registered environment id, e.g. 'babyai' (GET /envs lists them).")
    task_id: int | str | None = Field(
        default=None,
        description="Task within the split: an index (int) or a task name (str); None draws one at random.",
    )
    seed: int | None = Field(
        default=None, description="Seed of the episode; None draws one (the response reports it)."
    )
    split: str = Field(default="train", description="Task split, e.g. 'train' or 'test'.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Environment-specific options (GET /envs lists the valid names)."
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

    session_id: str = Field(description="Session id from /create.")
    action: str = Field(description="The action text, e.g. 'go forward'.")


class StepResponse(_Model):
    """The outcome of one action (Gymnasium's step tuple)."""

    observation: str = Field(description="Observation text after the action.")
    reward: float = Field(description="Reward of this step.")
    terminated: bool = Field(description="The task ended (success or failure); no more steps.")
    truncated: bool = Field(description="We stopped the episode (e.g. max_steps reached); no more steps.")
    info: dict[str, Any] = Field(default_factory=dict, description="Extra information, e.g. 'steps'.")


class EvaluateRequest(_Model):
    """Ask for the episode's score (allowed during and after the episode)."""

    session_id: str = Field(description="Session id from /create.")


class EvaluateResponse(_Model):
    """The episode's score."""

    score: float = Field(ge=0.0, le=1.0, description="Episode score in [0, 1].")
    success: bool = Field(description="Whether the task was solved.")


class ReleaseRequest(_Model):
    """Close a session and free its environment."""

    session_id: str = Field(description="Session id from /create.")


class ReleaseResponse(_Model):
    """Confirmation that a session was released."""

    session_id: str = Field(description="The released session id.")
    released: bool = Field(description="Always true; an unknown session is a 404 instead.")


class EnvSpec(_Model):
    """One served environment as listed by GET /envs."""

    id: str = Field(description="Environment id used in /create.")
    description: str = Field(description="One-line description of the environment.")
    tasks: dict[str, int] = Field(description="Number of tasks per split.")
    max_steps: int = Field(description="Steps after which the service truncates an episode.")
    max_sessions: int = Field(description="Most sessions of this environment open at once.")
    params: dict[str, str] = Field(description="Valid `params` names of /create and what each means.")


class EnvList(_Model):
    """Response of GET /envs."""

    envs: list[EnvSpec] = Field(description="The environments this service serves.")


class Health(_Model):
    """Response of GET /healthz."""

    status: str = Field(description="'ok' when the service accepts requests.")
    sessions: int = Field(description="Sessions currently open.")
    max_sessions: int = Field(description="Most sessions open at once, all environments together.")
    envs: list[str] = Field(description="Ids of the served environments.")


class ErrorResponse(_Model):
    """Body of every non-2xx response."""

    code: ErrorCode = Field(description="Machine-readable error code.")
    message: str = Field(description="A sentence naming the bad field or the failing part.")
    valid_choices: list[Any] | None = Field(
        default=None, description="The accepted values, when the error is a wrong choice."
    )
    detail: list[dict[str, Any]] | None = Field(
        default=None, description="Per-field validation errors (422 only), as FastAPI reports them."
    )
