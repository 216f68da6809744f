"""verl's validation done once per run, at most: the provision task records it (and reuses one of an
earlier run of the same configuration), the preflight job trusts it only for the same overrides and
verl installation, and each validates itself otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_pipeline import steps
from verl_pipeline.constants import Mode
from verl_pipeline.models.prefetch import prefetch
from verl_pipeline.paths import pipeline_home
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import ModelSource, RunSpec
from verl_pipeline.trainer import preflight
from verl_pipeline.trainer.render import render_job
from verl_pipeline.trainer.validate import (
    UNVALIDATED_KEYS,
    VerlConfigError,
    override_key,
    trusted,
    validate,
    validation_key,
)


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSpec, RunDir]:
    """The embedded default's spec, validated and recorded as the provision task does it."""
    spec = build_run_spec({"total_training_steps": 3}, run_name="pytest/validation-record")
    run_dir = RunDir(tmp_path_factory.mktemp("run"))
    steps.validate_spec_with_verl(spec, record_in=run_dir)
    return spec, run_dir


def _job_overrides(spec: RunSpec, tmp: Path, **settings: object) -> list[str]:
    """The overrides of the run's preflight job as the submit task renders them (the built-in model, as
    prefetched on the embedded default; parquet paths the provision task could not know)."""
    model = prefetch(ModelSource("builtin", "tiny-qwen2"), pipeline_home() / "models").path
    job = render_job(spec, mode=Mode.PREFLIGHT, train_files=str(tmp / "train.parquet"),
                     val_files=str(tmp / "val.parquet"), model_path=model)
    return [o for o in job.overrides if override_key(o) not in settings] + [f"{k}={v}" for k, v in settings.items()]


def test_the_preflight_job_trusts_the_provision_tasks_validation_of_its_overrides(
        provisioned: tuple[RunSpec, RunDir], tmp_path: Path) -> None:
    spec, run_dir = provisioned
    record = run_dir.validation()
    assert record is not None and record["key"] and "data:" in record["config_yaml"]
    overrides = _job_overrides(spec, tmp_path, **{"data.filter_overlong_prompts": "false"})
    v, why = trusted(record, overrides)
    assert v is not None, why
    assert "validated these overrides at provision" in why
    # The config verl composed at provision, with the data this job was given.
    assert v.config.data.train_files == str(tmp_path / "train.parquet")
    assert v.config.data.val_files == str(tmp_path / "val.parquet")
    assert v.config.data.filter_overlong_prompts is False
    assert v.config.trainer.total_training_steps == 3
    composed = validate(overrides)
    assert (v.n_gpus, v.use_critic, v.use_reference_policy) == (
        composed.n_gpus, composed.use_critic, composed.use_reference_policy)
    assert v.config == composed.config
    # It is still verl's struct config: a key verl's YAML does not have is an error, as after a compose.
    from omegaconf.errors import ConfigAttributeError

    with pytest.raises(ConfigAttributeError, match=r"no_such_key"):
        v.config.data.no_such_key = 1


def test_a_record_for_other_overrides_or_none_is_not_trusted(provisioned: tuple[RunSpec, RunDir],
                                                             tmp_path: Path) -> None:
    spec, run_dir = provisioned
    record = run_dir.validation()
    changed = _job_overrides(spec, tmp_path, **{"data.train_batch_size": 32})
    v, why = trusted(record, changed)
    assert v is None and "other overrides or another verl installation" in why
    assert trusted(None, changed) == (None, "no validation was recorded for this run")
    # Another model than the stand-in the provision task validated with: verl's model checks must run again.
    other_model = [o if override_key(o) != "actor_rollout_ref.model.path" else "actor_rollout_ref.model.path=/m"
                   for o in _job_overrides(spec, tmp_path)]
    assert trusted(record, other_model)[0] is None
    # The key covers the verl installation and this validation's own code, not only the overrides.
    assert validation_key(changed) != record["key"]


def test_verls_validation_reads_none_of_the_unvalidated_keys(provisioned: tuple[RunSpec, RunDir],
                                                             tmp_path: Path) -> None:
    """Why a record may stand for other values of UNVALIDATED_KEYS: verl accepts the same
    configuration with any of them (files that do not exist, either filter setting, other run names)."""
    spec, _ = provisioned
    base = validate(_job_overrides(spec, tmp_path))
    for overrides in (
        _job_overrides(spec, tmp_path, **{"data.train_files": "/nowhere/a.parquet", "data.val_files": "[]"}),
        _job_overrides(spec, tmp_path, **{"data.filter_overlong_prompts": "true"}),
        _job_overrides(spec, tmp_path, **{"data.filter_overlong_prompts": "false"}),
        _job_overrides(spec, tmp_path, **{"trainer.experiment_name": "other",
                                          "trainer.default_local_dir": "/nowhere/checkpoints"}),
        # The length counted against the training rows at submit (trainer/length.py).
        _job_overrides(spec, tmp_path, **{"trainer.total_training_steps": 500, "trainer.total_epochs": 7}),
    ):
        v = validate(overrides)
        assert (v.n_gpus, v.use_critic, v.use_reference_policy) == (base.n_gpus, base.use_critic,
                                                                    base.use_reference_policy)
    assert {o.partition("=")[0] for o in _job_overrides(spec, tmp_path)} >= set(UNVALIDATED_KEYS) - {
        "data.filter_overlong_prompts"}


def test_a_later_run_of_a_configuration_reuses_its_validation_and_a_bad_one_is_never_kept(tmp_path: Path) -> None:
    params = {"total_training_steps": 11}
    first = steps.validate_spec_with_verl(build_run_spec(params, run_name="pytest/reuse-1"))  # validates, keeps
    assert first["reused"] is None
    later = build_run_spec(params, run_name="pytest/reuse-2")  # another run: other names, same configuration
    run_dir = RunDir(tmp_path / "run")
    again = steps.validate_spec_with_verl(later, record_in=run_dir, reuse=True)
    assert again["reused"] and (again["n_gpus"], again["use_critic"]) == (first["n_gpus"], first["use_critic"])
    # The run's own record then serves its preflight job (its names, not the first run's, in the config).
    v, why = trusted(run_dir.validation(), _job_overrides(later, tmp_path))
    assert v is not None, why
    assert v.config.trainer.experiment_name == later.run_key
    # Another configuration is validated; a rejected one is not kept, so it fails every time.
    assert steps.validate_spec_with_verl(build_run_spec({"total_training_steps": 12}, run_name="pytest/reuse-3"),
                                         reuse=True)["reused"] is None
    bad = build_run_spec(params, run_name="pytest/reuse-bad", overrides={"actor_rollout_ref.actor.loss_agg_mode": "x"})
    bad_dir = RunDir(tmp_path / "bad")
    for _ in range(2):
        with pytest.raises(VerlConfigError, match="loss_agg_mode"):
            steps.validate_spec_with_verl(bad, record_in=bad_dir, reuse=True)
    assert bad_dir.validation() is None


def test_the_preflight_job_validates_itself_without_a_record_and_fails_on_a_bad_config(
        provisioned: tuple[RunSpec, RunDir], tmp_path: Path) -> None:
    spec, run_dir = provisioned
    bad = _job_overrides(spec, tmp_path, **{"actor_rollout_ref.actor.loss_agg_mode": "mean"})
    # The record of the good overrides does not cover the bad ones: the job composes, validates, fails.
    summary = preflight.run(bad, validation_record=run_dir.validation_file)
    check = summary["checks"]["verl_config"]
    assert summary["ok"] is False and check["ok"] is False and "loss_agg_mode" in check["error"]
    with pytest.raises(VerlConfigError):
        validate(bad)
    # No record at all: the same.
    assert preflight.run(bad, validation_record=tmp_path / "absent.json")["checks"]["verl_config"]["ok"] is False


def test_a_lora_run_is_validated_without_vllm_and_the_record_says_what_the_cluster_checks(tmp_path: Path) -> None:
    """verl's validate_config checks a LoRA rank against vLLM's, importing vLLM, which the Airflow side lacks: the
    rest is checked here, the record names the one check left to the job's own validate_config on the cluster, and
    the preflight job does not take the record for a full validation."""
    import importlib.util

    spec = build_run_spec({}, run_name="pytest/lora", overrides={"actor_rollout_ref.model.lora_rank": 8})
    run_dir = RunDir(tmp_path / "run")
    result = steps.validate_spec_with_verl(spec, record_in=run_dir)
    record = run_dir.validation()
    assert record is not None
    if importlib.util.find_spec("vllm") is not None:  # a machine with vLLM checks everything
        assert result["unchecked"] == record["unchecked"] == []
        return
    (line,) = result["unchecked"]
    assert line.startswith("actor_rollout_ref.model.lora_rank=8 against the LoRA ranks vLLM serves")
    assert "checks it on the cluster's nodes when the job starts" in line
    assert record["unchecked"] == [line]
    v, why = trusted(record, _job_overrides(spec, tmp_path))
    assert v is None and why.startswith("the recorded validation left unchecked: actor_rollout_ref.model.lora_rank=8")
    # The other checks still run: a bad value beside the rank is refused here.
    bad = build_run_spec({}, run_name="pytest/lora-bad", overrides={"actor_rollout_ref.model.lora_rank": 8,
                                                                     "actor_rollout_ref.actor.loss_agg_mode": "x"})
    with pytest.raises(VerlConfigError, match="loss_agg_mode"):
        steps.validate_spec_with_verl(bad)
    # A full fine-tune leaves nothing unchecked.
    assert validate(_job_overrides(build_run_spec({}, run_name="pytest/full"), tmp_path)).unchecked == ()
