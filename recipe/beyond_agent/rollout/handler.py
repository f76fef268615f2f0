"""Token bookkeeping for one multi-turn episode, and the collation of many episodes into a verl batch.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from verl import DataProto

TERMINATION_REASONS = ("done", "max_rounds", "length", "env_error", "llm_error", "timeout")
PROMPT_TRUNCATION_POLICIES = ("left", "error")
OBSERVATION_ROLES = ("user", "tool")


@dataclass
class Episode:
    """A finished episode's token lists: what `collate` needs, free of any tokenizer."""

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


class RolloutHandler:
    """Token bookkeeping for ONE episode: prompt, assistant turns as generated, observation deltas.

    Typical loop (the dataflow thread):

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
        self.messages: list[dict] = [dict(m) for m in messages]
        """The chat so far, for logging: assistant content is decoded text (rendering only, never training
        ids), and a message cut by the length limit is kept whole here."""
        self.termination: str | None = None
        """Why the episode ended (one of TERMINATION_REASONS), None while it runs."""
        self.reward: float = 0.0
        """Episode reward, set by the caller once the environment has scored the episode."""
        self.num_turns = 0
        """Number of assistant turns added."""
        self._has_logprobs = True
        self._response_ids: list[int] = []
        self._response_mask: list[int] = []
        self._response_logprobs: list[float] = []
        self._check_first_messages()
        # The text our ids stand for; the next observation delta is the template text after it.
        self._rendered = self._render(self.messages, add_generation_prompt=True)
        self._prompt_ids, self.prompt_truncated = self._cap_prompt(self._encode(self._rendered), prompt_truncation)

    # ----- building the sequence -------------------------------------------------------------------

    def add_assistant(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Append one generated turn exactly as sampled (mask 1), end-of-turn token included if present."""
        self._check_accepting("add_assistant")
        if self.messages[-1]["role"] == "assistant":
            raise ValueError("add_assistant called twice in a row: add an observation between assistant turns")
        ids = [int(t) for t in token_ids]
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"logprobs has {len(logprobs)} values but token_ids has {len(ids)} tokens")
        if logprobs is None:
            self._has_logprobs = False
        ended = bool(ids) and ids[-1] == self.end_of_turn_id
        content = self._decode(ids[:-1] if ended else ids)
        # Decoding here only feeds the template (and logs); the training ids are `ids`, untouched.
        self._rendered += content + (self._decode([self.end_of_turn_id]) if ended else "")
        self.messages.append({"role": "assistant", "content": content})
        self.num_turns += 1
        # Rule: generated tokens are trained on (mask 1) with the log-probs they were sampled with.
        self._append(ids, 1, [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))

    def add_observation(self, content: str, role: str = "user") -> None:
        """Append the template delta of one new user/tool message plus the next generation prompt (mask 0)."""
        self.add_observations([{"role": role, "content": content}])

    def add_observations(self, messages: Sequence[dict]) -> None:
        """Append several non-assistant messages at once, e.g. one tool result per tool call (mask 0)."""
        self._check_accepting("add_observation")
        if self.messages[-1]["role"] != "assistant":
            raise ValueError(
                f"observation after a {self.messages[-1]['role']!r} message: observations must follow an assistant turn"
            )
        new = [_observation_message(i, m) for i, m in enumerate(messages)]
        full = self._render(self.messages + new, add_generation_prompt=True)
        delta = self._text_delta(full)
        self._rendered = full
        self.messages.extend(new)
        # Rule: observation, turn separators and the next generation prompt come from the environment and
        # the template, not the policy, so they are context only (mask 0, log-prob 0.0).
        ids = self._encode(delta)
        self._append(ids, 0, [0.0] * len(ids))

    def finish(self, reason: str) -> None:
        """Record why the episode ended; a `length` truncation recorded earlier is kept."""
        if reason not in TERMINATION_REASONS:
            raise ValueError(f"termination reason {reason!r} is not valid; choose one of {TERMINATION_REASONS}")
        if self.termination is None:
            self.termination = reason

    # ----- views ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once a termination reason is recorded; no more turns are accepted."""
        return self.termination is not None

    @property
    def prompt_ids(self) -> list[int]:
        """First-turn prompt ids (capped to max_prompt_length)."""
        return list(self._prompt_ids)

    @property
    def response_ids(self) -> list[int]:
        """All ids after the prompt."""
        return list(self._response_ids)

    @property
    def response_mask(self) -> list[int]:
        """1 on assistant-generated ids, 0 on observation/template ids."""
        return list(self._response_mask)

    @property
    def response_logprobs(self) -> list[float] | None:
        """Sampling log-prob per response id (0.0 where mask is 0); None if any turn came without them."""
        return list(self._response_logprobs) if self._has_logprobs else None

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
        """Prompt + response so far: the ids the LLM is asked to continue."""
        return self._prompt_ids + self._response_ids

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
        )

    # ----- internals ------------------------------------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes special tokens as text; they must not be doubled by add_special_tokens.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _text_delta(self, full: str) -> str:
        """The part of `full` after the text our ids stand for; the template must extend, not rewrite."""
        if not full.startswith(self._rendered):
            at = next(i for i, (a, b) in enumerate(zip(self._rendered + "\0", full + "\1")) if a != b)
            raise ValueError(
                "the chat template rewrote earlier turns, so the observation cannot be appended as a delta: "
                f"at character {at} the ids so far stand for {self._rendered[at:at + 40]!r} but the template "
                f"now renders {full[at:at + 40]!r}"
            )
        return full[len(self._rendered):]

    def _cap_prompt(self, ids: list[int], policy: str) -> tuple[list[int], bool]:
        if len(ids) <= self.max_prompt_length:
            return ids, False
        if policy == "error":
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_prompt_length={self.max_prompt_length} "
                "(prompt_truncation='error'; use 'left' to keep the tail)"
            )
        # Keep the tail: it holds the generation prompt and the latest task text.
        return ids[len(ids) - self.max_prompt_length:], True

    def _append(self, ids: list[int], mask_value: int, logprobs: list[float]) -> None:
        room = self.remaining_response_length
        if len(ids) > room:
            # Over budget: keep what fits and end the episode, recording why.
            ids, logprobs = ids[:room], logprobs[:room]
            self.termination = "length"
        self._response_ids.extend(ids)
        self._response_mask.extend([mask_value] * len(ids))
        self._response_logprobs.extend(logprobs)

    def _check_accepting(self, method: str) -> None:
        if self.done:
            raise RuntimeError(f"{method} after the episode ended (termination={self.termination!r})")

    def _check_first_messages(self) -> None:
        if not self.messages:
            raise ValueError("messages is empty: give at least the task as a user message")
        for i, message in enumerate(self.messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"message {i} needs 'role' and 'content' keys, got {sorted(message)}")
        if self.messages[-1]["role"] == "assistant":
            raise ValueError("the last initial message is from 'assistant' but should be the task (user)")


def _observation_message(index: int, message: dict) -> dict:
    """Validate one observation message; roles other than user/tool would be rendered as policy turns."""
    role = message.get("role")
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"observation {index} has role {role!r}; valid roles are {OBSERVATION_ROLES}")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"observation {index} content must be a str, got {type(content).__name__}")
    return {"role": role, "content": content}


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----- collation ------------------------------------------------------------------------------------


def collate(
    episodes: Sequence[Episode | RolloutHandler],
    pad_token_id: int,
    max_prompt_length: int,
    max_response_length: int,
) -> DataProto:
    """Pad finished episodes into the DataProto verl's trainer expects from `generate_sequences`.

    Prompts are left-padded to max_prompt_length and responses right-padded to max_response_length, so
    every row's prompt ends and response starts at the same column. `rollout_log_probs` is present only
    if every episode has log-probs. Non-tensor fields: `termination`, `__num_turns__`, `prompt_truncated`.
    """
    from verl import DataProto  # imported here: importing verl takes seconds, the handler does not need it

    rows = [e.to_episode() if isinstance(e, RolloutHandler) else e for e in episodes]
    if not rows:
        raise ValueError("collate needs at least one episode")
    for i, row in enumerate(rows):
        _check_episode(i, row, max_prompt_length, max_response_length)
    tensors = _sequence_tensors(rows, pad_token_id, max_prompt_length, max_response_length)
    tensors["rm_scores"] = _reward_tensor(rows, max_response_length)  # [batch, response]
    if all(row.response_logprobs is not None for row in rows):
        # Padding gets 0.0; verl only reads positions where response_mask is 1.
        tensors["rollout_log_probs"] = _pad(
            [row.response_logprobs for row in rows], max_response_length, 0.0, left=False, dtype=torch.float32
        )  # [batch, response]
    non_tensors = {
        "termination": np.array([row.termination for row in rows], dtype=object),
        "__num_turns__": np.array([row.num_turns for row in rows], dtype=np.int32),
        "prompt_truncated": np.array([row.prompt_truncated for row in rows], dtype=bool),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _sequence_tensors(rows: list[Episode], pad_id: int, prompt_len: int, response_len: int) -> dict:
    """prompts, responses, response_mask, input_ids, attention_mask, position_ids."""
    prompts = _pad([r.prompt_ids for r in rows], prompt_len, pad_id, left=True)  # [batch, prompt]
    prompt_attention = _pad([[1] * len(r.prompt_ids) for r in rows], prompt_len, 0, left=True)
    responses = _pad([r.response_ids for r in rows], response_len, pad_id, left=False)  # [batch, response]
    response_attention = _pad([[1] * len(r.response_ids) for r in rows], response_len, 0, left=False)
    # Padding is never trained on: the mask is padded with 0.
    response_mask = _pad([r.response_mask for r in rows], response_len, 0, left=False)  # [batch, response]
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)  # [batch, prompt + response]
    # Positions count real tokens only: left padding sits at 0, as verl's compute_position_id_with_mask does.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [batch, prompt + response]
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),  # [batch, prompt + response]
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def _reward_tensor(rows: list[Episode], response_len: int) -> torch.Tensor:
    """Each reward on its row's last policy token (mask 1), zeros elsewhere.

    Why the last mask-1 token and not simply the last response token: an episode cut by the length limit
    can end inside an observation (mask 0), and verl's GAE and REINFORCE++ skip mask-0 positions when
    they propagate returns, so a reward sitting there would be lost (tests/trainer shows it with verl's
    own functions). Sum-based estimators (GRPO, RLOO) see the same total either way. A row with no
    policy token keeps its reward on its last response token; an empty response gets no reward.
    """
    scores = torch.zeros(len(rows), response_len, dtype=torch.float32)  # [batch, response]
    for i, row in enumerate(rows):
        policy_positions = [t for t, m in enumerate(row.response_mask) if m == 1]
        if policy_positions:
            scores[i, policy_positions[-1]] = float(row.reward)
        elif row.response_ids:
            scores[i, len(row.response_ids) - 1] = float(row.reward)
    return scores


def _pad(rows: list[list], width: int, value, left: bool, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Pad each row to `width` with `value`, on the left or the right; returns [batch, width]."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            values = torch.tensor(row, dtype=dtype)
            if left:
                out[i, width - len(row):] = values
            else:
                out[i, : len(row)] = values
    return out


def _check_episode(index: int, row: Episode, prompt_len: int, response_len: int) -> None:
    """Fail with the episode index and the field when an episode does not fit the batch."""
    if row.termination not in TERMINATION_REASONS:
        raise ValueError(
            f"episode {index} has termination={row.termination!r}; call finish() with one of {TERMINATION_REASONS}"
        )
    if len(row.prompt_ids) > prompt_len:
        raise ValueError(
            f"episode {index}: prompt_ids has {len(row.prompt_ids)} tokens > max_prompt_length={prompt_len}"
        )
    if len(row.response_ids) > response_len:
        raise ValueError(
            f"episode {index}: response_ids has {len(row.response_ids)} tokens > max_response_length={response_len}"
        )
    lengths = {"response_mask": len(row.response_mask)}
    if row.response_logprobs is not None:
        lengths["response_logprobs"] = len(row.response_logprobs)
    for name, length in lengths.items():
        if length != len(row.response_ids):
            raise ValueError(
                f"episode {index}: {name} has {length} values but response_ids has {len(row.response_ids)}"
            )
