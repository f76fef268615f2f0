"""`kind: openenv`: envservice in front of a real OpenEnv server (the SDK's app factory and WebSocket sessions).

The server is `envservice.remote.openenv_example_server` (our FrozenLake as an OpenEnv `Environment`), run
as a child process on loopback; its `GET /open_envs` counts the environment instances alive on it, which is
how these tests see that every remote session an envservice opened is closed again: after a release, idle
reaping, a client killed mid-episode, and the service's own shutdown.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import requests

from envservice.childproc import ChildProcess, free_port
from envservice import registry
from envservice.check import check_env
from envservice.client import EnvClient
from envservice.env_config import EnvConfigError, load_env_config
from envservice.envs.base import Task
from envservice.envs.frozenlake import generate_map, shortest_path_actions
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess
from envservice.remote.openenv_env import OpenEnvEnv, OpenEnvServerError

# OpenEnv's example servers start in fresh processes: the full run only (tests/conftest.py).
pytestmark = [pytest.mark.timeout(120), pytest.mark.startup]

READY_PREFIX = "openenv example server ready on "
"""The line the example server prints once it listens (`envservice.remote.openenv_example_server`, stated here:
importing that module loads OpenEnv's server side and gradio, ~7 s, into every test worker that collects this file)."""

SERVER_MAX_SESSIONS = 4
"""The example server's max_concurrent_envs (the capacity test fills it)."""


def start_server(name: str, log_dir: Path) -> ChildProcess:
    """The example OpenEnv server on a port it picks itself (`--port 0`); not waited for (see `ready_url`)."""
    return ChildProcess.start([sys.executable, "-m", "envservice.remote.openenv_example_server", "--port", "0",
                               "--max-sessions", str(SERVER_MAX_SESSIONS)], name, log_dir / f"{name}.log",
                              stdout=subprocess.PIPE, text=True)


def ready_url(child: ChildProcess, timeout_s: float = 90.0) -> str:
    """The URL of the server's ready line (read on a side thread, so that a silent child cannot hang us)."""
    line: list[str] = []
    threading.Thread(target=lambda: line.append(child.process.stdout.readline()), daemon=True).start()
    child.wait_until(lambda: bool(line and line[0]), timeout_s, "printing its ready line", poll_s=0.05)
    assert line[0].startswith(READY_PREFIX), line[0]
    return line[0][len(READY_PREFIX):].strip()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two example servers, started together: `main` for the tests, `victim` for a test that kills it."""
    log_dir = tmp_path_factory.mktemp("openenv")
    children = {name: start_server(f"openenv-{name}", log_dir) for name in ("main", "victim")}
    try:
        urls = {name: ready_url(child) for name, child in children.items()}
        yield {"urls": urls, "children": children}
    finally:
        for child in children.values():
            child.stop(grace_s=5)


@pytest.fixture
def url(servers) -> str:
    return servers["urls"]["main"]


def open_envs(url: str) -> int:
    """Environment instances alive on the example server."""
    return requests.get(f"{url}/open_envs", timeout=5).json()["open_envs"]


def write_config(path: Path, urls: dict[str, str], max_steps: int = 100) -> Path:
    """An env-config YAML with one `kind: openenv` FrozenLake entry per {env id: server URL}."""
    entries = []
    for env_id, server_url in urls.items():
        entries.append(textwrap.dedent(f"""\
            {env_id}:
              kind: openenv
              config:
                url: "{server_url}"
                splits: {{train: 1000, test: 200}}
                task_kwarg: task_index
                split_kwarg: split
                reset_params: {{size: "Side of the square map, 3..12 (default 4)."}}
                info_fields: [map]
                score_field: score
                timeout_s: 10
              max_steps: {max_steps}
            """))
    path.write_text("".join(entries))
    return path


@pytest.fixture(scope="module")
def service(servers, tmp_path_factory):
    """One envservice serving the main server (`fl`), the victim (`fl-victim`) and a dead port (`fl-down`),
    with a 2 s idle timeout."""
    tmp = tmp_path_factory.mktemp("openenv-service")
    dead_url = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp / "envs.yaml", {"fl": servers["urls"]["main"], "fl-victim": servers["urls"]["victim"],
                                              "fl-down": dead_url})
    with EnvServiceProcess(["fl", "fl-victim", "fl-down"], log_path=tmp / "service.log",
                           extra_args=["--env-config", str(config), "--idle-timeout", "2"],
                           env={"ENVSERVICE_TOKEN": ""}) as process:
        yield {"url": process.url, "dead_url": dead_url, "config": config, "process": process}


def test_an_episode_is_played_to_success_through_envservice(service, url, wait_for) -> None:
    assert wait_for(lambda: open_envs(url) == 0, 10)
    with EnvClient(service["url"], timeout=30) as client:
        created = client.create("fl", task_id=9, seed=0, params={"size": 6})
        task = Task(split="train", index=9, name="9", seed=0, params={"size": 6})
        assert created.info["map"] == generate_map(task)  # the task index, split and size reached the server
        assert created.observation.startswith("Legend:") and open_envs(url) == 1
        for action in shortest_path_actions(created.info["map"]):
            step = client.step(created.session_id, action)
        assert step.terminated and not step.truncated and step.reward == 1.0
        assert "You reached the goal!" in step.observation
        evaluation = client.evaluate(created.session_id)
        assert evaluation.success and evaluation.score == 1.0
        invalid = client.create("fl", task_id=9, seed=0, params={"size": 6})
        assert open_envs(url) == 2  # two of our sessions, two remote sessions
        refused = client.step(invalid.session_id, "jump")
        assert "Invalid action 'jump'" in refused.observation and refused.reward == 0.0 and not refused.terminated
        assert client.release(created.session_id).released and client.release(invalid.session_id).released
        assert open_envs(url) == 0  # release returns once the server has closed both


def test_check_env_passes_for_the_configured_id(url, tmp_path) -> None:
    registrations = load_env_config(write_config(tmp_path / "envs.yaml", {"fl-openenv-check": url}, max_steps=20))
    try:
        assert "garbage_actions" in check_env("fl-openenv-check")
    finally:
        for registration in registrations:
            registry.unregister(registration.env_id)
    assert open_envs(url) == 0


def test_idle_reaping_closes_the_remote_session(service, url, wait_for) -> None:
    with EnvClient(service["url"]) as client:
        created = client.create("fl", task_id=1, seed=0)
        client.step(created.session_id, "right")
        assert open_envs(url) == 1
        assert wait_for(lambda: open_envs(url) == 0, 15)  # --idle-timeout 2
        assert client.release(created.session_id).closed_by == "reaper"


def test_a_client_killed_mid_episode_leaves_no_remote_session(service, url, tmp_path, wait_for) -> None:
    script = textwrap.dedent(f"""
        import time
        from envservice.client import EnvClient
        client = EnvClient({service['url']!r})
        session = client.create("fl", task_id=2, seed=0)
        client.step(session.session_id, "right")
        print(session.session_id, flush=True)
        time.sleep(600)
    """)
    victim = ChildProcess.start([sys.executable, "-c", script], "openenv-client", tmp_path / "client.log",
                                stdout=subprocess.PIPE, text=True)
    try:
        session_id = victim.process.stdout.readline().strip()
        assert session_id, victim.log_tail()
        assert open_envs(url) == 1
    finally:
        victim.kill()  # SIGKILL to its process group: no release, no goodbye
    assert victim.process.returncode is not None
    assert wait_for(lambda: open_envs(url) == 0, 15)
    with EnvClient(service["url"]) as client:
        assert client.release(session_id).closed_by == "reaper"


def test_envservice_shutdown_closes_open_remote_sessions(url, tmp_path, wait_for) -> None:
    config = write_config(tmp_path / "envs.yaml", {"fl": url})
    process = EnvServiceProcess(["fl"], log_path=tmp_path / "service.log", extra_args=["--env-config", str(config)],
                                env={"ENVSERVICE_TOKEN": ""})
    with process, EnvClient(process.url) as client:
        for task_id in (3, 4, 5):
            client.step(client.create("fl", task_id=task_id, seed=0).session_id, "down")
        assert open_envs(url) == 3
    # `with` ended with SIGTERM to the service; it closed every session on its way out
    assert '"closed": {"shutdown": 3}, "open": 0' in (tmp_path / "service.log").read_text(), process.log_tail()
    assert open_envs(url) == 0


def test_worker_processes_build_the_configured_class_and_a_dead_worker_leaks_nothing(url, tmp_path,
                                                                                     wait_for) -> None:
    import psutil

    config = write_config(tmp_path / "envs.yaml", {"fl": url})
    process = EnvServiceProcess(["fl"], log_path=tmp_path / "service.log", backend="process", workers=1,
                                extra_args=["--env-config", str(config)], env={"ENVSERVICE_TOKEN": ""})
    with process, EnvClient(process.url) as client:
        created = client.create("fl", task_id=9, seed=0, params={"size": 6})  # built in the worker from its reference
        for action in shortest_path_actions(created.info["map"]):
            step = client.step(created.session_id, action)
        assert step.terminated and client.evaluate(created.session_id).success
        client.release(created.session_id)
        assert open_envs(url) == 0
        client.step(client.create("fl", task_id=1, seed=0).session_id, "right")
        assert open_envs(url) == 1
        for worker in psutil.Process(process.process.pid).children(recursive=True):
            worker.kill()  # its socket dies with it, and the server ends that session
        assert wait_for(lambda: open_envs(url) == 0, 10)


def test_a_server_that_is_down_is_an_env_error_naming_its_url(service) -> None:
    with EnvClient(service["url"]) as client:
        with pytest.raises(EnvServiceError) as error:
            client.create("fl-down", task_id=0, seed=0)
        assert (error.value.code.value, error.value.status) == ("env_error", 500)
        assert service["dead_url"] in error.value.message and "is the server running" in error.value.message
        assert client.health().sessions == 0


def test_a_server_dying_mid_episode_is_an_env_error_not_a_reward(service, servers) -> None:
    victim_url = servers["urls"]["victim"]
    with EnvClient(service["url"]) as client:
        created = client.create("fl-victim", task_id=0, seed=0)
        first, second = shortest_path_actions(created.info["map"])[:2]
        assert not client.step(created.session_id, first).terminated
        servers["children"]["victim"].kill()
        with pytest.raises(EnvServiceError) as error:
            client.step(created.session_id, second)
        assert error.value.code.value == "env_error" and victim_url in error.value.message
        assert "closed the connection during step" in error.value.message
        assert client.release(created.session_id).closed_by == "env_error"


def test_a_full_server_is_a_capacity_error(url) -> None:
    cls = OpenEnvEnv.configure({"url": url, "action_field": "command", "observation_field": "text"})
    task = cls.resolve_task(0, "train", 0, {})
    envs = [cls() for _ in range(SERVER_MAX_SESSIONS + 1)]
    try:
        for env in envs[:-1]:
            env.reset(task)
        with pytest.raises(EnvServiceError) as error:
            envs[-1].reset(task)
        assert error.value.code.value == "capacity" and url in error.value.message
    finally:
        for env in envs:
            env.close()
    assert open_envs(url) == 0


def test_a_server_that_never_answers_times_out_naming_its_url(wait_for) -> None:
    config = {"action_field": "command", "observation_field": "text", "timeout_s": 0.5}
    with socket.socket() as silent:  # accepts TCP connections (backlog) but never speaks: the handshake times out
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cls = OpenEnvEnv.configure({"url": silent_url, **config})
        env = cls()
        with pytest.raises(OpenEnvServerError) as error:
            env.reset(cls.resolve_task(0, "train", 0, {}))
        env.close()
    assert silent_url in str(error.value) and "timed out after 0.5 s" in str(error.value)

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.server import serve

    connected = []

    def mute(connection) -> None:  # a WebSocket server that reads every message and answers none
        connected.append(connection)
        try:
            for _ in connection:
                pass
        except ConnectionClosed:
            pass
        connected.remove(connection)

    with serve(mute, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        mute_url = f"http://127.0.0.1:{server.socket.getsockname()[1]}"
        cls = OpenEnvEnv.configure({"url": mute_url, **config})
        env = cls()
        with pytest.raises(OpenEnvServerError) as error:
            env.reset(cls.resolve_task(0, "train", 0, {}))
        assert mute_url in str(error.value) and "no reply to reset within 0.5 s" in str(error.value)
        assert wait_for(lambda: not connected, 5)  # the timed-out connection was closed at once, before close()
        with pytest.raises(OpenEnvServerError, match="broken"):
            env.step("left")
        env.close()
        server.shutdown()


def test_an_action_field_the_server_does_not_have_is_an_error_not_an_invalid_action(url) -> None:
    cls = OpenEnvEnv.configure({"url": url, "action_field": "move"})
    env = cls()
    try:
        env.reset(cls.resolve_task(0, "train", 0, {}))
        with pytest.raises(OpenEnvServerError) as error:
            env.step("left")
        assert "action_field='move'" in str(error.value) and url in str(error.value)
    finally:
        env.close()
    assert open_envs(url) == 0


@pytest.mark.parametrize("config, expected", [
    ({"splits": {"train": 5}}, "nothing sends the task"),
    ({"url": "127.0.0.1:8000"}, "config.url="),
    ({"seed": "sometimes"}, "valid values: episode, task, none"),
    ({"splits": {"train": {"start": 5, "stop": 1}}, "task_kwarg": "i"}, "splits.train"),
    ({"port": 1}, "unknown setting(s) ['port']"),
    ({"observation_field": "text", "observation_template": "{text}"}, "not both"),
])
def test_config_errors_name_the_field(config: dict, expected: str, tmp_path) -> None:
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"bad-openenv": {"kind": "openenv",
                                                    "config": {"url": "http://127.0.0.1:1", **config}}}))
    with pytest.raises(EnvConfigError) as error:
        load_env_config(path)
    assert str(path) in str(error.value) and "bad-openenv" in str(error.value) and expected in str(error.value)
    assert "bad-openenv" not in registry.registered_ids()


def test_configured_splits_and_reset_arguments(url) -> None:
    cls = OpenEnvEnv.configure({"url": url, "splits": {"train": {"start": 10, "stop": 13}, "test": ["a", 7]},
                                "seed": "none", "task_kwarg": "task_index"})
    assert cls.splits == {"train": ["10", "11", "12"], "test": ["a", "7"]}
    assert cls.task_counts() == {"train": 3, "test": 2} and cls.description == f"OpenEnv server at {url}"
    assert cls.resolve_task("12", "train", 0, {}).index == 2
    instance = cls()
    try:
        with pytest.raises(OpenEnvServerError) as error:  # the server refuses task_index='a' (a name is sent as is)
            instance.reset(cls.resolve_task("a", "test", 0, {}))
        assert "task_index='a'" in str(error.value)
    finally:
        instance.close()
