"""The task seam without servers: which task a row gets, the first messages, rewards, and config errors."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from beyond_agent.rollout_manager import rows_to_episodes
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.tasks import (DEFAULT_SYSTEM_PROMPT, AgentTask, EnvTask, EpisodeOutcome, StepRewardTask,
                                       TaskTable)

pytestmark = pytest.mark.timeout(60)


class HalfScoreTask(AgentTask):
    """A user's task, named by `_target_` (this module is importable under its test-module name)."""

    def __init__(self, factor: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def reward(self, outcome: EpisodeOutcome) -> float:
        return self.factor * outcome.score


def outcome(score=1.0, steps=(0.0, 0.5, 1.0)) -> EpisodeOutcome:
    return EpisodeOutcome(score=score, success=score == 1.0, step_rewards=tuple(steps), termination="done",
                          rounds=len(steps))


def test_rows_choose_their_task_by_name_then_env_then_default():
    table = TaskTable.from_config({
        "default": {"name": "env", "action_format": "plain"},
        "babyai": {"name": "step_rewards", "action_format": "tagged", "add_score": True},
        "halved": {"_target_": f"{__name__}.HalfScoreTask", "factor": 0.25},
    })
    assert type(table.for_row("frozenlake")) is EnvTask  # no entry for the env: default
    babyai = table.for_row("babyai")
    assert isinstance(babyai, StepRewardTask) and babyai.action_format == "tagged" and babyai.label == "step_rewards"
    assert babyai.reward(outcome()) == 1.5 + 1.0  # summed step rewards plus the final score
    assert table.for_row("babyai", "halved").reward(outcome()) == 0.25  # the row's own task wins over its env's
    assert type(table.for_row("frozenlake", "step_rewards")) is StepRewardTask  # registered, not configured
    assert table.for_row("frozenlake", "step_rewards") is table.for_row("textcraft", "step_rewards")  # built once


@pytest.mark.parametrize("entry, message", [
    ({"name": "nope"}, r"beyond_agent.tasks.x: task 'nope' is not registered; registered tasks: \['env', "),
    ({"_target_": "no_such_module.Task"}, r"beyond_agent.tasks.x._target_='no_such_module.Task' cannot be imported"),
    ({"_target_": "collections.OrderedDict"}, r"_target_='collections.OrderedDict' is not an AgentTask subclass"),
    ({"name": "env", "colour": "red"}, r"beyond_agent.tasks.x: EnvTask\(colour='red'\) failed: .*colour"),
    ({"action_format": "json"}, r"action_format='json' is not registered; choose one of \['plain', 'raw', 'react', 'tagged'"),
    ({"name": "env", "_target_": "a.B"}, r"gives both _target_ \('a.B'\) and name \('env'\)"),
])
def test_bad_task_entries_name_the_entry_and_the_choices(entry, message):
    with pytest.raises(ValueError, match=message):
        TaskTable.from_config({"x": entry})


def test_a_row_naming_an_unknown_task_lists_configured_and_registered_names():
    with pytest.raises(ValueError, match=r"task 'missing', which is neither configured \(beyond_agent.tasks: "
                                         r"\['default'\]\) nor registered \(\['env', 'step_rewards'\]\)"):
        TaskTable({}).for_row("babyai", "missing")


def test_first_messages_from_the_observation_or_from_the_row_prompt():
    task = EnvTask(system_prompt="Be brief.")
    assert task.first_messages("You see a door.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "You see a door."}]
    assert EnvTask().first_messages("x")[0]["content"] == DEFAULT_SYSTEM_PROMPT
    # A row prompt without a system message: the task's system prompt, then the row's (edited) text.
    row = [{"role": "user", "content": "Hint: doors open.\n{observation}"}]
    assert task.first_messages("You see a door.", row) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hint: doors open.\nYou see a door."}]
    # A row with its own system message keeps it.
    row = np.array([{"role": "system", "content": "Row system."}, {"role": "user", "content": "Row text."}])
    assert task.first_messages("ignored", row) == [{"role": "system", "content": "Row system."},
                                                   {"role": "user", "content": "Row text."}]
    with pytest.raises(ValueError, match="prompt message 0 must be a system, user or assistant message"):
        task.first_messages("x", [{"role": "tool", "content": "t"}])


def test_rows_become_episodes_with_their_env_task_prompt_and_group():
    table = TaskTable.from_config({"frozenlake": {"action_format": "tagged"}})
    batch = {
        "extra_info": np.array([{"env_id": "frozenlake", "task_id": 3, "seed": 3, "split": "train"},
                                {"env_id": "babyai", "task_id": 1, "seed": 1, "task": "step_rewards"},
                                {"task_id": 0}], dtype=object),
        "uid": np.array(["u0", "u1", "u2"], dtype=object),
        "raw_prompt": np.array([[{"role": "user", "content": "map 3"}], [{"role": "user", "content": "go"}],
                                [{"role": "user", "content": "{observation}"}]], dtype=object),
    }
    specs = rows_to_episodes(batch, "textcraft", table)
    assert [(s.env_id, s.task_id, s.group_id, s.index) for s in specs] == [
        ("frozenlake", 3, "u0", 0), ("babyai", 1, "u1", 1), ("textcraft", 0, "u2", 2)]
    assert [s.agent_task.label for s in specs] == ["env", "step_rewards", "env"]
    assert specs[0].agent_task.action_format == "tagged" and specs[2].agent_task.action_format == "plain"
    assert specs[0].prompt == [{"role": "user", "content": "map 3"}]
    with pytest.raises(ValueError, match="row 0: extra_info has no env_id and beyond_agent.env.env_id is not set"):
        rows_to_episodes({"extra_info": np.array([{}], dtype=object)}, None, table)


def recipe_config(*overrides: str):
    from pathlib import Path

    config_dir = Path(__file__).resolve().parents[2] / "recipe" / "multiturn_rl" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="beyond_agent_trainer", overrides=list(overrides))


def test_settings_hold_the_rollout_objects_and_name_bad_keys():
    settings = BeyondAgentConfig.from_config(recipe_config(
        "data.max_prompt_length=128", "data.max_response_length=256", "beyond_agent.max_tokens_per_turn=16",
        "+beyond_agent.tasks.babyai.name=step_rewards", "actor_rollout_ref.rollout.temperature=0.7"))
    assert (settings.episode.max_prompt_length, settings.episode.max_response_length,
            settings.episode.max_tokens_per_turn) == (128, 256, 16)
    assert settings.llm.max_in_flight == settings.concurrency == 64
    assert settings.sampling({}).temperature == 0.7 and settings.sampling({"validate": True}).temperature == 0.0
    assert settings.tasks.for_row("babyai").label == "step_rewards" and settings.group_based
    for override, message in [
        ("beyond_agent.max_tokens_per_turn=0", r"beyond_agent.max_tokens_per_turn must be an int >= 1; got 0"),
        ("beyond_agent.concurrency=0", r"beyond_agent.concurrency must be an int >= 1; got 0"),
        ("data.max_response_length=0", r"data.max_response_length must be an int >= 1; got 0"),
        ("+beyond_agent.action_format=tagged", r"beyond_agent has unknown key\(s\) \['action_format'\]; valid "
                                               r"keys: .*action_format is now beyond_agent.tasks.default.action_format"),
        ("beyond_agent.env.url=localhost:8000", r"beyond_agent.env.url must start with http:// or https://"),
        ("beyond_agent.tasks.default.name=nope", r"beyond_agent.tasks.default: task 'nope' is not registered"),
    ]:
        with pytest.raises(ValueError, match=message):
            BeyondAgentConfig.from_config(recipe_config(override))
