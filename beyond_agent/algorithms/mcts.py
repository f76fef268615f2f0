"""Agent-R's Monte Carlo Tree Search over an envservice task: states reached by reset + replay.

    root = mcts_search(EnvReplayer(client, TaskRef("frozenlake", 3, seed=3)), propose, MCTSConfig())

Each iteration: select a leaf by UCT (beyond_agent/algorithms/agent_r.py); a terminal leaf backs up its score
again; otherwise expand it with `n_gen` proposed actions (duplicates dropped), each child's state reached
by resetting the task and replaying the actions from the root (works for every env: no snapshot needed);
a terminal child backs up the env's score at once, any other is simulated (one proposed action per step,
in one session) to a terminal or the depth limit and backs up that episode's score. Scores are
envservice's /evaluate score in [0, 1]; an episode cut by the depth limit counts what it scored so far.

`propose(node, n)` returns up to n candidate actions at a node: `model_proposer` samples them from a
model through an EpisodeLoop-style `generate` function (vLLM or Hugging Face), rendering the node's history
with the same RolloutHandler and AgentTask as rollouts; tests use a scripted proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from beyond_agent.algorithms.agent_r import UCT_EXPLORATION, SearchNode, backpropagate, select_leaf


@dataclass(frozen=True)
class MCTSConfig:
    """The search's knobs (Agent-R's names in brackets)."""

    exploration: float = UCT_EXPLORATION
    """UCT constant c."""
    iterations: int = 16
    """Selections per tree [ITERA]."""
    n_gen: int = 3
    """Actions proposed per expansion [N_GEN]."""
    max_depth: int = 8
    """Actions from the root to a leaf at most [MAX_DEPTH]; a node at this depth is terminal."""
    temperature: float = 1.0
    """Sampling temperature of a model proposer [TEMP]."""
    max_tokens: int = 64
    """Tokens per proposed action of a model proposer [MAX_TOKEN_LENGTH]."""

    def __post_init__(self):
        for name in ("iterations", "n_gen", "max_depth", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"MCTSConfig.{name} must be >= 1; got {getattr(self, name)}")


@dataclass(frozen=True)
class TaskRef:
    """One envservice task: what /create needs to reset it identically every time."""

    env_id: str
    task_id: int | str | None = None
    seed: int | None = None
    split: str = "train"
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayedState:
    """The state after replaying some actions from a reset."""

    observation: str
    done: bool
    """The env ended the episode (terminated or truncated)."""
    score: float
    success: bool


class EnvReplayer:
    """Reaches any state of a task by resetting it and replaying actions; counts what that costs."""

    def __init__(self, client: Any, task: TaskRef):
        self.client, self.task = client, task
        self.resets = 0
        self.steps = 0

    def first_observation(self) -> str:
        return self.replay([]).observation

    def replay(self, actions: list[str]) -> ReplayedState:
        """Reset the task, apply `actions` in order, score it, release the session."""
        return self.play(actions, lambda observation, depth: None, max_depth=len(actions))

    def play(self, actions: list[str], next_action: Callable[[str, int], str | None], max_depth: int) -> ReplayedState:
        """Replay `actions`, then keep asking `next_action(observation, depth)` until the env ends the
        episode, it returns None, or `max_depth` actions were taken; the final state, scored."""
        t = self.task
        created = self.client.create(t.env_id, task_id=t.task_id, seed=t.seed, split=t.split, params=t.params)
        self.resets += 1
        try:
            observation, done, depth = created.observation, False, 0
            for action in actions:
                if done:
                    raise ValueError(f"replay of {actions} goes past the end of the episode at step {depth}")
                observation, done = self._step(created.session_id, action)
                depth += 1
            while not done and depth < max_depth:
                action = next_action(observation, depth)
                if action is None:
                    break
                observation, done = self._step(created.session_id, action)
                depth += 1
            scored = self.client.evaluate(created.session_id)
            return ReplayedState(observation, done, float(scored.score), bool(scored.success))
        finally:
            self.client.release(created.session_id)

    def _step(self, session_id: str, action: str) -> tuple[str, bool]:
        step = self.client.step(session_id, action)
        self.steps += 1
        return step.observation, bool(step.terminated or step.truncated)


Proposer = Callable[[SearchNode, int], list[str]]
"""propose(node, n) -> up to n candidate actions at `node` (duplicates allowed; the search drops them)."""


def mcts_search(replayer: EnvReplayer, propose: Proposer, config: MCTSConfig = MCTSConfig()) -> SearchNode:
    """The search tree of one task after `config.iterations` selections."""
    root = SearchNode(observation=replayer.first_observation())
    for _ in range(config.iterations):
        leaf = select_leaf(root, config.exploration)
        if leaf.terminal:
            backpropagate(leaf, leaf.score)
        else:
            for child in expand(leaf, replayer, propose, config):
                backpropagate(child, child.score if child.terminal else simulate(child, replayer, propose, config))
    return root


def expand(leaf: SearchNode, replayer: EnvReplayer, propose: Proposer, config: MCTSConfig) -> list[SearchNode]:
    """Add the proposed actions' children (replayed from a reset each); the new children.

    A leaf that gets no new child (every proposal a duplicate) becomes terminal with its replayed score."""
    path = leaf.actions()
    depth = len(path)
    known = {child.action for child in leaf.children}
    added = []
    for action in propose(leaf, config.n_gen):
        if action in known:
            continue  # Agent-R drops duplicate proposals
        known.add(action)
        state = replayer.replay(path + [action])
        terminal = state.done or depth + 1 >= config.max_depth
        added.append(leaf.add_child(action, state.observation, terminal=terminal, score=state.score if terminal else 0.0))
    if not added:
        leaf.terminal, leaf.score = True, replayer.replay(path).score
        backpropagate(leaf, leaf.score)
    return added


def simulate(node: SearchNode, replayer: EnvReplayer, propose: Proposer, config: MCTSConfig) -> float:
    """Play on from `node` with one proposed action per step (in one session); the episode's score."""
    scratch = [node]  # the simulated path; its nodes are never added to the tree

    def next_action(observation: str, depth: int) -> str | None:
        if len(scratch) > 1:
            scratch[-1].observation = observation  # the env's answer to the previous simulated action
        proposals = propose(scratch[-1], 1)
        if not proposals:
            return None
        scratch.append(SearchNode(proposals[0], "", parent=scratch[-1]))
        return proposals[0]

    return replayer.play(node.actions(), next_action, config.max_depth).score


def tree_nodes(root: SearchNode) -> list[SearchNode]:
    """Every node below the root, depth first."""
    nodes, stack = [], list(reversed(root.children))
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(reversed(node.children))
    return nodes
