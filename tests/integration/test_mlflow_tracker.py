"""A real MLflow tracking server receives the run's metrics, step by step, through verl's own Tracking.

The submit operator itself runs (connection look-up, the run's MLflow run found or created through
MLflow's REST API, the job submitted with the credentials in its runtime_env) on the session's one
local Ray cluster; the stand-in trainer logs through ``verl.utils.tracking.Tracking`` with
``trainer.logger=[console,mlflow,file]``. Then MLflow's client lists every step, and the secret
canaries planted in the connection are in no run file, XCom value or log line.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.airflow.context import FakeDag, FakeTI, provisioned
from tests.integration.secret_canary import find_leaks, scan_text
from verl_pipeline.airflow.operators import SubmitVerlJobOperator
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.paths import configs_dir
from verl_pipeline.trackers import ENV_FILE_VAR, SETUP_HOOK

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = REPO / "tests" / "fakes" / "fake_verl_trainer.py"
STEPS = 3
JOB_S = 180.0


def _configs(tmp_path: Path, home: Path) -> Path:
    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    (cfg / "clusters" / "mlflow-local.yaml").write_text(yaml.safe_dump({
        "cluster": {"backend": "local"}, "hardware": {"gpu_memory_gb": 24},
        "storage": {"root": str(home)}, "runtime": {"ship_package": False, "env": {}}}))
    (cfg / "profiles" / "mlflow-run.yaml").write_text(yaml.safe_dump({
        "model_profile": "tiny-ppo", "cluster_profile": "mlflow-local",
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": STEPS}, "mode": "train",
        "trainer_command": [sys.executable, str(FAKE_TRAINER)],
        "verl": {"trainer": {"logger": ["console", "mlflow"], "save_freq": STEPS, "project_name": "vp-tracker-test"},
                 "+fake": {"step_seconds": 0.1}},
        "trackers": {"mlflow": {"conn_id": "mlflow_test"}}}))
    return cfg


def _wait_succeeded(handle: ClusterHandle, job_id: str) -> None:
    client = handle.client()
    deadline = time.monotonic() + JOB_S
    while True:
        info = client.get_job(job_id)
        assert info is not None
        if info.status.is_terminal():
            tail = client.logs(job_id)[-3000:]
            assert info.status.value == "SUCCEEDED", f"{info.status.value}: {info.message}\n{tail}"
            return
        assert time.monotonic() < deadline, f"job {job_id} still {info.status.value} after {JOB_S}s"
        time.sleep(0.3)


def test_mlflow_lists_every_step_and_the_credentials_leak_nowhere(
    ray_cluster: ClusterHandle, mlflow_server: str, tiny_model_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from mlflow.tracking import MlflowClient

    canaries = {name: f"vpcanary-{name.replace('.', '-')}-{secrets.token_hex(12)}"
                for name in ("mlflow_test.login", "mlflow_test.password")}
    port = int(mlflow_server.rsplit(":", 1)[1])
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_TEST", json.dumps({
        "conn_type": "http", "host": "127.0.0.1", "port": port,
        "login": canaries["mlflow_test.login"], "password": canaries["mlflow_test.password"]}))
    home = tmp_path / "home"
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(_configs(tmp_path, home)))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(home))
    data = home / "data"
    data.mkdir(parents=True)
    for split in ("train", "val"):
        (data / f"{split}.parquet").write_bytes(b"")  # the stand-in reads no data
    ti = FakeTI({"provision_ray_cluster": ray_cluster.to_dict(),
                 "preprocess_data": {"train_path": str(data / "train.parquet"), "val_path": str(data / "val.parquet"),
                                     "counts": {}},
                 "prefetch_model": {"actor": {"path": str(tiny_model_path), "source": "builtin:tiny-qwen2"}}})
    ctx = {"ti": ti, "params": {"profile": "mlflow-run"}, "run_id": f"manual__mlflow_{time.time_ns()}",
           "dag": FakeDag()}
    spec = provisioned(ctx)

    with caplog.at_level(logging.INFO):
        out = SubmitVerlJobOperator(task_id="submit_verl_job").execute(ctx)
        _wait_succeeded(ray_cluster, out["submission_id"])

    # The run's MLflow run was made before the job started; its page is the task's "MLflow run" button.
    url = out["tracker_links"]["MLflow run"]
    assert ti.xcoms["pushed:_link_MlflowRunLink"] == url and url.startswith(f"{mlflow_server}/#/experiments/")
    run_id = url.rsplit("/", 1)[1]
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(run_id)
    assert run.info.run_name == spec.run_key
    assert client.get_experiment(run.info.experiment_id).name == "vp-tracker-test"
    assert run.data.params["trainer/experiment_name"] == spec.run_key  # verl logs the config as params
    # verl's Tracking logged every step to MLflow, and the same numbers to the file the pipeline reads.
    rows = [json.loads(line) for line in (spec.run_dir / "metrics-a1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("critic/score/mean", "perf/throughput", "training/global_step"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == list(range(1, STEPS + 1)), key
        assert [m.value for m in history] == pytest.approx([r["data"][key] for r in rows]), key

    # The connection's values reached the job's worker (verl's Tracking there found the server and the
    # run above through them) by a private file that Ray's setup hook loads, named by path only ...
    jobs = ray_cluster.client()
    info = requests.get(f"{jobs.dashboard_url}/api/jobs/{out['submission_id']}", headers=jobs.headers,
                        timeout=30).json()
    assert info["runtime_env"]["worker_process_setup_hook"] == SETUP_HOOK
    secret_file = Path(info["runtime_env"]["env_vars"][ENV_FILE_VAR])
    assert secret_file.parent == spec.run_dir / "secrets"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
    assert json.loads(secret_file.read_text()) == {
        "MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_RUN_ID": run_id,
        "MLFLOW_TRACKING_USERNAME": canaries["mlflow_test.login"],
        "MLFLOW_TRACKING_PASSWORD": canaries["mlflow_test.password"]}
    # ... and are nowhere else: the Jobs API's job info (runtime_env, entrypoint, metadata) and log, Ray's
    # session files (its runtime_env agent logs every runtime_env), the run files (job.json, run_spec.json,
    # attempts, metrics, checkpoints), XCom, the task log.
    assert scan_text(json.dumps(info) + jobs.logs(out["submission_id"]), canaries, "Jobs API") == []
    assert find_leaks(canaries, run_dirs=[spec.run_dir, spec.checkpoint_dir], clusters=[ray_cluster.to_dict()]) == []
    pushed = {k: v for k, v in ti.xcoms.items() if k.startswith("pushed:")}
    assert scan_text(json.dumps(out) + json.dumps(pushed), canaries, "XCom") == []
    assert "MLFLOW_TRACKING_PASSWORD" in caplog.text  # the submit's log names the variables, not their values
    assert scan_text(caplog.text, canaries, "task log") == []
