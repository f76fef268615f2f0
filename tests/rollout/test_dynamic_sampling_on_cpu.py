"""Dynamic sampling's rule and budget by hand: which groups carry no signal under each `drop` rule, how many a
step may drop, the figures it logs, and the settings' errors. (The async pool's side is in
test_async_pool_on_cpu.py; both modes train end to end in tests/trainer/.)"""

from __future__ import annotations

import pytest

from beyond_agent.algorithms.gigpo import GiGPOConfig, group_has_step_signal
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.dynamic_sampling import DynamicSamplingConfig, GroupSieve, group_has_signal
from beyond_agent.settings import BeyondAgentConfig


def group(*outcomes: tuple[float, bool], termination: str = "done") -> list[EpisodeResult]:
    """One group: an episode per (reward, success)."""
    return [EpisodeResult(spec=EpisodeSpec(env_id="frozenlake"), episode=None, termination=termination, reward=reward,
                          success=won) for reward, won in outcomes]


SOLVED, UNSOLVED = group((1.0, True), (1.0, True)), group((0.0, False), (0.0, False))
MIXED = group((1.0, True), (0.0, False))
EQUAL_NOT_WON = group((0.5, False), (0.5, False))  # shaped reward, equal, nobody succeeded


@pytest.mark.parametrize("drop, expected", [
    # columns: SOLVED, UNSOLVED, MIXED, EQUAL_NOT_WON
    ("none", [True, True, True, True]),
    ("zero_variance", [False, False, True, False]),
    ("all_success", [False, True, True, True]),
    ("all_failure", [True, False, True, False]),
])
def test_which_groups_each_rule_drops(drop, expected):
    assert [group_has_signal(g, drop) for g in (SOLVED, UNSOLVED, MIXED, EQUAL_NOT_WON)] == expected


def test_a_group_with_an_infrastructure_failure_has_no_signal():
    failed = group((0.0, False), termination="env_error")
    # Regression (#53): two scored episodes that differ beside an env_error used to pass the sieve, and then the
    # whole group was masked (batch.excluded_rows), a batch slot that trained nothing.
    assert not group_has_signal(MIXED + failed, "zero_variance")
    assert not group_has_signal(MIXED + failed, "all_success") and not group_has_signal(MIXED + failed, "all_failure")
    assert not group_has_signal(group((1.0, True)) + failed, "zero_variance")
    assert group_has_signal(failed * 2, "none")  # no rule: nothing is judged
    sieve = GroupSieve(DynamicSamplingConfig(drop="zero_variance"), batch_size=2)
    assert [sieve.offer(g, "frozenlake") for g in (MIXED + failed, MIXED)] == [False, True]
    assert sieve.metrics()["dynamic_sampling/groups_with_failures"] == 1.0


def turns(reward: float, step_rewards: tuple[float, ...], anchors: str) -> EpisodeResult:
    """A won episode of the given turns: step rewards and the anchor state (one letter) each turn started from."""
    return EpisodeResult(spec=EpisodeSpec(env_id="frozenlake"), episode=None, termination="done", reward=reward,
                         success=True, step_rewards=list(step_rewards), anchors=list(anchors))


def test_with_gigpo_equal_returns_keep_a_group_whose_steps_differ():
    gigpo = GiGPOConfig(gamma=0.5)
    # Both won (reward 1); from state a, the first went straight to the goal (step returns a: 0 + 0.5 * 1 = 0.5),
    # the second took a detour through c (a: 0 + 0.5 * 0 + 0.25 * 1 = 0.25): state a's two turns differ.
    detour = [turns(1.0, (0.0, 1.0), "ab"), turns(1.0, (0.0, 0.0, 1.0), "acb")]
    same_path = [turns(1.0, (0.0, 1.0), "ab"), turns(1.0, (0.0, 1.0), "ab")]
    assert group_has_step_signal(detour, gigpo) and not group_has_step_signal(same_path, gigpo)
    # Regression (#53): zero_variance used to drop the detour group, whose step advantages are +-0.707 (std norm).
    assert not group_has_signal(detour, "zero_variance")
    signal = lambda results: group_has_step_signal(results, gigpo)  # noqa: E731
    assert group_has_signal(detour, "zero_variance", signal) and group_has_signal(detour, "all_success", signal)
    assert not group_has_signal(same_path, "zero_variance", signal)
    sieve = GroupSieve(DynamicSamplingConfig(drop="zero_variance"), batch_size=2, step_signal=signal)
    assert [sieve.offer(g, "frozenlake") for g in (same_path, detour)] == [False, True]


def test_rewards_within_the_tolerance_count_as_equal():
    assert not group_has_signal(group((0.1 + 0.2, False), (0.3, False)), "zero_variance")


def test_the_sieve_drops_within_its_budget_then_keeps_and_counts():
    sieve = GroupSieve(DynamicSamplingConfig(drop="zero_variance", max_extra_batches=0.5), batch_size=3)
    assert sieve.budget == 2  # ceil(0.5 * 3)
    offers = [(SOLVED, "frozenlake"), (MIXED, "frozenlake"), (group((0.0, False), (0.0, False)), "babyai"),
              (UNSOLVED, "frozenlake"), (MIXED, "babyai")]
    assert [sieve.offer(g, task) for g, task in offers] == [False, True, False, True, True]
    # 10 episodes played, 4 won (SOLVED's 2, each MIXED's 1).
    assert sieve.metrics() == {
        "dynamic_sampling/dropped_groups": 2.0, "dynamic_sampling/extra_episodes": 4.0,
        "dynamic_sampling/kept_without_signal_groups": 1.0, "dynamic_sampling/groups_with_failures": 0.0,
        "dynamic_sampling/played_success_rate": 0.4, "dynamic_sampling/dropped/frozenlake": 1.0, "dynamic_sampling/dropped/babyai": 1.0,
    }


def test_without_a_rule_nothing_is_dropped_or_logged():
    sieve = GroupSieve(DynamicSamplingConfig(), batch_size=4)
    assert sieve.budget == 0 and sieve.offer(SOLVED, "frozenlake") and sieve.metrics() == {}


@pytest.mark.parametrize("section, message", [
    ({"drop": "zero"}, r"dynamic_sampling.drop='zero' is not valid; choose one of none, zero_variance, all_success, all_failure"),
    ({"drop": "zero_variance", "max_extra_batches": -1}, r"max_extra_batches must be a number >= 0, got -1"),
    ({"drop": "zero_variance", "extra": 1}, r"dynamic_sampling has unknown key\(s\) \['extra'\]"),
])
def test_bad_sections_are_named(section, message):
    with pytest.raises(ValueError, match=message):
        BeyondAgentConfig.from_config(config(section))


def config(section: dict, n: int = 4, estimator: str = "grpo") -> dict:
    return {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}, "dynamic_sampling": section},
            "data": {"max_prompt_length": 256, "max_response_length": 256},
            "algorithm": {"adv_estimator": estimator}, "actor_rollout_ref": {"rollout": {"n": n}}}


def test_settings_need_groups_and_a_group_estimator():
    settings = BeyondAgentConfig.from_config(config({"drop": "all_failure"}))
    assert settings.dynamic_sampling.drop == "all_failure" and settings.rows_played_by_loader
    assert not BeyondAgentConfig.from_config(config({"drop": "none"}, n=1)).rows_played_by_loader
    with pytest.raises(ValueError, match=r"needs groups: set actor_rollout_ref.rollout.n >= 2 \(it is 1\)"):
        BeyondAgentConfig.from_config(config({"drop": "zero_variance"}, n=1))
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='gae' is not one: set dynamic_sampling.drop=none"):
        BeyondAgentConfig.from_config(config({"drop": "zero_variance"}, estimator="gae"))
