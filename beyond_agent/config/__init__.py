"""The library's shared Hydra configs (trajectory_training.yaml: what the SFT and DPO recipes share); YAML only."""
