"""Reading an HTTP request's body in an ASGI layer before the app does: bounded as it arrives, then handed on.

Used by envservice's `server.RequestGuard` and by the trainer's gateway, so that an oversized upload is refused
without being kept whole, and the app still reads the body as usual.
"""

from __future__ import annotations

from starlette.types import Message, Receive


class BodyTooLarge(Exception):
    """The body grew past the limit while it was read (no Content-Length told us before)."""


async def read_body(receive: Receive, max_bytes: int) -> bytes:
    """The whole body, refusing it (`BodyTooLarge`) as soon as it grows past `max_bytes`; what arrived so far
    when the client went away."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body read already, then passes on what the server sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
