"""Scheduled retraining: one DAG per profile that asks for it, built by :func:`build_retrain_dag`.

A profile opts in with a ``retrain`` section::

    retrain:
      schedule: "0 3 * * 1"     # cron (UTC): weekly, Monday 03:00
      on_data_update: true      # also run when the profile's preprocessed-data Asset is updated
      run_immediately: false    # when a newly unpaused DAG first runs (see below)

When a newly unpaused retraining DAG first runs is Airflow's ``CronTriggerTimetable(run_immediately=…)``
rule, which the profile chooses (:func:`first_run_rule` states it in words, and the DAG's doc shows it):

- ``false`` (Airflow's default): the latest past tick runs at once only when it is at most
  max(10% of the gap between that tick and the next, 5 minutes) old; otherwise the first run is the
  next tick. For a weekly cron that window is 16.8 hours after the tick.
- ``true``: the latest past tick runs at once, whenever the DAG is unpaused.
- a duration (``"6h"``, ``"90m"``, ``"1d12h"``): the latest past tick runs at once when it is at most
  that old; otherwise the first run is the next tick.

The DAG is the ``verl_ppo`` pipeline pinned to that profile plus ``publish_run``, after
``export_model`` and ``evaluate_model``: when the job succeeded and its trained model was exported and
verified, it records the run's manifest; it moves ``latest/<profile>`` to the run and publishes the
model as the profile's trained-model Asset (``promoted: true``) only when the profile's promotion rule
(:mod:`verl_pipeline.promotion`) says the trained model beat the base and the champion on the
evaluation (``evaluation.json``). A run that does not is kept, recorded as not promoted with the
numbers (``promotion.json``). A failed run, or one whose export failed, records a ``failed`` manifest
and leaves ``latest`` alone.
Runs of one profile never overlap (``max_active_runs=1``) and missed intervals are not caught up.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from verl_pipeline.airflow.operators import spec_from_context
from verl_pipeline.airflow.operators.export import run_skip_reason
from verl_pipeline.airflow.operators.wait_result import succeeded
from verl_pipeline.airflow.task_ids import EXPORT_TASK, PREFETCH_TASK, PREPROCESS_TASK, SUBMIT_TASK, WAIT_TASK
from verl_pipeline.durations import format_duration, parse_duration
from verl_pipeline.exceptions import ConfigError, PipelineError
from verl_pipeline.paths import slug
from verl_pipeline.profiles import PROMOTE_ANYWAY_PARAM, list_profiles, load_yaml_profile

PUBLISH_TASK = "publish_run"
DAG_ID_PREFIX = "verl_retrain__"
_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@yearly")
_RETRAIN_KEYS = ("schedule", "on_data_update", "run_immediately")

# Airflow's CronTriggerTimetable takes True, False or a timedelta.
RunImmediately = bool | timedelta


@dataclass(frozen=True)
class RetrainSchedule:
    profile: str
    cron: str
    on_data_update: bool = True
    run_immediately: RunImmediately = False

    @property
    def dag_id(self) -> str:
        return f"{DAG_ID_PREFIX}{slug(self.profile, 80).replace('-', '_')}"


def _check_cron(profile: str, cron: Any) -> str:
    from croniter import croniter

    key = f"profiles/{profile}.retrain.schedule"
    if not isinstance(cron, str) or not cron.strip():
        raise ConfigError(key, cron, "must be a cron expression", 'schedule: "0 3 * * 1" (weekly)')
    cron = cron.strip()
    if cron.startswith("@"):
        if cron not in _PRESETS:
            raise ConfigError(key, cron, "unknown cron preset", f"one of {list(_PRESETS)} or a 5-field cron")
    elif len(cron.split()) != 5 or not croniter.is_valid(cron):
        raise ConfigError(key, cron, "is not a valid 5-field cron expression", 'schedule: "0 3 * * 1"')
    return cron


def _check_run_immediately(profile: str, value: Any) -> RunImmediately:
    key = f"profiles/{profile}.retrain.run_immediately"
    fix = 'run_immediately: true, false or a duration such as "6h", "90m" or "1d12h"'
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ConfigError(key, value, "must be true, false or a duration string", fix)
    seconds = parse_duration(value)
    if seconds is None:
        raise ConfigError(key, value, "is not a duration (a number with d, h, m or s, e.g. 6h)", fix)
    if seconds <= 0:
        raise ConfigError(key, value, "must be longer than zero", fix)
    return timedelta(seconds=seconds)


def first_run_rule(sched: RetrainSchedule) -> str:
    """When a newly unpaused retraining DAG of this schedule first runs, in words."""
    ri = sched.run_immediately
    if ri is True:
        return "its latest past cron tick runs at once"
    window = (f"{format_duration(ri.total_seconds())} (retrain.run_immediately)" if isinstance(ri, timedelta)
              else "max(10% of the gap between that tick and the next, 5 min)")
    return (f"its latest past cron tick runs at once only when it is at most {window} old; "
            "otherwise the first run is the next tick")


def retrain_timetable(sched: RetrainSchedule) -> Any:
    """The cron half of the schedule: Airflow's CronTriggerTimetable in UTC with the profile's first-run rule."""
    from airflow.sdk import CronTriggerTimetable

    return CronTriggerTimetable(sched.cron, timezone="UTC", run_immediately=sched.run_immediately)


def retrain_schedule(profile: str) -> RetrainSchedule | None:
    """The profile's ``retrain`` section, validated; None when the profile does not ask for retraining."""
    section = load_yaml_profile("profiles", profile).get("retrain")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"profiles/{profile}.retrain", section, "must be a mapping",
                          'retrain: {schedule: "0 3 * * 1", on_data_update: true}')
    unknown = sorted(set(section) - set(_RETRAIN_KEYS))
    if unknown:
        raise ConfigError(f"profiles/{profile}.retrain.{unknown[0]}", section[unknown[0]], "unknown key",
                          f"use {', '.join(_RETRAIN_KEYS)}")
    on_data = section.get("on_data_update", True)
    if not isinstance(on_data, bool):
        raise ConfigError(f"profiles/{profile}.retrain.on_data_update", on_data, "must be true or false",
                          "on_data_update: true")
    return RetrainSchedule(profile, _check_cron(profile, section.get("schedule")), on_data,
                           _check_run_immediately(profile, section.get("run_immediately", False)))


def retrain_schedules() -> list[RetrainSchedule]:
    """Every profile's retraining schedule (profiles without a ``retrain`` section are skipped)."""
    out = []
    for name in list_profiles():
        sched = retrain_schedule(name)
        if sched is not None:
            out.append(sched)
    return out


def promotion_blocker(waited: Any, exported: Any, export_skipped: str | None) -> str | None:
    """Why ``latest/<profile>`` must not move to this run; None when it may.

    It moves only to a run whose job succeeded and, unless the export had nothing to do
    (``export_skipped``: :func:`~verl_pipeline.airflow.operators.export.run_skip_reason`, e.g. a
    preflight run), whose model was exported and verified (the export's manifest names its ``model_dir``).
    """
    if not succeeded(waited):
        return "its job did not succeed"
    if export_skipped is None and not (isinstance(exported, dict) and exported.get("model_dir")):
        return f"its trained model was not exported and verified (task {EXPORT_TASK})"
    return None


def promotion_verdict(spec: Any, *, export_skipped: str | None, force: bool) -> Any:
    """The promotion rule's verdict on a run whose job succeeded (:func:`verl_pipeline.promotion.decide`
    with the run's ``evaluation.json`` and the profile's champion); None when there is no model to judge
    (``export_skipped``: a preflight run, ``export: false``) — ``latest`` then moves as for any good run."""
    from verl_pipeline import runs
    from verl_pipeline.promotion import Verdict, VerdictKind, decide
    from verl_pipeline.rundir import RunDir
    from verl_pipeline.scores import read_evaluation

    if export_skipped is not None:
        return None
    champion = runs.latest_run(spec.storage_root, spec.profile)
    champion_run = str(champion) if champion is not None and RunDir(champion).model_dir.is_dir() else None
    if not spec.evaluation.enabled:
        return Verdict(True, VerdictKind.UNCHECKED, "the run profile says evaluation: {enabled: false}",
                       spec.promotion.metric.value, {}, spec.promotion.to_dict(), force, champion_run)
    evaluation, error = read_evaluation(RunDir(spec.run_dir))
    return decide(spec.promotion, evaluation, champion_run=champion_run, evaluation_error=error, force=force)


class PublishRunOperator(BaseOperator):
    """Record the run's manifest; move ``latest/<profile>`` to it when :func:`promotion_blocker` allows
    and the promotion rule (:func:`promotion_verdict`) promotes it, and then publish its model as the
    profile's trained-model Asset (``promoted: true``). Runs whatever happened."""

    ui_color = "#d5f5e3"

    def __init__(self, **kwargs: Any) -> None:
        from verl_pipeline.airflow.assets import trained_model_alias

        kwargs.setdefault("outlets", [trained_model_alias()])
        super().__init__(**kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import runs

        ti = context["ti"]
        try:
            spec = spec_from_context(context)
        except PipelineError as e:
            # Nothing ran (provision refused the run's params/profiles): no run directory to record.
            raise AirflowFailException(f"run not published, it has no frozen spec (its provision failed): {e}") from e
        skipped = run_skip_reason(spec, ti.xcom_pull(task_ids=SUBMIT_TASK))
        exported = ti.xcom_pull(task_ids=EXPORT_TASK)
        blocker = promotion_blocker(ti.xcom_pull(task_ids=WAIT_TASK), exported, skipped)
        verdict = None
        if blocker is None:
            force = bool((context.get("params") or {}).get(PROMOTE_ANYWAY_PARAM))
            verdict = promotion_verdict(spec, export_skipped=skipped, force=force)
        manifest = self._record(context, spec, ok=blocker is None, verdict=verdict)
        if blocker is not None:
            kept = runs.latest_run(spec.storage_root, spec.profile)
            raise AirflowFailException(f"run {spec.run_key} is not published ({blocker}): latest/{spec.profile} "
                                       f"stays at {kept}")
        out = {"run_dir": str(spec.run_dir), "manifest": manifest.to_dict(),
               "latest": str(runs.latest_link(spec.storage_root, spec.profile)),
               "promoted": verdict is None or verdict.promoted,
               "verdict": verdict.to_dict() if verdict is not None else None}
        if verdict is not None and not verdict.promoted:
            kept = runs.latest_run(spec.storage_root, spec.profile)
            self.log.warning("Run %s %s; latest/%s stays at %s", spec.run_key, verdict.line(), spec.profile, kept)
            return {**out, "previous": str(kept) if kept else None,
                    "registry": self._registry(spec, exported, promoted=False)}
        previous = runs.promote(spec.storage_root, spec.profile, spec.run_dir)
        self.log.info("Run %s %s; latest/%s -> %s (previous good run kept: %s)", spec.run_key,
                      verdict.line() if verdict else "published (no model to evaluate)", spec.profile,
                      spec.run_dir, previous)
        if isinstance(exported, dict) and exported.get("model_dir"):
            self._publish_model(context, spec.profile, exported, verdict)
        return {**out, "previous": str(previous) if previous else None,
                "registry": self._registry(spec, exported, promoted=True)}

    @staticmethod
    def _record(context: Any, spec: Any, *, ok: bool, verdict: Any) -> Any:
        from verl_pipeline import runs
        from verl_pipeline.models.prefetch import models_by_role
        from verl_pipeline.rundir import RunDir

        ti = context["ti"]
        if verdict is not None:
            RunDir(spec.run_dir).save_promotion(verdict.to_dict())
        return runs.record_run(
            run_dir=spec.run_dir, run_key=spec.run_key, run_name=spec.run_name, profile=spec.profile,
            status=runs.RunStatus.SUCCEEDED if ok else runs.RunStatus.FAILED,
            checkpoint_dir=spec.checkpoint_dir,
            data=ti.xcom_pull(task_ids=PREPROCESS_TASK), models=models_by_role(ti.xcom_pull(task_ids=PREFETCH_TASK)),
            submit=ti.xcom_pull(task_ids=SUBMIT_TASK),
            promotion=verdict.to_dict() if verdict is not None else None,
        )

    def _registry(self, spec: Any, exported: Any, *, promoted: bool) -> dict[str, Any] | None:
        """With a model registry in the profile (``trackers: {mlflow: {registry: ...}}``): the exported model as a new
        version (alias ``challenger``), and ``champion`` moved to it when the run was promoted."""
        from verl_pipeline.airflow.tracker_connections import run_registry_env

        env = run_registry_env(spec)
        has_model = isinstance(exported, dict) and bool(exported.get("model_dir"))
        if env is None or spec.trackers.registry is None or not has_model:
            return None
        from pathlib import Path

        from verl_pipeline import registry
        from verl_pipeline.rundir import RunDir
        from verl_pipeline.scores import read_evaluation
        from verl_pipeline.trainer.render import tracker_names

        uri = env.values["MLFLOW_TRACKING_URI"]
        login = {"username": env.values.get("MLFLOW_TRACKING_USERNAME"),
                 "password": env.values.get("MLFLOW_TRACKING_PASSWORD")}
        try:
            mv = registry.register(uri, name=spec.trackers.registry.model_name, model_dir=Path(exported["model_dir"]),
                                   run_key=spec.run_key, experiment=tracker_names(spec)[0],
                                   evaluation=read_evaluation(RunDir(spec.run_dir))[0],
                                   data_hash=exported.get("data_hash"), links={"run_dir": str(spec.run_dir)}, **login)
            if promoted:
                mv = registry.promote(uri, name=mv.name, version=mv.version, **login)
        except PipelineError as e:
            raise AirflowFailException(f"run {spec.run_key}: {e}") from e
        self.log.info("Run %s: registered as %s version %d (aliases %s)", spec.run_key, mv.name, mv.version,
                      list(mv.aliases))
        return {"name": mv.name, "version": mv.version, "aliases": list(mv.aliases)}

    @staticmethod
    def _publish_model(context: Any, profile: str, exported: dict[str, Any], verdict: Any) -> None:
        """The trained-model Asset event of a promoted run (a serving DAG scheduled on it deploys champions)."""
        events = context.get("outlet_events")
        if events is None:
            return
        from verl_pipeline.airflow.assets import model_event_extra, trained_model_alias, trained_model_asset

        extra = {**model_event_extra(exported), "promoted": True,
                 "promotion": verdict.line() if verdict is not None else None}
        events[trained_model_alias()].add(trained_model_asset(profile), extra=extra)


def build_retrain_dag(sched: RetrainSchedule) -> Any:
    """The retraining DAG of one profile (cron, or cron OR data update when ``on_data_update``)."""
    from airflow.sdk import DAG, AssetOrTimeSchedule, Param, TriggerRule

    from verl_pipeline.airflow.assets import preprocessed_data_asset
    from verl_pipeline.airflow.operators import cleanup_failed_run
    from verl_pipeline.airflow.params import build_params, default_args
    from verl_pipeline.airflow.pipeline import wire_pipeline

    timetable = retrain_timetable(sched)
    schedule: Any = (AssetOrTimeSchedule(timetable=timetable, assets=[preprocessed_data_asset(sched.profile)])
                     if sched.on_data_update else timetable)
    params = build_params()
    params["profile"] = Param(sched.profile, type="string", enum=[sched.profile],
                              description="This retraining DAG's profile (fixed).")
    params[PROMOTE_ANYWAY_PARAM] = Param(False, type="boolean",
                                         description="Promote this run whatever its evaluation says (recorded as a "
                                                     "manual override in promotion.json and the report).")
    doc = (f"### Scheduled retraining of `{sched.profile}`\n\nRuns on `{sched.cron}` (UTC)"
           + (f" and whenever the asset `{preprocessed_data_asset(sched.profile).uri}` is updated" if
              sched.on_data_update else "")
           + f".\n\nWhen this DAG is unpaused, {first_run_rule(sched)}"
           + ". Each run writes its own versioned run directory; `latest/" + sched.profile
           + "` moves to a run only when it succeeded and its trained model beat the base and the champion "
             "(the profile's `promotion:` rule).")
    with DAG(
        dag_id=sched.dag_id,
        description=f"Scheduled verl retraining of profile {sched.profile}",
        doc_md=doc,
        schedule=schedule,
        catchup=False,
        max_active_runs=1,
        tags=["verl", "ray", "rl", "retrain"],
        params=params,
        default_args=default_args(),
        # A run marked failed by hand or timed out skips its teardown task: clean up here.
        on_failure_callback=cleanup_failed_run,
    ) as dag:
        # No outlet on preprocess: this DAG consumes the preprocessed-data Asset, it must not re-trigger itself.
        publish = PublishRunOperator(task_id=PUBLISH_TASK, trigger_rule=TriggerRule.ALL_DONE, retries=1,
                                     retry_delay=timedelta(seconds=5))
        wire_pipeline(emit_asset=False, after_wait=[publish], export_publishes=False)
    return dag
