"""`SessionManager` directly: per-session locking, reset failures, reaping with a fake clock."""

from __future__ import annotations

import threading
import time

import pytest

from envservice.errors import EnvServiceError
from envservice.protocol import CreateRequest
from envservice.sessions import SessionManager

pytestmark = pytest.mark.timeout(30)


def _open(manager: SessionManager, env_id: str) -> str:
    return manager.create(CreateRequest(env_id=env_id)).session_id


def test_a_blocked_env_does_not_block_other_sessions(test_envs) -> None:
    gated = test_envs["gated"]
    gated.gate.clear()
    gated.entered.clear()
    manager = SessionManager(["gated", "counting"])
    slow, fast = _open(manager, "gated"), _open(manager, "counting")
    worker = threading.Thread(target=manager.step, args=(slow, "wait"))
    worker.start()
    try:
        assert gated.entered.wait(5), "the gated step never started"
        started = time.monotonic()
        assert manager.step(fast, "inc").observation == "value 1"
        assert manager.count() == 2 and time.monotonic() - started < 1.0
        assert worker.is_alive()  # the slow step is still running while the other session was served
    finally:
        gated.gate.set()
        worker.join(10)
        manager.shutdown()


def test_reset_crash_is_env_error_and_frees_the_slot(test_envs) -> None:
    manager = SessionManager(["crashonreset", "counting"], max_sessions=1)
    for _ in range(3):  # the failed creates must not leak their reserved slots
        with pytest.raises(EnvServiceError) as failure:
            _open(manager, "crashonreset")
        assert failure.value.code.value == "env_error" and "simulated crash in reset" in failure.value.message
    _open(manager, "counting")
    assert manager.count() == 1
    manager.shutdown()


def test_reap_idle_uses_last_use_time(test_envs) -> None:
    now = [100.0]
    manager = SessionManager(["counting"], idle_timeout_s=10, clock=lambda: now[0])
    stale, active = _open(manager, "counting"), _open(manager, "counting")
    now[0] = 108.0
    manager.step(active, "inc")  # touches `active` only
    now[0] = 111.0
    assert manager.reap_idle() == [stale]
    with pytest.raises(EnvServiceError, match="unknown"):
        manager.step(stale, "inc")
    assert manager.step(active, "inc").observation == "value 2"
    manager.shutdown()
    assert manager.count() == 0
