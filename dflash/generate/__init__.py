"""Stage zero (optional): the target writes the dataset's assistant turns (docs/DESIGN.md §10)."""
