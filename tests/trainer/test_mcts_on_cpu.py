"""Agent-R's MCTS over a real envservice (beyond_agent/algorithms/mcts.py): FrozenLake served over loopback,
states reached by reset + replay. A seeded scripted proposer stands in for the model (it proposes from the
four moves, duplicates included), so the test checks the search itself: every node's state, reached by
replaying its actions, matches playing the same actions directly in one session.
"""

from __future__ import annotations

import random

import pytest

from envservice.client import EnvClient
from envservice.process import EnvServiceProcess
from beyond_agent.algorithms.agent_r import leaf_paths
from beyond_agent.algorithms.mcts import EnvReplayer, MCTSConfig, TaskRef, mcts_search, tree_nodes

MOVES = ["left", "down", "right", "up"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with EnvServiceProcess(["frozenlake"], log_path=tmp_path_factory.mktemp("mcts") / "envservice.log") as service:
        with EnvClient(service.url) as env_client:
            yield env_client


def seeded_proposer(seed: int, moves: list[str] = MOVES):
    generator = random.Random(seed)
    return lambda node, n: [generator.choice(moves) for _ in range(n)]


def direct_play(client, task: TaskRef, actions: list[str]):
    """(observation, done, score) after playing `actions` in one fresh session."""
    created = client.create(task.env_id, task_id=task.task_id, seed=task.seed, split=task.split)
    try:
        observation, done = created.observation, False
        for action in actions:
            step = client.step(created.session_id, action)
            observation, done = step.observation, step.terminated or step.truncated
        return observation, done, client.evaluate(created.session_id).score
    finally:
        client.release(created.session_id)


def test_replayed_states_match_direct_play(client):
    task = TaskRef("frozenlake", task_id=2, seed=2)
    config = MCTSConfig(iterations=12, n_gen=3, max_depth=5)
    replayer = EnvReplayer(client, task)
    root = mcts_search(replayer, seeded_proposer(0), config)

    nodes = tree_nodes(root)
    assert len(nodes) >= config.iterations  # each expansion adds at least one child or ends a leaf
    assert root.observation == direct_play(client, task, [])[0]
    for node in nodes:
        observation, done, score = direct_play(client, task, node.actions())
        assert node.observation == observation, node.actions()
        assert len(node.actions()) <= config.max_depth
        if done:
            assert node.terminal and node.score == score, node.actions()
        elif node.terminal:  # cut by the depth limit
            assert len(node.actions()) == config.max_depth and node.score == score
        children = [child.action for child in node.children]
        assert len(children) == len(set(children)) and len(children) <= config.n_gen  # duplicates dropped
    assert root.visits >= config.iterations and all(0.0 <= n.value <= 1.0 for n in nodes)
    assert replayer.resets > len(nodes)  # one reset per child, plus the simulations
    assert {p.nodes[-1].terminal for p in leaf_paths(root)} >= {True}


def test_the_search_finds_the_goal_and_backs_up_its_score(client):
    """The goal is at the bottom right: a proposer that mostly says down or right (as a half-trained model
    would) lets the search find it, and the success's value reaches the root."""
    task = TaskRef("frozenlake", task_id=2, seed=2)
    proposer = seeded_proposer(1, ["down", "right", "down", "right", "left", "up"])
    root = mcts_search(EnvReplayer(client, task), proposer, MCTSConfig(iterations=40, n_gen=3, max_depth=8))
    best = leaf_paths(root)[0]
    assert best.value > 0 and best.nodes[-1].score == 1.0
    assert direct_play(client, task, best.actions)[2] == 1.0
    assert root.value > 0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="MCTSConfig.n_gen must be >= 1; got 0"):
        MCTSConfig(n_gen=0)
