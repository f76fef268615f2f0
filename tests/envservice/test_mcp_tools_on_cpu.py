"""envservice's envs as MCP tools (envservice/mcp_tools.py, issue #31): the official `mcp` client plays
FrozenLake to the goal through a real `python -m envservice` process over streamable HTTP, and a refused call
is a tool error naming the protocol's code."""

from __future__ import annotations

import asyncio

import pytest
from mcp import Client

from envservice.client import EnvClient
from envservice.envs.frozenlake import shortest_path_actions
from envservice.process import EnvServiceProcess


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("mcp") / "service.log"
    with EnvServiceProcess(["frozenlake"], log_path=log, startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""}) as live:
        yield live.url


def test_an_mcp_client_plays_frozenlake_to_the_goal(service: str) -> None:
    async def play() -> tuple[list[str], dict, dict, dict]:
        async with Client(f"{service}/mcp/") as client:
            tools = sorted(tool.name for tool in (await client.list_tools()).tools)
            envs = (await client.call_tool("list_envs", {})).structured_content
            created = (await client.call_tool("create", {"env_id": "frozenlake", "task_id": 3})).structured_content
            last = None
            for action in shortest_path_actions(created["info"]["map"]):
                last = (await client.call_tool("step", {"session_id": created["session_id"],
                                                        "action": action})).structured_content
            scored = (await client.call_tool("evaluate", {"session_id": created["session_id"]})).structured_content
            await client.call_tool("release", {"session_id": created["session_id"]})
            return tools, envs, last, scored

    tools, envs, last, scored = asyncio.run(play())
    assert tools == ["create", "evaluate", "list_envs", "release", "step"]
    assert envs["result"][0]["id"] == "frozenlake" and envs["result"][0]["tasks"]
    assert last["terminated"] and last["reward"] == 1.0
    assert scored["success"] and scored["score"] == 1.0
    # The same sessions as the HTTP protocol: the service's ledger counts the MCP episode.
    health = EnvClient(service).health()
    assert health.created >= 1 and health.sessions == 0


def test_a_refused_call_is_a_tool_error_with_the_protocol_code(service: str) -> None:
    async def refused() -> list[tuple[bool, str]]:
        async with Client(f"{service}/mcp/") as client:
            answers = []
            for name, arguments in (("step", {"session_id": "f" * 32, "action": "left"}),
                                    ("create", {"env_id": "no_such_env"}),
                                    ("create", {"env_id": "frozenlake", "seed": -1})):
                result = await client.call_tool(name, arguments)
                answers.append((result.is_error, result.content[0].text))
            return answers

    answers = asyncio.run(refused())
    assert all(is_error for is_error, _ in answers), answers
    # The SDK says which tool failed, then our text: the protocol's code first.
    assert answers[0][1].endswith("step: unknown_session: session_id='" + "f" * 32 + "' is not open: never created, "
                                  "or closed long ago"), answers
    assert "create: unknown_env: " in answers[1][1] and "create: invalid_request: " in answers[2][1], answers
    assert "seed" in answers[2][1]


def test_the_mcp_endpoint_needs_the_service_token(tmp_path) -> None:
    import requests

    with EnvServiceProcess(["frozenlake"], extra_args=["--token", "s3cret-token"], log_path=tmp_path / "guarded.log",
                           startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""}) as live:
        answer = requests.post(f"{live.url}/mcp/", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                               headers={"Accept": "application/json, text/event-stream"}, timeout=10)
        assert answer.status_code == 401 and answer.json()["code"] == "unauthorized"


def test_a_long_action_is_refused_like_on_http_and_no_stream_stays_open(service: str) -> None:
    """Issue #51: MCP `step` took a 900 KB action the HTTP protocol refuses, and `GET /mcp/` streams were never
    closed (each held a connection of the service's limit)."""
    import time

    import requests

    async def long_step() -> tuple[bool, str]:
        async with Client(f"{service}/mcp/") as client:
            created = (await client.call_tool("create", {"env_id": "frozenlake", "task_id": 3})).structured_content
            result = await client.call_tool("step", {"session_id": created["session_id"], "action": "x" * 900_000})
            await client.call_tool("release", {"session_id": created["session_id"]})
            return result.is_error, result.content[0].text

    is_error, text = asyncio.run(long_step())
    assert is_error and "invalid_request" in text and "100000" in text
    started = time.monotonic()
    answer = requests.get(f"{service}/mcp/", headers={"Accept": "text/event-stream"}, timeout=10)
    assert answer.status_code == 405 and time.monotonic() - started < 5
