"""envservice's environments as MCP tools (the official `mcp` SDK, streamable HTTP at `/mcp/`).

Any MCP-capable agent can act in our environments: the same sessions, limits and accounting as the HTTP
protocol (one `SessionManager` serves both), through five tools:

- `list_envs()`                                   the served envs, their task splits and limits;
- `create(env_id, task_id?, seed?, split?)`       open a session: its id and first observation;
- `step(session_id, action)`                      act: observation, reward, terminated, truncated;
- `evaluate(session_id)`                          the episode's score and success;
- `release(session_id)`                           close the session (idempotent).

A refused call (an unknown env or session, a finished episode, a busy session, capacity) is a tool error whose
text (after the SDK's "Error executing tool <name>: ") starts with the protocol's error code, e.g.
`unknown_session: ...`, so an agent can tell them apart. The
endpoint is stateless (no MCP session to keep; the env session id is every call's argument) and answers JSON;
it opens no server-to-client stream (`GET` is answered 405, as the MCP transport allows), so no connection
stays open beyond its call. The service's token, Host check and body limits apply to it as to every route, and
the tools' arguments to the HTTP protocol's own validation (`CreateRequest`, `StepRequest`).
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from envservice import registry
from envservice.errors import EnvServiceError, clip
from envservice.protocol import CreateRequest, StepRequest
from envservice.sessions import SessionManager

MCP_PATH = "/mcp"
"""Where the MCP endpoint is mounted (clients connect to `<service>/mcp/`)."""


def mcp_server(manager: SessionManager, env_ids: list[str]) -> MCPServer:
    """The MCP server whose tools act on `manager`'s sessions (module docstring)."""
    server = MCPServer(name="envservice", instructions=(
        "Text environments for agents. create() a session, step() it with one action at a time until "
        "terminated or truncated, evaluate() it for the score, and release() it when done."))

    @server.tool()
    def list_envs() -> list[dict[str, Any]]:
        """The environments this service serves, with their task splits and limits."""
        return [registry.get(env_id).spec().model_dump(mode="json") for env_id in env_ids]

    @server.tool()
    def create(env_id: str, task_id: int | str | None = None, seed: int | None = None,
               split: str = "train") -> dict[str, Any]:
        """Open a session of `env_id` on a task (by index or name) and return its id and first observation."""
        request = _refused_if_invalid(lambda: CreateRequest(env_id=env_id, task_id=task_id, seed=seed, split=split))
        return _answered(lambda: manager.create(request))

    @server.tool()
    def step(session_id: str, action: str) -> dict[str, Any]:
        """Apply one action; returns the observation, the reward and whether the episode ended."""
        request = _refused_if_invalid(lambda: StepRequest(session_id=session_id, action=action))
        return _answered(lambda: manager.step(request.session_id, request.action))

    @server.tool()
    def evaluate(session_id: str) -> dict[str, Any]:
        """The episode's score and success (allowed during and after it)."""
        return _answered(lambda: manager.evaluate(session_id))

    @server.tool()
    def release(session_id: str) -> dict[str, Any]:
        """Close the session (releasing one that is already closed says how it closed)."""
        return _answered(lambda: manager.release(session_id))

    return server


def _answered(call) -> dict[str, Any]:
    """The call's response model as JSON, or a tool error that starts with the protocol's error code."""
    try:
        return call().model_dump(mode="json")
    except EnvServiceError as error:
        raise ToolError(f"{error.code.value}: {error.message}") from None


def _refused_if_invalid(build):
    try:
        return build()
    except ValueError as error:  # pydantic's ValidationError: the same limits as the HTTP protocol
        raise ToolError(f"invalid_request: {clip(str(error), 600)}") from None


def mcp_app(server: MCPServer) -> ASGIApp:
    """The server's streamable-HTTP app, to mount at MCP_PATH: stateless, JSON answers, no stream (`NoStreams`),
    and no Host check of its own (`server.RequestGuard` has checked the Host against the bound names before the
    request gets here). Its session manager must run while the service does (`server.session_manager.run()` in
    the lifespan)."""
    return NoStreams(server.streamable_http_app(
        streamable_http_path="/", stateless_http=True, json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)))


class NoStreams:
    """Answers `GET` (the client's request for a server-to-client event stream) with 405 before the MCP app sees
    it. Why: in stateless mode the SDK keeps such a stream open until the client leaves, each one holding a
    connection of the service's limit, and a stateless server has nothing to send on it."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            answer = JSONResponse({"code": "method_not_allowed", "message": "this MCP endpoint is stateless and "
                                   "opens no event stream: POST JSON-RPC requests to it"}, status_code=405,
                                  headers={"Allow": "POST, DELETE"})
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)
