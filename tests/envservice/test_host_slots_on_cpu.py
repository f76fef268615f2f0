"""Fair sharing of the event loop between client hosts (envservice/host_slots.py, issue #33 finding 3).

32 raw-socket connections from one host used to keep 32 requests in the event loop's queue, in front of every
other host's request (bench/soak.py's greedy phase: an honest client's p99 went from 2.1 to 32.6 ms). Now a host
has at most N requests on the loop; its others wait unread. By hand on `HostSlots`, then on a live service over
loopback, where the "other host" is another loopback address (127.0.0.2).
"""

from __future__ import annotations

import socket
import time
from typing import Iterator

import pytest

from envservice.__main__ import parse_args
from envservice.client import EnvClient
from envservice.host_slots import HostSlots, LoopSlot
from envservice.process import EnvServiceProcess

pytestmark = pytest.mark.timeout(120)

OTHER_HOST = "127.0.0.2"
"""A second loopback address: a client from another host (Linux routes all of 127.0.0.0/8 to loopback)."""


def test_a_host_gets_at_most_its_slots_and_the_next_waiter_gets_a_freed_one() -> None:
    slots, granted = HostSlots(2), []
    first, second = slots.take("a", granted.append), slots.take("a", granted.append)
    waiter_1, waiter_2 = (lambda slot: granted.append(("w1", slot))), (lambda slot: granted.append(("w2", slot)))
    assert isinstance(first, LoopSlot) and isinstance(second, LoopSlot)
    assert slots.take("a", waiter_1) is None and slots.take("a", waiter_2) is None
    assert slots.held("a") == 2 and slots.waiting("a") == 2
    assert slots.take("b", granted.append) is not None  # another host is not held back by a's
    first.release()
    assert [name for name, _ in granted] == ["w1"] and slots.held("a") == 2 and slots.waiting("a") == 1
    first.release()  # a second release of the same slot gives nothing more away
    assert slots.held("a") == 2 and slots.waiting("a") == 1
    slots.cancel("a", waiter_2)  # its connection closed while it waited
    granted[0][1].release()
    second.release()
    assert slots.held("a") == 0 and slots.waiting("a") == 0 and len(granted) == 1


def test_a_newcomer_queues_behind_the_waiters_even_when_a_slot_is_free_for_a_moment() -> None:
    slots, order = HostSlots(1), []
    held = slots.take("a", order.append)
    assert slots.take("a", lambda slot: order.append("first waiter")) is None
    held.release()  # passes straight to the waiter: nobody can overtake it
    assert order == ["first waiter"] and slots.take("a", order.append) is None


def test_no_limit_and_bad_counts() -> None:
    unlimited = HostSlots(0)
    assert all(unlimited.take("a", print) is not None for _ in range(100)) and unlimited.held("a") == 0
    with pytest.raises(ValueError, match="loop slots per host must be >= 0"):
        HostSlots(-1)
    assert parse_args([]).loop_slots_per_host == 4
    with pytest.raises(SystemExit, match="--loop-slots-per-host -2 is invalid; give a count >= 1, or 0 for no limit"):
        parse_args(["--loop-slots-per-host", "-2"])


# ---- on a live service ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_slot_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live service giving each client host 2 loop slots, with 2 s steps (for the pool test)."""
    log = tmp_path_factory.mktemp("slots") / "service.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--loop-slots-per-host", "2", "--step-delay", "fixed:2"],
                           log_path=log, startup_timeout_s=60) as service:
        yield service.url


def _connect(url: str, source: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def _answered_within(sock: socket.socket, seconds: float) -> bytes:
    """The server's whole answer (head and body) if it started within `seconds`; b"" for nothing yet or closed."""
    sock.settimeout(seconds)
    try:
        answer = sock.recv(65536)
    except socket.timeout:
        return b""
    sock.settimeout(10)
    while answer and not _whole(answer):  # the head and the body may come in separate reads
        answer += sock.recv(65536)
    return answer


def _whole(answer: bytes) -> bool:
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    return len(body) >= length


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
STEP_BODY = b'{"session_id": "nope", "action": "left"}'
STEP_HEAD = b"POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def test_a_hosts_third_request_waits_unread_while_another_host_is_answered(two_slot_service: str) -> None:
    """Two half-sent bodies from one host hold its two slots: its third request is not read until one of them
    ends, while a request from another host is answered at once (before, the third was answered at once too).
    The third waits on a kept-alive connection past uvicorn's 5 s keep-alive timeout, which must not close it."""
    holders = [_connect(two_slot_service, OTHER_HOST) for _ in range(2)]
    third = _connect(two_slot_service, OTHER_HOST)
    try:
        third.sendall(HEALTHZ)
        assert _answered_within(third, 10).startswith(b"HTTP/1.1 200")  # kept alive: its idle timer runs
        for holder in holders:
            holder.sendall(STEP_HEAD % len(STEP_BODY) + STEP_BODY[:1])
        time.sleep(0.3)  # the two bodies are being read
        third.sendall(HEALTHZ)
        assert _answered_within(third, 6.0) == b"", "the host's third request was read beside its two others"
        assert EnvClient(two_slot_service, retries=0).health().status == "ok"  # 127.0.0.1: another host
        holders[0].sendall(STEP_BODY[1:])  # its body ends (an unknown session: 404) and its slot is free
        assert _answered_within(holders[0], 10).startswith(b"HTTP/1.1 404")
        answer = _answered_within(third, 10)
        assert answer.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in answer, answer[:300]
    finally:
        for sock in (*holders, third):
            sock.close()


def test_an_env_call_holds_no_slot(two_slot_service: str) -> None:
    """Two 2 s steps of one host in the pool, and its /healthz is answered before either ends: a request gives its
    slot back when its env call goes to the pool."""
    client = EnvClient(two_slot_service, retries=0)
    sessions = [client.create("frozenlake", task_id=0).session_id for _ in range(2)]
    steppers = [_connect(two_slot_service, OTHER_HOST) for _ in range(2)]
    asker = _connect(two_slot_service, OTHER_HOST)
    try:
        for sock, session in zip(steppers, sessions):
            body = f'{{"session_id": "{session}", "action": "left"}}'.encode()
            sock.sendall(STEP_HEAD % len(body) + body)
        time.sleep(0.2)  # both steps are in the pool (each sleeps 2 s there)
        asker.sendall(HEALTHZ)
        assert _answered_within(asker, 1.5).startswith(b"HTTP/1.1 200")
        assert all(_answered_within(sock, 0.01) == b"" for sock in steppers), "a step ended first: nothing proven"
        assert all(_answered_within(sock, 10).startswith(b"HTTP/1.1 200") for sock in steppers)
    finally:
        for sock in (*steppers, asker):
            sock.close()


def test_an_upgrade_request_is_answered_as_http_and_keeps_no_slot(two_slot_service: str) -> None:
    """envservice has no WebSocket route: an upgrade request is answered over HTTP and its connection closed in
    this layer, so its slot comes back (an upgraded connection would never give it back)."""
    upgrade = (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
               b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    for _ in range(3):  # more than the host's 2 slots
        with _connect(two_slot_service, OTHER_HOST) as sock:
            sock.sendall(upgrade)
            assert not _answered_within(sock, 10).startswith(b"HTTP/1.1 101")
    with _connect(two_slot_service, OTHER_HOST) as sock:
        sock.sendall(HEALTHZ)
        assert _answered_within(sock, 10).startswith(b"HTTP/1.1 200")
