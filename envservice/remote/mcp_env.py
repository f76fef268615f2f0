"""A user's MCP server as an envservice env, through config alone (`kind: mcp` in an env-config file).

    guess:
      kind: mcp
      config:
        url: http://127.0.0.1:9000/mcp/           # the server's streamable-HTTP endpoint
        tasks: {train: [guess-3, guess-7], test: [guess-5]}
        start_tool: start                         # optional: called at reset with {task, seed}; its text is the
                                                  # first observation (default: the task name and the tools)
        final_tools: [give_up]                    # optional: calling one ends the episode
        scorer: envservice.remote.mcp_example_server:score   # (task name, calls) -> (score, success)
      max_steps: 10

The session's tools are its actions: an action is one call written as JSON, `{"name": "guess", "arguments":
{"n": 5}}` (what the `tool_call` action parser writes), and the tool's text result is the observation. An
action that is not such a call, or names a tool the server does not have, is answered with an observation
saying so and listing the tools, as every env answers an unknown action; a tool that reports an error gives
its error text as the observation. The episode ends when the agent calls a `final_tools` tool (or at the step
limit). The reward is the user's scorer's verdict on the episode's calls, at evaluate.

Each envservice session is one MCP session (the official `mcp` SDK's `Client`), opened at `reset` and closed
by `close()`, so a remote session never outlives ours; a reset on the same instance opens a fresh one. The
client sessions of a process share one event-loop thread, each held open by a task of its own. The server or
the way to it failing (down, timeout, a broken reply) raises `MCPEnvError`, an `env_error` for that session
only, never a reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Mapping

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envservice.envs.base import Param, StepResult, Task, TextEnv, parse_tool_call
from envservice.registry import import_object
from envservice.errors import clip

CallRecord = dict[str, Any]
"""One tool call of an episode: {"name", "arguments", "result", "is_error"}."""


class MCPEnvError(RuntimeError):
    """The MCP server or the way to it failed; the message names the URL. The service reports it as env_error."""


MAX_RESULT_CHARS = 20_000
"""Default cap on a tool result's text (an observation: what an agent's context can hold, and what a service
and a trainer keep per step)."""


class _CappedAnswers(httpx2.AsyncBaseTransport):
    """An HTTP transport that refuses an answer whose Content-Length is over `max_bytes` before its body is read,
    answering in its place a JSON-RPC error the MCP client hands to the caller (a 40 MB tool result once cost
    envservice +425 MB, read whole only to be cut)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int) -> None:
        self.inner, self.max_bytes = inner, max_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        length = response.headers.get("content-length", "")
        if not (length.isdigit() and int(length) > self.max_bytes):
            return response
        await response.aclose()
        message = f"an answer of {length} bytes is over the {self.max_bytes} this env reads (max_result_chars)"
        return httpx2.Response(502, json={"jsonrpc": "2.0", "id": None, "error": {"code": -32603, "message": message}},
                               request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def max_answer_bytes(max_result_chars: int) -> int:
    """The largest server answer read for a result of `max_result_chars` characters: room for JSON escapes
    (up to 6 bytes a character) and the envelope, at least 1 MiB."""
    return max(1 << 20, 6 * max_result_chars + (64 << 10))


def capped(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a note saying how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} characters of the tool's result cut]"


class MCPEnv(TextEnv):
    """A text env played on a user's MCP server, one MCP session per envservice session (module docstring)."""

    description = "a user's MCP server (configure with kind: mcp)"
    config_fields = {
        "url": Param("The server's streamable-HTTP MCP endpoint, e.g. http://127.0.0.1:9000/mcp/.", str),
        "tasks": Param("Task names per split, e.g. {train: [a, b], test: [c]} (default {train: [default]}).", dict),
        "start_tool": Param("Tool called at reset with {task, seed}; its text is the first observation (default: "
                            "none, the observation names the task and the tools). It is not one of the actions.", str),
        "final_tools": Param("Tools whose call ends the episode (default none: the step limit ends it).", list),
        "scorer": Param("'module:function' called at evaluate as f(task_name, calls) -> (score in [0, 1], "
                        "success); calls are the episode's {name, arguments, result, is_error}.", str),
        "timeout_s": Param("Seconds to open the session and to wait for each tool (default 30).", float),
        "max_result_chars": Param(f"A tool result longer than this is cut, with a note of what was cut, before it "
                                  f"becomes an observation (default {MAX_RESULT_CHARS}); a server answer larger than "
                                  "`max_answer_bytes` of it is refused unread (an env failure of that step).", int),
        "description": Param("One line for GET /envs.", str),
    }
    required_config = ("url", "scorer")

    _scorer: Callable[[str, list[CallRecord]], tuple[float, bool]] | None = None

    def __init__(self) -> None:
        """An instance without a session; the first `reset` opens one."""
        self._connection: _Connection | None = None
        self._task: Task | None = None
        self._tools: list[str] = []
        self._calls: list[CallRecord] = []

    @classmethod
    def configured_attributes(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """`splits`, `description` and the scorer, from a checked config (`ValueError` naming a bad field)."""
        tasks = config.get("tasks", {"train": ["default"]})
        if not tasks or not all(isinstance(names, list) and names and all(isinstance(n, str) for n in names)
                                for names in tasks.values()):
            raise ValueError("MCPEnv: config.tasks maps each split to a non-empty list of task names (strings)")
        if not all(isinstance(name, str) for name in config.get("final_tools", [])):
            raise ValueError("MCPEnv: config.final_tools must be a list of tool names")
        if config.get("timeout_s", 30.0) <= 0:
            raise ValueError(f"MCPEnv: config.timeout_s={config['timeout_s']!r} must be > 0 seconds")
        return {"splits": {split: list(names) for split, names in tasks.items()},
                "description": config.get("description") or f"MCP server at {config['url']}",
                "_scorer": staticmethod(_load_scorer(config["scorer"]))}

    # ---- the TextEnv contract ----------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """A fresh MCP session on `task`: (the start tool's text, or the task and the tools; {"tools": [...]})."""
        self.close()
        max_chars = int(self.config.get("max_result_chars", MAX_RESULT_CHARS))
        self._connection = _Connection(self.config["url"], float(self.config.get("timeout_s", 30.0)),
                                       max_answer_bytes(max_chars))
        start = self.config.get("start_tool")
        # The start tool is the env's to call, not an action: calling it mid-episode would restart the game.
        self._tools = [name for name in self._connection.tools if name != start]
        self._task, self._calls = task, []
        if start:
            result = self._connection.call(start, {"task": task.name, "seed": task.seed})
            if result["is_error"]:
                raise MCPEnvError(f"{self.config['url']}: start tool {start!r} failed: {clip(result['text'], 300)}")
            observation = capped(result["text"], int(self.config.get("max_result_chars", MAX_RESULT_CHARS)))
        else:
            observation = f"Task: {task.name}"
        return f"{observation}\n\n{self._tool_help()}", {"tools": list(self._tools)}

    def step(self, action: str) -> StepResult:
        """One tool call written as JSON; its text result is the observation (module docstring)."""
        call = parse_tool_call(action)
        if isinstance(call, str) or call[0] not in self._tools:
            problem = call if isinstance(call, str) else f"there is no tool {clip(call[0], 80)!r}"
            return f"Invalid action: {problem}. {self._tool_help()}", 0.0, False, False, {}
        name, arguments = call
        result = self._connection.call(name, arguments)
        text = capped(result["text"], int(self.config.get("max_result_chars", MAX_RESULT_CHARS)))
        self._calls.append({"name": name, "arguments": arguments, "result": text, "is_error": result["is_error"]})
        return text, 0.0, name in self.config.get("final_tools", []), False, {}

    def evaluate(self) -> tuple[float, bool]:
        """The scorer's verdict on the episode's calls, the score clipped to [0, 1]."""
        score, success = type(self)._scorer(self._task.name if self._task else "", list(self._calls))
        return min(1.0, max(0.0, float(score))), bool(success)

    def close(self) -> None:
        """End the MCP session (it never outlives this instance's envservice session)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _tool_help(self) -> str:
        return ('Act with one tool call as JSON, {"name": "<tool>", "arguments": {...}}. Tools: '
                + ", ".join(self._tools) + ".")


def _load_scorer(path: str) -> Callable[[str, list[CallRecord]], tuple[float, bool]]:
    try:
        scorer = import_object(path)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"MCPEnv: config.scorer={path!r}: cannot import it ({error})") from error
    if not callable(scorer):
        raise ValueError(f"MCPEnv: config.scorer={path!r} names no callable ('module:function')")
    return scorer


# ---- the client side: MCP sessions on one event-loop thread ----------------------------------------------

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for MCP client sessions (a daemon thread, started on first use)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="envservice-mcp-clients", daemon=True).start()
        return _LOOP


class _Connection:
    """One MCP client session, held open by a task of its own on the shared loop (the SDK's `Client` must be
    entered and left by the same task); calls reach it through a queue."""

    def __init__(self, url: str, timeout_s: float, max_bytes: int = 1 << 20) -> None:
        """`max_bytes`: the largest answer read from the server (by its Content-Length, or one SSE event)."""
        self.url, self.timeout_s, self.max_bytes = url, timeout_s, max_bytes
        self._opened: concurrent.futures.Future = concurrent.futures.Future()
        self._queue: asyncio.Queue | None = None
        self._task = asyncio.run_coroutine_threadsafe(self._serve(), _loop())
        try:
            self.tools: list[str] = self._opened.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise MCPEnvError(f"{url}: no MCP session within {timeout_s:g} s") from None
        except Exception as error:
            self.close()
            raise MCPEnvError(f"{url}: could not open an MCP session ({type(error).__name__}: {error})") from None

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """{"text", "is_error"} of one tool call; MCPEnvError when the session failed."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        _loop().call_soon_threadsafe(self._queue.put_nowait, (name, arguments, answer))
        try:
            return answer.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise MCPEnvError(f"{self.url}: tool {name!r} gave no answer within {self.timeout_s:g} s") from None
        except MCPEnvError:
            raise
        except Exception as error:
            raise MCPEnvError(f"{self.url}: tool {name!r} failed in the session ({type(error).__name__}: "
                              f"{clip(str(error), 300)})") from None

    def close(self) -> None:
        """End the session and wait (up to the timeout) for its task to leave the client."""
        if self._queue is not None:
            _loop().call_soon_threadsafe(self._queue.put_nowait, None)
        try:
            self._task.result(self.timeout_s)
        except Exception:  # already failed, or stuck: cancel it (the SDK closes the HTTP session)
            self._task.cancel()

    async def _serve(self) -> None:
        self._queue = asyncio.Queue()
        http = httpx2.AsyncClient(transport=_CappedAnswers(httpx2.AsyncHTTPTransport(), self.max_bytes),
                                  timeout=httpx2.Timeout(30.0, read=300.0))  # the SDK's own client's
        transport = streamable_http_client(self.url, http_client=http, max_sse_event_size=self.max_bytes)
        try:
            async with http, Client(transport) as client:
                tools = [tool.name for tool in (await client.list_tools()).tools]
                self._opened.set_result(tools)
                while (item := await self._queue.get()) is not None:
                    name, arguments, answer = item
                    try:
                        result = await client.call_tool(name, arguments)
                    except Exception as error:
                        answer.set_exception(error)
                        continue
                    text = "\n".join(part.text for part in result.content if getattr(part, "text", None) is not None)
                    answer.set_result({"text": text, "is_error": bool(result.is_error)})
        except Exception as error:
            if not self._opened.done():
                self._opened.set_exception(error)
            while not self._queue.empty():  # calls sent before the session failed get its error, not a wait
                item = self._queue.get_nowait()
                if item is not None:
                    item[2].set_exception(error)
            raise
