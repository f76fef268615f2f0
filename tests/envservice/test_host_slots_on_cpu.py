"""Fair sharing of the event loop between client hosts (envservice/host_slots.py, issue #33 finding 3).

32 raw-socket connections from one host used to keep 32 requests in the event loop's queue, in front of every
other host's request (bench/soak.py's greedy phase: an honest client's p99 went from 2.1 to 32.6 ms). Now a host
has at most N requests on the loop; its others wait unread; and a heavy host makes room for an active light one
(one slot, giving way). By hand on `HostSlots` with a hand-driven clock, then on a live service over loopback, where
the "other host" is another loopback address (127.0.0.2).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Iterator

import pytest
import uvicorn

from envservice.__main__ import parse_args
from envservice.body_check import LARGE_BODY_BYTES
from envservice.client import EnvClient
from envservice.host_slots import SHARING_WINDOW_S, HostSlots, LoopSlot
from envservice.process import EnvServiceProcess
from envservice.transport import server_options

pytestmark = pytest.mark.timeout(120)

OTHER_HOST = "127.0.0.2"
"""A second loopback address: a client from another host (Linux routes all of 127.0.0.0/8 to loopback)."""


class Clock:
    """A hand-driven clock and timer for HostSlots: `advance(s)` moves time and fires the timers that are due."""

    def __init__(self) -> None:
        self.now, self.timers = 0.0, []

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback) -> "Clock.Timer":
        timer = Clock.Timer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for timer in sorted(self.timers, key=lambda timer: timer.due):
            if timer.due <= self.now + 1e-12 and not timer.cancelled:
                self.timers.remove(timer)
                timer.callback()

    class Timer:
        def __init__(self, due: float, callback) -> None:
            self.due, self.callback, self.cancelled = due, callback, False

        def cancel(self) -> None:
            self.cancelled = True


def hand_slots(per_host: int, give_way_s: float = 0.002) -> tuple[HostSlots, Clock]:
    """HostSlots on a hand-driven clock."""
    clock = Clock()
    return HostSlots(per_host, give_way_s, clock=clock, call_later=clock.call_later), clock


def test_a_host_gets_at_most_its_slots_and_the_next_waiter_gets_a_freed_one() -> None:
    slots, _ = hand_slots(2)
    granted = []
    first, second = slots.take("a", granted.append), slots.take("a", granted.append)
    waiter_1, waiter_2 = (lambda slot: granted.append(("w1", slot))), (lambda slot: granted.append(("w2", slot)))
    assert isinstance(first, LoopSlot) and isinstance(second, LoopSlot)
    assert slots.take("a", waiter_1) is None and slots.take("a", waiter_2) is None
    assert slots.held("a") == 2 and slots.waiting("a") == 2
    first.release()
    assert [name for name, _ in granted] == ["w1"] and slots.held("a") == 2 and slots.waiting("a") == 1
    first.release()  # a second release of the same slot gives nothing more away
    assert slots.held("a") == 2 and slots.waiting("a") == 1 and slots.in_progress("a") == 3
    first.close()  # its answer went out: no longer in progress; closing again changes nothing
    first.close()
    assert slots.in_progress("a") == 2
    slots.cancel("a", waiter_2)  # its connection closed while it waited
    granted[0][1].close()
    second.close()
    assert slots.held("a") == 0 and slots.waiting("a") == 0 and slots.in_progress("a") == 0 and len(granted) == 1


def test_a_newcomer_queues_behind_the_waiters_even_when_a_slot_is_free_for_a_moment() -> None:
    slots, _ = hand_slots(1)
    order = []
    held = slots.take("a", order.append)
    assert slots.take("a", lambda slot: order.append("first waiter")) is None
    held.release()  # passes straight to the waiter: nobody can overtake it
    assert order == ["first waiter"] and slots.take("a", order.append) is None


def heavy_host_with_waiters(slots: HostSlots, granted: list, waiting: int = 4) -> list[LoopSlot]:
    """Host "heavy" takes all 4 of its slots and queues `waiting` more requests (load over per_host: not light)."""
    held = [slots.take("heavy", granted.append) for _ in range(4)]
    assert all(isinstance(slot, LoopSlot) for slot in held)  # alone, it gets per_host slots
    assert all(slots.take("heavy", granted.append) is None for _ in range(waiting))
    return held


def test_beside_an_active_light_host_a_heavy_host_gets_one_slot_until_the_window_ends() -> None:
    slots, clock = hand_slots(4)
    granted = []
    assert slots.take("heavy", print) is not None
    slots.take("light", print).close()  # a light host (fewer requests: 0 against 1) was just active
    assert slots.take("heavy", granted.append) is None  # so the heavy host's second request waits
    clock.advance(SHARING_WINDOW_S)
    assert len(granted) == 1 and slots.held("heavy") == 2

    slots, clock = hand_slots(4)
    granted = []
    held = heavy_host_with_waiters(slots, granted)
    light = slots.take("light", print)
    assert isinstance(light, LoopSlot)  # a light host never waits for a heavy one
    light.close()  # answered at once: nothing to give way to, but it was active just now
    for slot in held[:3]:
        slot.close()
    assert slots.held("heavy") == 1 and granted == []  # one slot: the one still on the loop
    clock.advance(SHARING_WINDOW_S / 2)
    held[3].close()
    assert slots.held("heavy") == 1 and len(granted) == 1  # one at a time while the light host is recent
    clock.advance(SHARING_WINDOW_S / 2)  # the light host's last start is now SHARING_WINDOW_S old: a timer looks
    assert slots.held("heavy") == 4 and len(granted) == 4 and slots.waiting("heavy") == 0


def test_a_heavy_host_gives_way_to_a_light_hosts_request_until_it_is_answered_or_for_give_way_s() -> None:
    slots, clock = hand_slots(4, give_way_s=0.002)
    granted = []
    held = heavy_host_with_waiters(slots, granted, waiting=6)
    light = slots.take("light", print)
    for slot in held:
        slot.close()  # the heavy host has room, but the light host's request is in progress
    assert slots.held("heavy") == 0 and granted == []
    clock.advance(0.001)
    light.close()  # answered: the heavy host goes on at once, before its give_way_s is up
    assert slots.held("heavy") == 1 and len(granted) == 1
    slots.take("light", print)  # the light host's next request (a slow env step: in progress for long)
    granted.pop().close()
    clock.advance(0.0015)
    slots.take("light", print)  # and another: the light host is still starting requests
    assert granted == [] and slots.in_progress("light") == 2
    clock.advance(0.0005)  # it gave way for give_way_s: it goes on though the light host is still active
    assert len(granted) == 1 and slots.waiting("heavy") == 4
    clock.advance(0.002)  # the light host's requests started give_way_s ago: no more giving way for them
    granted.pop().close()
    assert len(granted) == 1 and slots.waiting("heavy") == 3  # at once, but still one slot: the light host is
    # still lighter (2 requests against 4) and started one within SHARING_WINDOW_S


def test_heavy_hosts_side_by_side_and_give_way_zero_are_not_held_back() -> None:
    slots, _ = hand_slots(4)
    granted = []
    trainer_1 = [slots.take("trainer-1", granted.append) for _ in range(4)]
    assert all(slots.take("trainer-1", granted.append) is None for _ in range(6))  # load 10
    assert all(slots.take("trainer-2", print) is not None for _ in range(4))
    assert all(slots.take("trainer-2", print) is None for _ in range(2))  # load 6: lighter, but not light
    trainer_1[0].close()
    assert len(granted) == 1 and slots.held("trainer-1") == 4  # neither one slot nor giving way
    plain, _ = hand_slots(4, give_way_s=0)
    granted = []
    held = heavy_host_with_waiters(plain, granted)
    assert plain.take("light", print) is not None
    held[0].close()
    assert len(granted) == 1  # give_way_s 0: no giving way and no one-slot rule


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
    """A live service giving each client host 2 loop slots, with 2 s steps (for the pool test) and a 2 s keep-alive
    timeout (for the third request's wait)."""
    log = tmp_path_factory.mktemp("slots") / "service.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--loop-slots-per-host", "2", "--step-delay", "fixed:2",
                                                       "--keep-alive", str(KEPT_ALIVE_S)],
                           log_path=log, startup_timeout_s=60) as service:
        yield service.url


KEPT_ALIVE_S = 2.0
"""The keep-alive timeout of `two_slot_service`."""


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
CREATE_HEAD = (b"POST /create HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n")
STEP_HEAD = b"POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def test_a_hosts_third_request_waits_unread_while_another_host_is_answered(two_slot_service: str) -> None:
    """Two half-sent bodies from one host hold its two slots: its third request is not read until one of them
    ends, while a request from another host is answered at once (before, the third was answered at once too).
    The third waits on a kept-alive connection past the service's keep-alive timeout, which must not close it."""
    holders = [_connect(two_slot_service, OTHER_HOST) for _ in range(2)]
    third = _connect(two_slot_service, OTHER_HOST)
    try:
        third.sendall(HEALTHZ)
        assert _answered_within(third, 10).startswith(b"HTTP/1.1 200")  # kept alive: its idle timer runs
        for holder in holders:
            holder.sendall(STEP_HEAD % len(STEP_BODY) + STEP_BODY[:1])
        time.sleep(0.3)  # the two bodies are being read
        third.sendall(HEALTHZ)
        unread = _answered_within(third, KEPT_ALIVE_S + 1) == b""
        assert unread, "the host's third request was read beside its two others"
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


def test_large_bodies_hold_no_slot_once_they_wait_for_their_hosts_turn(two_slot_service: str) -> None:
    """A body over 64 KiB is read and checked one at a time per host, after its host's share of the checking helper
    allows (envservice/body_check.py): from then on the turn bounds it, and it gives its slot back as an env call
    does. Two such half-sent bodies of one host, and the same host's /healthz is still answered (before, the two
    held both slots, and a host whose large bodies waited for their share stalled its every other request)."""
    head = CREATE_HEAD % (LARGE_BODY_BYTES + 10)
    large = [_connect(two_slot_service, OTHER_HOST) for _ in range(2)]
    asker = _connect(two_slot_service, OTHER_HOST)
    try:
        for sock in large:
            sock.sendall(head + b"{")
        time.sleep(0.3)  # one is being read, the other waits for the host's turn
        asker.sendall(HEALTHZ)
        assert _answered_within(asker, 3).startswith(b"HTTP/1.1 200")
    finally:
        for sock in (*large, asker):
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


def test_every_request_that_took_a_slot_is_closed_by_the_connection_layer() -> None:
    """The connection layer (envservice/transport.py) closes each request's slot however the request ends, so a
    host never looks busier than it is: answered on a kept-alive connection, dropped mid-body, refused for its
    head. Served in this process by uvicorn with the guarded protocol, so the host's counts can be read."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    options = server_options(loop_slots_per_host=2)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **options))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url, slots = f"http://127.0.0.1:{port}", options["http"].host_slots
    try:
        with _connect(url, OTHER_HOST) as kept_alive:
            for _ in range(5):
                kept_alive.sendall(HEALTHZ)
                assert _answered_within(kept_alive, 10).startswith(b"HTTP/1.1 200")
        with _connect(url, OTHER_HOST) as dropped:
            dropped.sendall(STEP_HEAD % 1000 + b"{")
            time.sleep(0.2)
        with _connect(url, OTHER_HOST) as refused:
            refused.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n")
            assert _answered_within(refused, 10).startswith(b"HTTP/1.1 431")
        deadline = time.monotonic() + 5
        while (slots.in_progress(OTHER_HOST) or slots.held(OTHER_HOST)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (slots.held(OTHER_HOST), slots.in_progress(OTHER_HOST), slots.waiting(OTHER_HOST)) == (0, 0, 0)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
