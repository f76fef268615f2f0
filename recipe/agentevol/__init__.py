"""AgentEvol (AgentGym): `python -m recipe.agentevol.main --help`."""
