"""The real service as a subprocess (`python -m envservice --port 0`) driven through `EnvClient`."""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import httpx
import psutil
import pytest
from minigrid.utils.baby_ai_bot import BabyAIBot

from envservice.client import IDLE_EXPIRY_S, EnvClient
from envservice.envs.babyai import ACTIONS
from envservice.errors import EnvServiceError
from envservice.transport import server_options

pytestmark = pytest.mark.timeout(120)


def test_ready_line_shows_real_port_and_envs(live_service) -> None:
    assert live_service["port"] > 0 and live_service["envs"] == ["babyai", "frozenlake"]
    health = EnvClient(live_service["url"]).wait_until_healthy(10)
    assert health.status == "ok" and health.envs == ["babyai", "frozenlake"]


def test_babyai_episode_solved_by_bot_over_http(live_service) -> None:
    level = "BabyAI-GoToLocal-v0"
    with EnvClient(live_service["url"], timeout=10) as client:
        created = client.create("babyai", task_id=level, seed=12)
        assert created.observation.startswith("Mission: go to")
        twin = gym.make(level).unwrapped  # the bot plans on a local twin reset with the layout's seed
        twin.reset(seed=created.info["layout_seed"])
        bot = BabyAIBot(twin)
        for _ in range(64):
            action = bot.replan()
            twin.step(action)
            step = client.step(created.session_id, ACTIONS[int(action)])
            if step.terminated or step.truncated:
                break
        assert step.terminated and not step.truncated and step.reward > 0
        evaluation = client.evaluate(created.session_id)
        assert evaluation.success and 0.0 < evaluation.score <= 1.0
        assert client.release(created.session_id).released


def test_frozenlake_oracle_over_http(live_service, play_frozenlake_oracle) -> None:
    with EnvClient(live_service["url"]) as client:
        step, evaluation = play_frozenlake_oracle(client)
    assert step.terminated and step.reward == 1.0
    assert evaluation.success


def test_threads_stepping_through_one_client_each_get_their_own_answers(live_service) -> None:
    """Four episodes stepped at once through one client's /steps batches see what each sees stepped alone."""
    actions = ["down", "right", "down", "right", "up", "left", "down", "right"]

    def play(client: EnvClient, task: int) -> list[tuple[str, float, bool, bool]]:
        session = client.create("frozenlake", task_id=task, seed=0).session_id
        seen = []
        for action in actions:
            step = client.step(session, action)
            seen.append((step.observation, step.reward, step.terminated, step.truncated))
            if step.terminated or step.truncated:
                break
        client.release(session)
        return seen

    with EnvClient(live_service["url"], batch_steps=False) as alone:
        expected = [play(alone, task) for task in range(4)]
    with EnvClient(live_service["url"]) as batched, ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda task: play(batched, task), range(4))) == expected
        assert batched.steps is not None and batched.steps.items == sum(map(len, expected))
        copy = pickle.loads(pickle.dumps(batched))  # a client still travels to another process (e.g. a Ray actor)
        assert play(copy, 0) == expected[0] and copy.steps.items == len(expected[0])


def test_client_raises_typed_errors(live_service) -> None:
    with EnvClient(live_service["url"]) as client:
        with pytest.raises(EnvServiceError) as failure:
            client.create("textcraft")  # not served by this instance
        assert (failure.value.code.value, failure.value.status) == ("unknown_env", 404)
        assert failure.value.valid_choices == ["babyai", "frozenlake"]
        with pytest.raises(EnvServiceError) as failure:
            client.step("no-such-session", "go forward")
        assert (failure.value.code.value, failure.value.status) == ("unknown_session", 404)


def test_client_retries_503_until_a_slot_frees(live_service) -> None:
    """The service runs with --max-sessions 4: a fifth create waits (503 + backoff) until one is released."""
    with EnvClient(live_service["url"], retries=6, backoff_s=0.1) as client:
        held = [client.create("frozenlake", task_id=0, seed=0).session_id for _ in range(4)]
        with pytest.raises(EnvServiceError) as failure:
            EnvClient(live_service["url"], retries=0).create("frozenlake")
        assert (failure.value.code.value, failure.value.status) == ("capacity", 503)
        releaser = threading.Timer(0.3, client.release, args=(held.pop(),))
        releaser.start()
        started = time.monotonic()
        held.append(client.create("frozenlake", task_id=0, seed=0).session_id)
        assert time.monotonic() - started >= 0.25
        releaser.join()
        for session_id in held:
            client.release(session_id)


def _ports_to(service_port: int) -> set[int]:
    """This process's local ports of its open TCP connections to the service."""
    return {conn.laddr.port for conn in psutil.Process().net_connections(kind="tcp")
            if conn.raddr and conn.raddr.port == service_port and conn.status == psutil.CONN_ESTABLISHED}


def test_a_connection_idle_past_the_expiry_is_replaced_not_reused(live_service) -> None:
    """A server closes an idle keep-alive connection after its timeout, and a step sent at that moment was reset
    ("Connection reset by peer", an env_error: 5 of 120 requests sent within +-10 ms of a 1 s timeout). The client
    reuses a connection only while it is younger than its idle expiry, and opens a new one after."""
    others = _ports_to(live_service["port"])  # earlier tests' clients, still open

    def ours() -> set[int]:
        return _ports_to(live_service["port"]) - others

    with EnvClient(live_service["url"], idle_expiry_s=0.5) as client:
        session = client.create("frozenlake", task_id=0).session_id
        first = ours()
        client.step(session, "right")
        assert ours() == first and len(first) == 1, "a busy connection was not reused"
        time.sleep(0.7)
        client.step(session, "right")
        after_idle = ours()
        assert len(after_idle) == 1 and after_idle != first, "a connection idle past its expiry was reused"
        client.release(session)


def test_the_service_keeps_an_idle_connection_past_every_clients_expiry() -> None:
    """envservice (and the gateway, with the same options) keeps an idle connection longer than our clients' and
    httpx's (the `openai` SDK's) expiry: uvicorn's default, 5 s, equals httpx's, the race above."""
    keep_alive = server_options()["timeout_keep_alive"]
    assert keep_alive > IDLE_EXPIRY_S and keep_alive > httpx.Limits().keepalive_expiry
    with pytest.raises(ValueError, match="keep_alive_s must be > 0"):
        server_options(keep_alive_s=0)
