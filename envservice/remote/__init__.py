"""Env backends that proxy to servers running elsewhere (AgentGym env servers, OpenEnv servers)."""
