"""The pre-validation JSON check of request bodies and where it runs (envservice/body_check.py, issue #33).

A large body is checked in a helper process and one at a time per client host, so that 32 huge bodies from
one greedy client no longer hold the event loop ~30 ms each in front of everyone else's requests."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal

import pytest

from envservice.__main__ import parse_args
from envservice.body_check import (LARGE_BODY_BYTES, MAX_OBJECT_KEYS, BodyChecker, refusal_reason,
                                     timed_refusal_reason)

WIDE = json.dumps({"env_id": "frozenlake", "params": {f"p{i}": [[i]] for i in range(30_000)}}).encode()
PADDED = json.dumps({"env_id": "frozenlake", "params": {"text": "x" * (2 * LARGE_BODY_BYTES)}}).encode()


@pytest.mark.parametrize("body, reason", [
    (b'{"seed": NaN}', "the body holds NaN, which is not JSON"),
    (b'{"a": 1, "a": 2}', "the body gives the key(s) ['a'] more than once in one object"),
    (json.dumps({f"k{i}": i for i in range(MAX_OBJECT_KEYS + 1)}).encode(),
     f"an object of the body has {MAX_OBJECT_KEYS + 1} keys; the protocol's objects have at most {MAX_OBJECT_KEYS}"),
    (json.dumps({f"k{i}": i for i in range(MAX_OBJECT_KEYS)}).encode(), None),
    (b"not json at all", None),  # left to validation, which names the fault
    (b"", None),
])
def test_refusal_reasons_by_hand(body: bytes, reason: str | None) -> None:
    found = refusal_reason(body)
    assert (found is None and reason is None) or (reason is not None and found.startswith(reason)), found


def test_large_bodies_are_checked_in_the_helper_which_is_restarted_when_it_dies() -> None:
    async def scenario() -> None:
        checker = BodyChecker()
        try:
            assert await checker.reason(b'{"a": 1, "a": 2}') is not None and checker._pool is None  # small: inline
            assert (await checker.reason(WIDE)).startswith("an object of the body has 30000 keys")
            assert await checker.reason(PADDED) is None
            helper = next(iter(checker._pool._processes))  # the one helper process that answered
            assert helper != os.getpid()
            os.kill(helper, signal.SIGKILL)
            await asyncio.sleep(0.5)
            # The body at hand is still answered (on the loop), and the next one starts a new helper.
            assert (await checker.reason(WIDE)).startswith("an object of the body has 30000 keys")
            assert (await checker.reason(WIDE)).startswith("an object of the body has 30000 keys")
            assert helper not in checker._pool._processes
        finally:
            checker.close()

    asyncio.run(scenario())


def test_the_helper_yields_the_cpu_and_runs_without_the_cycle_collector() -> None:
    """Where the helper shares a core with the event loop it must not take it (a pinned soak's greedy phase:
    honest p99 168-246 ms before, 11.8 ms at nice 10; SCHED_IDLE yields at once), and its parses must not pay for
    full collections (732 of them, 15.9 s in a 30 s phase): JSON results hold no cycles."""
    async def scenario() -> None:
        checker = BodyChecker()
        try:
            assert (await checker.reason(WIDE)).startswith("an object of the body has 30000 keys")
            helper = checker._helper()
            assert helper.submit(gc.isenabled).result(timeout=30) is False
            assert helper.submit(os.sched_getscheduler, 0).result(timeout=30) == os.SCHED_IDLE
            assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the service itself keeps its priority
            assert gc.isenabled()  # the service's own process keeps its collector
        finally:
            checker.close()

    asyncio.run(scenario())


def test_one_large_body_at_a_time_per_host_and_small_ones_pass() -> None:
    async def scenario() -> list[str]:
        checker, order = BodyChecker(), []

        async def request(name: str, host: str, length: int | None) -> None:
            async with checker.turn(host, length):
                order.append(f"{name} in")
                await asyncio.sleep(0.05)
                order.append(f"{name} out")

        large = LARGE_BODY_BYTES + 1
        await asyncio.gather(request("a1", "10.0.0.1", large), request("a2", "10.0.0.1", large),
                             request("b1", "10.0.0.2", large), request("a-small", "10.0.0.1", 100),
                             request("a-chunked", "10.0.0.1", None))  # unknown length: it may be large
        assert checker._host_turns == {}, "a host's turn is forgotten once nobody holds or waits for it"
        return order

    order = asyncio.run(scenario())
    # a2 and the chunked body wait for a1 (same host); b1 (another host) and the small body of host 1 do not wait.
    assert order.index("a2 in") > order.index("a1 out") and order.index("a-chunked in") > order.index("a1 out"), order
    assert order.index("b1 in") < order.index("a1 out") and order.index("a-small in") < order.index("a1 out"), order


def test_a_host_waits_for_its_share_of_the_helper_after_a_costly_check() -> None:
    """At share 0.2, a check of 20 ms CPU makes that host's next large body wait 20 * (1/0.2 - 1) = 80 ms after
    it; another host's large body, and a small body of the same host, do not wait, and the wait is for one check
    only. Share 0 is no limit. Why: 30 000-entry bodies, ~100 a second, kept the helper busy beside the service
    on its one core and set an honest client's p99 at 2.2-2.6x quiet (a pinned soak's greedy phase)."""
    large = LARGE_BODY_BYTES + 1

    async def waited(checker: BodyChecker, host: str, length: int) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with checker.turn(host, length):
            return loop.time() - started

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        checker = BodyChecker(large_body_share=0.2)
        checker.charge("10.0.0.1", 0.020, charged_at := loop.time())
        assert await waited(checker, "10.0.0.2", large) < 0.03
        assert await waited(checker, "10.0.0.1", 100) < 0.03
        await waited(checker, "10.0.0.1", large)
        # asyncio may wake a timer up to its clock resolution early (1 ns on Linux; 1 ms of slack is plenty)
        assert 0.079 <= loop.time() - charged_at < 0.5
        assert await waited(checker, "10.0.0.1", large) < 0.03
        unlimited = BodyChecker(large_body_share=0)
        unlimited.charge("10.0.0.1", 10.0, loop.time())
        assert await waited(unlimited, "10.0.0.1", large) < 0.03

    asyncio.run(scenario())
    with pytest.raises(ValueError, match=r"large_body_share 1.5 is invalid; give a fraction in \[0, 1\]"):
        BodyChecker(large_body_share=1.5)
    assert parse_args([]).large_body_share == 0.005
    with pytest.raises(SystemExit, match=r"--large-body-share -0.1 is invalid; give a fraction in \[0, 1\], or 0 for"):
        parse_args(["--large-body-share", "-0.1"])


def test_a_check_in_the_helper_is_charged_to_the_host_given_at_its_cpu_time() -> None:
    """The helper times its own parse; `reason(body, host)` charges it to `host`, `reason(body)` to nobody."""
    reason, cpu_s = timed_refusal_reason(WIDE)
    assert reason.startswith("an object of the body has 30000 keys") and cpu_s > 0
    assert timed_refusal_reason(b"{}") == (None, pytest.approx(0, abs=0.01))
    large = LARGE_BODY_BYTES + 1

    async def scenario() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        checker = BodyChecker(large_body_share=0.05)  # waits 19x the check's CPU time
        try:
            await checker.reason(WIDE)  # starts the helper; charged to nobody
            _, helper_cpu_s = checker._helper().submit(timed_refusal_reason, WIDE).result(timeout=30)
            started = loop.time()
            async with checker.turn("10.0.0.1", large):
                uncharged = loop.time() - started
            await checker.reason(WIDE, "10.0.0.1")
            started = loop.time()
            async with checker.turn("10.0.0.1", large):
                charged = loop.time() - started
            return uncharged, charged, helper_cpu_s
        finally:
            checker.close()

    uncharged, charged, helper_cpu_s = asyncio.run(scenario())
    # 19x the check's CPU time, about what the helper took for the same body just before (half of it, for noise)
    assert uncharged < 0.03 and charged >= 19 * helper_cpu_s / 2, (uncharged, charged, helper_cpu_s)


def test_the_helper_ends_with_its_service_however_the_service_ends(tmp_path) -> None:
    """A service SIGKILLed (no shutdown, no `close`) leaves no helper behind (issue #51: one stayed 11 minutes)."""
    import subprocess
    import sys
    import time

    import psutil

    service = subprocess.Popen([sys.executable, "-c", """
import asyncio, os, sys
from envservice.body_check import BodyChecker
checker = BodyChecker()
helper = checker._helper()
helper.submit(os.getpid).result(timeout=60)
print(next(iter(helper._processes)), flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    helper = int(service.stdout.readline())
    assert psutil.pid_exists(helper)
    service.kill()
    service.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(helper) and \
            psutil.Process(helper).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
