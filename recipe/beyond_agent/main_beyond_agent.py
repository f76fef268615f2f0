"""Hydra entry point of the BeyondAgent recipe.

    python -m recipe.beyond_agent.main_beyond_agent [hydra overrides]
    python -m recipe.beyond_agent.main_beyond_agent --config-path=$PWD/examples/quickstart --config-name=cpu_tiny

The config (config/beyond_agent_trainer.yaml) is verl's ppo_trainer plus our `beyond_agent:` section.
Ray and the run itself are started by verl's own `run_ppo`; our TaskRunner builds verl's workers and
datasets like verl's legacy runner does, then trains with BeyondAgentTrainer.
"""

from __future__ import annotations

import os

import hydra
import ray
from omegaconf import OmegaConf

from recipe.beyond_agent.settings import BeyondAgentSettings
from recipe.beyond_agent.verl_pin import ensure_pinned_verl


def check_config(config) -> None:
    """Refuse configs this recipe cannot run, with the key to change."""
    if config.trainer.get("use_v1", False):
        raise SystemExit("BeyondAgent subclasses verl's legacy RayPPOTrainer: set trainer.use_v1=false "
                         "(recipe/beyond_agent/config/beyond_agent_trainer.yaml does)")
    BeyondAgentSettings.from_config(config)


def build_datasets(config, tokenizer, processor):
    """verl's RL datasets for the train and val parquet files written by recipe.beyond_agent.data."""
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler

    train = create_rl_dataset(config.data.train_files, config.data, tokenizer, processor, is_train=True,
                              max_samples=config.data.get("train_max_samples", -1))
    val = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor, is_train=False,
                            max_samples=config.data.get("val_max_samples", -1))
    return train, val, create_rl_sampler(config.data, train)


def _task_runner_class():
    """Defined lazily: verl's runner base class is imported only once verl is known to be the pinned one."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner

    class BeyondAgentTaskRunner(BaseTaskRunner):
        """Ray actor that builds verl's workers and datasets and runs BeyondAgentTrainer.fit()."""

        def run(self, config):
            from verl.trainer.ppo.utils import need_critic, need_reference_policy
            from verl.utils.config import omega_conf_to_dataclass, validate_config
            from verl.utils.dataset.rl_dataset import collate_fn

            from recipe.beyond_agent.trainer import BeyondAgentTrainer

            print(f"[beyond_agent] TaskRunner pid {os.getpid()}", flush=True)
            OmegaConf.resolve(config)
            _, worker_group_cls = self.add_actor_rollout_worker(config)
            self.add_critic_worker(config)
            self.add_reward_model_resource_pool(config)
            self.add_teacher_model_resource_pool(config)
            validate_config(config=config, use_reference_policy=need_reference_policy(config),
                            use_critic=need_critic(config))
            model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
            train, val, sampler = build_datasets(config, model_config.tokenizer, model_config.processor)
            trainer = BeyondAgentTrainer(
                config=config, tokenizer=model_config.tokenizer, processor=model_config.processor,
                role_worker_mapping=self.role_worker_mapping, resource_pool_manager=self.init_resource_pool_mgr(config),
                ray_worker_group_cls=worker_group_cls, train_dataset=train, val_dataset=val,
                collate_fn=collate_fn, train_sampler=sampler,
            )
            trainer.init_workers()
            trainer.fit()

    return ray.remote(BeyondAgentTaskRunner)


@hydra.main(config_path="config", config_name="beyond_agent_trainer", version_base=None)
def main(config) -> None:
    """Check the pin and our config, then hand over to verl's run_ppo with our TaskRunner."""
    ensure_pinned_verl()
    check_config(config)
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    run_ppo(config, task_runner_class=_task_runner_class())


if __name__ == "__main__":
    main()
