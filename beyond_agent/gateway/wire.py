"""The OpenAI chat-completions wire format, as far as the gateway speaks it.

`ChatRequest` validates a `/v1/chat/completions` body (unknown fields are accepted and ignored, as OpenAI's
own server and vLLM do, since SDKs send fields such as `stream_options` or `user`); `chat_response` builds the
answer; `error_body` is the OpenAI error format (`{"error": {"message", "type", "param", "code"}}`).
`template_messages` turns OpenAI messages into what a Hugging Face chat template reads (tool-call arguments
as objects, text parts joined); `same_messages` compares two histories the way the gateway decides whether a
call continues the previous one (role, text, tool calls by name and arguments; ids and SDK extras ignored).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from beyond_agent.actions import TOOL_CALL_BLOCK, tool_call_blocks

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a request message may have ("developer" is rendered as "system")."""
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "stop"}
"""Our generation stop reasons -> OpenAI's finish_reason (a tool call turns "stop" into "tool_calls")."""


class ChatRequest(BaseModel):
    """The fields of a chat-completions request the gateway acts on."""

    model_config = ConfigDict(extra="ignore")

    model: str
    """The served model's name (`/v1/models` lists it); another name is refused."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation so far, in OpenAI's format."""
    tools: list[dict[str, Any]] | None = None
    """Function tools the model may call (`{"type": "function", "function": {...}}`); rendered by the template."""
    tool_choice: Any = None
    """"auto" and "none" are accepted ("none": the tools are not shown to the model); forcing a tool is not."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    """Only one choice per request: each sampled turn belongs to one episode."""
    stream: bool = False
    """Answer as server-sent `chat.completion.chunk` events (the whole reply in one chunk, once sampled)."""
    stream_options: dict[str, Any] | None = None
    """`{"include_usage": true}` adds a last chunk with the token counts."""
    logprobs: bool = False
    """Answer each sampled token's log-prob (the behaviour policy's, as trained on)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Only 0 or absent: the alternatives' log-probs are not kept."""
    stop: Any = None
    """Refused when set (see `unsupported`)."""
    response_format: Any = None
    """Only `{"type": "text"}` or absent (see `unsupported`)."""

    @field_validator("messages")
    @classmethod
    def _messages_well_formed(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, message in enumerate(messages):
            if message.get("role") not in MESSAGE_ROLES:
                raise ValueError(f"messages[{index}].role is {message.get('role')!r}; valid roles: "
                                 f"{', '.join(MESSAGE_ROLES)}")
            if not _is_content(message.get("content")):
                raise ValueError(f"messages[{index}].content must be a string, null, or a list of parts whose "
                                 "text is a string")
            if not _are_tool_calls(message.get("tool_calls")):
                raise ValueError(f"messages[{index}].tool_calls must be a list of "
                                 "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}} objects")
        return messages

    def turn_limit(self) -> int | None:
        """What the caller allows this reply at most (`max_completion_tokens`, else `max_tokens`)."""
        return self.max_completion_tokens or self.max_tokens

    def shown_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template renders: none with `tool_choice: "none"`."""
        if self.tool_choice == "none" or not self.tools:
            return None
        return self.tools


def _is_content(content: Any) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text", ""), str)
                                             for part in content)


def _are_tool_calls(calls: Any) -> bool:
    if calls is None:
        return True
    return isinstance(calls, list) and all(isinstance(call, dict) and isinstance(call.get("function", {}), dict)
                                           for call in calls)


def longest_message(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(index, characters) of the longest message: its text, or the longest of its tool calls' arguments."""
    sizes = [max([len(_text(message.get("content")))] +
                 [len(str(call.get("function", {}).get("arguments", ""))) for call in message.get("tool_calls") or []])
             for message in messages]
    longest = max(range(len(sizes)), key=sizes.__getitem__)
    return longest, sizes[longest]


def unsupported(request: ChatRequest) -> tuple[str, str] | None:
    """(parameter, why) for a request the gateway cannot serve faithfully, or None."""
    if request.tool_choice not in (None, "auto", "none"):
        return "tool_choice", "only 'auto' and 'none' are supported (forcing a tool would change what the policy sampled)"
    if request.stop not in (None, "", []):
        return "stop", ("stop sequences are not supported: the reply is what the policy sampled up to its own end "
                        "(cutting it would train on an ending it did not choose); cut the text in the agent instead")
    if request.response_format is not None and request.response_format != {"type": "text"}:
        return "response_format", ("only {\"type\": \"text\"} is supported: constrained decoding would make the "
                                   "sampled tokens' log-probs differ from the policy's, which training needs")
    if request.top_logprobs:
        return "top_logprobs", "only the sampled tokens' log-probs are kept (top_logprobs 0 or absent)"
    return None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error format."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


MAX_ARGUMENT_DEPTH = 32
"""Deepest nesting of a tool call's arguments read as an object; deeper ones stay the string they came as."""


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object (OpenAI sends a JSON string; templates read an object). Arguments that are
    not JSON, or nested deeper than MAX_ARGUMENT_DEPTH (which parsing, comparing and rendering walk recursively:
    a 100 000-deep array was a RecursionError and a plain-text 500), stay the string they came as."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            return raw
        return parsed if _depth(parsed) <= MAX_ARGUMENT_DEPTH else raw
    return raw


def _depth(value: Any) -> int:
    """How deeply containers nest in a parsed JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_ARGUMENT_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(call.get("function", {}).get("name"), _arguments(call.get("function", {}).get("arguments")))
            for call in message.get("tool_calls") or []]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template reads them."""
    rendered = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}
                                 for name, arguments in _calls(message)]
        rendered.append(out)
    return rendered


def same_messages(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> bool:
    """Whether two histories say the same to the model (role, text, tool calls; ids and extras aside)."""
    def key(message: dict[str, Any]) -> tuple:
        return message.get("role"), _text(message.get("content")), json.dumps(_calls(message), sort_keys=True)

    return len(left) == len(right) and all(key(a) == key(b) for a, b in zip(left, right))


def reply_message(text: str) -> tuple[dict[str, Any], list[str]]:
    """The assistant message for the model's reply text: its `<tool_call>` blocks become `tool_calls` (each with a
    fresh id), the rest is the content. Returns the message and a note per block that was not a valid call
    (such a block stays in the content, as the model wrote it)."""
    calls, notes = [], []
    for block in tool_call_blocks(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as error:
            notes.append(f"a <tool_call> block is not JSON ({error.msg}); left in the content")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            notes.append("a <tool_call> block has no \"name\" string; left in the content")
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    content = TOOL_CALL_BLOCK.sub("", text).strip() if calls and not notes else text
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message, notes


def stream_events(response: dict[str, Any], include_usage: bool = False) -> list[str]:
    """A `chat.completion` as server-sent events of `chat.completion.chunk`s, as OpenAI streams it: the role and
    the content (and tool calls, with their index) in one delta, then the finish reason, with `include_usage` a
    chunk with the token counts, then `[DONE]`. The gateway samples the whole reply before answering, so the
    reply comes in one piece."""
    choice = response["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
                "model": response["model"], "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    events = [event([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice.get("logprobs")}]),
              event([{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}])]
    if include_usage:
        events.append(event([], usage=response["usage"]))
    return [*events, "data: [DONE]\n\n"]


def token_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: each sampled token's text, log-prob and bytes (no alternatives)."""
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                        for token, logprob in zip(tokens, logprobs)]}


def chat_response(model: str, message: dict[str, Any], stop_reason: str, prompt_tokens: int,
                  completion_tokens: int, response_id: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `chat.completion` object with one choice (`logprobs`: `token_logprobs(...)` when asked for)."""
    finish: Literal["stop", "length", "tool_calls"] = FINISH_REASONS[stop_reason]  # type: ignore[assignment]
    if message.get("tool_calls") and finish == "stop":
        finish = "tool_calls"
    return {"id": response_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
