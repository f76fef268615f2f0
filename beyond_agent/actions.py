"""Turn the model's assistant text into the one action an environment steps with.

Each environment names its parser in config (`plain`, `tagged`, `tool_call`, or one registered with
`@register_action_parser("name")`). A parser never raises on what the model wrote: a reply it cannot read
becomes `ParsedAction(action=None, error=...)`, and `error` is a sentence the environment can show the
model as its next observation. Only the text is parsed here; the token ids the model sampled are kept as
they were by the RolloutHandler and are never re-tokenised from this text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class ParsedAction:
    """What a parser read from one assistant reply: exactly one of the two fields is set."""

    action: str | None
    """The action string to send to the environment's `step`, or None when the reply could not be parsed."""
    error: str | None
    """Why the reply could not be parsed, written for the model (shown as its next observation); else None."""

    def __post_init__(self) -> None:
        if (self.action is None) == (self.error is None):
            raise ValueError(f"ParsedAction needs exactly one of action and error; got action={self.action!r}, "
                             f"error={self.error!r}")

    @property
    def ok(self) -> bool:
        """True when an action was found."""
        return self.action is not None


class ActionParser(Protocol):
    """The contract of a parser: text in, a ParsedAction out, no exception for malformed model output."""

    def parse(self, text: str) -> ParsedAction:
        """Read one assistant reply (already decoded, special tokens removed)."""
        ...


ACTION_PARSERS: dict[str, Callable[..., ActionParser]] = {}
"""Parser factories by name; filled by `register_action_parser`."""


def register_action_parser(name: str) -> Callable[[type], type]:
    """Class decorator: make a parser available to `get_action_parser(name)`."""

    def decorate(cls: type) -> type:
        if name in ACTION_PARSERS:
            raise ValueError(f"Action parser {name!r} is already registered by {ACTION_PARSERS[name]!r}")
        ACTION_PARSERS[name] = cls
        return cls

    return decorate


def get_action_parser(name: str, **kwargs) -> ActionParser:
    """Build the parser registered as `name` with its keyword arguments."""
    if name not in ACTION_PARSERS:
        raise ValueError(f"Action parser {name!r} is not registered; registered action parsers: "
                         f"{sorted(ACTION_PARSERS)}")
    return ACTION_PARSERS[name](**kwargs)


@register_action_parser("plain")
class PlainActionParser:
    """The whole reply is the action: surrounding whitespace stripped, only its first line kept."""

    def parse(self, text: str) -> ParsedAction:
        stripped = text.strip()
        if not stripped:
            return ParsedAction(None, "Your reply was empty. Reply with one action on a single line.")
        return ParsedAction(stripped.splitlines()[0].strip(), None)


@register_action_parser("react")
class ReactActionParser:
    """AgentGym's ReAct format: `Thought: ...` then `Action:` and the action; the first non-empty line after
    the last `Action:` is the action (AgentGym's servers, e.g. WebShop's `click[...]`, expect it bare)."""

    _marker = re.compile(r"Action\s*:", re.IGNORECASE)

    def parse(self, text: str) -> ParsedAction:
        parts = self._marker.split(text)
        if len(parts) < 2:
            return ParsedAction(None, "No 'Action:' found. Reply as 'Thought: <your reasoning>' and then "
                                      "'Action: <one action>'.")
        lines = [line.strip() for line in parts[-1].splitlines() if line.strip()]
        if not lines:
            return ParsedAction(None, "Nothing followed 'Action:'. Write one action after it.")
        return ParsedAction(lines[0], None)


@register_action_parser("raw")
class RawActionParser:
    """The whole reply, stripped, for servers that parse the model's text themselves (AgentGym's WebArena
    server reads the action out of "In summary, the next action I will perform is ```...```")."""

    def parse(self, text: str) -> ParsedAction:
        stripped = text.strip()
        if not stripped:
            return ParsedAction(None, "Your reply was empty. Reply with your reasoning and one action.")
        return ParsedAction(stripped, None)


@register_action_parser("tagged")
class TaggedActionParser:
    """The action is inside `<tag>...</tag>` (default tag `action`); the last such block wins, so the
    model may think aloud before it. The content is stripped; an empty or missing block is an error."""

    def __init__(self, tag: str = "action"):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", tag):
            raise ValueError(f"TaggedActionParser.tag must be a plain tag name like 'action'; got {tag!r}")
        self.tag = tag
        self._pattern = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        blocks = self._pattern.findall(text)
        example = f"<{self.tag}>go north</{self.tag}>"
        if not blocks:
            return ParsedAction(None, f"No <{self.tag}>...</{self.tag}> block found. End your reply with "
                                      f"your action inside it, for example {example}.")
        action = blocks[-1].strip()
        if not action:
            return ParsedAction(None, f"The <{self.tag}> block was empty. Put your action inside it, "
                                      f"for example {example}.")
        return ParsedAction(action, None)


TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""One `<tool_call>...</tool_call>` block of a reply (Hermes / Qwen2.5 format); group 1 is its JSON."""


def tool_call_blocks(text: str) -> list[str]:
    """The stripped insides of every `<tool_call>` block of `text`, in order."""
    return [block.strip() for block in TOOL_CALL_BLOCK.findall(text)]


@register_action_parser("tool_call")
class ToolCallActionParser:
    """One `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, the format our ChatML
    template renders. The action is that call re-serialised as compact JSON with exactly the keys `name`
    and `arguments` (e.g. `{"name": "calculator", "arguments": {"expr": "1+2"}}`), so the env can
    `json.loads` it. No block, several blocks, invalid JSON, a missing or non-string name, arguments that
    are not an object, or (when `tools` is given) an unknown tool name are errors for the model."""

    def __init__(self, tools: list[str] | None = None):
        self.tools = list(tools) if tools is not None else None

    def parse(self, text: str) -> ParsedAction:
        blocks = tool_call_blocks(text)
        if len(blocks) != 1:
            found = "no" if not blocks else str(len(blocks))
            return ParsedAction(None, f"Call exactly one tool per turn; found {found} <tool_call> blocks. "
                                      'Write <tool_call>{"name": "...", "arguments": {...}}</tool_call>.')
        return self._parse_call(blocks[0])

    def _parse_call(self, body: str) -> ParsedAction:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return ParsedAction(None, f"The <tool_call> block is not valid JSON ({err.msg} at position "
                                      f"{err.pos}).")
        problem = self._check_call(call)
        if problem:
            return ParsedAction(None, problem)
        canonical = {"name": call["name"], "arguments": call.get("arguments", {})}
        return ParsedAction(json.dumps(canonical, ensure_ascii=False), None)

    def _check_call(self, call: object) -> str | None:
        """A sentence for the model naming what is wrong with the decoded call, or None if it is valid."""
        if not isinstance(call, dict):
            return f'The <tool_call> JSON must be an object like {{"name": ..., "arguments": {{...}}}}; got ' \
                   f"{type(call).__name__}."
        name = call.get("name")
        if not isinstance(name, str) or not name:
            return 'The <tool_call> JSON needs a "name" string naming the tool.'
        if not isinstance(call.get("arguments", {}), dict):
            return f'The "arguments" of tool {name!r} must be a JSON object.'
        if self.tools is not None and name not in self.tools:
            return f"Unknown tool {name!r}; available tools: {', '.join(self.tools)}."
        return None
