"""Agent mode's bookkeeping by hand (beyond_agent/gateway/agents.py): which call an env step's reward belongs
to, the anchors, how an agent episode ends, and how an agent is named in the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from beyond_agent.gateway.agents import AgentConfig, EnvSession, load_agent


class Steps:
    """An envservice client's `step` answering given (reward, terminated[, truncated]) tuples."""

    def __init__(self, answers):
        self.answers = list(answers)

    def step(self, session_id, action):
        reward, terminated, *truncated = self.answers.pop(0)
        return SimpleNamespace(observation=f"after {action}", reward=reward, terminated=terminated,
                               truncated=bool(truncated and truncated[0]), info={})


def test_step_rewards_go_to_the_call_before_them_and_anchors_to_the_state_each_call_started_from() -> None:
    calls = [0]
    session = EnvSession(Steps([(0.5, False), (0.25, False), (1.0, True)]), "s", "start", None, max_steps=10,
                         calls_so_far=lambda: calls[0])
    calls[0] = 1                 # call 0 answered
    session.step("a")            # -> call 0's reward 0.5
    session.step("b")            # two steps after one call: call 0 gets 0.25 more
    calls[0] = 3                 # calls 1 and 2 answered, no step between them
    session.step("c")            # -> call 2's reward 1.0, the env ends it
    rewards, anchors = session.turn_rewards_and_anchors(first_call=0, calls=3)
    assert rewards == [0.75, 0.0, 1.0]
    assert anchors[0] != anchors[1] and anchors[1] == anchors[2]  # call 0 from the start, 1 and 2 after "b"
    assert session.done and session.termination == "done"
    # Only the calls of the trained segment count: from call 1 on, call 0's steps are left out.
    assert session.turn_rewards_and_anchors(first_call=1, calls=3)[0] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="the episode is over"):
        session.step("d")


def test_the_step_limit_ends_an_episode_as_max_rounds_and_an_agent_that_stops_as_done() -> None:
    limited = EnvSession(Steps([(0.0, False), (0.0, False)]), "s", "start", None, max_steps=2, calls_so_far=lambda: 1)
    limited.step("a")
    assert not limited.done
    limited.step("b")
    assert limited.done and limited.termination == "max_rounds"
    stopped = EnvSession(Steps([]), "s", "start", None, max_steps=5, calls_so_far=lambda: 0)
    assert stopped.termination == "done"  # the agent returned before any limit
    # Regression (#53): the env's own step limit was reported as the round limit's.
    truncated = EnvSession(Steps([(0.0, False, True)]), "s", "start", None, max_steps=5, calls_so_far=lambda: 1)
    truncated.step("a")
    assert truncated.done and truncated.termination == "truncated"


def test_agents_are_named_by_module_or_file(tmp_path) -> None:
    agent_file = tmp_path / "my_agent.py"
    agent_file.write_text("def play(ctx):\n    return 'played'\n")
    assert load_agent(f"{agent_file}:play")(None) == "played"
    assert load_agent("json:dumps")([1]) == "[1]"
    with pytest.raises(ValueError, match="cannot import 'no_such_module_here'"):
        load_agent("no_such_module_here:run")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_agent(f"{agent_file}:missing")
    with pytest.raises(ValueError, match="cannot import .*nowhere.py"):
        load_agent(f"{tmp_path / 'nowhere.py'}:run")
    with pytest.raises(ValueError, match="must be 'package.module:function' or 'path/to/file.py:function'"):
        AgentConfig(function="just_a_module")
    with pytest.raises(ValueError, match="merge='sometimes' is not valid; choose one of auto, never"):
        AgentConfig(function="m:f", merge="sometimes")
    assert not AgentConfig().active and AgentConfig(function="m:f").active


def test_an_env_failure_under_the_agent_is_recorded_even_when_the_agent_catches_it() -> None:
    from envservice.errors import EnvServiceError
    from envservice.protocol import ErrorCode

    class Broken:
        def step(self, session_id, action):
            raise EnvServiceError(ErrorCode.env_error, "the env crashed")

    session = EnvSession(Broken(), "s", "start", None, max_steps=5, calls_so_far=lambda: 1)
    with pytest.raises(RuntimeError, match="the environment failed \\(env_error\\)"):
        session.step("a")
    assert session.failure[0] == "env_error" and "the env crashed" in session.failure[1] and session.done
    late = EnvSession(Steps([(0.0, False)]), "s", "start", None, max_steps=5, calls_so_far=lambda: 0, deadline=0.0)
    with pytest.raises(RuntimeError, match="timeout"):
        late.step("a")
    assert late.failure[0] == "timeout"
