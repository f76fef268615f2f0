"""A scripted policy: an EpisodeLoop `generate` function that writes given actions, one per assistant turn.

Episodes whose actions are known in advance (an oracle's path, a recorded episode being replayed to reach
one of its states, a hand-written failure for a test) run through the same EpisodeLoop, RolloutHandler and
trajectory records as sampled ones, so their tokens and masks are exactly what a rollout would produce.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScriptedTurn:
    """What the EpisodeLoop receives: the reply's token ids (no log-probs: nothing was sampled)."""

    token_ids: list[int]
    logprobs: list[float] | None = None


def reply_ids(tokenizer, text: str) -> list[int]:
    """An assistant reply as the model should write it: the text's tokens, then end-of-turn."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


class ScriptedPolicy:
    """Writes `actions[0]`, `actions[1]`, ... each as its text plus the end-of-turn token.

    Asked for more turns than it has actions, it raises (the EpisodeLoop records an llm_error), so a script
    that is too short is never mistaken for the policy's choice.
    """

    def __init__(self, actions: list[str], tokenizer):
        self.replies = [reply_ids(tokenizer, action) for action in actions]
        self.turns_written = 0

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> ScriptedTurn:
        if self.turns_written >= len(self.replies):
            raise RuntimeError(f"scripted policy ran out of actions after {self.turns_written} turns")
        reply = self.replies[self.turns_written]
        self.turns_written += 1
        return ScriptedTurn(token_ids=reply[:max_tokens])
