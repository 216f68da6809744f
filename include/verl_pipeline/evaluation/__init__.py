"""Evaluating a run's models: the trained model, the base model and the profile's champion scored on the
same rows with the run's reward function, as a Ray job on the run's cluster (``scores.Evaluation``)."""
