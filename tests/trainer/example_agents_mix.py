"""Both example agents of examples/agents in one training run (one run instead of two keeps CI's time): the
groups of even task ids are played by the tool-calling OpenAI-SDK agent, those of odd ones by the trimming agent."""

from __future__ import annotations

from pathlib import Path

from beyond_agent.gateway.agents import load_agent

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
TOOL_AGENT, TRIMMING_AGENT = (load_agent(f"{EXAMPLES / name}.py:run") for name in ("openai_tool_agent", "trimming_agent"))


def run(ctx) -> None:
    """One episode, by the agent of its task's parity."""
    (TOOL_AGENT if int(ctx.spec.task_id) % 2 == 0 else TRIMMING_AGENT)(ctx)
