"""Ray Jobs API access, submission ids and job summaries."""
