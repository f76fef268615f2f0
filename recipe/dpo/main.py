"""DPO on pairs of trajectories: verl's SFT trainer with our DPO loss and pair data (beyond_agent/dpo.py).

    python -m recipe.dpo.main data.train_files=RUN/trajectories model.path=MODEL \\
        dpo.beta=0.1 data.min_reward_margin=0.5 trainer.total_training_steps=50 trainer.default_local_dir=OUT

Started as SFT's is (`recipe/sft`): plain `python -m` starts torchrun, whose processes run this program again.
The config is `config/dpo.yaml`: verl's `sft_trainer_engine`, the library's `trajectory_training.yaml`, the pairs
and DPO's beta.
"""

import hydra

from beyond_agent.dpo import dpo_trainer_class
from beyond_agent.sft import dry_run_checked, start_program, use_metrics_file


@hydra.main(config_path="config", config_name="dpo", version_base=None)
def main(config) -> None:
    """One process of the DPO run: check (dry run) or train."""
    from verl.utils.device import auto_set_device
    from verl.utils.distributed import destroy_global_process_group, initialize_global_process_group

    if dry_run_checked(config):
        return
    use_metrics_file(config)
    auto_set_device(config)
    initialize_global_process_group()
    dpo_trainer_class()(config=config).fit()
    destroy_global_process_group()


if __name__ == "__main__":
    start_program(main)
