"""The HTTP connection layer under envservice: slow and greedy clients are cut off before they cost the others.

uvicorn (0.54) times out only an idle keep-alive connection, and un-arms even that on the first byte of a
request: a connection that sends nothing, half a request head, or one header byte every 10 s stays open for
ever, and its head may grow without bound (httptools has no size limit). Each such connection holds a file
descriptor; 300 of them made every honest `/healthz` fail under `ulimit -n 256`. So:

- `GuardedHttpToolsProtocol` (uvicorn's httptools protocol with two more rules) gives each request head
  `HEAD_TIMEOUT_S` from the moment its connection opened, or its previous response went out, to arrive
  whole (408 otherwise), and at most `MAX_HEAD_BYTES` of request line and headers (431 otherwise), both
  answered in envservice's JSON error format and followed by closing the connection;
- the body is read under a deadline by `server.RequestGuard` (408 `request_timeout`);
- bytes that are not HTTP/1.1 get a 400 in the same format (uvicorn's own is plain text);
- a connection whose host may not start another request on the loop (`envservice/host_slots.py`: all its loop
  slots taken, or it makes room for a light host) is not read until it may: one host's many connections cannot
  fill the event loop's queue in front of another host's request;
- `server_options` caps the connections uvicorn serves at once below the process's file-descriptor limit (503
  beyond it, from uvicorn), bounds the graceful shutdown, and keeps an idle connection open `KEEP_ALIVE_S`: well
  past the idle expiry of the clients that reuse connections (ours: `client.IDLE_EXPIRY_S`; httpx's and so the
  `openai` SDK's: 5 s, uvicorn's own timeout), so that a client never sends on a connection the server is closing.
"""

from __future__ import annotations

import asyncio
import json
import resource
import uuid
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from envservice.host_slots import LOOP_SLOT_STATE, LOOP_SLOTS_PER_HOST, HostSlots, LoopSlot

HEAD_TIMEOUT_S = 10.0
"""Seconds a request head may take to arrive whole (request line and headers)."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line and headers); real clients send well under 8 KiB."""
KEEP_ALIVE_S = 15.0
"""Seconds an idle keep-alive connection stays open (uvicorn's default, 5 s, equals httpx's client-side expiry: a
request sent at that moment was reset)."""
GRACEFUL_SHUTDOWN_S = 10.0
"""How long a stopping service waits for requests in flight before it closes their connections."""
SPARE_FILE_DESCRIPTORS = 128
"""Descriptors kept back from the connection cap for logs, pipes to workers and env files."""


def server_options(max_connections: int | None = None, head_timeout_s: float = HEAD_TIMEOUT_S,
                   loop_slots_per_host: int = LOOP_SLOTS_PER_HOST,
                   keep_alive_s: float = KEEP_ALIVE_S) -> dict[str, Any]:
    """uvicorn.Config options: the guarded protocol with this head deadline and this many loop slots per client
    host (0: no limit), the connection cap (default: the file-descriptor limit less SPARE_FILE_DESCRIPTORS), the
    idle keep-alive timeout and the shutdown bound."""
    if not head_timeout_s > 0:
        raise ValueError(f"head_timeout_s must be > 0, got {head_timeout_s}")
    if not keep_alive_s > 0:
        raise ValueError(f"keep_alive_s must be > 0, got {keep_alive_s}")
    protocol = type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                    {"head_timeout_s": head_timeout_s, "host_slots": HostSlots(loop_slots_per_host)})
    # ws "none": envservice has no WebSocket route, and an upgraded connection would leave this protocol without
    # ever closing it here, keeping its loop slot.
    return {"http": protocol, "ws": "none", "limit_concurrency": max_connections or default_max_connections(),
            "timeout_keep_alive": keep_alive_s, "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S}


def default_max_connections() -> int:
    """What this process can hold open: its soft RLIMIT_NOFILE less the spare, at least 64."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft - SPARE_FILE_DESCRIPTORS)


def error_bytes(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP response in envservice's error format (`protocol.ErrorResponse`, with a request id like every
    other answer), closing the connection."""
    request_id = uuid.uuid4().hex[:16]
    body = json.dumps({"code": code, "message": message, "request_id": request_id}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {request_id}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size limit on every request head, and a loop slot of
    its client host for every request (module docstring)."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    """Seconds a request head may take (`server_options` makes a subclass with another value)."""
    host_slots: HostSlots = HostSlots(0)
    """The service's loop slots per client host (`server_options` gives each server its own); here: no limit."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._refused = False
        self._head_deadline: asyncio.TimerHandle | None = None
        self._slot: LoopSlot | None = None
        self._unread: list[bytes] = []  # what arrived while the connection waited for a slot (reading paused)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self.host_slots.cancel(self._host, self._slot_granted)
        self._release_slot()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answered and closing: nothing more is parsed
            return
        if self._unread:  # still waiting for a slot (bytes read just before the pause took effect)
            self._unread.append(data)
            return
        if self._slot is None:
            self._slot = self.host_slots.take(self._host, self._slot_granted)
            if self._slot is None:  # the host's slots are all taken: keep these bytes, read no more until one frees
                self._unread.append(data)
                self.transport.pause_reading()
                self._unset_keepalive_if_required()  # a request is here: the idle keep-alive timer must not close it
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        # The app gives the slot back when the request's env call goes to the pool or its answer starts
        # (envservice/host_slots.py). A request pipelined behind another on one connection runs without a slot of
        # its own (its bytes are read already).
        self.scope.setdefault("state", {})[LOOP_SLOT_STATE] = self._slot
        if self._head_deadline is None:
            self._arm_head_deadline()

    # After a refusal the parser may still call back for the rest of the bytes it holds: those calls do
    # nothing (no request is started on a connection that was answered and is closing).

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn answers to bytes that are not HTTP/1.1 (a negative or doubled Content-Length, a non-ASCII
        request line), in our JSON error format instead of its plain text."""
        self._refused = True
        self._cancel_head_deadline()
        self.transport.write(error_bytes(400, "Bad Request", "bad_request",
                                         f"{msg.rstrip('.')}: the request line or headers are not valid HTTP/1.1"))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._release_slot()  # the connection's next request takes a slot again when its first bytes come
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head, from the end of this response

    # ---- the rules ---------------------------------------------------------------------------------

    @property
    def _host(self) -> str:
        return self.client[0] if self.client else "?"

    def _slot_granted(self, slot: LoopSlot) -> None:
        """The host may start this connection's request now (a slot came free, or the host's giving way ended):
        read what waited, on the next loop iteration rather than inside another connection's callback."""
        self._slot = slot
        self.loop.call_soon(self._read_unread)

    def _read_unread(self) -> None:
        if self.transport.is_closing():  # closed meanwhile: connection_lost gives the slot back
            return
        data, self._unread = b"".join(self._unread), []
        self.transport.resume_reading()
        self.data_received(data)

    def _release_slot(self) -> None:
        if self._slot is not None:
            self._slot.close()  # the request is over: off the loop and no longer in progress
            self._slot = None

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES and not self._refused:
            self._refuse(431, "Request Header Fields Too Large", "too_large",
                         f"the request head is over {MAX_HEAD_BYTES} bytes")

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and not self._refused:
            self._refuse(408, "Request Timeout", "request_timeout",
                         f"the request head did not arrive whole within {self.head_timeout_s:g} s")

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        self._refused = True
        self._cancel_head_deadline()
        self.transport.write(error_bytes(status, reason, code, message))
        self.transport.close()

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
