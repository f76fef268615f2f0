"""One agent episode behind the gateway: every call it made, and the training samples (segments) they form.

Each chat-completions call either continues the episode's current segment or starts a new one:
- it continues when its messages are the previous call's messages, then the reply the gateway gave, then only
  new user/tool messages (the agent appended to its history): the new messages are added to the segment's
  `RolloutHandler` as an observation delta, so the segment is one multi-turn sample with our exact ids and
  masks — the model's earlier replies stay the ids it sampled, never re-tokenised text;
- otherwise (the agent trimmed, summarised or rewrote its history, changed its tools, or `merge: never`) the
  call's whole history is rendered by the chat template as the prompt of a new segment, which the call's reply
  starts. Earlier replies in that prompt are then template text (mask 0, not trained on) — as the agent
  really showed them to the model.

`GatewayEpisode.mode` says which happened: "merged" (one segment) or "per_call" (several); every call's record
says whether it continued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from beyond_agent.gateway.wire import same_messages, template_messages
from beyond_agent.rollout.handler import OBSERVATION_ROLES, RolloutHandler

MERGE_POLICIES = ("auto", "never")
"""`auto`: calls that extend the previous one share a segment; `never`: every call is its own segment."""


@dataclass
class CallRecord:
    """One chat-completions call as the gateway served it."""

    index: int
    """0, 1, 2, ... in the order the episode's calls were answered."""
    segment: int
    """Index of the segment (training sample) this call's reply belongs to."""
    continued: bool
    """True when the call extended the previous call's messages and reply (same segment)."""
    prompt_ids: list[int]
    """Exactly the ids the LLM was asked to continue."""
    sampled_ids: list[int]
    """The ids it sampled, as it returned them (end-of-turn token included when it stopped on it)."""
    logprobs: list[float]
    """The sampling log-prob of each sampled id."""
    stop_reason: str
    """Why the reply ended (`rollout.llm.STOP_REASONS`)."""
    policy_version: int | None
    """Version of the weights that sampled it, when the gateway's owner knows it."""
    reply: dict[str, Any]
    """The assistant message returned to the agent (content and parsed tool calls)."""
    latency_s: float = 0.0
    """Seconds the LLM took for it."""
    notes: list[str] = field(default_factory=list)
    """What the gateway noticed, e.g. a `<tool_call>` block that was not valid JSON."""


class GatewayEpisode:
    """The calls of one episode and the segments they form (module docstring). Calls are answered one at a
    time (`lock`): an agent that sends two at once gets the second refused by the gateway."""

    def __init__(self, episode_id: str, tokenizer: Any, max_prompt_length: int, max_response_length: int,
                 merge: str = "auto") -> None:
        """`merge` is one of MERGE_POLICIES (checked by `GatewayConfig`, which the gateway builds episodes from)."""
        self.episode_id = episode_id
        """The id the agent's base URL carries."""
        self.tokenizer, self.merge = tokenizer, merge
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.segments: list[RolloutHandler] = []
        """One handler per training sample, in order."""
        self.calls: list[CallRecord] = []
        """Every answered call, in order."""
        self.lock = threading.Lock()
        """Held while a call is answered."""
        self.generate: Any = None
        """The episode's `generate(request_id, prompt_ids, max_tokens)` (set by `Gateway.open_episode`)."""
        self.env: Any = None
        """The episode's env session, when one is served under its `/env` routes (`Gateway.attach_env`)."""
        self.key: str | None = None
        """When set, the key every request on this episode must carry (`Gateway.authorize`)."""
        self.limit_reached: str | None = None
        """`max_calls` once a call was refused for the episode's call cap, `length` once one was refused because the
        segment's response budget (max_response_length) is spent: the episode ends as that, scored, even when the
        agent raises on the refusal (like a round limit of our own loop)."""
        self.refused_calls = 0
        """Calls refused with an error (bad requests, a call while another was answered): they count toward
        `max_calls` as answered ones do, so that no agent can send requests without end."""
        self.infra_failures: list[str] = []
        """Why LLM calls failed (each ended its segment as `llm_error`)."""
        self._last_messages: list[dict[str, Any]] | None = None
        self._last_reply: dict[str, Any] | None = None
        self._last_tools: list[dict[str, Any]] | None = None

    @property
    def mode(self) -> str:
        """"merged" when all calls formed one segment, "per_call" when the history was rewritten along the way."""
        return "merged" if len(self.segments) <= 1 else "per_call"

    def segment_for(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> tuple[RolloutHandler, bool]:
        """The segment this call's reply goes to, with the call's new messages already added, and whether it
        continues the previous call (else it is a new segment whose prompt is the whole history)."""
        new = self._appended(messages, tools)
        if new is not None:
            handler = self.segments[-1]
            handler.add_observations(template_messages(new))
            return handler, True
        handler = RolloutHandler(self.tokenizer, template_messages(messages), self.max_prompt_length,
                                 self.max_response_length, tools=tools)
        self.segments.append(handler)
        return handler, False

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, call: CallRecord) -> None:
        """Keep the call (its reply is already on its segment) and remember what the next call must extend."""
        self.calls.append(call)
        self._last_messages, self._last_reply, self._last_tools = list(messages), call.reply, tools

    def llm_failed(self, handler: RolloutHandler, message: str) -> None:
        """The LLM failed on a call of `handler`'s segment: the segment ends as an infrastructure failure
        (`llm_error`, never scored) and the next call starts a new one."""
        handler.finish("llm_error")
        self.infra_failures.append(message)
        self._last_messages = None

    def _appended(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                  ) -> list[dict[str, Any]] | None:
        """The messages this call added after the previous call's messages and reply, when that is all it
        changed; None when the call must start a new segment."""
        if self.merge == "never" or self._last_messages is None or not self.segments or self.segments[-1].done:
            return None
        if tools != self._last_tools:
            return None
        previous = len(self._last_messages)
        if len(messages) <= previous + 1:
            return None
        if not same_messages(messages[:previous], self._last_messages):
            return None
        if not same_messages(messages[previous:previous + 1], [self._last_reply]):
            return None
        new = messages[previous + 1:]
        if any(message.get("role") not in OBSERVATION_ROLES for message in new):
            return None
        return new
