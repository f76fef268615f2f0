"""An agent that keeps its context short: the last `KEEP` exchanges plus a one-line summary of the rest.

Agents that summarise or trim their history (to fit a context window, or to stay focused) are what most
RL frameworks cannot train: the prompt of a later call is no longer the earlier prompt plus the reply. Behind
the gateway, the calls made while the history still only grew form one sample; once the agent starts
dropping turns, each call becomes a sample of its own, with exactly the context the model saw
(`episode.mode == "per_call"`, recorded per episode and shown in the viewer).

    python launcher.py --conf examples/agents/cpu_trimming_agent.yaml --with-envservice

Run as a program (`beyond_agent.agent.command: python examples/agents/trimming_agent.py`), it plays the one
episode its environment names (`beyond_agent.gateway.remote.episode_context`), through the gateway's env routes.
"""

from __future__ import annotations

import openai

KEEP = 1
"""Exchanges (reply + observation) kept verbatim."""
SYSTEM = "You act in a text environment. Answer with exactly one action, for example: turn left."


def run(ctx) -> None:
    """Play one episode with a trimmed history."""
    client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    first = ctx.env.observation
    exchanges: list[tuple[str, str]] = []  # (the model's reply, the observation it got back)
    while not ctx.env.done:
        dropped = len(exchanges) - KEEP
        task = first if dropped <= 0 else f"{first}\n\n(Summary: {dropped} earlier action(s) taken.)"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
        for reply, observation in exchanges[-KEEP:] if dropped > 0 else exchanges:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        reply = client.chat.completions.create(model=ctx.model, messages=messages).choices[0].message.content or ""
        exchanges.append((reply, ctx.env.step(reply).observation))


if __name__ == "__main__":  # as a command agent (beyond_agent.agent.command): the episode from the environment
    from beyond_agent.gateway.remote import episode_context

    run(episode_context())
