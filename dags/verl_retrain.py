"""Scheduled retraining: one DAG per profile with a ``retrain`` section (cron and/or data updates).

``verl_retrain__<profile>`` runs the verl pipeline for that profile on its cron and whenever the
profile's preprocessed-data Asset is updated, never two at once, no catch-up; a run that succeeded
becomes ``latest/<profile>``. See include/verl_pipeline/airflow/retrain.py.
"""

from __future__ import annotations

from verl_pipeline.airflow.retrain import build_retrain_dag, retrain_schedules

for _sched in retrain_schedules():
    globals()[_sched.dag_id] = build_retrain_dag(_sched)
