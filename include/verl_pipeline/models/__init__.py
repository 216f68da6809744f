"""Model sources: the built-in tiny model and the HuggingFace hub."""
