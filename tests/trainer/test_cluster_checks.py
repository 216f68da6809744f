"""Checks that need the real cluster (Ray version, CPUs for a verl training job, shared paths), run
at submit time against a real local Ray head with 2 CPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from verl_pipeline import steps
from verl_pipeline.cluster.base import ClusterHandle, ClusterStatus, probe
from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.trainer.scaling import parse_version, required_cpus


def _inputs(spec: Any, tiny_model_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from verl_pipeline.data.preprocess import preprocess

    data = preprocess(spec.data, spec.data_options, spec.data_root).to_dict()
    return data, {"actor": {"path": str(tiny_model_path)}}


@pytest.mark.integration
def test_train_mode_is_rejected_on_a_2_cpu_cluster_and_preflight_still_resolves(
    ray_cluster: ClusterHandle, tiny_model_path: Path
) -> None:
    status = probe(ray_cluster.client())
    assert status.ready and status.cpus == 2

    train = build_run_spec({"mode": "train"}, run_name="checks/train")
    assert steps.choose_mode(train, status) is Mode.TRAIN
    e = steps.cluster_problems(train, status, Mode.TRAIN)[0]
    assert e.key == "cluster.CPU" and e.value == 2
    need, _ = required_cpus(1, train.verl)
    assert "the cluster has 2" in e.rule and "TransferQueue storage actors" in e.rule
    assert f">= {need} CPUs" in str(e.fix) and "mode=preflight" in str(e.fix)

    # auto resolves to preflight on a cluster without GPUs, and preflight passes the checks.
    assert steps.choose_mode(build_run_spec({}, run_name="checks/auto"), status) is Mode.PREFLIGHT
    pre = build_run_spec({"mode": "preflight"}, run_name="checks/pre")
    assert steps.choose_mode(pre, status) is Mode.PREFLIGHT and not steps.cluster_problems(pre, status, Mode.PREFLIGHT)
    data, models = _inputs(pre, tiny_model_path)
    job = steps.render(pre, data=data, models=models, mode=Mode.PREFLIGHT)
    assert job.entrypoint.startswith("python -m verl_pipeline.trainer.preflight")


def test_ray_version_below_2_41_is_rejected() -> None:
    spec = build_run_spec({"mode": "preflight"}, run_name="checks/version")
    old = ClusterStatus(True, 1, 64, 8, "2.40.0", "ok")
    (e,) = steps.cluster_problems(spec, old, Mode.PREFLIGHT)
    assert e.key == "cluster.ray_version" and "ray>=2.41" in str(e.fix)
    assert not steps.cluster_problems(spec, ClusterStatus(True, 1, 64, 8, "2.41.0", "ok"), Mode.TRAIN)
    assert parse_version("2.60.0rc1") == (2, 60, 0) and parse_version(None) is None


def test_train_needs_the_target_gpus() -> None:
    spec = build_run_spec({"nnodes": 2, "n_gpus_per_node": 8, "mode": "train"}, run_name="checks/gpus")
    (e,) = steps.cluster_problems(spec, ClusterStatus(True, 1, 128, 8, "2.60.0", "ok"), Mode.TRAIN)
    assert e.key == "cluster.GPU" and "16 GPU(s)" in e.rule


def test_paths_outside_the_shared_mount_are_rejected_for_remote_clusters() -> None:
    spec = build_run_spec({"profile": "gsm8k-qwen2.5-0.5b-ppo"}, run_name="checks/paths")
    data = {"train_path": "/shared/data/x/train.parquet", "val_path": "/home/me/val.parquet"}
    with pytest.raises(ConfigError) as err:
        steps.render(spec, data=data, models={"actor": {"path": "/shared/models/a"}}, mode=Mode.TRAIN)
    assert err.value.key == "data.val_files" and "/shared" in str(err.value.fix)
    ok = {"train_path": "/shared/data/x/train.parquet", "val_path": "/shared/data/x/val.parquet"}
    job = steps.render(spec, data=ok, models={"actor": {"path": "/shared/models/a"}}, mode=Mode.TRAIN)
    assert job.settings["trainer.default_local_dir"].startswith("/shared/checkpoints/")
