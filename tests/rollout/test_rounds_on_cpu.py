"""RoundsConfig: values at stage boundaries, AgentGym-RL aliases, and every validation message (read by
`sections.from_section`, as the recipe reads it); the adaptive RoundLimit: when it raises the limit
(hand-worked windows), its floor, and its record for resumed runs."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.rounds import HORIZON_RECORD, RoundLimit, RoundsConfig, step_signal
from beyond_agent.sections import from_section

STEPWISE = {"type": "stepwise", "rounds": [10, 20, 30], "every": 100}


def rounds_of(section) -> RoundsConfig:
    """`beyond_agent.rounds` read as the recipe reads it."""
    return from_section(RoundsConfig, section, "beyond_agent.rounds")


def test_fixed_is_the_same_at_every_step():
    schedule = rounds_of({"type": "fixed", "rounds": 15})
    assert [schedule.max_rounds(s) for s in (0, 1, 100, 10_000)] == [15, 15, 15, 15]


@pytest.mark.parametrize(
    "step, rounds",
    [(0, 10), (1, 10), (100, 10), (101, 20), (200, 20), (201, 30), (10_000, 30)],
)
def test_stepwise_stages_start_at_step_one(step, rounds):
    # verl's fit() trains steps 1, 2, ...: each stage is exactly `every` training steps long.
    assert rounds_of(STEPWISE).max_rounds(step) == rounds


def test_agentgym_names_mean_the_same_schedule():
    agentgym = {"type": "scaling_inter_stepwise", "rounds": [10, 20, 30], "steps_scaling_inter": 100}
    ours, theirs = rounds_of(STEPWISE), rounds_of(agentgym)
    assert theirs == ours
    assert theirs.type == "stepwise" and theirs.every == 100 and theirs.rounds == (10, 20, 30)


def test_resumed_run_gets_the_same_value_for_the_same_step():
    # A fresh schedule (as after a restart) answers from the step alone: no hidden counters.
    first = rounds_of(STEPWISE)
    before = [first.max_rounds(s) for s in range(1, 260)]
    resumed = rounds_of(STEPWISE)
    assert [resumed.max_rounds(s) for s in range(150, 260)] == before[149:]
    assert [first.max_rounds(s) for s in range(1, 260)] == before


def test_direct_construction_normalises_like_the_reader():
    assert RoundsConfig(type="fixed", rounds=15) == rounds_of({"type": "fixed", "rounds": 15})
    schedule = RoundsConfig(type="scaling_inter_stepwise", rounds=[10, 20], every=100)
    assert (schedule.type, schedule.rounds) == ("stepwise", (10, 20))


def test_null_every_falls_back_to_the_agentgym_key():
    # YAML that lists both keys with one left null (our default) must use the other.
    config = {"type": "stepwise", "rounds": [10, 20], "every": None, "steps_scaling_inter": 100}
    assert rounds_of(config).max_rounds(101) == 20


def test_single_stage_stepwise_and_tuple_rounds():
    schedule = rounds_of({"type": "stepwise", "rounds": (7,), "every": 5})
    assert [schedule.max_rounds(s) for s in (1, 6, 50)] == [7, 7, 7]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"type": "linear", "rounds": 5}, r"beyond_agent.rounds.type='linear' is not valid; choose one of \('fixed'.*'adaptive'\)"),
        ({"type": "adaptive", "rounds": 5, "threshold": 0.2}, "at least two ints for type 'adaptive'"),
        ({"type": "adaptive", "rounds": [4, 4], "threshold": 0.2}, r"strictly increasing for type 'adaptive'"),
        ({"type": "adaptive", "rounds": [4, 6]}, r"threshold must be a fraction in \[0, 1\] .* got None"),
        ({"type": "adaptive", "rounds": [4, 6], "threshold": 1.5}, r"threshold must be a fraction .* got 1.5"),
        ({"type": "adaptive", "rounds": [4, 6], "threshold": 0.2, "signal": "reward"},
         r"beyond_agent.rounds.signal='reward' is not valid; choose one of truncated, success"),
        ({"type": "adaptive", "rounds": [4, 6], "threshold": 0.2, "window": 0}, "window must be a positive int, got 0"),
        ({"type": "adaptive", "rounds": [4, 6], "threshold": 0.2, "every": 0}, "every must be a positive int or null"),
        ({"type": "stepwise", "rounds": [4, 6], "every": 5, "threshold": 0.2}, "threshold only applies to type 'adaptive'"),
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
        rounds_of(config)


@pytest.mark.parametrize("step", [-1, 1.5, "3"])
def test_step_must_be_a_non_negative_int(step):
    with pytest.raises(ValueError, match="global_step must be an int >= 0"):
        rounds_of(STEPWISE).max_rounds(step)


def test_omegaconf_lists_are_accepted():
    config = OmegaConf.create({"type": "scaling_inter_stepwise", "rounds": [6, 13, 20],
                                         "steps_scaling_inter": 50})
    assert rounds_of(config).max_rounds(51) == 13


def episodes(*terminations: str, success: tuple[bool, ...] = ()) -> list[EpisodeResult]:
    """One result per termination reason (success per episode where given)."""
    flags = success or (False,) * len(terminations)
    return [EpisodeResult(spec=EpisodeSpec(env_id="frozenlake"), episode=None, termination=end, success=won)
            for end, won in zip(terminations, flags)]


def test_step_signal_counts_scored_episodes_only():
    results = episodes("max_rounds", "done", "env_error", "max_rounds", success=(False, True, False, False))
    # env_error is an infrastructure failure: 2 of the 3 scored episodes were cut, 1 of 3 succeeded.
    assert step_signal(results, "truncated") == pytest.approx(2 / 3)
    assert step_signal(results, "success") == pytest.approx(1 / 3)


def test_the_truncated_signal_counts_the_run_s_limits_and_not_the_env_s():
    # Regression (#53): the token budget (length) and the gateway's call limit cut episodes too, and were not
    # counted; an env's own step limit (truncated) was counted as the round limit's. Cut here: max_rounds,
    # length, max_calls = 3 of the 5 scored episodes.
    results = episodes("max_rounds", "length", "max_calls", "truncated", "done", "timeout")
    assert step_signal(results, "truncated") == pytest.approx(3 / 5)
    assert step_signal(episodes("timeout"), "truncated") is None


def adaptive(**keys) -> RoundsConfig:
    return rounds_of({"type": "adaptive", "rounds": [4, 6, 8], "threshold": 0.25, **keys})


def test_adaptive_raises_when_the_window_mean_of_truncations_falls_to_the_threshold(tmp_path):
    horizon = RoundLimit(adaptive(window=2), record_dir=tmp_path)
    cut_half, cut_none, cut_all = ("max_rounds", "done"), ("done", "done"), ("max_rounds",) * 2
    limits = []
    for step, ends in enumerate([cut_all, cut_half, cut_none, cut_half, cut_none, cut_none], start=1):
        limits.append(horizon.max_rounds(step))
        horizon.observe(step, episodes(*ends))
    limits.append(horizon.max_rounds(7))
    # Window of 2 at each limit: steps 1-2 mean (1 + .5)/2 = .75 > .25, keep 4; steps 2-3 (.5 + 0)/2 = .25 <= .25:
    # 6 from step 4. A new limit starts a new window: step 4 alone is not a full window; steps 4-5 mean .25:
    # 8 from step 6, the last value, where it stays.
    assert limits == [4, 4, 4, 6, 6, 8, 8]


def test_adaptive_success_signal_and_the_stepwise_floor():
    horizon = RoundLimit(adaptive(signal="success", threshold=0.5, every=3))
    limits = []
    for step in range(1, 8):
        limits.append(horizon.max_rounds(step))
        won = (True, False) if step == 2 else (False, False)  # success 0.5 at step 2 only
        horizon.observe(step, episodes("done", "done", success=won))
    # Step 2's success of 0.5 >= 0.5 raises to 6 for step 3. The floor is stepwise [4, 6, 8] every 3: steps
    # 4-6 at least 6, step 7 at least 8; the signal never again reaches 0.5, so only the floor moves it.
    assert limits == [4, 4, 6, 6, 6, 6, 8]


def test_adaptive_never_lowers_and_ignores_steps_without_scored_episodes():
    horizon = RoundLimit(adaptive())
    horizon.observe(1, episodes("done"))  # truncated share 0 <= .25: 6 from step 2
    figures = horizon.observe(2, episodes("env_error", "timeout"))  # nothing scored: no signal, no change
    assert figures == {"max_rounds": 6.0}
    horizon.observe(3, episodes("max_rounds"))  # all cut: stays at 6, never back to 4
    assert [horizon.max_rounds(step) for step in (3, 4)] == [6, 6]


def test_fixed_and_stepwise_horizons_are_the_schedule(tmp_path):
    horizon = RoundLimit(rounds_of(STEPWISE), record_dir=tmp_path)
    assert horizon.observe(101, episodes("done")) == {"max_rounds": 20.0}
    assert [horizon.max_rounds(step) for step in (1, 101, 201)] == [10, 20, 30]
    assert not (tmp_path / HORIZON_RECORD).exists()  # nothing to remember


def test_a_resumed_run_replays_the_record_up_to_its_step(tmp_path):
    first = RoundLimit(adaptive(), record_dir=tmp_path)
    for step, ends in enumerate([("max_rounds",), ("done",), ("done",), ("done",)], start=1):
        first.observe(step, episodes(*ends))  # raised after steps 2 and 3: 4, 4, 6, 8
    record = json.loads((tmp_path / HORIZON_RECORD).read_text())
    assert [entry["max_rounds"] for entry in record["observed"]] == [4, 4, 6, 8]
    # Resumed from the checkpoint of step 2: verl validates at step 2, then trains step 3 on. Steps 3 and 4
    # of the record are redone; the limit is the one step 2 left, and the record forgets the redone steps.
    resumed = RoundLimit(adaptive(), record_dir=tmp_path)
    assert resumed.max_rounds(2, validate=True) == 6
    assert resumed.max_rounds(3) == 6
    resumed.observe(3, episodes("max_rounds"))
    assert [entry["step"] for entry in json.loads((tmp_path / HORIZON_RECORD).read_text())["observed"]] == [1, 2, 3]
    assert resumed.max_rounds(4) == 6
    fresh = RoundLimit(adaptive(), record_dir=tmp_path)  # a new run in the same folder starts at step 1
    assert fresh.max_rounds(1) == 4


def test_a_damaged_record_is_named(tmp_path):
    (tmp_path / HORIZON_RECORD).write_text("{not json")
    with pytest.raises(ValueError, match=f"{HORIZON_RECORD} is not a horizon record"):
        RoundLimit(adaptive(), record_dir=tmp_path).max_rounds(1)
