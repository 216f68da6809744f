from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from verl_pipeline.constants import Mode
from verl_pipeline.profiles import build_run_spec
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
    _, job = _job(Mode.TRAIN)
    env = job.runtime_env["env_vars"]
    for key, value in BASE_ENV.items():
        assert env[key] == value
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    # Each attempt's metrics file is decided where its number is known: jobs.submit.submit_or_reattach.
    assert "VERL_FILE_LOGGER_PATH" not in env
    (module,) = job.runtime_env["py_modules"]
    assert module.endswith("verl_pipeline")


def test_auto_mode_must_be_resolved_first() -> None:
    with pytest.raises(ValueError):
        _job(Mode.AUTO)


def test_infiniband_cluster_sets_nccl_env_and_debug_is_on_request() -> None:
    spec = build_run_spec({"nnodes": 4}, run_name="r", model_profile="qwen2.5-7b-grpo", cluster_profile="h100-ib")
    job = render_job(spec, mode=Mode.TRAIN, train_files="/mnt/shared/d/t.parquet", val_files="/mnt/shared/d/v.parquet",
                     model_path="/mnt/shared/models/m")
    env = job.runtime_env["env_vars"]
    assert env["NCCL_IB_HCA"].startswith("mlx5_0,mlx5_1") and env["NCCL_PROTO"] == "Simple"
    assert "NCCL_DEBUG" not in env
    loud = build_run_spec({"nnodes": 4}, run_name="r", model_profile="qwen2.5-7b-grpo", cluster_profile="h100-ib",
                          nccl_debug=True)
    env = render_job(loud, mode=Mode.TRAIN, train_files="/mnt/shared/t", val_files="/mnt/shared/v",
                     model_path="/mnt/shared/m").runtime_env["env_vars"]
    assert env["NCCL_DEBUG"] == "INFO"
    # No InfiniBand on the local cluster: NCCL picks its defaults.
    _, local = _job(Mode.TRAIN)
    assert not {"NCCL_IB_HCA", "NCCL_PROTO", "NCCL_DEBUG"} & set(local.runtime_env["env_vars"])


def test_grpo_job_has_no_critic_and_keeps_the_profile_save_freq() -> None:
    spec = build_run_spec({}, run_name="r", model_profile="qwen2.5-0.5b-grpo")
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v", model_path="/m/a")
    assert "critic.model.path" not in job.settings
    assert job.settings["trainer.save_freq"] == 10
    assert job.settings["actor_rollout_ref.rollout.n"] == 5
    for key in ("trainer.default_local_dir", "trainer.resume_mode", "trainer.logger", "trainer.save_freq"):
        assert key in job.derived


def test_save_run_files_logs_and_keeps_the_merged_config_next_to_checkpoints(caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    from verl_pipeline import steps

    spec, job = _job(Mode.PREFLIGHT)
    with caplog.at_level(logging.INFO, logger="verl_pipeline.steps"):
        steps.save_run_files(spec, job)
    saved = json.loads((spec.checkpoint_dir / "run_config.json").read_text())
    assert saved["job"]["entrypoint"] == job.entrypoint
    assert saved["spec"]["verl"]["data.train_batch_size"] == 16
    assert any("verl data.train_batch_size = 16" in r.getMessage() for r in caplog.records)


def test_cli_render_prints_entrypoint_runtime_env_and_rules(capsys: pytest.CaptureFixture[str]) -> None:
    from verl_pipeline.cli import main

    rc = main(["render", "--model-profile", "qwen2.5-32b-grpo", "--cluster-profile", "h100-ib", "--nnodes", "4",
               "--n-gpus-per-node", "8", "--set", "trainer.test_freq=5", "--set", "trainer.logger=[console,wandb]"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "verl 0.9.1: composed ppo_trainer.yaml and passed validate_config" in out
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size" in out and ">= 2 for models >= 20B" in out
    assert "data.train_batch_size" in out and "64 prompts per node x 4 node(s)" in out
    words = shlex.split(out.split("entrypoint:\n", 1)[1].split("\nruntime_env:", 1)[0])
    assert words[:3] == ["python", "-m", "verl.trainer.main_ppo"]
    assert "trainer.test_freq=5" in words and "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in words
    assert "trainer.logger=[console,wandb,file]" in words  # the user's tracker kept, verl's file logger added
    assert '"NCCL_IB_HCA"' in out
    assert "placeholder" in out  # the 32B weights are not here; render says so instead of downloading


def test_a_prefetched_reward_model_reaches_verl() -> None:
    from verl_pipeline import steps

    spec = build_run_spec({}, run_name="verl_ppo/manual__reward")
    models = {"actor": {"path": "/m/actor"}, "reward": {"path": "/m/reward"}}
    data = {"train_path": "/d/train.parquet", "val_path": "/d/val.parquet"}
    job = steps.render(spec, data=data, models=models, mode=Mode.TRAIN)
    assert job.settings["reward.reward_model.model_path"] == "/m/reward"
    assert "reward.reward_model.model_path=/m/reward" in job.overrides
    without = steps.render(spec, data=data, models={"actor": {"path": "/m/actor"}}, mode=Mode.TRAIN)
    assert "reward.reward_model.model_path" not in without.settings


def test_render_for_a_cluster_writes_nothing_under_its_storage_even_where_it_is_mounted(
        own_configs: Path, tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dry run for a cluster of its own nodes plans its data and model paths: with the cluster's shared
    mount present on this machine (and the model directory on it) nothing is preprocessed, prefetched
    or recorded there."""
    import shutil

    import yaml

    from verl_pipeline.cli import main

    storage = tmp_path / "mnt-shared"
    model = storage / "models" / "mine"
    shutil.copytree(tiny_model_path, model)
    prof = yaml.safe_load((own_configs / "clusters" / "h100-ib.yaml").read_text())
    prof["storage"] = {"root": str(storage), "shared": [str(storage)]}
    (own_configs / "clusters" / "mounted.yaml").write_text(yaml.safe_dump(prof))
    before = sorted(p for p in storage.rglob("*"))
    rc = main(["render", "--model-profile", "tiny-grpo", "--cluster-profile", "mounted", "--model-source", str(model),
               "--no-verl-check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert sorted(p for p in storage.rglob("*")) == before
    assert f"actor_rollout_ref.model.path={model}" in out and "<content-key>" in out
