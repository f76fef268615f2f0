"""Rollout side of the BeyondAgent recipe: per-episode token bookkeeping and the round schedule."""

from .handler import TERMINATION_REASONS, Episode, RolloutHandler, collate
from .rounds import RoundScheduler

__all__ = ["TERMINATION_REASONS", "Episode", "RolloutHandler", "RoundScheduler", "collate"]
