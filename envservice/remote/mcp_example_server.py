"""A small MCP server for `kind: mcp` (envservice/remote/mcp_env.py): guess a number from 1 to 10.

    python -m envservice.remote.mcp_example_server --port 9000     # streamable HTTP at /mcp/

Tools: `start(task, seed)` begins a game whose target is the task's number (`guess-7` -> 7), `guess(n)` answers
"higher", "lower" or "correct", `give_up()` ends it. Each MCP session plays its own game. `score` is the
scorer to configure beside it: 1.0 and success when a guess was correct. It stands for a user's own MCP server
in tests and in docs/environments.md's example; it is not an env of ours.
"""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings

_GAMES: dict[str, int] = {}  # MCP session id -> its target


def _session(ctx: Context) -> str:
    """The MCP session this request belongs to (the Mcp-Session-Id header of streamable HTTP)."""
    return (ctx.headers or {}).get("mcp-session-id", "")


def build_server() -> MCPServer:
    """The guessing game's MCP server."""
    server = MCPServer(name="guess-the-number")

    @server.tool()
    def start(task: str, seed: int = 0, ctx: Context = None) -> str:
        """Begin a game; the task names the target, e.g. guess-7."""
        _GAMES[_session(ctx)] = int(task.rsplit("-", 1)[-1])
        return "I picked a number from 1 to 10. Guess it with the guess tool."

    @server.tool()
    def guess(n: int, ctx: Context = None) -> str:
        """Guess the number."""
        target = _GAMES.get(_session(ctx))
        if target is None:
            raise ValueError("no game: call start first")
        return "correct" if n == target else ("higher" if n < target else "lower")

    @server.tool()
    def shout(n: int, ctx: Context = None) -> str:
        """Answer n letters (a large answer, for the tests' size caps)."""
        return "a" * max(0, min(n, 100_000_000))

    @server.tool()
    def give_up(ctx: Context = None) -> str:
        """End the game without the answer."""
        _GAMES.pop(_session(ctx), None)
        return "Game over."

    return server


def score(task: str, calls: list[dict[str, Any]]) -> tuple[float, bool]:
    """The scorer for this server: 1.0 and success once a guess was correct."""
    won = any(call["name"] == "guess" and call["result"] == "correct" for call in calls)
    return (1.0 if won else 0.0), won


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    server = build_server()
    app = server.streamable_http_app(streamable_http_path="/mcp/", transport_security=TransportSecuritySettings(
        enable_dns_rebinding_protection=False))
    print(f"guess-the-number MCP server on http://{args.host}:{args.port}/mcp/", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
