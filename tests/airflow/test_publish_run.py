"""PublishRunOperator: records every run's manifest; only a succeeded job (whose trained model was
exported) moves ``latest``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tests.airflow.context import FakeDag, FakeTI, provisioned
from verl_pipeline import runs
from verl_pipeline.airflow.retrain import PublishRunOperator, promotion_blocker
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.promotion import VerdictKind
from verl_pipeline.rundir import RunDir
from verl_pipeline.scores import FAILED_KEY, Engine, Evaluation, ModelScore, Role


@pytest.fixture(autouse=True)
def _own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own storage: ``latest/smoke`` starts empty."""
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))


def _ctx(run_id: str, waited: dict[str, Any] | None, mode: str = "preflight",
         exported: dict[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    xcoms = {
        "preprocess_data": {"key": f"data-{run_id}", "train_path": "/d/t.parquet", "val_path": "/d/v.parquet"},
        "prefetch_model": {"actor": {"source": "builtin:tiny-qwen2", "revision": None, "path": "/m/tiny"}},
        "submit_verl_job": {"submission_id": f"job-{run_id}", "mode": mode},
        "wait_for_verl_job": waited,
        "export_model": exported,
    }
    ctx = {"ti": FakeTI(xcoms), "params": {"profile": "smoke", **params}, "run_id": run_id,
           "dag": FakeDag("verl_retrain__smoke")}
    provisioned(ctx)
    return ctx


def _storage() -> Path:
    return Path(os.environ["VERL_PIPELINE_HOME"]).resolve()


def test_success_promotes_failure_records_and_keeps_latest() -> None:
    op = PublishRunOperator(task_id="publish_run")
    first = op.execute(_ctx("scheduled__pub-1", {"status": "SUCCEEDED", "job_id": "job-1"}))
    spec1 = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-1")
    assert first["run_dir"] == str(spec1.run_dir)
    assert first["manifest"]["data_hash"] == "data-scheduled__pub-1" and first["manifest"]["status"] == "succeeded"
    assert runs.latest_run(_storage(), "smoke") == spec1.run_dir.resolve()

    # The job failed (wait pushed nothing): a failed manifest, the task fails, latest stays put.
    with pytest.raises(AirflowFailException, match="its job did not succeed"):
        op.execute(_ctx("scheduled__pub-2", None))
    spec2 = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-2")
    assert runs.read_manifest(spec2.run_dir).status is runs.RunStatus.FAILED
    assert runs.latest_run(_storage(), "smoke") == spec1.run_dir.resolve()

    third = op.execute(_ctx("scheduled__pub-3", {"status": "SUCCEEDED", "job_id": "job-3"}))
    assert third["previous"] == str(spec1.run_dir.resolve())
    assert RunDir(spec1.run_dir).manifest_file.is_file()  # the previous good run is still there


def test_a_trained_run_moves_latest_only_once_its_model_was_exported() -> None:
    op = PublishRunOperator(task_id="publish_run")
    before = runs.latest_run(_storage(), "smoke")
    # The job trained and succeeded, but export_model failed (it pushed nothing): latest stays.
    with pytest.raises(AirflowFailException, match=r"not exported and verified .task export_model"):
        op.execute(_ctx("scheduled__pub-noexport", {"status": "SUCCEEDED"}, mode="train"))
    spec = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-noexport")
    assert runs.read_manifest(spec.run_dir).status is runs.RunStatus.FAILED
    assert runs.latest_run(_storage(), "smoke") == before
    ctx = _ctx("scheduled__pub-exported", {"status": "SUCCEEDED"}, mode="train",
               exported={"model_dir": "/runs/x/model", "step": 2})
    _evaluated(ctx, trained=0.5, base=0.1)
    done = op.execute(ctx)
    assert done["promoted"] is True
    assert runs.latest_run(_storage(), "smoke") == Path(done["run_dir"]).resolve()


class Events(dict):  # type: ignore[type-arg]
    """Airflow's outlet_events accessor as the publish task uses it: ``events[alias].add(asset, extra=...)``."""

    added: list[tuple[Any, dict[str, Any]]]

    def __missing__(self, alias: Any) -> Any:
        self.added = getattr(self, "added", [])
        outer = self

        class Accessor:
            def add(self, asset: Any, extra: dict[str, Any]) -> None:
                outer.added.append((asset, extra))

        return Accessor()


def _evaluated(ctx: dict[str, Any], *, trained: float, base: float, champion: float | None = None,
               failed: str | None = None) -> RunDir:
    """The evaluation task's record for the run of ``ctx``, with these mean rewards (a model dir beside it)."""
    spec = build_run_spec(dict(ctx["params"]), run_name=f"verl_retrain__smoke/{ctx['run_id']}")
    run = RunDir(spec.run_dir)
    run.model_dir.mkdir(parents=True, exist_ok=True)
    if failed:
        run.save_evaluation({FAILED_KEY: failed})
        return run
    models = {Role.TRAINED: trained, Role.BASE: base, **({Role.CHAMPION: champion} if champion is not None else {})}
    run.save_evaluation(Evaluation(
        data_path="/d/v.parquet", data_hash="h", split="val", engine=Engine.TRANSFORMERS, sampling={},
        models={r: ModelScore(path=f"/{r.value}", mean_reward=v, pass_rate=v, mean_response_length=3.0, n=8)
                for r, v in models.items()}).to_dict())
    return run


def _trained(run_id: str, **params: Any) -> dict[str, Any]:
    ctx = _ctx(run_id, {"status": "SUCCEEDED"}, mode="train",
               exported={"model_dir": f"/runs/{run_id}/model", "step": 2}, **params)
    ctx["outlet_events"] = Events()
    return ctx


def test_a_run_is_promoted_only_when_it_beats_the_base_and_the_champion() -> None:
    op = PublishRunOperator(task_id="publish_run")
    first = _trained("scheduled__gate-1")
    champion = _evaluated(first, trained=0.4, base=0.1)
    assert op.execute(first)["verdict"]["kind"] == VerdictKind.WIN.value
    assert runs.latest_run(_storage(), "smoke") == champion.path.resolve()
    (_, extra), = first["outlet_events"].added
    assert extra["promoted"] is True and extra["model_dir"] == "/runs/scheduled__gate-1/model"

    worse = _trained("scheduled__gate-2")
    run = _evaluated(worse, trained=0.3, base=0.1, champion=0.4)
    out = op.execute(worse)
    assert (out["promoted"], out["verdict"]["kind"]) == (False, VerdictKind.NO_GAIN_OVER_CHAMPION.value)
    assert out["verdict"]["champion_run"] == str(champion.path.resolve())
    assert runs.latest_run(_storage(), "smoke") == champion.path.resolve()
    assert not worse["outlet_events"].__dict__.get("added")  # no model event for a run that was not promoted
    manifest = runs.read_manifest(run.path)
    assert manifest.status is runs.RunStatus.SUCCEEDED and manifest.promotion["promoted"] is False
    assert run.promotion()["scores"] == {"trained": 0.3, "base": 0.1, "champion": 0.4}

    better = _trained("scheduled__gate-3")
    run = _evaluated(better, trained=0.6, base=0.1, champion=0.4)
    assert op.execute(better)["promoted"] is True
    assert runs.latest_run(_storage(), "smoke") == run.path.resolve()


def test_a_failed_evaluation_holds_the_run_and_an_override_promotes_it() -> None:
    op = PublishRunOperator(task_id="publish_run")
    kept = runs.latest_run(_storage(), "smoke")
    ctx = _trained("scheduled__gate-failed")
    _evaluated(ctx, trained=0, base=0, failed="the evaluation job eval-1 failed: CUDA out of memory")
    out = op.execute(ctx)
    assert out["verdict"]["kind"] == VerdictKind.NO_EVALUATION.value and "out of memory" in out["verdict"]["reason"]
    assert runs.latest_run(_storage(), "smoke") == kept

    forced = _trained("scheduled__gate-forced", promote_anyway=True)
    run = _evaluated(forced, trained=0.0, base=0.5)
    out = op.execute(forced)
    assert (out["promoted"], out["verdict"]["kind"], out["verdict"]["forced"]) == (True, "forced", True)
    assert runs.latest_run(_storage(), "smoke") == run.path.resolve()



def test_promotion_waits_for_the_export_only_when_there_was_one_to_make() -> None:
    assert promotion_blocker(None, None, None) == "its job did not succeed"
    ok = {"status": "SUCCEEDED"}
    assert "not exported" in str(promotion_blocker(ok, None, None))
    assert promotion_blocker(ok, {"model_dir": "/r/model"}, None) is None
    assert promotion_blocker(ok, None, "the run profile says export: false") is None


def test_invalid_spec_is_not_published() -> None:
    op = PublishRunOperator(task_id="publish_run")
    ctx = {"ti": FakeTI({}), "params": {"profile": "smoke", "data_source": "builtin:nope"},
           "run_id": "scheduled__pub-bad", "dag": FakeDag("verl_retrain__smoke")}  # provision refused it
    with pytest.raises(AirflowFailException, match="has no frozen spec"):
        op.execute(ctx)


def test_without_an_evaluation_setting_or_a_model_the_rule_is_not_applied() -> None:
    import dataclasses

    from verl_pipeline.airflow.retrain import promotion_verdict
    from verl_pipeline.scores import EvaluationSettings

    spec = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__unchecked")
    off = dataclasses.replace(spec, evaluation=EvaluationSettings(enabled=False))
    v = promotion_verdict(off, export_skipped=None, force=False)
    assert (v.promoted, v.kind) == (True, VerdictKind.UNCHECKED) and "enabled: false" in v.reason
    assert promotion_verdict(spec, export_skipped="the job ran in preflight mode", force=False) is None
    v = promotion_verdict(spec, export_skipped=None, force=False)  # nothing evaluated this run
    assert (v.promoted, v.kind) == (False, VerdictKind.NO_EVALUATION)


def test_the_registry_gets_every_evaluated_model_and_champion_only_for_a_promoted_one(
        mlflow_server: str, own_configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import yaml
    from mlflow.tracking import MlflowClient

    port = int(mlflow_server.rsplit(":", 1)[1])
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_MLFLOW", json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": port}))
    prof = yaml.safe_load((own_configs / "profiles" / "smoke.yaml").read_text())
    prof["trackers"] = {"mlflow": {"conn_id": "team_mlflow", "registry": {"model_name": "publish-gate-model"}}}
    (own_configs / "profiles" / "gate.yaml").write_text(yaml.safe_dump(prof))
    op = PublishRunOperator(task_id="publish_run")

    def trained(run_id: str, **scores: float) -> dict[str, Any]:
        ctx = _trained(run_id, profile="gate")
        run = _evaluated(ctx, **scores)
        (run.model_dir / "config.json").write_text("{}")
        ctx["ti"].xcoms["export_model"]["model_dir"] = str(run.model_dir)
        return ctx

    first = op.execute(trained("scheduled__reg-1", trained=0.5, base=0.1))
    assert first["registry"] == {"name": "publish-gate-model", "version": 1, "aliases": ["challenger", "champion"]}
    worse = op.execute(trained("scheduled__reg-2", trained=0.3, base=0.1, champion=0.5))
    assert worse["promoted"] is False and worse["registry"]["version"] == 2
    client = MlflowClient(mlflow_server)
    assert client.get_model_version_by_alias("publish-gate-model", "champion").version == "1"
    assert client.get_model_version_by_alias("publish-gate-model", "challenger").version == "2"
    assert client.get_model_version("publish-gate-model", "2").tags["trained_mean_reward"] == "0.3"
