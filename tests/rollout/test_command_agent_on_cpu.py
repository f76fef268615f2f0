"""An agent given as a command (`beyond_agent.agent.command`, issue #31): one process per episode that talks to
the gateway with the real `openai` SDK and acts through the gateway's `/env` routes, on a real envservice
(FrozenLake) over loopback; its failures and time-outs are infrastructure, never reward."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from envservice.client import EnvClient
from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.agents import AgentConfig, AgentEpisodeLoop, CommandAgent, EnvSession
from beyond_agent.gateway.remote import RemoteEnv, episode_context
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.llm import GenerationResult
from sandbox import SandboxConfig

AGENT_SCRIPT = '''
import json, sys
import openai
from beyond_agent.gateway.remote import episode_context

ctx = episode_context()
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
seen = [ctx.env.observation]
while not ctx.env.done:
    messages = [{"role": "user", "content": ctx.env.observation}]
    reply = client.chat.completions.create(model=ctx.model, messages=messages).choices[0].message.content
    seen.append(ctx.env.step(reply).observation)
try:
    ctx.env.step("down")
except RuntimeError as error:
    after_the_end = str(error)
json.dump({"spec": [ctx.spec.env_id, ctx.spec.task_id, ctx.spec.seed], "seen": seen, "after": after_the_end},
          open(sys.argv[1], "w"))
'''


class Moves:
    """The policy: always answers `move` (its tokens plus end-of-turn)."""

    def __init__(self, tokenizer, move: str) -> None:
        self.ids = tokenizer.encode(move, add_special_tokens=False) + [tokenizer.eos_token_id]

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        return GenerationResult(list(self.ids), [-0.5] * len(self.ids), "stop", 0.0)


@pytest.fixture(scope="module")
def tokenizer(chatml_tokenizer):
    return chatml_tokenizer


@pytest.fixture
def play(tokenizer, frozenlake_url):
    """play(agent, move) -> the EpisodeResult of one FrozenLake episode (map 3, at most 4 steps) by `agent`."""
    server = GatewayServer(Gateway(GatewayConfig(max_tokens_per_turn=8), tokenizer)).start()
    client = EnvClient(frozenlake_url, timeout=10, retries=0)

    def run(agent, move: str = "right"):
        spec = EpisodeSpec(env_id="frozenlake", task_id=3, seed=0, group_id="g")
        config = EpisodeConfig(max_prompt_length=512, max_response_length=512, max_tokens_per_turn=8)
        return AgentEpisodeLoop(spec, client, server.gateway, server.url, agent, config, 4, Moves(tokenizer, move),
                             server.socket_path).run()

    yield run
    assert client.health().sessions == 0  # every episode released its session, whatever its ending
    client.close()
    server.stop()


def test_a_command_plays_its_episode_through_the_gateway_and_the_env_routes(play, tmp_path) -> None:
    out = tmp_path / "seen.json"
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    result = play(CommandAgent(f"python {script} {out}", timeout_s=120, sandbox=SandboxConfig(writable=(str(tmp_path),))))
    seen = json.loads(out.read_text())

    assert seen["spec"] == ["frozenlake", 3, 0]
    steps = len(seen["seen"]) - 1
    assert 1 <= steps <= 4 and result.rounds == steps  # every step went through the episode's session
    assert result.termination in ("done", "max_rounds") and result.error is None
    # Each call sent only the latest observation (a rewritten history): one sample per call, the earlier ones
    # kept for training beside the last, each with its own call's step reward and anchor.
    assert result.agent_mode == "per_call" and len(result.earlier_segments) == steps - 1
    samples = [*result.earlier_segments, result]
    assert [len(s.step_rewards) for s in samples] == [len(s.anchors) for s in samples] == [1] * steps
    assert len({s.anchors[0] for s in samples}) == steps  # each call started from the state the last step left
    assert all(s.reward == result.reward and s.termination == result.termination for s in samples)
    # Each sample carries the step rewards of the calls after its own, so that its returns run to the episode's end.
    assert [len(s.later_step_rewards) for s in samples] == list(range(steps - 1, -1, -1))
    assert samples[0].step_rewards + samples[0].later_step_rewards == [r for s in samples for r in s.step_rewards]
    assert "409" in seen["after"] and "the episode is over" in seen["after"]


def test_a_failing_or_hanging_command_is_an_infrastructure_failure_never_reward(play) -> None:
    failed = play(CommandAgent(f"{sys.executable} -c \"import sys; sys.stderr.write('boom'); sys.exit(3)\"", 60))
    assert failed.termination == "agent_error" and failed.reward == 0.0
    assert "exited with 3" in failed.error and "boom" in failed.error
    hung = play(CommandAgent(f"{sys.executable} -c 'import time; time.sleep(60)'", timeout_s=1))
    assert hung.termination == "timeout" and "ran past 1 s" in hung.error and hung.reward == 0.0


def test_the_env_routes_refuse_a_step_past_the_end_and_an_episode_without_env(tokenizer) -> None:
    class OneStep:
        def step(self, session_id, action):
            return SimpleNamespace(observation=f"after {action}", reward=1.0, terminated=True, truncated=False,
                                   info={})

    gateway = Gateway(GatewayConfig(), tokenizer, Moves(tokenizer, "x"))
    server = GatewayServer(gateway).start()
    try:
        gateway.open_episode("e1")
        gateway.attach_env("e1", EnvSession(OneStep(), "s", "start", None, max_steps=5, calls_so_far=lambda: 0))
        env = RemoteEnv(f"{server.url}/episodes/e1/env")
        assert (env.observation, env.done, env.max_steps) == ("start", False, 5)
        step = env.step("go")
        assert (step.observation, step.reward, step.terminated, env.done) == ("after go", 1.0, True, True)
        with pytest.raises(RuntimeError, match="409: the episode is over"):
            env.step("again")
        gateway.open_episode("e2")
        with pytest.raises(RuntimeError, match="404: episode 'e2' has no env session attached"):
            RemoteEnv(f"{server.url}/episodes/e2/env")
    finally:
        server.stop()


def test_a_command_is_named_in_the_config_and_checked_before_it_runs(monkeypatch) -> None:
    with pytest.raises(ValueError, match="set function or command, not both"):
        AgentConfig(function="m:f", command="python agent.py")
    with pytest.raises(ValueError, match="must be a non-empty command line"):
        AgentConfig(command="  ")
    with pytest.raises(ValueError, match="no program 'no_such_program_here' on PATH"):
        AgentConfig(command="no_such_program_here --flag").load(10)
    monkeypatch.setenv("PATH", "/nonexistent")  # `python` is the trainer's interpreter, venv activated or not
    agent = AgentConfig(command="python agent.py").load(10)
    assert isinstance(agent, CommandAgent) and AgentConfig(command="python agent.py").active
    with pytest.raises(KeyError, match="OPENAI_BASE_URL, BEYOND_AGENT_MODEL, BEYOND_AGENT_ENV_URL"):
        episode_context({})
