"""``verl_ppo`` and the data-triggered retraining DAG under a real scheduler on PostgreSQL.

Triggered through the REST API v2 like the UI's trigger form does (``conf`` + ``logical_date: null``);
the wait task defers to the real triggerer process; the runs use the embedded local Ray cluster in
preflight mode.
"""

from __future__ import annotations

import itertools
import json
import pprint
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ray_processes
from tests.integration import secret_canary
from tests.integration.airflow_stack import AirflowStack
from verl_pipeline import runs
from verl_pipeline.airflow.assets import preprocessed_data_uri

# Above the sum of the waits below (each has its own deadline and message); pytest-timeout also counts
# the session's Airflow stack start when this module runs first.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

DAG = "verl_ppo"
RETRAIN = "verl_retrain__smoke"
TASKS = ["provision_ray_cluster", "preprocess_data", "plan_models", "prefetch_model", "submit_verl_job",
         "wait_for_verl_job", "teardown_ray_cluster", "report_run"]


def _xcom(api: httpx.Client, dag_id: str, run_id: str, task_id: str) -> Any:
    r = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")
    assert r.status_code == 200, r.text
    return r.json()["value"]


def _task_states(api: httpx.Client, dag_id: str, run_id: str) -> dict[str, Any]:
    tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    return {ti["task_id"]: ti["state"] for ti in tis}


def _errors_logged(stack: AirflowStack, dag_id: str, run_id: str, limit: int = 12000) -> str:
    """The errors and warnings every task try (and its trigger) of the run logged, from the stack's
    own log files: the exception that failed a task, and what the pipeline warned before."""
    run_logs = stack.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
    out: list[str] = []
    for path in sorted(run_logs.rglob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or rec.get("level") not in ("error", "warning", "critical"):
                continue
            if rec.get("logger") == "task.stderr":
                continue  # Ray's INFO lines on stderr
            detail = " | ".join(f"{d.get('exc_type')}: {d.get('exc_value')}"
                                for d in rec.get("error_detail") or [] if isinstance(d, dict))
            line = f"{path.relative_to(run_logs)}: {rec.get('event')}"[:1500]
            out.append(line + (f" [{detail[:2500]}]" if detail else ""))
    text = "\n".join(out)
    return text[-limit:] if text else f"(no errors logged under {run_logs})"


def _why(stack: AirflowStack, api: httpx.Client, dag_id: str, run_id: str) -> str:
    """Why a run is not what the test expects, for an assertion message (as text: pytest shortens a
    dict's repr there to one line, which hid the failed task in a red CI)."""
    return (f"run {run_id} of {dag_id}: {pprint.pformat(_task_states(api, dag_id, run_id), width=120)}\n"
            f"errors logged:\n{_errors_logged(stack, dag_id, run_id)}")


@pytest.fixture(scope="module")
def api(airflow_stack: AirflowStack) -> httpx.Client:
    client = airflow_stack.client()
    airflow_stack.wait_for_dag(client, DAG)
    airflow_stack.wait_for_dag(client, RETRAIN)
    return client


@pytest.fixture(scope="module")
def started(airflow_stack: AirflowStack, api: httpx.Client, canaries: dict[str, str]) -> Iterator[dict[str, str]]:
    """Unpause both DAGs, trigger ``verl_ppo`` with a conf, and update the smoke profile's data Asset.

    The retraining DAG goes first. The smoke profile sets ``retrain.run_immediately: true``, so
    unpausing runs the cron's latest past tick at once whatever the day and hour (with Airflow's
    default it would only within 16.8 h of Monday 03:00 UTC). That run finishes before any data
    update, so each update is queued on its own and not held behind it (two updates queued behind one
    active run become one run that lists only the first). A cron tick that falls due during the
    module adds a scheduled run; the tests allow it. Both DAGs are paused again at the end. The secret
    canaries are in the stack's connections before the first run."""
    from verl_pipeline.airflow.retrain import retrain_schedule

    assert retrain_schedule("smoke").run_immediately is True  # type: ignore[union-attr]
    r = api.patch(f"/api/v2/dags/{RETRAIN}", json={"is_paused": False})
    assert r.status_code == 200 and r.json()["is_paused"] is False, r.text
    deadline = time.monotonic() + 120
    while not (runs := api.get(f"/api/v2/dags/{RETRAIN}/dagRuns").json()["dag_runs"]):
        assert time.monotonic() < deadline, "the retraining DAG's latest cron tick did not start a run"
        time.sleep(1)
    assert [r["run_type"] for r in runs] == ["scheduled"], runs
    cron_run = airflow_stack.wait_for_run(api, RETRAIN, runs[0]["dag_run_id"], timeout_s=600)
    assert cron_run["state"] == "success", _why(airflow_stack, api, RETRAIN, runs[0]["dag_run_id"])
    r = api.patch(f"/api/v2/dags/{DAG}", json={"is_paused": False})
    assert r.status_code == 200 and r.json()["is_paused"] is False, r.text
    r = api.post(f"/api/v2/dags/{DAG}/dagRuns",
                 json={"logical_date": None, "conf": {"total_training_steps": 3, "mode": "preflight"}})
    assert r.status_code == 200, r.text
    ppo_run = r.json()["dag_run_id"]
    # A second experiment at once (max_active_runs > 1): it must not queue behind the first.
    r = api.post(f"/api/v2/dags/{DAG}/dagRuns",
                 json={"logical_date": None, "conf": {"total_training_steps": 2, "mode": "preflight"}})
    assert r.status_code == 200, r.text
    second_run = r.json()["dag_run_id"]
    # An upstream DAG's outlet does the same: an event on the profile's preprocessed-data Asset.
    assets = api.get("/api/v2/assets", params={"uri_pattern": "preprocessed-data/smoke"}).json()["assets"]
    asset = next(a for a in assets if a["uri"] == preprocessed_data_uri("smoke"))
    assert {d["dag_id"] for d in asset["scheduled_dags"]} == {RETRAIN}
    r = api.post("/api/v2/assets/events", json={"asset_id": asset["id"], "extra": {"source": "test_scheduler"}})
    assert r.status_code == 200, r.text
    yield {"ppo": ppo_run, "second": second_run}
    for dag_id in (RETRAIN, DAG):
        api.patch(f"/api/v2/dags/{dag_id}", json={"is_paused": True})


def test_invalid_params_are_rejected_by_the_api(api: httpx.Client) -> None:
    before = api.get(f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"]
    for conf, key in (({"nnodes": 0}, "nnodes"), ({"mode": "fast"}, "mode"), ({"profile": "nope"}, "profile"),
                      ({"total_training_steps": "many"}, "total_training_steps")):
        r = api.post(f"/api/v2/dags/{DAG}/dagRuns", json={"logical_date": None, "conf": conf})
        assert r.status_code == 400, (conf, r.status_code, r.text)
        assert key in r.json()["detail"], r.text
    assert api.get(f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"] == before


def test_verl_ppo_succeeds_under_the_real_scheduler_and_triggerer(
    airflow_stack: AirflowStack, api: httpx.Client, started: dict[str, str]
) -> None:
    run_id = started["ppo"]
    seen_wait: set[str] = set()
    trigger_classpaths: set[str] = set()
    deadline = time.monotonic() + 600
    while True:
        ti = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/wait_for_verl_job").json()
        seen_wait.add(str(ti.get("state")))
        if ti.get("state") == "deferred" and ti.get("trigger"):
            trigger_classpaths.add(ti["trigger"]["classpath"])
            assert ti.get("triggerer_job") is None or ti["triggerer_job"]["job_type"] == "TriggererJob"
        run = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}").json()
        if run["state"] in ("success", "failed"):
            break
        assert time.monotonic() < deadline, f"run still {run['state']}: {_why(airflow_stack, api, DAG, run_id)}"
        time.sleep(1)
    states = _task_states(api, DAG, run_id)
    assert run["state"] == "success", _why(airflow_stack, api, DAG, run_id)
    # Nothing trained in preflight: no model to export.
    assert states == {**{t: "success" for t in TASKS}, "export_model": "skipped", "evaluate_model": "skipped"}

    # The wait task handed over to the triggerer process (its classpath imported there) and resumed.
    assert "deferred" in seen_wait, seen_wait
    assert trigger_classpaths == {"verl_pipeline.airflow.triggers.RayJobTrigger"}, trigger_classpaths

    # The params arrived: the conf reached the rendered job, and the mode the job ran in.
    assert run["conf"] == {"total_training_steps": 3, "mode": "preflight"}
    sub = _xcom(api, DAG, run_id, "submit_verl_job")
    waited = _xcom(api, DAG, run_id, "wait_for_verl_job")
    assert sub["mode"] == "preflight" and sub["action"] == "submitted"
    job = json.loads((Path(sub["run_dir"]) / "job.json").read_text())
    assert "trainer.total_training_steps=3" in job["overrides"]
    assert waited["status"] == "SUCCEEDED" and waited["preflight"]["ok"] is True
    assert waited["preflight"]["all_ground_truths_score_1"] is True
    teardown = _xcom(api, DAG, run_id, "teardown_ray_cluster")
    assert teardown, "teardown returned nothing"
    # The run's report, also for a preflight run: no steps, and the checks preflight ran.
    rep = _xcom(api, DAG, run_id, "report_run")
    assert rep["steps_done"] == 0 and Path(rep["html"]).is_file()
    # The run's embedded Ray cluster is gone (agents may outlive the raylet by seconds).
    cluster = _xcom(api, DAG, run_id, "provision_ray_cluster")
    deadline = time.monotonic() + 30
    while ray_processes(cluster["extra"]["temp_dir"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert ray_processes(cluster["extra"]["temp_dir"]) == []


def test_data_update_triggers_retraining_which_publishes_latest(
    airflow_stack: AirflowStack, api: httpx.Client, started: dict[str, str]
) -> None:
    """Two producers update the smoke profile's data Asset: the test's own API event, and verl_ppo's
    preprocess task (its AssetAlias outlet). Each is consumed by a retraining run (one run may
    consume both when they arrive together); every retraining run succeeds."""
    airflow_stack.wait_for_run(api, DAG, started["ppo"], timeout_s=600)
    deadline = time.monotonic() + 600
    while True:
        retrain_runs = api.get(f"/api/v2/dags/{RETRAIN}/dagRuns").json()["dag_runs"]
        sources: list[dict[str, Any]] = []
        for r in retrain_runs:
            events = api.get(f"/api/v2/dags/{RETRAIN}/dagRuns/{r['dag_run_id']}/upstreamAssetEvents").json()
            sources += [e.get("extra") or {} for e in events.get("asset_events", [])]
        from_test = any(e.get("source") == "test_scheduler" for e in sources)
        from_ppo = any("train_path" in e for e in sources)
        if from_test and from_ppo:
            break
        assert time.monotonic() < deadline, f"retraining runs {retrain_runs} consumed events {sources}"
        time.sleep(2)
    # The cron's run (see `started`) and one asset-triggered run per update (or one for both).
    assert any(r["run_type"] == "asset_triggered" and r["triggered_by"] == "asset" for r in retrain_runs)
    assert all(r["run_type"] in ("asset_triggered", "scheduled") for r in retrain_runs), retrain_runs
    finished = [airflow_stack.wait_for_run(api, RETRAIN, r["dag_run_id"], timeout_s=600) for r in retrain_runs]
    for r in finished:
        assert r["state"] == "success", _why(airflow_stack, api, RETRAIN, r["dag_run_id"])
    ordered = sorted(finished, key=lambda r: r["queued_at"])
    storage = Path(airflow_stack.env()["VERL_PIPELINE_HOME"])
    published = [_xcom(api, RETRAIN, r["dag_run_id"], "publish_run") for r in ordered]
    for pub in published:
        run_dir = Path(pub["run_dir"])
        manifest = runs.read_manifest(run_dir)
        assert manifest.status is runs.RunStatus.SUCCEEDED and manifest.profile == "smoke"
        assert manifest.mode == "preflight" and manifest.data_hash and manifest.model_source == "builtin:tiny-qwen2"
        assert (run_dir / "run_spec.json").is_file() and (run_dir / "job.json").is_file()
    assert published[0]["previous"] is None
    # `latest` moved to the last good run; an earlier good run is kept, never deleted.
    assert runs.latest_run(storage, "smoke") == Path(published[-1]["run_dir"]).resolve()
    for earlier, later in itertools.pairwise(published):
        assert Path(earlier["run_dir"]).is_dir()
        assert Path(later["previous"]).resolve() == Path(earlier["run_dir"]).resolve()


def test_two_runs_at_once_each_get_their_own_cluster(
    airflow_stack: AirflowStack, api: httpx.Client, started: dict[str, str]
) -> None:
    """Two ``verl_ppo`` runs on the embedded default overlap in time, each with its own Ray cluster,
    ports, run directory and job ids, and both succeed."""
    first, second = (airflow_stack.wait_for_run(api, DAG, started[k], timeout_s=900) for k in ("ppo", "second"))
    for run in (first, second):
        assert run["state"] == "success", _why(airflow_stack, api, DAG, run["dag_run_id"])
    # Overlap: each started before the other ended (with max_active_runs=1 the second would queue).
    assert second["start_date"] < first["end_date"] and first["start_date"] < second["end_date"], (first, second)
    clusters = [_xcom(api, DAG, r["dag_run_id"], "provision_ray_cluster") for r in (first, second)]
    subs = [_xcom(api, DAG, r["dag_run_id"], "submit_verl_job") for r in (first, second)]
    assert clusters[0]["extra"]["temp_dir"] != clusters[1]["extra"]["temp_dir"]
    assert clusters[0]["dashboard_url"] != clusters[1]["dashboard_url"]
    assert not set(clusters[0]["extra"]["ports"].values()) & set(clusters[1]["extra"]["ports"].values())
    assert subs[0]["run_dir"] != subs[1]["run_dir"] and subs[0]["submission_id"] != subs[1]["submission_id"]


def test_no_secret_leaks_anywhere(airflow_stack: AirflowStack, api: httpx.Client, started: dict[str, str],
                                  canaries: dict[str, str]) -> None:
    """Every secret the runs handled — the canaries of the hub token, a Ray token and cluster
    credentials (Airflow connections), and each run's real Ray token — appears in no task or
    triggerer log, no metadata table a run writes (XCom, trigger kwargs …), no file of the run
    directories or of Ray's temp dirs, and not in `verl-pipeline render --json`."""
    keys = ("ppo", "second")
    for k in keys:
        airflow_stack.wait_for_run(api, DAG, started[k], timeout_s=900)
    clusters = [_xcom(api, DAG, started[k], "provision_ray_cluster") for k in keys]
    run_dirs = [Path(_xcom(api, DAG, started[k], "submit_verl_job")["run_dir"]) for k in keys]
    assert all(secret_canary.ray_token(c) for c in clusters), clusters  # the real tokens are searched too
    assert airflow_stack.postgres is not None
    # The scanner sees the database: the canaries are where they were planted.
    assert secret_canary.scan_database(airflow_stack.postgres.url, canaries, tables=["connection"])
    leaks = secret_canary.find_leaks(
        canaries, log_dirs=secret_canary.stack_log_dirs(airflow_stack), run_dirs=run_dirs, clusters=clusters,
        db_url=airflow_stack.postgres.url,
        render_env={**airflow_stack.env(), "HF_TOKEN": canaries["hf_default.password"]})
    assert leaks == [], [str(leak) for leak in leaks]
