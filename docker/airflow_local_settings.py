"""Airflow's local settings for the project's image (``$AIRFLOW_HOME/config``): the cluster policy that
puts runs on a shared Ray cluster in that cluster's pool (see verl_pipeline.airflow.policy).

In another deployment, add the same import to your own ``airflow_local_settings.py``.
"""

from verl_pipeline.airflow.policy import task_instance_mutation_hook

__all__ = ["task_instance_mutation_hook"]
