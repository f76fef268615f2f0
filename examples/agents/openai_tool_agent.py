"""A tool-calling agent written with the official OpenAI Python SDK — the kind of agent people already have.

BeyondAgent trains it unchanged: the trainer calls `run(ctx)` once per episode, `ctx.base_url` points the
SDK at the gateway (which samples from the policy being trained and records exact token ids), and the agent
acts in the episode's environment through `ctx.env.step`. It keeps its whole history and only appends to it,
so each episode becomes one multi-turn training sample.

    python launcher.py --conf examples/agents/cpu_openai_tool_agent.yaml --with-envservice
"""

from __future__ import annotations

import json

import openai

SYSTEM = ("You act in a text environment. Each turn, call the `act` tool with exactly one action, "
          "for example: turn left, turn right, move forward.")
TOOLS = [{"type": "function", "function": {
    "name": "act", "description": "Take one action in the environment and see what happens.",
    "parameters": {"type": "object", "properties": {"action": {"type": "string"}}, "required": ["action"]}}}]


def run(ctx) -> None:
    """Play one episode: ask the model, run the action it calls for, send back what the environment said."""
    client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ctx.env.observation}]
    while not ctx.env.done:
        reply = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if reply.tool_calls:
            call = reply.tool_calls[0]
            try:
                action = str(json.loads(call.function.arguments).get("action", ""))
            except (json.JSONDecodeError, AttributeError):
                action = ""
            step = ctx.env.step(action)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": step.observation})
        else:  # small models often answer in plain text: take the text as the action
            step = ctx.env.step(reply.content or "")
            messages.append({"role": "user", "content": step.observation})
