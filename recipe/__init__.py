"""Recipes: thin programs on the `beyond_agent` library, one folder each, none importing another.

    multiturn_rl/   multi-turn RL on verl's RayPPOTrainer (sync and async rollout)
    agentevol/      AgentEvol: explore, keep successes, SFT, repeat
    agent_r/        Agent-R: MCTS, revision trajectories, SFT, repeat

SFT and DPO on trajectories are library programs (`python -m beyond_agent.sft`, `beyond_agent.dpo`),
since AgentEvol and Agent-R run them too. To make your own recipe, copy one folder under a new name: its
imports of itself are relative, so nothing else needs renaming.
"""
