"""The exception type of the environment service, raised by the server and by the client (one subclass:
`EnvTimeoutError` for the `env_timeout` code, so callers can catch a timed-out env call by type)."""

from __future__ import annotations

from typing import Any, Sequence

from envservice.protocol import ERROR_STATUS, ErrorCode, ErrorResponse

CLIP_CHARS = 200
"""How much of a caller's input an error message or observation quotes at most."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text` cut to `limit` characters with a marker saying how many were left out: a message never echoes
    unbounded input back (a 50 MB action would otherwise come back whole)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"


class EnvServiceError(Exception):
    """An error with a protocol code: the server turns it into an `ErrorResponse`, the client raises it back.

    `status` defaults to the HTTP status that belongs to `code` (see `protocol.ERROR_STATUS`).
    """

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        status: int | None = None,
        valid_choices: Sequence[Any] | None = None,
        detail: list[dict[str, Any]] | None = None,
    ) -> None:
        self.code = ErrorCode(code)
        self.message = message
        self.status = status if status is not None else ERROR_STATUS[self.code]
        self.valid_choices = list(valid_choices) if valid_choices is not None else None
        self.detail = detail
        super().__init__(f"[{self.code.value}] {message}")

    def to_response(self) -> ErrorResponse:
        """The wire form of this error."""
        return ErrorResponse(
            code=self.code, message=self.message, valid_choices=self.valid_choices, detail=self.detail
        )

    @classmethod
    def from_response(cls, response: ErrorResponse, status: int) -> "EnvServiceError":
        """Rebuild the error a server sent (used by the client); `env_timeout` becomes `EnvTimeoutError`."""
        error_class = EnvTimeoutError if response.code == ErrorCode.env_timeout else cls
        return error_class(response.code, response.message, status, response.valid_choices, response.detail)


class EnvTimeoutError(EnvServiceError):
    """An env call ran past the service's per-call limit (`env_timeout`, HTTP 504); its session was closed.

    Never retried by the client: a step that timed out may have been applied.
    """
