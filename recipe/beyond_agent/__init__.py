"""BeyondAgent: multi-turn agent RL as a recipe on upstream, unmodified verl."""
