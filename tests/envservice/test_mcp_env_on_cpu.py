"""A user's MCP server as an env (`kind: mcp`, envservice/remote/mcp_env.py, issue #31): the guessing-game
server shipped for tests passes `python -m envservice.check`, and a live envservice plays it: tools as
actions, the scorer's reward, a bad action answered with the tool list, a server that is down an env_error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import requests

from envservice.childproc import ChildProcess, free_port
from envservice.client import EnvClient
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess

ENV_CONFIG = """\
guess:
  kind: mcp
  config:
    url: {url}
    tasks: {{train: [guess-3, guess-7], test: [guess-5]}}
    start_tool: start
    final_tools: [give_up]
    scorer: envservice.remote.mcp_example_server:score
    timeout_s: 10
  max_steps: 10
guess_capped:
  kind: mcp
  config:
    url: {url}
    tasks: {{train: [guess-3]}}
    start_tool: start
    scorer: envservice.remote.mcp_example_server:score
    max_result_chars: 4
"""


@pytest.fixture(scope="module")
def mcp_url(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("mcp-server") / "server.log"
    child = ChildProcess.start([sys.executable, "-m", "envservice.remote.mcp_example_server", "--port", str(port)],
                               "guessing-game MCP server", log)
    try:
        child.wait_until(lambda: "MCP server on" in log.read_text(), timeout_s=60, what="printing its URL")
        yield f"http://127.0.0.1:{port}/mcp/"
    finally:
        child.stop()


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "envs.yaml"
    path.write_text(ENV_CONFIG.format(url=url))
    return path


def test_the_mcp_env_keeps_the_service_contract(mcp_url: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "envservice.check", "guess", "--env-config",
                           str(_config(tmp_path, mcp_url))], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "guess: every clause holds" in done.stdout, done.stdout + done.stderr


def test_an_episode_on_the_mcp_server_through_envservice(mcp_url: str, tmp_path: Path) -> None:
    with EnvServiceProcess(["guess", "guess_capped"], extra_args=["--env-config", str(_config(tmp_path, mcp_url))],
                           log_path=tmp_path / "service.log", startup_timeout_s=60,
                           env={"ENVSERVICE_TOKEN": ""}) as service, EnvClient(service.url) as client:
        created = client.create("guess", task_id="guess-7")
        assert created.observation.startswith("I picked a number from 1 to 10")
        assert created.observation.endswith("Tools: guess, shout, give_up.")  # start is the env's, not an action
        bad = client.step(created.session_id, "guess 5")
        assert bad.observation.startswith("Invalid action: write one tool call as JSON") and not bad.terminated
        assert client.step(created.session_id, '{"name": "guess", "arguments": {"n": 5}}').observation == "higher"
        assert "there is no tool 'cheat'" in client.step(created.session_id, '{"name": "cheat"}').observation
        assert client.step(created.session_id, '{"name": "guess", "arguments": {"n": 7}}').observation == "correct"
        ended = client.step(created.session_id, '{"name": "give_up", "arguments": {}}')
        assert ended.terminated and ended.observation == "Game over."
        scored = client.evaluate(created.session_id)
        assert scored.success and scored.score == 1.0
        client.release(created.session_id)
        # A tool result is capped like any observation (`max_result_chars`), saying how much was cut.
        capped = client.create("guess_capped", task_id="guess-3")
        answer = client.step(capped.session_id, '{"name": "guess", "arguments": {"n": 9}}').observation
        assert answer == "lowe\n[... 1 characters of the tool's result cut]"
        # An answer over what the env reads (1 MiB here) is refused by its Content-Length, never read whole:
        # an env failure of that step, not megabytes in the service.
        with pytest.raises(EnvServiceError, match="over the 1048576 this env reads"):
            client.step(capped.session_id, '{"name": "shout", "arguments": {"n": 5000000}}')
        client.release(capped.session_id)
        assert requests.get(f"{service.url}/healthz", timeout=10).json()["sessions"] == 0


def test_a_server_that_is_down_is_an_env_error_not_a_crash(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}/mcp/"
    with EnvServiceProcess(["guess", "guess_capped"], extra_args=["--env-config", str(_config(tmp_path, down))],
                           log_path=tmp_path / "service.log", startup_timeout_s=60,
                           env={"ENVSERVICE_TOKEN": ""}) as service, EnvClient(service.url, retries=0) as client:
        with pytest.raises(EnvServiceError) as failure:
            client.create("guess", task_id=0)
        assert failure.value.code.value == "env_error" and down in failure.value.message
        assert requests.get(f"{service.url}/healthz", timeout=10).json()["status"] == "ok"
