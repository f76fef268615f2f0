"""Recipes: thin programs on the `beyond_agent` library, one folder each, none importing another.

    multiturn_rl/   multi-turn RL on verl's RayPPOTrainer (sync and async rollout)
    agentevol/      AgentEvol: explore, keep successes, SFT, repeat
    agent_r/        Agent-R: MCTS, revision trajectories, SFT, repeat
    sft/            SFT on trajectory records through verl's SFT trainer
    dpo/            DPO on pairs of trajectories through verl's SFT trainer

AgentEvol and Agent-R run the SFT program through the library's `beyond_agent.sft.run_sft` (a child torchrun),
not by importing `recipe/sft`. To make your own recipe, copy one folder under a new name: its
imports of itself are relative, so nothing else needs renaming.
"""
