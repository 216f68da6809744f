"""verl configuration: Hydra override rendering, job rendering, validation and preflight."""
