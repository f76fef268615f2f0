"""Both example agents of examples/agents in one training run (one run instead of several keeps CI's time): the
BabyAI groups of even task ids are played by the tool-calling OpenAI-SDK agent, those of odd ones by the trimming
agent; the `code` env's group (HumanEval) by the OpenAI-SDK agent run as a command (`CommandAgent`: this file as the
program, in the sandbox, its env over the gateway's `/env` routes), which notes each episode in
$BEYOND_TEST_COMMAND_LOG (given to the sandbox on purpose, its folder writable), with what it could see of the
trainer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from beyond_agent.gateway.agents import CommandAgent, load_agent
from sandbox import SandboxConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
TOOL_AGENT, TRIMMING_AGENT = (load_agent(f"{EXAMPLES / name}.py:run") for name in ("openai_tool_agent", "trimming_agent"))
LOG = "BEYOND_TEST_COMMAND_LOG"
AS_COMMAND = CommandAgent(f"{sys.executable} {Path(__file__).resolve()}", timeout_s=300,
                          sandbox=SandboxConfig(pass_env=(LOG,), writable=(os.path.dirname(os.environ.get(LOG, "/")),)))


def run(ctx) -> None:
    """One episode, by the agent of its env and task number."""
    if ctx.spec.env_id == "code":
        AS_COMMAND(ctx)
    else:
        (TOOL_AGENT if int(ctx.spec.task_id) % 2 == 0 else TRIMMING_AGENT)(ctx)


if __name__ == "__main__":  # started by AS_COMMAND for one episode
    from beyond_agent.gateway.remote import episode_context

    context = episode_context()
    try:  # the agent raises when the gateway refuses a call past the episode's token budget (it ends as `length`)
        TOOL_AGENT(context)
    finally:
        with open(os.environ[LOG], "a") as log:
            log.write(json.dumps({"env": context.spec.env_id, "task": context.spec.task_id, "env_url": context.env_url,
                                  "done": context.env.done, "pid": os.getpid(), "variables": sorted(os.environ)})
                      + "\n")
