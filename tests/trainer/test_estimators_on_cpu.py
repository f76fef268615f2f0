"""Advantage estimators declare whether they are group-based; an undeclared one is refused at start-up."""

from __future__ import annotations

import pytest
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

from beyond_agent.algorithms.estimators import GROUP_BASED, declare_estimator, is_group_based
from beyond_agent.settings import BeyondAgentConfig


def config(adv_estimator: str) -> dict:
    return {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}}, "algorithm": {"adv_estimator": adv_estimator},
            "data": {"max_prompt_length": 256, "max_response_length": 256},
            "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}


def test_every_estimator_verl_registers_is_declared():
    assert sorted(set(ADV_ESTIMATOR_REGISTRY) - set(GROUP_BASED)) == []


def test_the_group_flags_of_verls_estimators():
    assert sorted(name for name, group in GROUP_BASED.items() if not group) == ["gae", "reinforce_plus_plus", "remax"]
    assert BeyondAgentConfig.from_config(config("rloo")).group_based
    assert not BeyondAgentConfig.from_config(config("gae")).group_based


def test_an_undeclared_estimator_is_refused_until_declared():
    with pytest.raises(ValueError, match=r"adv_estimator='my_estimator' is not declared .*declare_estimator"
                                         r"\('my_estimator', group_based=True or False\).*declared: gae, gdpo"):
        BeyondAgentConfig.from_config(config("my_estimator"))
    declare_estimator("my_estimator", group_based=False)
    try:
        assert not BeyondAgentConfig.from_config(config("my_estimator")).group_based
        assert not is_group_based("my_estimator")
    finally:
        GROUP_BASED.pop("my_estimator")
    with pytest.raises(TypeError, match="needs True or False"):
        declare_estimator("my_estimator", group_based="yes")
