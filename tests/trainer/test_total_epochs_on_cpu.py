"""BeyondAgentTrainer makes verl's epoch loop long enough for the requested number of training steps."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from beyond_agent.training import align_total_epochs


def trainer_config(total_epochs: int):
    config = OmegaConf.create({"trainer": {"total_epochs": total_epochs, "total_training_steps": None}})
    OmegaConf.set_struct(config, True)  # as verl leaves it: a typo'd key would raise
    return config


@pytest.mark.parametrize(
    "batches, steps, epochs_before, epochs_after",
    [
        (4, 300, 30, 75),   # 30 epochs x 4 batches = 120 steps < 300: raised to 300 / 4
        (4, 301, 30, 76),   # the last epoch may be partial: ceil
        (1, 60, 30, 60),    # one batch per epoch: one epoch per step (the learning bench's case)
        (4, 120, 30, 30),   # exactly enough: untouched
        (4, 10, 30, 30),    # more than enough: untouched (verl stops at the step count)
    ],
)
def test_epochs_follow_the_step_count(batches, steps, epochs_before, epochs_after):
    config = trainer_config(epochs_before)
    notice = align_total_epochs(config, batches, steps)
    assert config.trainer.total_epochs == epochs_after
    if epochs_after == epochs_before:
        assert notice is None
    else:
        assert notice == (f"trainer.total_training_steps={steps} needs {epochs_after} epochs of {batches} batches; "
                          f"trainer.total_epochs raised from {epochs_before} to {epochs_after} "
                          "(verl stops at whichever ends first)")
