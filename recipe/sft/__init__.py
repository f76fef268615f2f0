"""SFT on trajectory records through verl's SFT trainer:
`python -m recipe.sft.main data.train_files=... model.path=...`."""
