"""Environments served by envservice; each module holds one `TextEnv` subclass (imported lazily by the registry)."""
