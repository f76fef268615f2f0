"""Token bookkeeping for one multi-turn episode (`rollout/batch.py` collates many into a verl batch).

The sequence the policy is trained on is `prompt_ids + response_ids`:

    prompt    = chat template of (system, task) with the generation prompt      (not in the response)
    response  = assistant ids as generated        (mask 1, log-probs kept)
              + observation delta                 (mask 0: the environment wrote it)
              + assistant ids as generated        (mask 1)
              + ...

Two promises, both checked by the golden tests:
- assistant ids are stored exactly as the server returned them; generated text is never decoded and
  re-tokenised into training ids (decoding happens only to render the chat for the template and logs);
- every observation is appended as the template's text delta, so when the assistant ids are the
  tokenizer's own encoding, the whole sequence equals `encode(render(conversation))` token for token.

Policies (each also recorded on the handler):
- Prompt longer than `max_prompt_length`: by default the head is dropped and the tail kept
  (`prompt_truncation="left"`, as verl's agent loop does), because the tail holds the generation prompt
  and the latest task text; `prompt_truncated` records it. `prompt_truncation="error"` raises instead.
- Assistant turn that stopped without the end-of-turn token (per-turn length stop): its ids stay as
  they are and the next observation delta starts with the end-of-turn token (mask 0), since the template
  closes every assistant turn; the model is not trained to emit a token it did not emit.
- Response longer than `max_response_length`: the ids that fit are kept, `termination` becomes
  `"length"` and the handler stops accepting turns.

How an observation becomes ids (the "simple delta"): the template renders a short fixed chat, a dummy
system and user message, an assistant turn and the new messages, with the generation prompt; the text
after the assistant turn's content (after its end-of-turn token when our ids end with it) is what the
template appends, and it is encoded whole with `tokenizer.encode`. So every boundary between our ids and
a delta sits at the assistant turn's end, where the template writes a special token, and the ids equal the
full rendering's. That holds for templates that only append and that write a message the same wherever it
stands after the first exchange (the initial messages must hold the task as a user message). Each template
(with its tools) is probed once for both, and refused with the place it differs: one that rewrites earlier
turns (a header counting messages, Qwen3-style removal of past reasoning) or renders a message by its
position (alternating markers, numbered turns).
Assistant turns are decoded only when their text is needed (`messages`, logs).
"""

from __future__ import annotations

import json
import threading
import zlib
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np

MAX_CHARS_PER_TOKEN = 32
"""More characters than any token of a real vocabulary spans, bar rare runs: text beyond this many characters
per token of room is cut before tokenizing (the ids kept are still exactly what the model is given)."""
TERMINATION_REASONS = ("done", "max_rounds", "truncated", "length", "max_calls", "env_error", "llm_error", "timeout", "agent_error")
PROMPT_TRUNCATION_POLICIES = ("left", "error")
UNVERSIONED = -1
"""`Episode.token_policy_versions` of a token no policy sampled (mask 0) or whose version is unknown."""
_UNVERSIONED_TOKEN = array("q", [UNVERSIONED])  # repeated for a run of such tokens without a Python list
OBSERVATION_ROLES = ("user", "tool")
DUMMY_PREFIX = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"})
"""The fixed chat before the assistant turn whose suffix the simple delta reads."""
ASSISTANT_MARK = "ASSISTANTCONTENTMARK"
"""Content of that assistant turn: plain text that every template writes as given."""


@dataclass
class Episode:
    """A finished episode's token lists: what `batch.collate` needs, free of any tokenizer."""

    prompt_ids: list[int]
    """Prompt token ids (already capped to max_prompt_length)."""
    response_ids: list[int]
    """Everything after the prompt: assistant turns and observation deltas."""
    response_mask: list[int]
    """1 where the policy generated the token (trained on), 0 where the environment/template wrote it."""
    response_logprobs: list[float] | None
    """Sampling log-prob per response token, 0.0 on mask-0 tokens; None if the server sent none."""
    reward: float = 0.0
    """Episode reward, placed on the last policy (mask-1) token by `collate`."""
    termination: str | None = None
    """Why the episode ended: one of TERMINATION_REASONS."""
    num_turns: int = 0
    """Number of assistant turns."""
    prompt_truncated: bool = False
    """True if the head of the prompt was dropped to fit max_prompt_length."""
    step_rewards: list[float] = field(default_factory=list)
    """One per assistant turn: the env's reward for that turn's action (0.0 where the env did not step)."""
    turn_ends: list[int] = field(default_factory=list)
    """One per assistant turn: the response position of its last token (-1 when the turn kept no token)."""
    turn_policy_versions: list[int | None] = field(default_factory=list)
    """One per assistant turn: the policy version (verl global step) of the weights that sampled it (its oldest
    token's, when an update interrupted it: `rollout.versions`), None when the rollout does not track versions
    (synchronous rollout)."""
    token_policy_versions: list[int] | None = None
    """One per response token: the version that sampled it, -1 on mask-0 tokens; None when no turn's version is
    known."""
    turn_contexts: list[tuple[int, int]] = field(default_factory=list)
    """One per generation request: (how many ids the LLM was given, their `ids_digest`). Each must be a prefix of
    the ids the row trains on (`beyond_agent.integrity.prefix`)."""


def ids_digest(ids: Any) -> int:
    """CRC-32 of token ids as 64-bit integers (an `array("q")`, or anything numpy reads as int64): what a turn's
    context is remembered by, cheaply (a 16k-token context hashes in ~0.1 ms)."""
    return zlib.crc32(ids.tobytes() if isinstance(ids, array) else np.asarray(ids, dtype=np.int64).tobytes())


class RolloutHandler:
    """Token bookkeeping for ONE episode: prompt, assistant turns as generated, observation deltas.

    Typical loop (the episode loop's thread):

        handler = RolloutHandler(tokenizer, [system, task], 512, 4096)
        while not handler.done:
            out = llm.generate(handler.prompt_ids_for_next_turn(), max_tokens=handler.remaining_response_length)
            handler.add_assistant(out.token_ids, out.logprobs)
            ...; handler.add_observation(observation)        # or handler.finish("done")
        handler.reward = score
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[dict],
        max_prompt_length: int,
        max_response_length: int,
        tools: list[dict] | None = None,
        prompt_truncation: str = "left",
        end_of_turn_id: int | None = None,
    ):
        if prompt_truncation not in PROMPT_TRUNCATION_POLICIES:
            raise ValueError(
                f"prompt_truncation={prompt_truncation!r} is not valid; choose one of {PROMPT_TRUNCATION_POLICIES}"
            )
        _require_positive("max_prompt_length", max_prompt_length)
        _require_positive("max_response_length", max_response_length)
        self.tokenizer = tokenizer
        """The Hugging Face tokenizer whose chat template renders the conversation."""
        self.tools = tools
        """Tool schemas passed to the chat template (or None)."""
        self.max_prompt_length = max_prompt_length
        """Cap on the first-turn prompt, in tokens."""
        self.max_response_length = max_response_length
        """Cap on the whole response (all turns and observations), in tokens."""
        self.end_of_turn_id = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        """Token that ends an assistant turn (the tokenizer's eos unless given)."""
        self.termination: str | None = None
        """Why the episode ended (one of TERMINATION_REASONS), None while it runs."""
        self.reward: float = 0.0
        """Episode reward, set by the caller once the environment has scored the episode."""
        self.step_rewards: list[float] = []
        """One reward per assistant turn, set by the caller (see `Episode.step_rewards`)."""
        self.num_turns = 0
        """Number of assistant turns added."""
        self._messages: list[dict] = [dict(m) for m in messages]
        self._undecoded: list[tuple[dict, _AssistantTurn]] = []  # assistant messages whose text is not read yet
        self._last_turn: _AssistantTurn | None = None
        self._has_logprobs = True
        # Typed arrays, not lists: 8 bytes a token instead of ~36, and invisible to Python's garbage
        # collector, which would otherwise walk every token of every live episode on each collection.
        self._response_ids = array("q")
        self._response_mask = array("b")
        self._response_logprobs = array("d")
        self._turn_ends = array("q")
        self._turn_versions: list[int | None] = []
        self._response_versions = array("q")  # aligned with _response_ids (UNVERSIONED on mask-0 tokens)
        self._versions_known = False
        self._contexts: list[tuple[int, int]] = []
        self._check_first_messages()
        # Why the simple delta would be wrong for this template (probed once per template), or None.
        self._template_problem = template_problem(tokenizer, tools)
        text = self._render(self._messages, add_generation_prompt=True)
        cut = prompt_truncation == "left" and len(text) > self.max_prompt_length * MAX_CHARS_PER_TOKEN
        if cut:  # only the tail can be kept: never tokenize (megabytes of) text that is dropped anyway
            text = text[-self.max_prompt_length * MAX_CHARS_PER_TOKEN:]
        prompt_ids, self.prompt_truncated = self._cap_prompt(self._encode(text), prompt_truncation)
        self.prompt_truncated = self.prompt_truncated or cut
        self._prompt_ids = array("q", prompt_ids)

    # ----- building the sequence -------------------------------------------------------------------

    def add_generated(self, turn: Any) -> None:
        """`add_assistant` for a generate call's answer: its ids and log-probs, and its versions when it has them
        (the version gate's `VersionedTurn`)."""
        self.add_assistant(turn.token_ids, turn.logprobs, getattr(turn, "policy_version", None),
                           getattr(turn, "token_versions", None))

    def add_assistant(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None,
                      policy_version: int | None = None, token_versions: Sequence[int] | None = None) -> None:
        """Append one generated turn exactly as sampled (mask 1), end-of-turn token included if present;
        `policy_version` is the version of the weights that sampled it, when the rollout knows it, and
        `token_versions` each token's, when an update interrupted the turn (default: `policy_version` for all)."""
        self._check_accepting("add_assistant")
        if self._messages[-1]["role"] == "assistant":
            raise ValueError("add_assistant called twice in a row: add an observation between assistant turns")
        ids = _token_id_array(token_ids)
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"logprobs has {len(logprobs)} values but token_ids has {len(ids)} tokens")
        if token_versions is not None and len(token_versions) != len(ids):
            raise ValueError(f"token_versions has {len(token_versions)} values but token_ids has {len(ids)} tokens")
        if logprobs is None:
            self._has_logprobs = False
        # The text is decoded only if the template or a log needs it; the training ids are `ids`, untouched.
        turn = _AssistantTurn(ids, bool(ids) and ids[-1] == self.end_of_turn_id, self._decode)
        message = {"role": "assistant"}  # "content" is filled in from `turn` when `messages` is read
        self._messages.append(message)
        self._undecoded.append((message, turn))
        self._last_turn = turn
        self.num_turns += 1
        # Rule: generated tokens are trained on (mask 1) with the log-probs they were sampled with.
        if token_versions is None and policy_version is not None:
            token_versions = [policy_version] * len(ids)
        self._versions_known = self._versions_known or token_versions is not None
        kept = self._append(ids, 1, array("d", logprobs) if logprobs is not None else None, token_versions)
        self._turn_ends.append(len(self._response_ids) - 1 if kept else -1)
        self._turn_versions.append(policy_version)

    def add_observation(self, content: str, role: str = "user") -> None:
        """Append the template delta of one new user/tool message plus the next generation prompt (mask 0)."""
        self.add_observations([{"role": role, "content": content}])

    def add_observations(self, messages: Sequence[dict]) -> None:
        """Append several non-assistant messages at once, e.g. one tool result per tool call (mask 0)."""
        self._check_accepting("add_observation")
        last_role = self._messages[-1]["role"]
        if last_role != "assistant":
            raise ValueError(f"observation after a {last_role!r} message: observations must follow an assistant turn")
        new = [_observation_message(i, m) for i, m in enumerate(messages)]
        delta = self._observation_text(self._last_turn, new)
        self._messages.extend(new)
        room = self.max_response_length - len(self._response_ids)
        cut = len(delta) > room * MAX_CHARS_PER_TOKEN
        if cut:  # past the response budget whatever its tokens: tokenize only what can be kept
            delta = delta[:room * MAX_CHARS_PER_TOKEN]
        # Rule: observation, turn separators and the next generation prompt come from the environment and
        # the template, not the policy, so they are context only (mask 0, log-prob 0.0).
        self._append(self._encode(delta), 0, None)
        if cut:  # the cut took the next generation prompt with it: the episode cannot go on
            self.termination = self.termination or "length"

    def finish(self, reason: str) -> None:
        """Record why the episode ended; a `length` truncation recorded earlier is kept."""
        if reason not in TERMINATION_REASONS:
            raise ValueError(f"termination reason {reason!r} is not valid; choose one of {TERMINATION_REASONS}")
        if self.termination is None:
            self.termination = reason

    # ----- views ----------------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        """The chat so far, for logging: assistant content is decoded text (rendering only, never training
        ids), and a message cut by the length limit is kept whole here."""
        for message, turn in self._undecoded:
            message["content"] = turn.content
        self._undecoded.clear()
        return self._messages

    @property
    def done(self) -> bool:
        """True once a termination reason is recorded; no more turns are accepted."""
        return self.termination is not None

    @property
    def prompt_ids(self) -> list[int]:
        """First-turn prompt ids (capped to max_prompt_length)."""
        return self._prompt_ids.tolist()

    @property
    def response_ids(self) -> list[int]:
        """All ids after the prompt."""
        return self._response_ids.tolist()

    @property
    def response_mask(self) -> list[int]:
        """1 on assistant-generated ids, 0 on observation/template ids."""
        return self._response_mask.tolist()

    @property
    def response_logprobs(self) -> list[float] | None:
        """Sampling log-prob per response id (0.0 where mask is 0); None if any turn came without them."""
        return self._response_logprobs.tolist() if self._has_logprobs else None

    @property
    def remaining_response_length(self) -> int:
        """How many more response tokens fit (use it to cap the next turn's max_tokens)."""
        return self.max_response_length - len(self._response_ids)

    @property
    def attention_mask(self) -> list[int]:
        """All ones over prompt + response: one unpadded episode has no padding."""
        return [1] * (len(self._prompt_ids) + len(self._response_ids))

    @property
    def position_ids(self) -> list[int]:
        """0 .. len(prompt + response) - 1."""
        return list(range(len(self._prompt_ids) + len(self._response_ids)))

    def prompt_ids_for_next_turn(self) -> list[int]:
        """Prompt + response so far: the ids the LLM is asked to continue (their length and digest are kept, to
        check later that the row trains on exactly these ids before the turn's: `Episode.turn_contexts`)."""
        context = self._prompt_ids + self._response_ids
        self._contexts.append((len(context), ids_digest(context)))
        return context.tolist()

    def to_episode(self) -> Episode:
        """Snapshot of the token lists, reward and termination for `collate`."""
        return Episode(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_mask=self.response_mask,
            response_logprobs=self.response_logprobs,
            reward=float(self.reward),
            termination=self.termination,
            num_turns=self.num_turns,
            prompt_truncated=self.prompt_truncated,
            step_rewards=list(self.step_rewards),
            turn_ends=self._turn_ends.tolist(),
            turn_policy_versions=list(self._turn_versions),
            token_policy_versions=self._response_versions.tolist() if self._versions_known else None,
            turn_contexts=list(self._contexts),
        )

    # ----- template text ------------------------------------------------------------------------------

    def _observation_text(self, turn: "_AssistantTurn", new: list[dict]) -> str:
        """The template's text after our ids once `new` is added, ending with the next generation prompt."""
        if self._template_problem:
            raise ValueError(self._template_problem)
        full = self._render([*DUMMY_PREFIX, {"role": "assistant", "content": ASSISTANT_MARK}, *new],
                            add_generation_prompt=True)
        cut = full.index(ASSISTANT_MARK) + len(ASSISTANT_MARK)
        if turn.ended:  # our ids already end with the end-of-turn token: the delta starts after its text
            if not full.startswith(self._end_of_turn_text, cut):
                raise ValueError(f"the chat template does not close an assistant turn with the end-of-turn token "
                                 f"{self._end_of_turn_text!r}: after the content it writes {full[cut:cut + 30]!r}")
            cut += len(self._end_of_turn_text)
        return full[cut:]

    # ----- internals ------------------------------------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes special tokens as text; they must not be doubled by add_special_tokens.
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None \
                and backend.encode_special_tokens == self._split_special_tokens:
            # The Rust tokenizer's own ids, as transformers' `encode` returns them in this state, without its
            # wrapper (a third of the encoding time); another caller's truncation or padding left on the backend
            # sends the text through transformers, which resets them. `encode_batch` of one text, not `encode`:
            # the same ids, but it releases the interpreter while it tokenizes (`encode` holds it), so the other
            # episodes' threads render and step meanwhile, on other cores.
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    @cached_property
    def _backend(self) -> Any:
        """The fast tokenizer's Rust `Tokenizer` (None for a slow, Python tokenizer)."""
        return self.tokenizer.backend_tokenizer if getattr(self.tokenizer, "is_fast", False) else None

    @cached_property
    def _split_special_tokens(self) -> bool:
        return bool(getattr(self.tokenizer, "split_special_tokens", False))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @cached_property
    def _end_of_turn_text(self) -> str:
        return self._decode([self.end_of_turn_id])

    def _cap_prompt(self, ids: Sequence[int], policy: str) -> tuple[Sequence[int], bool]:
        if len(ids) <= self.max_prompt_length:
            return ids, False
        if policy == "error":
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_prompt_length={self.max_prompt_length} "
                "(prompt_truncation='error'; use 'left' to keep the tail)"
            )
        # Keep the tail: it holds the generation prompt and the latest task text.
        return ids[len(ids) - self.max_prompt_length:], True

    def _append(self, ids: Sequence[int], mask_value: int, logprobs: array | None,
                versions: Sequence[int] | None = None) -> int:
        """Append ids with one mask value, their log-probs (None: 0.0 for each, as on mask-0 tokens) and the
        versions that sampled them (None: UNVERSIONED for each); returns how many were kept."""
        room = self.max_response_length - len(self._response_ids)
        if len(ids) > room:
            # Over budget: keep what fits and end the episode, recording why.
            ids, logprobs = ids[:room], logprobs[:room] if logprobs is not None else None
            versions = versions[:room] if versions is not None else None
            self.termination = "length"
        self._response_versions.extend(versions if versions is not None else _UNVERSIONED_TOKEN * len(ids))
        self._response_ids.extend(ids)
        self._response_mask.frombytes(bytes([mask_value]) * len(ids))
        if logprobs is None:
            self._response_logprobs.frombytes(bytes(8 * len(ids)))  # 8 zero bytes are the double 0.0
        else:
            self._response_logprobs.extend(logprobs)
        return len(ids)

    def _check_accepting(self, method: str) -> None:
        if self.done:
            raise RuntimeError(f"{method} after the episode ended (termination={self.termination!r})")

    def _check_first_messages(self) -> None:
        if not self._messages:
            raise ValueError("messages is empty: give at least the task as a user message")
        for i, message in enumerate(self._messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"message {i} needs 'role' and 'content' keys, got {sorted(message)}")
        if self._messages[-1]["role"] == "assistant":
            raise ValueError("the last initial message is from 'assistant' but should be the task (user)")
        if not any(message["role"] == "user" for message in self._messages):
            raise ValueError("the initial messages have no user message: give the task as a user message")


class _AssistantTurn:
    """One generated turn: the ids as sampled; its text is decoded on first use (fallback rendering, logs)."""

    __slots__ = ("ids", "ended", "_decode", "_content")

    def __init__(self, ids: array, ended: bool, decode: Callable[[list[int]], str]):
        self.ids = ids
        self.ended = ended
        self._decode = decode
        self._content: str | None = None

    @property
    def content_ids(self) -> list[int]:
        """The ids without the end-of-turn token: what the message content is decoded from."""
        return (self.ids[:-1] if self.ended else self.ids).tolist()

    @property
    def content(self) -> str:
        """The message content: the decoded ids without the end-of-turn token."""
        if self._content is None:
            self._content = self._decode(self.content_ids)
        return self._content



_APPENDS: dict[tuple, str | None] = {}
"""Probe verdicts by (template, tools): None when the simple delta is right for the template, else why not."""
_APPENDS_LOCK = threading.Lock()


def template_problem(tokenizer: Any, tools: list[dict] | None) -> str | None:
    """Why the simple delta would be wrong for this chat template (None when it is right), probed once per
    template: one that rewrites earlier turns when a message follows, or writes a message by its position.

    The probe renders the dummy chat up to an assistant turn that holds a `<think>` block, then again with a
    user message after it; the second rendering must begin with the first, up to the end of that turn.
    """
    key = (str(tokenizer.chat_template), json.dumps(tools, sort_keys=True, default=str))
    with _APPENDS_LOCK:
        if key not in _APPENDS:
            _APPENDS[key] = _rewrite_found(tokenizer, tools)
        return _APPENDS[key]


def _rewrite_found(tokenizer: Any, tools: list[dict] | None) -> str | None:
    """Why the simple delta would be wrong for this template (None when it is right)."""
    render = lambda messages, gen: tokenizer.apply_chat_template(  # noqa: E731
        messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    turn = {"role": "assistant", "content": f"<think>reasoning</think>{ASSISTANT_MARK}"}
    before = render([*DUMMY_PREFIX, turn], False)
    if ASSISTANT_MARK not in before:
        return "the chat template does not write an assistant message's content as given, so turns cannot be appended"
    after = render([*DUMMY_PREFIX, turn, {"role": "user", "content": "O"}], True)
    if not after.startswith(before[:before.index(ASSISTANT_MARK) + len(ASSISTANT_MARK)]):
        at = next(i for i, (a, b) in enumerate(zip(before + "\0", after + "\1")) if a != b)
        return ("the chat template rewrote earlier turns, so an observation cannot be appended as a delta: at "
                f"character {at} a chat renders {before[at:at + 40]!r} but, once a message follows, "
                f"{after[at:at + 40]!r}")
    return _position_dependence(render)


def _position_dependence(render: Callable[[list[dict], bool], str]) -> str | None:
    """Whether a user or tool message after an assistant turn is written differently one exchange later."""
    mark = {"role": "assistant", "content": ASSISTANT_MARK}
    exchange = [{"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]
    # One exchange later, and one exchange plus a second observation later (an odd shift: parity counts).
    laters = ([*DUMMY_PREFIX, *exchange], [*DUMMY_PREFIX, *exchange, {"role": "user", "content": "U3"}])
    for role in OBSERVATION_ROLES:
        new = {"role": role, "content": "O"}
        try:
            first = _after_mark(render([*DUMMY_PREFIX, mark, new], True))
        except Exception:  # the template cannot render this role at all; adding such an observation will say so
            continue
        for later in laters:
            try:
                second = _after_mark(render([*later, mark, new], True))
            except Exception:  # e.g. a template that insists on alternating roles
                continue
            if first != second:
                return (f"the chat template writes a {role} message differently by its position in the chat "
                        f"({first[:40]!r} after the first exchange, {second[:40]!r} later), so an observation "
                        "cannot be appended as a delta")
    return None


def _after_mark(text: str) -> str:
    return text[text.index(ASSISTANT_MARK) + len(ASSISTANT_MARK):]


def _observation_message(index: int, message: dict) -> dict:
    """Validate one observation message; roles other than user/tool would be rendered as policy turns."""
    role = message.get("role")
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"observation {index} has role {role!r}; valid roles are {OBSERVATION_ROLES}")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"observation {index} content must be a str, got {type(content).__name__}")
    return {"role": role, "content": content}


def _token_id_array(token_ids: Sequence[int]) -> array:
    """The ids as an int64 array (from a list, tuple, numpy array or tensor), refusing non-integers."""
    try:
        return array("q", token_ids)  # one C loop; numpy and torch integers convert via __index__
    except TypeError as exc:
        raise TypeError(f"token_ids must be integers: {exc}") from None


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
