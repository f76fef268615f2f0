"""Agent-R (ByteDance): revision trajectories from a search tree over one task, for self-training.

This module holds the parts that need no model: the search tree and UCT, root-to-leaf paths, pairing a
good and a bad path, finding the first wrong step (given a judge), and splicing the revision trajectory
with its loss masks. (MCTS collection over envservice and the iterative loop build on these.)

A revision trajectory (Agent-R's "revise_worst_path"), for a bad path B and a good path G of one tree:
    B's turns up to and including its first wrong step   -> context, loss off (the model must not learn them)
    an assistant turn with a reflection sentence          -> loss on (it learns to notice the mistake)
    a user turn "ok."                                    -> context
    G's turns after the prefix G and B share             -> loss on (it learns the way out)
built with RolloutHandler from the task's first observation, so the tokens are exactly what the chat
template gives a rollout, and returned as a `TrajectoryRecord` that the SFT trainer reads like any other.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

UCT_EXPLORATION = 0.25
"""Agent-R's exploration constant c in Q + c * sqrt(ln N_parent / N)."""
REFLECTIONS = (
    "I realize my approach was flawed. I need to revise it.",
    "I took the wrong actions. I need to identify the right path.",
    "My actions were not correct. I should go back and fix them.",
)
"""Reflection sentences, one chosen per revision (Agent-R uses a fixed list of such sentences)."""
JUDGEMENTS = ("good", "bad", "uncertain")
logger = logging.getLogger(__name__)


class RevisionTooLong(ValueError):
    """A spliced trajectory does not fit the length limits (it is skipped, never cut: a revision without its
    good continuation would teach the mistake and the reflection only)."""


@dataclass
class SearchNode:
    """One state of the search: reached from the root by `actions()`, scored by backed-up env values."""

    action: str | None = None
    """The action that led here from the parent (None at the root)."""
    observation: str = ""
    """What the env answered to that action (the task's first observation at the root)."""
    parent: "SearchNode | None" = field(default=None, repr=False)
    children: list["SearchNode"] = field(default_factory=list, repr=False)
    visits: int = 0
    value_sum: float = 0.0
    terminal: bool = False
    """The episode ended here (success, failure or the depth limit)."""
    score: float = 0.0
    """The env's score at a terminal node (its value when it is backed up)."""

    @property
    def value(self) -> float:
        """Mean backed-up value (0 before any visit)."""
        return self.value_sum / self.visits if self.visits else 0.0

    def add_child(self, action: str, observation: str, terminal: bool = False, score: float = 0.0) -> "SearchNode":
        child = SearchNode(action, observation, self, terminal=terminal, score=score)
        self.children.append(child)
        return child

    def actions(self) -> list[str]:
        """The actions from the root to this node: what replaying reaches it."""
        node, actions = self, []
        while node.parent is not None:
            actions.append(node.action)
            node = node.parent
        return actions[::-1]

    def path(self) -> list["SearchNode"]:
        """The nodes from the root's first child to this node."""
        node, nodes = self, []
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


def uct_score(child: SearchNode, parent_visits: int, exploration: float = UCT_EXPLORATION) -> float:
    """Q + c * sqrt(ln N_parent / N); an unvisited child comes first."""
    if child.visits == 0:
        return math.inf
    return child.value + exploration * math.sqrt(math.log(max(parent_visits, 1)) / child.visits)


def select_leaf(root: SearchNode, exploration: float = UCT_EXPLORATION) -> SearchNode:
    """Walk down by the highest UCT score (first child on ties) to a node with no children or a terminal."""
    node = root
    while node.children and not node.terminal:
        node = max(node.children, key=lambda child: uct_score(child, node.visits, exploration))
    return node


def backpropagate(node: SearchNode, value: float) -> None:
    """Add one visit with `value` to the node and every ancestor."""
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent


@dataclass(frozen=True)
class SearchPath:
    """A root-to-leaf path of a tree."""

    nodes: tuple[SearchNode, ...]
    """From the root's child to the leaf."""

    @property
    def value(self) -> float:
        """The leaf's value (its terminal score when it was scored but never visited)."""
        leaf = self.nodes[-1]
        return leaf.value if leaf.visits else leaf.score

    @property
    def actions(self) -> list[str]:
        return [node.action for node in self.nodes]


def leaf_paths(root: SearchNode) -> list[SearchPath]:
    """Every root-to-leaf path, best value first (ties: fewer steps first, then tree order)."""
    leaves, stack = [], list(reversed(root.children))
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(reversed(node.children))
        else:
            leaves.append(node)
    order = {id(leaf): index for index, leaf in enumerate(leaves)}
    paths = [SearchPath(tuple(leaf.path())) for leaf in leaves]
    return sorted(paths, key=lambda p: (-p.value, len(p.nodes), order[id(p.nodes[-1])]))


PAIRINGS = ("all", "one_to_one")
"""How good and bad paths are paired: "all" (Agent-R's `path_collection.py`: every good path with every bad one
whose value is lower by more than beta) or "one_to_one" (each path in at most one pair)."""


def pair_paths(paths: Sequence[SearchPath], alpha: float, beta: float,
               pairing: str = "all") -> list[tuple[SearchPath, SearchPath]]:
    """(good, bad) pairs: value(good) > alpha and value(good) - value(bad) > beta.

    "all" (the reference's rule, default): every such pair, best good path first, for each its bad paths
    worst first. "one_to_one": each bad path (worst first) gets the best good path not used yet, so every path
    is in at most one pair and the widest gaps are paired first."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not a pairing rule; valid choices: {list(PAIRINGS)}")
    ranked = sorted(paths, key=lambda p: -p.value)
    goods = [p for p in ranked if p.value > alpha]
    worst_first = list(reversed(ranked))
    if pairing == "all":
        return [(good, bad) for good in goods for bad in worst_first if good.value - bad.value > beta]
    pairs, used = [], set()
    for bad in worst_first:
        good = next((g for g in goods if id(g) not in used and g is not bad and g.value - bad.value > beta), None)
        if good is None:
            continue
        used.update({id(good), id(bad)})
        pairs.append((good, bad))
    return pairs


def shared_prefix(good: SearchPath, bad: SearchPath) -> int:
    """How many leading steps the two paths share (same tree nodes)."""
    count = 0
    for a, b in zip(good.nodes, bad.nodes):
        if a is not b:
            break
        count += 1
    return count


Judge = Callable[[Sequence[SearchNode], int], str]
"""judge(path_nodes, step_index) -> "good" | "bad" | "uncertain": the actor model's verdict on one step. As in
Agent-R's `revise_worst_path`, a judge should show the model the path only up to and including that step."""

JUDGE_FAILED = "judge_failed"
"""How a first wrong step was found when the judge raised: the fallback rule, after a logged warning."""


def first_wrong_step(good: SearchPath, bad: SearchPath, judge: Judge | None = None) -> tuple[int, str]:
    """Index (in `bad`) of the first wrong step, and how it was found: "judge", "fallback" or `JUDGE_FAILED`.

    The judge is asked about each step after the shared prefix (steps both paths share cannot be the
    mistake). The first "bad" wins. When the judge says no step is bad or answers outside `JUDGEMENTS`, the
    fallback rule names the step where the bad path left the good one; when it raises, the same rule, with a
    warning in the log."""
    start = shared_prefix(good, bad)
    fallback = min(start, len(bad.nodes) - 1)
    if judge is None:
        return fallback, "fallback"
    for index in range(start, len(bad.nodes)):
        try:
            verdict = str(judge(bad.nodes, index)).strip().lower()
        except Exception as error:  # a judge that cannot judge leaves the decision to the rule, visibly
            logger.warning("Agent-R judge failed on step %d (%r): %s: %s; the fallback rule picks step %d",
                           index, bad.nodes[index].action, type(error).__name__, error, fallback)
            return fallback, JUDGE_FAILED
        if verdict not in JUDGEMENTS:
            break
        if verdict == "bad":
            return index, "judge"
    return fallback, "fallback"


@dataclass(frozen=True)
class RevisionPlan:
    """Which turns a revision trajectory has, in order, and which of them are trained on."""

    turns: tuple[tuple[str, str, bool], ...]
    """(assistant text, observation after it, trained) per assistant turn."""


REFLECTION_REPLY = "ok."


def revision_plan(good: SearchPath, bad: SearchPath, first_wrong: int, reflection: str) -> RevisionPlan:
    """The turns of the revision: bad prefix (off), reflection (on) + "ok.", good continuation (on)."""
    turns = [(node.action, node.observation, False) for node in bad.nodes[: first_wrong + 1]]
    turns.append((reflection, REFLECTION_REPLY, True))
    turns += [(node.action, node.observation, True) for node in good.nodes[shared_prefix(good, bad):]]
    return RevisionPlan(tuple(turns))


def splice_revision(plan: RevisionPlan, first_observation: str, tokenizer, max_prompt_length: int = 4096,
                    max_response_length: int = 16384, messages_for: Callable[[str], list[dict]] | None = None):
    """(episode, messages, spans): the revision as an Episode (RolloutHandler's tokens) whose loss mask is on
    only for trained turns, its chat, and each assistant turn's (first, last) response position.

    `messages_for(first_observation)` gives the first messages (default: the recipe's EnvTask prompt)."""
    from beyond_agent.rollout.handler import RolloutHandler
    from beyond_agent.rollout.scripted import reply_ids
    from beyond_agent.tasks import EnvTask

    first_messages = (messages_for or EnvTask().first_messages)(first_observation)
    handler = RolloutHandler(tokenizer, first_messages, max_prompt_length, max_response_length)
    for index, (text, observation, _trained) in enumerate(plan.turns):
        handler.add_assistant(reply_ids(tokenizer, text))
        if handler.done:  # the length limit ended it before all turns were in
            raise RevisionTooLong(f"{len(plan.turns)} turns exceed max_response_length {max_response_length} "
                                  f"(stopped at turn {index + 1})")
        if index < len(plan.turns) - 1:
            handler.add_observation(observation)
            if handler.done:
                raise RevisionTooLong(f"{len(plan.turns)} turns exceed max_response_length {max_response_length} "
                                      f"(stopped after turn {index + 1}'s observation)")
    handler.finish("done")
    episode = handler.to_episode()
    mask = list(episode.response_mask)
    spans = assistant_spans(mask, episode.turn_ends)
    for (text, _observation, trained), (start, end) in zip(plan.turns, spans):
        if not trained:
            # The bad prefix is context: the model must not learn to repeat the mistake.
            mask[start:end + 1] = [0] * (end + 1 - start)
    episode.response_mask = mask
    return episode, handler.messages, spans


def assistant_spans(mask: Sequence[int], turn_ends: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) response position of each assistant turn: the run of 1s that ends at its turn end."""
    spans = []
    for end in turn_ends:
        start = end
        while start > 0 and mask[start - 1] == 1:
            start -= 1
        spans.append((start, end))
    return spans


def revision_record(good: SearchPath, bad: SearchPath, first_wrong: int, found_by: str, reflection: str,
                    task: dict, tokenizer, **limits):
    """The revision trajectory as a `TrajectoryRecord` (SFT reads it like any episode).

    `task`: {"env", "task", "split", "seed", "first_observation"} of the searched task; `extra["agent_r"]`
    keeps the pair's values, the first wrong step and how it was found."""
    plan = revision_plan(good, bad, first_wrong, reflection)
    return _plan_record(plan, task, tokenizer, "agent_r_revision", good.value, limits, {
        "good_value": good.value, "bad_value": bad.value, "first_wrong_step": first_wrong, "found_by": found_by,
        "shared_prefix": shared_prefix(good, bad)})


def good_path_record(good: SearchPath, task: dict, tokenizer, **limits):
    """The good path as an ordinary trajectory record, every turn trained (Agent-R trains on these too)."""
    plan = RevisionPlan(tuple((node.action, node.observation, True) for node in good.nodes))
    return _plan_record(plan, task, tokenizer, "agent_r_good_path", good.value, limits, {"good_value": good.value})


def _plan_record(plan: RevisionPlan, task: dict, tokenizer, label: str, value: float, limits: dict, notes: dict):
    from beyond_agent.trajectories import SCHEMA_VERSION, TrajectoryRecord

    episode, messages, spans = splice_revision(plan, task["first_observation"], tokenizer, **limits)
    return TrajectoryRecord(
        schema=SCHEMA_VERSION, step=0, kind="train", index=0, env=task["env"], task=task.get("task"),
        split=task.get("split", "train"), seed=task.get("seed"), agent_task=label,
        group=f"{task['env']}:{task.get('task')}", messages=messages, prompt_ids=episode.prompt_ids,
        response_ids=episode.response_ids, response_mask=episode.response_mask,
        response_logprobs=[], turn_ends=episode.turn_ends, step_rewards=[0.0] * len(plan.turns),
        reward=value, score=value, success=value > 0, rounds=len(plan.turns), termination="done",
        error=None, env_time_s=0.0, llm_time_s=0.0, wall_time_s=0.0,
        extra={"agent_r": {**notes, "trained_turns": [trained for _text, _obs, trained in plan.turns],
                           "turn_spans": [list(span) for span in spans]}})
