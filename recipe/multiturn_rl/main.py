"""Hydra entry point of the BeyondAgent recipe: its trainer (trainer.py), its YAML (config/), and this main.

    python -m recipe.multiturn_rl.main [hydra overrides]
    python -m recipe.multiturn_rl.main --config-path=$PWD/examples/quickstart --config-name=cpu_tiny

The config (config/beyond_agent_trainer.yaml) is verl's ppo_trainer plus our `beyond_agent:` section. What every
RL recipe does around its trainer (the config checks before Ray starts, verl's `run_ppo` with a TaskRunner that
builds verl's workers and datasets) is `beyond_agent.run_recipe`; a fork changes the trainer and the YAML.
"""

from __future__ import annotations

import hydra

from beyond_agent.verl_pin import ensure_pinned_verl

ensure_pinned_verl()  # before the trainer imports verl: a wrong verl is named as such, not as an import error
from beyond_agent.run_recipe import check_config, run_recipe  # noqa: E402,F401  (check_config: the config tests')
from .trainer import BeyondAgentTrainer  # noqa: E402  (relative: a copy of this folder trains with its own trainer)


@hydra.main(config_path="config", config_name="beyond_agent_trainer", version_base=None)
def main(config) -> None:
    """Check the config, then train with this recipe's trainer (`beyond_agent.run_recipe`)."""
    run_recipe(BeyondAgentTrainer, config)


if __name__ == "__main__":
    main()
