"""`python -m envservice --backend process`: envs in worker processes, crashes and hung calls contained.

The service runs on a loopback port with 2 workers, a 3 s step limit and the deliberately faulty test env
(`envservice/envs/testing.py`, registered by this test with `--register faulty=...`; workers import it by its path).
"""

from __future__ import annotations

import time
from typing import Iterator

import psutil
import pytest

from envservice.client import EnvClient
from envservice.errors import EnvServiceError, EnvTimeoutError
from envservice.envs.testing import ENTRY_POINT as FAULTY
from envservice.process import EnvServiceProcess
from beyond_agent.rollout.episode_loop import EpisodeLoop, EpisodeConfig, EpisodeSpec

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

STEP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServiceProcess]:
    log = tmp_path_factory.mktemp("envservice") / "service.log"
    with EnvServiceProcess(["frozenlake", "faulty"], backend="process", workers=2, step_timeout_s=STEP_TIMEOUT_S,
                           log_path=log, startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""},
                           extra_args=["--register", f"faulty={FAULTY}"]) as process:
        yield process


@pytest.fixture
def client(service: EnvServiceProcess) -> Iterator[EnvClient]:
    with EnvClient(service.url, timeout=30, retries=0) as env_client:
        yield env_client


def _worker_pids(service: EnvServiceProcess) -> set[int]:
    return {child.pid for child in psutil.Process(service.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())}  # not multiprocessing's resource tracker


def _open(client: EnvClient, count: int) -> list[tuple[str, int]]:
    """`count` faulty sessions as (session id, pid of the worker that holds it)."""
    return [(created.session_id, created.info["pid"]) for created in (client.create("faulty") for _ in range(count))]


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_ready_line_names_the_backend_and_two_workers_run(service) -> None:
    assert service.backend == "process, 2 workers" and service.envs == ["frozenlake", "faulty"]
    assert len(_worker_pids(service)) == 2


def test_frozenlake_oracle_episode_in_a_worker_process(client, play_frozenlake_oracle) -> None:
    step, evaluation = play_frozenlake_oracle(client)
    assert step.terminated and step.reward == 1.0
    assert evaluation.success


@pytest.mark.parametrize("action, exit_text", [("exit", "exit code 3"), ("segfault", "exit code -11 (SIGSEGV)")])
def test_a_dying_worker_ends_only_its_own_session(service, client, action: str, exit_text: str) -> None:
    (doomed, doomed_pid), (other, other_pid) = _open(client, 2)
    assert doomed_pid != other_pid and {doomed_pid, other_pid} == _worker_pids(service)
    with pytest.raises(EnvServiceError) as failure:
        client.step(doomed, action)
    assert (failure.value.code.value, failure.value.status) == ("env_error", 500)
    assert f"(pid {doomed_pid}) exited with {exit_text}; session {doomed} was closed" in failure.value.message
    assert client.step(other, "inc").info["pid"] == other_pid  # the other worker never noticed
    assert client.health().status == "ok" and client.health().sessions == 1
    assert _wait_gone(doomed_pid)
    (fresh, fresh_pid), = _open(client, 1)  # placed on the replacement worker
    assert fresh_pid not in (doomed_pid, other_pid) and len(_worker_pids(service)) == 2
    assert client.step(fresh, "inc").observation == "value 1"
    for session_id in (other, fresh):
        client.release(session_id)


def test_hung_step_is_env_timeout_and_its_worker_is_replaced(service, client) -> None:
    (hung, hung_pid), (other, other_pid), (neighbour, neighbour_pid) = _open(client, 3)
    assert neighbour_pid == hung_pid != other_pid  # the third session went to the first worker again
    started = time.monotonic()
    with pytest.raises(EnvTimeoutError) as failure:
        client.step(hung, "hang")
    assert STEP_TIMEOUT_S <= time.monotonic() - started < STEP_TIMEOUT_S + 5
    assert failure.value.status == 504 and f"did not finish step within {STEP_TIMEOUT_S:g} s" in failure.value.message
    assert f"worker 0 (pid {hung_pid}) was killed and restarted" in failure.value.message
    # The trade-off: its neighbour on that worker is lost too, and stops counting against capacity at once.
    assert client.health().sessions == 1
    with pytest.raises(EnvServiceError) as failure:
        client.step(neighbour, "inc")
    assert failure.value.code.value == "unknown_session"
    assert "it was closed (worker_lost)" in failure.value.message
    assert client.step(other, "inc").info["pid"] == other_pid
    assert _wait_gone(hung_pid)
    (fresh, fresh_pid), = _open(client, 1)
    assert fresh_pid != hung_pid and client.step(fresh, "inc").observation == "value 1"
    for session_id in (other, fresh):
        client.release(session_id)


def test_dead_worker_sessions_stop_counting_against_capacity_at_once(service, client, wait_for) -> None:
    (doomed, doomed_pid), (other, other_pid), (neighbour, neighbour_pid) = _open(client, 3)
    assert neighbour_pid == doomed_pid != other_pid
    before = client.health()
    with pytest.raises(EnvServiceError) as failure:
        client.step(doomed, "exit")
    assert failure.value.code.value == "env_error"  # the call in flight says what happened to it
    # The untouched neighbour is dropped as soon as the worker's death is seen, not when next touched or reaped.
    assert wait_for(lambda: client.health().sessions == before.sessions - 2, 10)
    after = client.health()
    assert after.closed.get("worker_lost", 0) == before.closed.get("worker_lost", 0) + 2
    assert after.created == after.sessions + sum(after.closed.values())  # every session accounted for
    released = client.release(neighbour)  # releasing it anyway succeeds and says how it ended
    assert (released.already_closed, released.closed_by) == (True, "worker_lost")
    client.release(other)


def test_hung_reset_ends_the_episode_with_timeout(service, client) -> None:
    config = EpisodeConfig(max_prompt_length=64, max_response_length=64, max_tokens_per_turn=8)
    spec = EpisodeSpec("faulty", params={"hang_in_reset": "1"})
    open_before = client.health().sessions
    result = EpisodeLoop(spec, client, None, None, config, max_rounds=4).run()
    assert (result.termination, result.infra_failure) == ("timeout", True)
    assert "did not finish reset within 3 s (--step-timeout); the session was not created" in result.error
    assert client.health().sessions == open_before
    (session_id, _), = _open(client, 1)  # the service still serves
    client.release(session_id)



def test_an_env_that_prints_much_does_not_stall_a_service_it_was_started_as(tmp_path) -> None:
    """An EnvServiceProcess read its service's stdout for the ready line only: an env that printed (minigrid prints
    every BabyAI layout it rejects) filled the pipe, and every env call then blocked in its print (the learning
    bench's BabyAI service hung 40 minutes, #69). Now the rest of stdout goes to the service's log."""
    log = tmp_path / "service.log"
    with EnvServiceProcess(["faulty"], log_path=log, step_timeout_s=30,
                           extra_args=["--register", f"faulty={FAULTY}"]) as process:
        with EnvClient(process.url, timeout=20, retries=0) as client:
            session = client.create("faulty", task_id=0).session_id
            for _ in range(3):  # 384 KB in all, past any pipe's buffer
                assert "Invalid action" in client.step(session, "chatter").observation
            client.release(session)
    assert log.read_text().count("sampling rejected") == 3 * 4000
