"""Agent-R's iterative self-training: `python -m recipe.agent_r.main --help`."""
