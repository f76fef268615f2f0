"""Multi-turn agent RL on verl's RayPPOTrainer: `python -m recipe.multiturn_rl.main [hydra overrides]`."""
