"""verl recipes shipped by BeyondAgent (one folder per recipe, verl-recipe style)."""
