"""The driver refuses configs it cannot run before Ray starts, in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipe.multiturn_rl.main import check_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe/multiturn_rl/config"


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("beyond_agent_trainer", overrides=list(overrides))


def test_the_recipe_default_passes():
    check_config(composed())
    # Rows load without worker processes, on every device (a worker Ray killed at the end printed a traceback after
    # a clean exit on the H200; verl's default is 8).
    assert composed().data.dataloader_num_workers == 0
    # No verl reward loop workers: the rollout scores through envservice and never calls them (verl starts 8 idle
    # Ray actors by default, each importing torch and verl).
    assert composed().reward.num_workers == 0
    check_config(composed("beyond_agent.rollout_mode=async", "actor_rollout_ref.rollout.free_cache_engine=false",
                          "beyond_agent.weight_sync.mode=delta"))
    check_config(composed("actor_rollout_ref.model.lora_rank=8", "beyond_agent.agent.function=examples/agents/"
                          "trimming_agent.py:run"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.use_v1=true"], "set trainer.use_v1=false"),
    (["beyond_agent.rollout_mode=async", "actor_rollout_ref.rollout.free_cache_engine=false",
      "beyond_agent.async_rollout.partial_rollout=tokens"], "partial_rollout must be true, false or token, got 'tokens'"),
    (["beyond_agent.rollout_mode=async", "actor_rollout_ref.rollout.free_cache_engine=true"],
     "rollout_mode=async needs actor_rollout_ref.rollout.free_cache_engine=false"),
    (["beyond_agent.weight_sync.mode=delta", "actor_rollout_ref.rollout.free_cache_engine=true"],
     "weight_sync.mode=delta cannot run with actor_rollout_ref.rollout.free_cache_engine=true"),
    (["beyond_agent.weight_sync.mode=sparse"], "weight_sync.mode must be one of"),
    (["beyond_agent.sampling_seed=true"], "beyond_agent.sampling_seed must be an int or null; got True"),
    (["actor_rollout_ref.model.lora_rank=8", "beyond_agent.weight_sync.mode=delta"],
     "LoRA \\(actor_rollout_ref.model.lora_rank=8\\) cannot run with beyond_agent.weight_sync.mode=delta"),
    (["beyond_agent.agent.function=no_such_agent_module:play"],
     "beyond_agent.agent.function='no_such_agent_module:play': cannot import 'no_such_agent_module'"),
    (["beyond_agent.agent.function=examples/agents/trimming_agent.py:no_such_function"],
     "has no callable 'no_such_function'"),
    (["beyond_agent.agent.command='no_such_agent_program --episode'"],
     "beyond_agent.agent.command='no_such_agent_program --episode': no program 'no_such_agent_program' on PATH"),
    (["beyond_agent.agent.command='python agent.py'", "beyond_agent.agent.function=m:f"],
     "beyond_agent.agent: set function or command, not both"),
    (["reward.reward_model.enable=true"],
     "reward.num_workers=0 with reward.reward_model.enable=true: .* set reward.num_workers to 1 or more"),
])
def test_a_run_that_cannot_work_is_refused_naming_the_key(overrides, message):
    with pytest.raises(SystemExit, match=message):
        check_config(composed(*overrides))
