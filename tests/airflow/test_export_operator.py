"""ExportModelOperator: skipped with a reason when nothing trained; else exports and emits the model Asset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from airflow.sdk.execution_time.context import OutletEventAccessors

from verl_pipeline.airflow.assets import TRAINED_MODEL_ALIAS, trained_model_alias, trained_model_uri
from verl_pipeline.airflow.operators import EXPORT_TASK, ExportModelOperator
from verl_pipeline.config import build_run_spec
from verl_pipeline.models.export import EXPORT_MANIFEST, ExportManifest


class _TI:
    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)


class _Dag:
    dag_id = "verl_ppo"


def _ctx(run_id: str, mode: str, events: OutletEventAccessors) -> dict[str, Any]:
    xcoms = {"submit_verl_job": {"submission_id": f"job-{run_id}", "mode": mode},
             "preprocess_data": {"key": "datahash"},
             "prefetch_model": {"actor": {"source": "builtin:tiny-qwen2", "revision": "tiny-qwen2-v2"}}}
    return {"ti": _TI(xcoms), "params": {"profile": "smoke"}, "run_id": run_id, "dag": _Dag(),
            "outlet_events": events}


def test_outlet_is_the_trained_model_alias() -> None:
    op = ExportModelOperator(task_id=EXPORT_TASK)
    assert [o.name for o in op.outlets] == [TRAINED_MODEL_ALIAS]
    # The profile is slugged, as in the preprocessed-data Asset's URI.
    assert trained_model_uri("gsm8k-qwen2.5-0.5b-ppo") == "verl-pipeline://models/gsm8k-qwen2-5-0-5b-ppo"


def test_preflight_run_is_skipped_with_the_reason() -> None:
    events = OutletEventAccessors()
    with pytest.raises(AirflowSkipException, match="ran in preflight mode and trained no step"):
        ExportModelOperator(task_id=EXPORT_TASK).execute(_ctx("pre-1", "preflight", events))
    assert events[trained_model_alias()].asset_alias_events == []


def test_trained_run_publishes_its_exported_model_on_the_profile_asset(
    fsdp_checkpoint: Path, tiny_model_path: Path,
) -> None:
    spec = build_run_spec({"profile": "smoke"}, run_name="verl_ppo/export-op-1")
    shutil.copytree(fsdp_checkpoint / "checkpoints", spec.checkpoint_dir)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    # An actor-only run (GRPO: no critic), so global_step_2 is complete as verl wrote it.
    (spec.run_dir / "job.json").write_text(json.dumps({"settings": {"algorithm.adv_estimator": "grpo"}}))
    # This checkpoint's export is already there (verl's merger itself runs in tests/models/test_export.py):
    # a retried task keeps it and still publishes.
    shutil.copytree(tiny_model_path, spec.run_dir / "model")
    done = ExportManifest(run_key=spec.run_key, run_name=spec.run_name, profile="smoke", step=2,
                          checkpoint=str(spec.checkpoint_dir / "global_step_2"), world_size=2,
                          model_dir=str(spec.run_dir / "model"), data_hash="datahash", base_model_source=None,
                          base_model_revision=None, final_reward=0.5, files={})
    (spec.run_dir / EXPORT_MANIFEST).write_text(json.dumps(done.to_dict()))
    events = OutletEventAccessors()
    result = ExportModelOperator(task_id=EXPORT_TASK).execute(_ctx("export-op-1", "train", events))
    assert result["step"] == 2 and result["model_dir"] == str(spec.run_dir / "model")
    (event,) = events[trained_model_alias()].asset_alias_events
    assert event.dest_asset_key.uri == "verl-pipeline://models/smoke"
    assert event.extra["model_dir"] == result["model_dir"] and event.extra["final_reward"] == 0.5
