"""verl post-training pipelines on Ray clusters, orchestrated by Airflow.

Every step is a plain function in this package; the Airflow operators, the ``verl-pipeline``
CLI and the Ray job entrypoints all call the same functions.
"""

from __future__ import annotations

__version__ = "0.1.0"
