"""Both example agents of examples/agents in one training run (one run instead of two keeps CI's time): the
groups of even task ids are played by the tool-calling OpenAI-SDK agent, those of odd ones by the trimming agent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_agent_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL_AGENT, TRIMMING_AGENT = _load("openai_tool_agent"), _load("trimming_agent")


def run(ctx) -> None:
    """One episode, by the agent of its task's parity."""
    (TOOL_AGENT if int(ctx.spec.task_id) % 2 == 0 else TRIMMING_AGENT).run(ctx)
