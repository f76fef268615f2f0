"""RoundScheduler: values at stage boundaries, AgentGym-RL aliases, and every validation message."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from beyond_agent.rollout.rounds import RoundScheduler

STEPWISE = {"type": "stepwise", "rounds": [10, 20, 30], "every": 100}


def test_fixed_is_the_same_at_every_step():
    scheduler = RoundScheduler.from_config({"type": "fixed", "rounds": 15})
    assert [scheduler.max_rounds(s) for s in (0, 1, 100, 10_000)] == [15, 15, 15, 15]


@pytest.mark.parametrize(
    "step, rounds",
    [(0, 10), (1, 10), (100, 10), (101, 20), (200, 20), (201, 30), (10_000, 30)],
)
def test_stepwise_stages_start_at_step_one(step, rounds):
    # verl's fit() trains steps 1, 2, ...: each stage is exactly `every` training steps long.
    assert RoundScheduler.from_config(STEPWISE).max_rounds(step) == rounds


def test_agentgym_names_mean_the_same_schedule():
    agentgym = {"type": "scaling_inter_stepwise", "rounds": [10, 20, 30], "steps_scaling_inter": 100}
    ours, theirs = RoundScheduler.from_config(STEPWISE), RoundScheduler.from_config(agentgym)
    assert theirs == ours
    assert theirs.type == "stepwise" and theirs.every == 100 and theirs.rounds == (10, 20, 30)


def test_resumed_run_gets_the_same_value_for_the_same_step():
    # A fresh scheduler (as after a restart) answers from the step alone: no hidden counters.
    first = RoundScheduler.from_config(STEPWISE)
    before = [first.max_rounds(s) for s in range(1, 260)]
    resumed = RoundScheduler.from_config(STEPWISE)
    assert [resumed.max_rounds(s) for s in range(150, 260)] == before[149:]
    assert [first.max_rounds(s) for s in range(1, 260)] == before


def test_direct_construction_normalises_like_from_config():
    assert RoundScheduler(type="fixed", rounds=15) == RoundScheduler.from_config({"type": "fixed", "rounds": 15})
    scheduler = RoundScheduler(type="scaling_inter_stepwise", rounds=[10, 20], every=100)
    assert (scheduler.type, scheduler.rounds) == ("stepwise", (10, 20))


def test_null_every_falls_back_to_the_agentgym_key():
    # YAML that lists both keys with one left null (our default) must use the other.
    config = {"type": "stepwise", "rounds": [10, 20], "every": None, "steps_scaling_inter": 100}
    assert RoundScheduler.from_config(config).max_rounds(101) == 20


def test_single_stage_stepwise_and_tuple_rounds():
    scheduler = RoundScheduler.from_config({"type": "stepwise", "rounds": (7,), "every": 5})
    assert [scheduler.max_rounds(s) for s in (1, 6, 50)] == [7, 7, 7]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"type": "adaptive", "rounds": 5}, r"beyond_agent.rounds.type='adaptive' is not valid; choose one of \('fixed'"),
        ({"type": "fixed"}, "beyond_agent.rounds.rounds is required"),
        ({"type": "fixed", "rounds": 0}, "beyond_agent.rounds.rounds values must be positive ints, got 0"),
        ({"type": "fixed", "rounds": 2.5}, "beyond_agent.rounds.rounds values must be positive ints, got 2.5"),
        ({"type": "fixed", "rounds": [10, 20]}, r"must be one int for type 'fixed', got the list \[10, 20\]"),
        ({"type": "fixed", "rounds": 5, "every": 10}, "only applies to type 'stepwise'"),
        ({"type": "stepwise", "rounds": 10, "every": 100}, "must be a list of ints for type 'stepwise', got 10"),
        ({"type": "stepwise", "rounds": [], "every": 100}, "empty list"),
        ({"type": "stepwise", "rounds": [10, -1], "every": 100}, "positive ints, got -1"),
        ({"type": "stepwise", "rounds": [10, 10, 30], "every": 100}, r"strictly increasing .* got \[10, 10, 30\]"),
        ({"type": "stepwise", "rounds": [10, 20]}, r"beyond_agent.rounds.every \(or steps_scaling_inter\) is missing"),
        ({"type": "stepwise", "rounds": [10, 20], "every": 0}, r"must be a positive int, got 0"),
        ({"type": "stepwise", "rounds": [10, 20], "steps_scaling_inter": -5}, r"must be a positive int, got -5"),
        ({"type": "stepwise", "rounds": [10, 20], "every": 100, "steps_scaling_inter": 100}, "both 'every' and"),
        ({"type": "fixed", "rounds": 5, "round": 6}, r"beyond_agent.rounds has unknown key\(s\) \['round'\]; valid keys: rounds, type, every"),
    ],
)
def test_invalid_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        RoundScheduler.from_config(config)


@pytest.mark.parametrize("step", [-1, 1.5, "3"])
def test_step_must_be_a_non_negative_int(step):
    with pytest.raises(ValueError, match="global_step must be an int >= 0"):
        RoundScheduler.from_config(STEPWISE).max_rounds(step)


def test_omegaconf_lists_are_accepted():
    config = OmegaConf.create({"type": "scaling_inter_stepwise", "rounds": [6, 13, 20],
                                         "steps_scaling_inter": 50})
    assert RoundScheduler.from_config(config).max_rounds(51) == 13
