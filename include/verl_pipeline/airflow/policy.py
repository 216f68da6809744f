"""The Airflow cluster policy that admits runs on a shared cluster through its pool.

A task's pool is fixed when the DAG is parsed; the cluster a run targets is a param of the run. So
the pool is set per run, when the scheduler (or the API server that triggers the run) creates the
run's task instances: :func:`task_instance_mutation_hook` gives the run's wait task the pool its
cluster profile names (:mod:`verl_pipeline.admission`) and as many slots as GPUs the run
needs. The wait task is the one that submits a pooled run's job (see the submit and wait
operators), and the pool counts deferred tasks, so the slots are held for the job's whole life
and a second run's wait queues until they are free.

Airflow applies a ``task_instance_mutation_hook`` when task instances are created only when it
comes from an ``airflow_local_settings`` module (``$AIRFLOW_HOME/config/airflow_local_settings.py``):

    from verl_pipeline.airflow.policy import task_instance_mutation_hook  # noqa: F401

``docker/airflow_local_settings.py`` is that file for the project's image. A pool the cluster profile
names is created on first use with ``cluster.expected_gpus`` slots, counting deferred tasks; an
existing pool is never changed (an administrator may have sized it), only warned about.

The hook runs inside the scheduler for every task instance of every DAG: it never raises, and it
acts only on the pipeline's wait task.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_pipeline.admission import Admission

# Airflow imports airflow_local_settings while it initialises itself: this module imports nothing
# of Airflow (or of the pipeline) at the top.
log = logging.getLogger(__name__)


def run_params(task: Any, dag_run: Any) -> dict[str, Any]:
    """The params a run's tasks see: the DAG's defaults, overridden by the run's ``conf``."""
    params = task.params.dump() if getattr(task, "params", None) is not None else {}
    params.update(dict(getattr(dag_run, "conf", None) or {}))
    return params


def admission_for(task_instance: Any, dag_run: Any) -> Admission | None:
    """The admission of the run ``dag_run`` when ``task_instance`` is its wait task (None otherwise).

    Raises what building the run's spec raises (a run with invalid params fails in its provision task)."""
    from verl_pipeline.profiles import build_run_spec

    params = run_params(task_instance.task, dag_run)
    spec = build_run_spec(params, run_name=f"{dag_run.dag_id}/{dag_run.run_id}")
    return spec.admission


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    """Airflow's per-task-instance policy: put a pooled run's wait task in its cluster's pool."""
    from verl_pipeline.airflow.operators import WaitForVerlJobOperator
    from verl_pipeline.airflow.task_ids import WAIT_TASK

    # TaskInstance.operator is the class name of the task's operator.
    if getattr(task_instance, "task_id", None) != WAIT_TASK or \
            getattr(task_instance, "operator", None) != WaitForVerlJobOperator.__name__:
        return
    if dag_run is None or getattr(task_instance, "task", None) is None:
        return  # the run (its conf) or the DAG (its params) is not known on this call: Airflow calls again
    try:
        admission = admission_for(task_instance, dag_run)
    except Exception as e:
        log.info("Run %s: no pool for %s (%s: %s)", getattr(dag_run, "run_id", "?"), WAIT_TASK, type(e).__name__, e)
        return
    if admission is None:
        return
    try:
        ensure_pool(admission, _session_of(dag_run))
    except Exception:
        log.exception("Could not check or create Airflow pool %r", admission.pool)
    task_instance.pool = admission.pool
    task_instance.pool_slots = admission.slots
    log.info("Run %s: %s takes %s", dag_run.run_id, WAIT_TASK, admission.describe())


def _session_of(obj: Any) -> Any:
    from sqlalchemy.orm import object_session

    try:
        return object_session(obj)
    except Exception:
        return None


def ensure_pool(admission: Admission, session: Any = None) -> None:
    """Create the admission's pool when it does not exist (``size`` slots, deferred tasks counted),
    in ``session`` (the run's, so it commits with the run) or a session of its own; warn about an
    existing pool that would not admit runs one at a time."""
    from airflow.models.pool import Pool
    from sqlalchemy import select
    from sqlalchemy.exc import IntegrityError

    if session is None:
        from airflow.utils.session import create_session

        with create_session() as own:
            ensure_pool(admission, own)
        return
    pool = session.scalar(select(Pool).where(Pool.pool == admission.pool))
    if pool is None:
        try:
            with session.begin_nested():  # a concurrent creator wins; this run's transaction goes on
                session.add(Pool(pool=admission.pool, slots=admission.size, include_deferred=True,
                                 description=f"GPUs of a shared Ray cluster (verl-pipeline, {admission.size} GPUs): "
                                             "a run takes one slot per GPU it needs"))
            log.info("Created Airflow pool %r with %d slots (deferred tasks counted)", admission.pool, admission.size)
        except IntegrityError:
            pass
        return
    if not pool.include_deferred:
        log.warning("Airflow pool %r does not count deferred tasks: runs on its cluster can overlap while they "
                    "wait (fix: airflow pools set %s %d '...' --include-deferred)", pool.pool, pool.pool, pool.slots)
    if pool.slots < admission.slots:
        log.warning("Airflow pool %r has %d slots and a run needs %d: it will wait until the pool is resized",
                    pool.pool, pool.slots, admission.slots)
