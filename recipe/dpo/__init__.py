"""DPO on pairs of trajectories through verl's SFT trainer:
`python -m recipe.dpo.main data.train_files=... model.path=...`."""
