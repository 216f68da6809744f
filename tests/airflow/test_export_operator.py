"""ExportModelOperator: skipped with a reason when nothing trained; else exports and emits the model Asset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from airflow.sdk.execution_time.context import OutletEventAccessors

from tests.airflow.context import FakeDag, FakeTI, provisioned
from verl_pipeline.airflow.assets import TRAINED_MODEL_ALIAS, trained_model_alias, trained_model_uri
from verl_pipeline.airflow.operators import ExportModelOperator
from verl_pipeline.airflow.operators.export import skip_reason
from verl_pipeline.airflow.task_ids import EXPORT_TASK
from verl_pipeline.models.export import ExportManifest
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir


def _ctx(run_id: str, mode: str, events: OutletEventAccessors) -> dict[str, Any]:
    xcoms = {"submit_verl_job": {"submission_id": f"job-{run_id}", "mode": mode},
             "preprocess_data": {"key": "datahash"},
             "prefetch_model": {"actor": {"source": "builtin:tiny-qwen2", "revision": "tiny-qwen2-v2"}}}
    ctx = {"ti": FakeTI(xcoms), "params": {"profile": "smoke"}, "run_id": run_id, "dag": FakeDag(),
           "outlet_events": events}
    provisioned(ctx)
    return ctx


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


@pytest.mark.parametrize(("submitted", "kwargs", "reason"), [
    (None, {}, "no job was submitted"),
    ({"mode": "preflight"}, {}, "ran in preflight mode"),
    ({"mode": "train"}, {"export": False}, "export: false"),
    ({"mode": "train"}, {"strategy": "megatron"}, "only FSDP checkpoints are exported"),
    ({"mode": "train"}, {"strategy": "fsdp2"}, None),
])
def test_skip_reason_case_by_case(submitted: dict[str, Any] | None, kwargs: dict[str, Any], reason: str | None) -> None:
    got = skip_reason(submitted, **kwargs)
    assert got == reason if reason is None else reason in str(got)


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
    RunDir(spec.run_dir).model_manifest_file.write_text(json.dumps(done.to_dict()))
    events = OutletEventAccessors()
    result = ExportModelOperator(task_id=EXPORT_TASK).execute(_ctx("export-op-1", "train", events))
    assert result["step"] == 2 and result["model_dir"] == str(spec.run_dir / "model")
    (event,) = events[trained_model_alias()].asset_alias_events
    assert event.dest_asset_key.uri == "verl-pipeline://models/smoke"
    assert event.extra["model_dir"] == result["model_dir"] and event.extra["final_reward"] == 0.5


def test_the_profile_switch_is_checked_before_any_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from verl_pipeline.exceptions import ConfigError
    from verl_pipeline.paths import configs_dir

    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    prof = yaml.safe_load((cfg / "profiles" / "smoke.yaml").read_text())
    (cfg / "profiles" / "no-export.yaml").write_text(yaml.safe_dump({**prof, "export": False}))
    (cfg / "profiles" / "bad-export.yaml").write_text(yaml.safe_dump({**prof, "export": "no"}))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    assert build_run_spec({"profile": "smoke"}, run_name="d/r").export_model is True
    assert build_run_spec({"profile": "no-export"}, run_name="d/r").export_model is False
    with pytest.raises(ConfigError, match=r"^profiles/bad-export.export='no': must be true or false"):
        build_run_spec({"profile": "bad-export"}, run_name="d/r")
