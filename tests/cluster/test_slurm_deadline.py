"""The end of a real Slurm allocation, as the pipeline passes it to verl (a throwaway one-host Slurm)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.slurm_fixture import SlurmCluster, slurm_cluster
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.registry import cluster_deadline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    yield from slurm_cluster(nodes=1, cpus_per_node=1)


def test_the_allocation_end_is_its_start_plus_its_time_limit(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = slurm.run("sbatch", "--parsable", "--time=00:07:00", "--partition=debug", f"--chdir={tmp_path}",
                    "--wrap", "sleep 600")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 30
        while slurm.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the test allocation never started"
            time.sleep(0.3)
        started = time.time()
        handle = ClusterHandle(backend="slurm", name="pytest/deadline", dashboard_url="http://127.0.0.1:1",
                               owned=True, extra={"job_id": job_id, "slurm_conf": str(slurm.conf)})
        d = cluster_deadline(handle)
        assert d is not None and f"Slurm job {job_id}" in d.source
        # EndTime has whole seconds: the start (within the wait above) + 7 minutes.
        assert abs(d.at - (started + 7 * 60)) < 35
    finally:
        slurm.run("scancel", job_id)
    # A job Slurm does not know (long gone) gives no deadline, not an error.
    gone = ClusterHandle(backend="slurm", name="pytest/gone", dashboard_url="http://127.0.0.1:1", owned=True,
                         extra={"job_id": "999999", "slurm_conf": str(slurm.conf)})
    assert cluster_deadline(gone) is None
