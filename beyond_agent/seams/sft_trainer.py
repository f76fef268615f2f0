"""verl's SFT trainer with its private build steps turned into named hooks: the only overrides of SFTTrainer's
private methods in BeyondAgent (each one a seam in `beyond_agent.seams.SEAMS`), the same shape as
`beyond_agent.seams.trainer.TrainerSeams` for RayPPOTrainer.

verl's `SFTTrainer.__init__` builds the trainer in steps that are not public API; a trainer built on
`SFTTrainerSeams` overrides these hooks instead, each called right after verl's own step:

- `after_engine_built()`: the engine and its training client exist (set a loss function, wrap the client);
- `after_dataloaders_built()`: the train and val dataloaders exist (change their collation);
- `after_engine_initialised()`: the engine holds the starting weights, before any step or resume (score what
  needs the starting model, e.g. DPO's reference log-probs).
"""

from __future__ import annotations

from verl.trainer.sft_trainer import SFTTrainer


class SFTTrainerSeams(SFTTrainer):
    """SFTTrainer whose private build steps call the public hooks of this class (module docstring); the hooks do
    nothing here."""

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def after_engine_built(self) -> None:
        """The engine and `self.training_client` exist."""

    def after_dataloaders_built(self) -> None:
        """`self.train_dataloader` and `self.val_dataloader` exist."""

    def after_engine_initialised(self) -> None:
        """The engine holds the starting weights."""

    # ---- the seams: verl's private build steps, each calling verl's own and then the hook -------------------------
    def _build_engine(self):
        super()._build_engine()
        self.after_engine_built()

    def _build_dataloader(self):
        super()._build_dataloader()
        self.after_dataloaders_built()

    def _init_engine(self):
        super()._init_engine()
        self.after_engine_initialised()
