"""SFT on trajectory records: verl's own SFT trainer with our dataset (beyond_agent/sft.py).

    python -m recipe.sft.main data.train_files=RUN/trajectories model.path=MODEL \\
        +data.trajectory_filter.success=true trainer.total_training_steps=100 trainer.default_local_dir=OUT

Run with plain `python -m`, it starts torchrun with one process per `trainer.n_gpus_per_node` (and the CPU settings
on a machine without CUDA); each process is then this program again, as verl's SPMD trainer. The config is
`config/sft.yaml`: verl's `sft_trainer_engine` plus the library's `trajectory_training.yaml`.
"""

import hydra

from beyond_agent.sft import dry_run_checked, start_program, use_metrics_file


@hydra.main(config_path="config", config_name="sft", version_base=None)
def main(config) -> None:
    """One process of the SFT run: check (dry run) or train."""
    from verl.trainer.sft_trainer import run_sft
    from verl.utils.device import auto_set_device

    if dry_run_checked(config):
        return
    use_metrics_file(config)
    auto_set_device(config)
    run_sft(config)


if __name__ == "__main__":
    start_program(main)
