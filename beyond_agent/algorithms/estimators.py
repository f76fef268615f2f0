"""Which advantage estimators baseline a sample against its group (the other samples of the same prompt).

This decides what an infrastructure failure costs: when an episode ends in `env_error`, `llm_error` or
`timeout`, it is never trained on, and for a group-based estimator (GRPO, RLOO, ...) the rest of its group
goes with it, since their baseline would otherwise be computed without it (beyond_agent/rollout/batch.py).

Every estimator verl 0.9.0 registers is declared here. An estimator of your own, registered with verl's
`@register_adv_est("mine")`, is declared beside it, in the module your `verl.plugins` entry point imports
(so every process has both):

    from beyond_agent.algorithms.estimators import declare_estimator
    declare_estimator("mine", group_based=True)

An undeclared estimator is an error at start-up, not a guess.
"""

from __future__ import annotations

GROUP_BASED: dict[str, bool] = {
    "gae": False,
    "reinforce_plus_plus": False,
    "remax": False,  # its baseline is a separate greedy rollout of the prompt, not the group
    "grpo": True,
    "grpo_vectorized": True,
    "grpo_passk": True,
    "gdpo": True,
    "gpg": True,
    "opo": True,
    "rloo": True,
    "rloo_vectorized": True,
    "reinforce_plus_plus_baseline": True,
    "optimal_token_baseline": True,
    "tir_optimal_token_baseline": True,
}
"""Estimator name (verl's `algorithm.adv_estimator`) -> whether its baseline uses the sample's group."""


def declare_estimator(name: str, group_based: bool) -> None:
    """State whether the estimator `name` baselines each sample against its group (see the module docstring)."""
    if not isinstance(group_based, bool):
        raise TypeError(f"declare_estimator({name!r}, group_based=...) needs True or False, got {group_based!r}")
    GROUP_BASED[str(name)] = group_based


def is_group_based(name: str) -> bool:
    """Whether the estimator `name` is group-based; ValueError naming the declared ones when it was never declared."""
    try:
        return GROUP_BASED[str(name)]
    except KeyError:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is not declared group-based or not: call "
            f"beyond_agent.algorithms.estimators.declare_estimator({name!r}, group_based=True or False) where you "
            f"register it (it decides whether an infrastructure failure drops the episode's whole group); "
            f"declared: {', '.join(sorted(GROUP_BASED))}") from None
