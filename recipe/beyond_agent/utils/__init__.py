"""Small helpers for the recipe: the offline tiny model, the verl pin check."""
