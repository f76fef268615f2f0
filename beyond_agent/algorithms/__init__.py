"""Algorithms BeyondAgent registers with verl; the ``verl.plugins`` entry point ``beyond_agent_algos``.

verl imports every ``verl.plugins`` entry point at ``import verl`` (verl/__init__.py), so importing this
package there is what makes our registrations exist in every process, Ray workers included. verl logs a
plugin that fails to import only at DEBUG level, so tests/trainer/test_m2po_loss_on_cpu.py checks the
registration in a fresh interpreter.

- ``m2po``: the M2PO policy loss (``actor_rollout_ref.actor.policy_loss.loss_mode=m2po``);
- ``gigpo``: GiGPO's episode-level advantage (``algorithm.adv_estimator=gigpo``; the trainer adds the
  step-level part, beyond_agent/algorithms/gigpo.py).
"""

from beyond_agent.algorithms.gigpo import compute_gigpo_episode_advantage
from beyond_agent.algorithms.m2po import (
    DEFAULT_M2PO_BUDGET,
    M2PO_BUDGET_KEY,
    M2POPolicyLossConfig,
    compute_policy_loss_m2po,
)

__all__ = ["compute_gigpo_episode_advantage", "DEFAULT_M2PO_BUDGET", "M2PO_BUDGET_KEY", "M2POPolicyLossConfig", "compute_policy_loss_m2po"]
