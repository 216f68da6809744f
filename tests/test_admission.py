"""A shared cluster's pool: which profiles name one, what a run takes of it, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_pooled_cluster
from verl_pipeline.admission import Admission, admission_of
from verl_pipeline.cluster.address import AddressBackend
from verl_pipeline.exceptions import ConfigError

SHARED = {"backend": "address", "conn_id": "ray_default", "auth_mode": "token", "pool": "gpus_a", "expected_gpus": 8}


def test_a_run_takes_a_slot_per_gpu_of_a_pool_sized_by_the_cluster() -> None:
    assert admission_of(SHARED, "shared", 4) == Admission("gpus_a", 4, 8)
    assert admission_of(SHARED, "shared", 8) == Admission("gpus_a", 8, 8)
    assert admission_of({k: v for k, v in SHARED.items() if k != "pool"}, "shared", 8) is None
    assert admission_of({"backend": "local"}, "local-cpu", 1) is None
    # The backend accepts the key (it is the admission's, not Ray's).
    AddressBackend.from_spec(SHARED)


@pytest.mark.parametrize("cluster,n_gpus,key,words", [
    ({**SHARED, "backend": "local"}, 1, "cluster.pool", "remove pool:"),
    ({**SHARED, "pool": "gpus a"}, 1, "cluster.pool", "Airflow pool name"),
    ({**SHARED, "pool": 7}, 1, "cluster.pool", "Airflow pool name"),
    ({**SHARED, "expected_gpus": 0}, 1, "cluster.expected_gpus", "the pool's size"),
    ({**SHARED, "expected_gpus": 2.5}, 1, "cluster.expected_gpus", "whole number"),
    ({**SHARED, "expected_gpus": "eight"}, 1, "cluster.expected_gpus", "must be a number"),
    # Airflow would leave a task that needs more slots than the pool has waiting for ever.
    (SHARED, 16, "cluster.expected_gpus", "needs 16 GPUs"),
])
def test_a_pool_that_cannot_work_fails_in_one_line(cluster: dict, n_gpus: int, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        admission_of(cluster, "shared", n_gpus)
    msg = str(e.value)
    assert msg.startswith(f"clusters/shared.{key}=") and words in msg and "\n" not in msg and "fix:" in msg


def test_the_run_spec_carries_the_admission(own_configs: Path) -> None:
    from verl_pipeline.profiles import build_run_spec

    write_pooled_cluster(own_configs, "shared_h100")
    spec = build_run_spec({"cluster_profile": "shared", "n_gpus_per_node": 4}, run_name="verl_ppo/r1")
    assert spec.admission == Admission("shared_h100", 4, 8)
    assert spec.to_dict()["admission"] == {"pool": "shared_h100", "slots": 4, "size": 8}
    with pytest.raises(ConfigError, match=r"clusters/shared\.cluster\.expected_gpus=8: the run needs 16 GPUs"):
        build_run_spec({"cluster_profile": "shared", "nnodes": 2, "n_gpus_per_node": 8}, run_name="verl_ppo/r2")
    assert build_run_spec({"cluster_profile": "gpu-address"}, run_name="verl_ppo/r3").admission is None
