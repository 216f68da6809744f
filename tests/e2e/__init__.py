"""End-to-end runs of the product, timed, that CI has no time for: scripts run by hand, not collected by pytest
(``make stack-e2e`` runs ``compose_stack.py``)."""
