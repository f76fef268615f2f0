"""`kind: agentgym`: envservice in front of AgentGym env servers.

AgentGym's servers (WebShop, WebArena, SciWorld, TextCraft, BabyAI, ALFWorld) cannot be installed here
(their data, Java, browsers and web stacks), so these tests play against
`envservice.remote.agentgym_example_server`, which serves each env type's routes and payloads as
AgentGym's server code does, over our FrozenLake: a known shortest path is a gold path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

from envservice.childproc import ChildProcess, free_port
from envservice import registry
from envservice.check import check_env
from envservice.client import EnvClient
from envservice.env_config import EnvConfigError, load_env_config
from envservice.envs.frozenlake import generate_map, shortest_path_actions
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess
from envservice.remote.agentgym import DIALECTS

pytestmark = pytest.mark.timeout(300)


def start_server(env_type: str, log_dir: Path) -> tuple[ChildProcess, str]:
    """An AgentGym-protocol server of `env_type` on a free loopback port."""
    port = free_port()
    child = ChildProcess.start([sys.executable, "-m", "envservice.remote.agentgym_example_server", "--env-type",
                                env_type, "--port", str(port)], f"agentgym-{env_type}", log_dir / f"{env_type}.log")
    url = f"http://127.0.0.1:{port}"
    child.wait_until(lambda: _answers(url), timeout_s=60, what="answering GET /")
    return child, url


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def open_remote_envs(url: str) -> list[int]:
    """The envs the AgentGym server holds now."""
    return requests.get(f"{url}/list_envs", timeout=5).json()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One running server per AgentGym env type: {env_type: url}."""
    log_dir = tmp_path_factory.mktemp("agentgym")
    children, urls = [], {}
    try:
        for env_type in DIALECTS:
            child, urls[env_type] = start_server(env_type, log_dir)
            children.append(child)
        yield urls
    finally:
        for child in children:
            child.stop()


def write_config(path: Path, entries: dict[str, tuple[str, str]], **extra: str) -> Path:
    """An env-config YAML with one `kind: agentgym` entry per {env id: (env_type, url)}."""
    lines = []
    for env_id, (env_type, url) in entries.items():
        lines += [f"{env_id}:", "  kind: agentgym",
                  f"  config: {{url: '{url}', env_type: {env_type}, splits: {{train: '0:50', test: [500, 510, 520]}}}}",
                  "  max_steps: 30"]
    path.write_text("\n".join(lines) + "\n" + "".join(extra.values()))
    return path


def gold_path(data_idx: int) -> list[str]:
    """FrozenLake's shortest path for the map the example server plays at `data_idx`."""
    from envservice.envs.frozenlake import FrozenLakeEnv

    return shortest_path_actions(generate_map(FrozenLakeEnv.resolve_task(data_idx % 1000, "train", 0, {})))


@pytest.fixture
def registered(servers, tmp_path):
    """Register every env type as `ag-<type>` through an env-config file; unregistered afterwards."""
    path = write_config(tmp_path / "envs.yaml", {f"ag-{t}": (t, url) for t, url in servers.items()})
    registrations = load_env_config(path)
    yield {r.env_id.removeprefix("ag-"): r for r in registrations}
    for registration in registrations:
        registry.unregister(registration.env_id)


@pytest.mark.parametrize("env_type", list(DIALECTS))
def test_every_env_type_plays_its_gold_path_to_success(env_type, registered, servers):
    cls = registered[env_type].env_class()
    task = cls.resolve_task("7", "train", 0, {})
    env = cls()
    observation, info = env.reset(task)
    assert "A" in observation and info["data_idx"] == 7
    if env_type == "alfworld":
        assert "AVAILABLE ACTIONS: left, down, right, up" in observation
    for action in gold_path(7):
        observation, reward, terminated, truncated, _ = env.step(action)
    assert terminated and not truncated
    assert env.evaluate() == (1.0, True)  # SciWorld's 100 is scaled to 1
    assert reward == 1.0
    before = open_remote_envs(servers[env_type])
    env.close()
    after = open_remote_envs(servers[env_type])
    if DIALECTS[env_type].has_close:
        assert len(after) == len(before) - 1
    else:  # no /close on BabyAI's and SciWorld's servers: the env is pooled and the next session reuses it
        again = cls()
        again.reset(task)
        assert open_remote_envs(servers[env_type]) == after == before
        again.close()


@pytest.mark.parametrize("env_type", ["webshop", "babyai"])
def test_check_env_passes_through_the_remote_server(env_type, registered):
    assert "garbage_actions" in check_env(registered[env_type].env_id)


def test_config_errors_name_the_file_the_env_and_the_field(tmp_path):
    cases = {
        "kind: agentgym\n  config: {url: 'http://x:1', env_type: shop, splits: {train: '0:5'}}": "valid env types: "
        "webshop, webarena, sciworld, babyai, textcraft, alfworld",
        "kind: agentgym\n  config: {env_type: webshop, splits: {train: '0:5'}}": "lacks required setting(s) ['url']",
        "kind: agentgym\n  config: {url: 'http://x:1', env_type: webshop, splits: {train: '5:0'}}": "splits.train",
        "kind: agentgym\n  config: {url: 'http://x:1', env_type: webshop, splits: {}, port: 3}": "unknown setting(s) "
        "['port']",
        "kind: agentgymm": "valid kinds: agentgym, openenv, gymnasium, mcp",
        "kind: agentgym\n  colour: red": "unknown key(s) ['colour']",
    }
    for body, expected in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(f"shop:\n  {body}\n")
        with pytest.raises(EnvConfigError) as error:
            load_env_config(path)
        assert str(path) in str(error.value) and "shop" in str(error.value) and expected in str(error.value)
        assert "shop" not in registry.registered_ids()  # a refused entry is not left registered


def play_to_success(client: EnvClient, env_id: str, data_idx: int) -> str:
    """Create a session of `env_id` on `data_idx`, walk the gold path, check success; returns the session id."""
    created = client.create(env_id, task_id=str(data_idx))
    for action in gold_path(data_idx):
        step = client.step(created.session_id, action)
    assert step.terminated and client.evaluate(created.session_id).success
    return created.session_id


def test_remote_sessions_are_closed_after_release_reaping_a_killed_client_and_shutdown(servers, tmp_path, wait_for):
    url = servers["webshop"]
    config = write_config(tmp_path / "envs.yaml", {"webshop-remote": ("webshop", url),
                                                    "babyai-remote": ("babyai", servers["babyai"])})
    baseline = len(open_remote_envs(url))
    service = EnvServiceProcess(["webshop-remote", "babyai-remote"], log_path=tmp_path / "service.log",
                                extra_args=["--env-config", str(config), "--idle-timeout", "2"])
    with service, EnvClient(service.url) as client:
        # release
        session = play_to_success(client, "webshop-remote", 3)
        client.release(session)
        assert len(open_remote_envs(url)) == baseline

        # reaping: a session nobody releases is reaped after the idle timeout, and its remote env closed
        client.create("webshop-remote", task_id="4")
        assert len(open_remote_envs(url)) == baseline + 1
        assert wait_for(lambda: len(open_remote_envs(url)) == baseline, 20.0)

        # a client killed in the middle of an episode: its session is reaped too
        script = textwrap.dedent(f"""
            import time
            from envservice.client import EnvClient
            client = EnvClient({service.url!r})
            session = client.create("webshop-remote", task_id="5")
            client.step(session.session_id, "right")
            print("stepped", flush=True)
            time.sleep(600)
        """)
        victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert victim.stdout.readline().strip() == "stepped"
        assert len(open_remote_envs(url)) == baseline + 1
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert wait_for(lambda: len(open_remote_envs(url)) == baseline, 20.0)

        # a server without /close: sequential sessions reuse one remote env instead of leaking one each
        babyai_before = len(open_remote_envs(servers["babyai"]))
        for data_idx in (1, 2, 3):
            client.release(play_to_success(client, "babyai-remote", data_idx))
        assert len(open_remote_envs(servers["babyai"])) <= babyai_before + 1

        # shutdown with sessions open
        for data_idx in (6, 7):
            client.create("webshop-remote", task_id=str(data_idx))
        assert len(open_remote_envs(url)) == baseline + 2
    assert len(open_remote_envs(url)) == baseline  # the service closed both on its way out


def test_a_server_that_is_down_is_an_env_error_naming_its_url_not_a_reward(tmp_path):
    dead_url = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "envs.yaml", {"webshop-down": ("webshop", dead_url)})
    service = EnvServiceProcess(["webshop-down"], log_path=tmp_path / "service.log",
                                extra_args=["--env-config", str(config)])
    with service, EnvClient(service.url) as client:
        with pytest.raises(EnvServiceError) as error:
            client.create("webshop-down", task_id="0")
        assert error.value.code.value == "env_error" and dead_url in error.value.message
        assert client.health().sessions == 0
