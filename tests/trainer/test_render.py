from __future__ import annotations

import shlex

import pytest

from verl_pipeline.config import build_run_spec
from verl_pipeline.constants import Mode
from verl_pipeline.trainer.render import BASE_ENV, render_job


def _job(mode: Mode, **params: object):  # type: ignore[no-untyped-def]
    spec = build_run_spec(dict(params), run_name="verl_ppo/manual__1")
    return spec, render_job(spec, mode=mode, train_files="/d/train.parquet", val_files="/d/val.parquet",
                            model_path="/m/actor")


def test_train_entrypoint_runs_verl_main_ppo_with_pipeline_owned_keys() -> None:
    spec, job = _job(Mode.TRAIN, nnodes=2, n_gpus_per_node=4)
    words = shlex.split(job.entrypoint)
    assert words[:3] == ["python", "-m", "verl.trainer.main_ppo"]
    s = job.settings
    assert s["trainer.nnodes"] == 2 and s["trainer.n_gpus_per_node"] == 4
    assert s["trainer.resume_mode"] == "auto"
    assert s["trainer.default_local_dir"] == str(spec.checkpoint_dir)
    assert s["trainer.logger"] == ["console", "file"]
    assert s["critic.model.path"] == "/m/actor"  # GAE needs a critic
    assert s["trainer.save_freq"] >= 1
    assert "data.train_files=/d/train.parquet" in words


def test_preflight_entrypoint_gets_the_same_overrides() -> None:
    _, train = _job(Mode.TRAIN)
    spec, pre = _job(Mode.PREFLIGHT)
    words = shlex.split(pre.entrypoint)
    assert words[:3] == ["python", "-m", "verl_pipeline.trainer.preflight"]
    assert words[words.index("--") + 1:] == train.overrides
    assert str(spec.run_dir / "preflight.json") in words


def test_runtime_env_carries_verl_environment_and_ships_the_package() -> None:
    spec, job = _job(Mode.TRAIN)
    env = job.runtime_env["env_vars"]
    for key, value in BASE_ENV.items():
        assert env[key] == value
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["VERL_FILE_LOGGER_PATH"] == str(spec.metrics_path)
    (module,) = job.runtime_env["py_modules"]
    assert module.endswith("verl_pipeline")


def test_auto_mode_must_be_resolved_first() -> None:
    with pytest.raises(ValueError):
        _job(Mode.AUTO)
