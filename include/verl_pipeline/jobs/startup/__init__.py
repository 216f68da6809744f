"""A verl job's start, timed: the minutes between its submission and its first training step.

- :mod:`.markers`: the lines of verl's, vLLM's and Ray's logs that end each phase of a start, one table;
- :mod:`.log_times`: when such a line was printed, read from its own time stamp;
- :mod:`.phases`: what a wait records of its job's start, phase by phase, as the lines arrive;
- :mod:`.actors`: where each Ray actor of the start spent its time, from Ray's own records.
"""
