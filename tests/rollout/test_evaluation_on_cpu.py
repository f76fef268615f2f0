"""The one evaluation API (beyond_agent.evaluation) against a real envservice over loopback.

The policy is scripted so the outcome of every episode is known: the BFS oracle's moves on the maps it
knows, a move the env does not accept on the others.
"""

from __future__ import annotations


import pytest

from beyond_agent.evaluation import (
    EvaluationIncomplete,
    EvaluationConfig,
    Policy,
    PolicyConfig,
    episode_specs,
    evaluate,
)
from beyond_agent.rollout.episode_loop import EpisodeConfig
from beyond_agent.rollout.scripted import ScriptedTurn
from envservice.childproc import free_port
from envservice.client import EnvClient
from envservice.contamination import TaskSet
from envservice.envs.frozenlake import FrozenLakeEnv, generate_map, shortest_path_actions
from envservice.server import EnvServiceConfig, create_app

pytestmark = pytest.mark.timeout(300)
LIMITS = EpisodeConfig(max_prompt_length=512, max_response_length=1024, max_tokens_per_turn=16)


@pytest.fixture(scope="module")
def service_url(serve_app):
    with serve_app(create_app(EnvServiceConfig(env_ids=["frozenlake"], max_sessions=64))) as url:
        yield url


class OracleOn:
    """Plays the oracle's moves on the maps in `solved` (by task index) and "fly" (no move) elsewhere."""

    def __init__(self, tokenizer, tasks: TaskSet, solved: set[int]):
        self.tokenizer = tokenizer
        self.moves = {}
        for index, seed in tasks.tasks:
            task = FrozenLakeEnv.resolve_task(index, tasks.split, seed, tasks.params)
            self.moves[index] = shortest_path_actions(generate_map(task)) if index in solved else ["fly"] * 99
        self.turns: dict[str, int] = {}
        self.order: list[str] = []

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> ScriptedTurn:
        index = int(request_id.split("-")[0].split(":")[1])  # request ids start with the group id "frozenlake:<i>"
        if request_id not in self.turns:
            self.order.append(request_id.rsplit("-", 1)[0])
        turn = self.turns[request_id] = self.turns.get(request_id, -1) + 1
        action = self.moves[index][min(turn, len(self.moves[index]) - 1)]
        return ScriptedTurn(self.tokenizer.encode(action, add_special_tokens=False) + [self.tokenizer.eos_token_id])


def test_specs_are_samples_per_task_in_task_order_sharing_the_task_seed():
    tasks = TaskSet.of("held-out", "frozenlake", "test", [3, 5], seed_offset=10, params={"around": True})
    specs = episode_specs(tasks, samples=2)
    assert [(s.task_id, s.seed, s.index, s.group_id) for s in specs] == [
        (3, 13, 0, "frozenlake:3"), (3, 13, 1, "frozenlake:3"), (5, 15, 2, "frozenlake:5"), (5, 15, 3, "frozenlake:5")]
    assert all(s.split == "test" and s.params == {"around": True} for s in specs)


def test_success_rate_is_the_share_of_solved_episodes_played_in_task_order(service_url, chatml_tokenizer):
    tasks = TaskSet.of("held-out", "frozenlake", "test", [0, 1, 2, 3])
    policy = OracleOn(chatml_tokenizer, tasks, solved={0, 2})
    with EnvClient(service_url, timeout=10, retries=0) as env:
        evaluation = evaluate(Policy(policy, concurrency=1), env, tasks, EvaluationConfig(LIMITS, 12, samples=2),
                              chatml_tokenizer)
    assert [r.spec.task_id for r in evaluation.results] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.success for r in evaluation.results] == [True, True, False, False, True, True, False, False]
    assert evaluation.success_rate == 0.5 and evaluation.require_complete() is evaluation
    assert policy.order == ["frozenlake:0-0", "frozenlake:0-1", "frozenlake:1-2", "frozenlake:1-3",
                            "frozenlake:2-4", "frozenlake:2-5", "frozenlake:3-6", "frozenlake:3-7"]


def test_an_unreachable_env_is_an_incomplete_evaluation_not_a_failure_of_the_model(chatml_tokenizer):
    tasks = TaskSet.of("held-out", "frozenlake", "test", [0, 1])
    with EnvClient(f"http://127.0.0.1:{free_port()}", timeout=2, retries=0) as env:
        evaluation = evaluate(Policy(OracleOn(chatml_tokenizer, tasks, {0, 1}), concurrency=2), env, tasks,
                              EvaluationConfig(LIMITS, 12), chatml_tokenizer)
    assert evaluation.scored == [] and evaluation.metrics.infra_failures == 2
    with pytest.raises(EvaluationIncomplete, match=r"held-out \(frozenlake test\) task 0: env_error: .*2 of 2"):
        evaluation.require_complete()


def test_policy_and_settings_refuse_bad_values_naming_the_valid_ones():
    with pytest.raises(ValueError, match="backend 'sglang' is unknown; valid backends: vllm, hf"):
        PolicyConfig(model="m", backend="sglang")
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        PolicyConfig(model="m", temperature=-1)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        EvaluationConfig(LIMITS, 12, samples=0)
