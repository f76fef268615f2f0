"""The BeyondAgent environment service: text environments behind one HTTP protocol."""

from envservice.check import check_env

__all__ = ["check_env"]
