"""The Slurm backend: the sbatch script it renders, its settings checks, and its lifecycle on a real Slurm."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.slurm_fixture import SlurmCluster, processes_of_job, slurm_cluster
from tests.conftest import ray_processes
from verl_pipeline.cluster.local import free_port_range
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.cluster.slurm import SlurmBackend, parse_scontrol_job
from verl_pipeline.exceptions import ClusterError, ConfigError

SITE = {
    "backend": "slurm", "nodes": 4, "cpus_per_node": 32, "gpus_per_node": 8, "time": "2-00:00:00",
    "partition": "gpu", "account": "ml-team", "env": {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "ib0"},
    "python": "/opt/verl/.venv/bin/python", "shared_dir": "/shared/ray-clusters",
}


# -- the rendered script (no Slurm needed) ---------------------------------------------------------------
def test_script_follows_verls_multinode_recipe() -> None:
    b = get_backend(SITE)
    assert isinstance(b, SlurmBackend)
    script = b.render_script("verl_ppo/run-1")
    # Token auth by default: the script names the token file (on shared storage), never the token.
    token_file = b.token_file_for("verl_ppo/run-1")
    assert token_file is not None and token_file.parent.name == "auth"
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=ml-team",
                 "#SBATCH --ntasks-per-node=1", "export NCCL_IB_HCA=mlx5", "export NCCL_SOCKET_IFNAME=ib0",
                 "export RAY_AUTH_MODE=token", "unset RAY_AUTH_TOKEN", f"export RAY_AUTH_TOKEN_PATH={token_file}",
                 "PY=/opt/verl/.venv/bin/python", "RAY=/opt/verl/.venv/bin/ray",
                 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")'):
        assert line in script.splitlines(), line
    # The head's IP is resolved on the head host; workers join with srun --overlap on the other hosts.
    assert 'srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname -I' in script
    assert script.count("srun --overlap --nodes=1 --ntasks=1 --kill-on-bad-exit=1") == 2
    assert '--num-cpus="$CPUS" --num-gpus="$GPUS"' in script
    assert "CPUS=${SLURM_CPUS_PER_TASK:-32}" in script and "GPUS=${SLURM_GPUS_PER_NODE:-0}" in script
    assert '"$RAY" start --address="$HEAD_IP:$GCS_PORT"' in script
    assert "--dashboard-host=0.0.0.0" in script
    # Held until scancel, and the output + head address go to shared storage.
    assert script.rstrip().endswith("exit 5") and "wait -n" in script
    assert "#SBATCH --output=/shared/ray-clusters/vp-verl-ppo-run-1-" in script
    assert "--partition" not in get_backend({"backend": "slurm"}).render_script("x")
    # The script is valid bash.
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("runtime,expect", [
    ("apptainer", "apptainer exec --nv --bind /shared:/shared /img/verl.sif"),
    ("docker", "--network=host --ipc=host --shm-size=128g --gpus=all -v /shared:/shared /img/verl.sif"),
    ("enroot", "--container-image=/img/verl.sif --container-mounts=/shared:/shared"),
])
def test_container_runs_with_host_network_and_large_shm(runtime: str, expect: str) -> None:
    b = get_backend({**SITE, "container": {"runtime": runtime, "image": "/img/verl.sif",
                                           "mounts": ["/shared:/shared"], "shm_size": "128g"}})
    script = b.render_script("r")  # type: ignore[attr-defined]
    assert expect in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_auth_disabled_only_when_the_profile_says_so() -> None:
    b = get_backend({**SITE, "auth_mode": "disabled"})
    assert isinstance(b, SlurmBackend) and b.token_file_for("r") is None
    lines = b.render_script("r").splitlines()
    assert "export RAY_AUTH_MODE=disabled" in lines and "unset RAY_AUTH_TOKEN_PATH" in lines


def test_python_defaults_to_the_submitting_environment() -> None:
    script = get_backend({"backend": "slurm"}).render_script("r")  # type: ignore[attr-defined]
    assert f"RAY={Path(sys.executable).parent / 'ray'}" in script


@pytest.mark.parametrize("key,value", [
    ("nodes", 0), ("nodes", "two"), ("gpus_per_node", -1), ("time", "forever"), ("partition", "gpu; rm -rf /"),
    ("env", {"BAD-KEY": "x"}), ("extra_sbatch", ["--ok", "not-an-option"]), ("python", "python3"),
    ("container", {"runtime": "podman", "image": "x"}), ("container", {"runtime": "docker"}),
    ("container", {"runtime": "docker", "image": "x", "shm_size": "lots"}), ("gcs_port", 80),
    ("port_stride", 10), ("shared_dir", "relative/dir"), ("pending_timeout_s", 0), ("colour", "blue"),
    ("auth_mode", "none"), ("env", {"RAY_AUTH_TOKEN": "would-be-written-into-the-script"}),
])
def test_invalid_settings_are_rejected_before_anything_runs(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        get_backend({**SITE, key: value})
    assert e.value.key.startswith(f"cluster.{key}")


def test_scontrol_output_is_parsed() -> None:
    line = ("JobId=7 JobName=vp-x UserId=root(0) JobState=PENDING Reason=Resources Dependency=(null) "
            "ExitCode=0:0 NodeList=(null) Command=/tmp/a b")
    info = parse_scontrol_job(line)
    assert info["JobState"] == "PENDING" and info["Reason"] == "Resources" and info["ExitCode"] == "0:0"


@pytest.mark.parametrize("key,value", [
    ("slurmrestd", {"url": "http://host:6820/slurm/v0.0.38"}), ("slurmrestd", {"url": "relative.sock"}),
    ("slurmrestd", {}), ("slurmrestd", {"url": "unix:/run/s.sock", "api_version": "v0.0.30"}),
    ("slurmrestd", {"url": "unix:/run/s.sock", "api_version": "v0.0.40"}),
    ("slurmrestd", {"url": "unix:/run/s.sock", "tokn_env": "X"}), ("slurmrestd", {"url": "unix:/s", "timeout_s": 0}),
])
def test_invalid_slurmrestd_settings_are_rejected(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        get_backend({**SITE, key: value})
    assert e.value.key.startswith("cluster.slurmrestd")


def test_slurmrestd_cannot_carry_extra_sbatch_options() -> None:
    with pytest.raises(ConfigError, match="slurmrestd does not read #SBATCH lines") as e:
        get_backend({**SITE, "extra_sbatch": ["--exclusive"], "slurmrestd": {"url": "unix:/run/s.sock"}})
    assert e.value.key == "cluster.extra_sbatch"


@pytest.mark.parametrize("text,minutes", [("30", 30), ("30:30", 31), ("04:00:00", 240), ("1-00", 1440),
                                          ("1-02:03", 1563), ("2-00:00:01", 2881), ("UNLIMITED", None)])
def test_slurm_time_limits_in_minutes(text: str, minutes: int | None) -> None:
    from verl_pipeline.cluster.slurm import time_limit_minutes

    assert time_limit_minutes(text) == minutes


def test_slurmrestd_job_properties_carry_the_profile() -> None:
    b = get_backend({**SITE, "slurmrestd": {"url": "unix:/run/s.sock"}, "mem": "64G", "qos": "high",
                     "shared_dir": "/shared/vp"})
    props = b.rest_job_properties("run/1")  # type: ignore[attr-defined]
    assert props["nodes"] == SITE["nodes"] and props["cpus_per_task"] == SITE["cpus_per_node"]
    assert props["tres_per_node"] == f"gres:gpu:{SITE['gpus_per_node']}"
    assert props["memory_per_node"] == 64 * 1024 and props["qos"] == "high" and props["partition"] == SITE["partition"]
    assert props["current_working_directory"].startswith("/shared/vp/vp-run-1-")
    assert props["environment"]["SLURM_GPUS_PER_NODE"] == str(SITE["gpus_per_node"])


def test_slurmrestd_unreachable_is_a_clear_error(tmp_path: Path) -> None:
    b = get_backend({**SITE, "slurmrestd": {"url": f"unix:{tmp_path}/none.sock", "timeout_s": 2}})
    with pytest.raises(ClusterError, match=r"slurmrestd at unix:.*none.sock is unreachable"):
        b.job("1")  # type: ignore[attr-defined]


# -- a real Slurm ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    yield from slurm_cluster(nodes=2, cpus_per_node=2)


def slurm_test_spec(slurm: SlurmCluster, shared: Path, **over: object) -> dict[str, object]:
    """Two Ray nodes on this one host: distinct ports per node, dashboard on loopback, this venv's Ray. The
    head's fixed ports lie below the kernel's ephemeral range, as a cluster profile's do (6379, 8265, 10001):
    a port the kernel handed out once can be any outgoing connection's by the time a restart binds it again."""
    base = free_port_range(3)
    gcs, dashboard, client = base, base + 1, base + 2
    return {
        "backend": "slurm", "nodes": 2, "cpus_per_node": 1, "time": "00:30:00", "partition": "debug",
        "dashboard_host": "127.0.0.1", "gcs_port": gcs, "dashboard_port": dashboard,
        "client_server_port": client, "port_base": 0, "port_stride": 100, "object_store_memory_mb": 200,
        "slurm_conf": str(slurm.conf), "shared_dir": str(shared), "ready_timeout_s": 150, "pending_timeout_s": 60,
        "poll_s": 1, **over,
    }


def nothing_left(extra: dict[str, str]) -> None:
    """No process of the allocation (by its SLURM_JOB_ID) or of its Ray temp dir survives."""
    deadline = time.monotonic() + 15
    while (processes_of_job(extra["job_id"]) or ray_processes(extra["temp_dir"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_job(extra["job_id"]) == []
    assert ray_processes(extra["temp_dir"]) == []


@pytest.mark.integration
def test_pending_too_long_names_the_slurm_state_and_reason(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = get_backend(slurm_test_spec(slurm, tmp_path, extra_sbatch=["--begin=now+3600"], pending_timeout_s=15))
    with pytest.raises(ClusterError, match=r"is PENDING \(reason: BeginTime\).*pending_timeout_s"):
        backend.provision("pytest/slurm-pending")
    # The pending job was cancelled: nothing of it stays queued.
    assert slurm.run("squeue", "-h", "--name", backend.job_name("pytest/slurm-pending")).stdout.strip() == ""  # type: ignore[attr-defined]


@pytest.mark.integration
def test_impossible_allocation_is_a_clear_error(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = get_backend(slurm_test_spec(slurm, tmp_path, nodes=3))
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"is PENDING \(reason: Partition\w+\).*can never start"):
        backend.provision("pytest/slurm-too-big")
    assert time.monotonic() - t0 < 50, "a hopeless request fails at once, not after pending_timeout_s"
    assert slurm.run("squeue", "-h", "--name", backend.job_name("pytest/slurm-too-big")).stdout.strip() == ""  # type: ignore[attr-defined]


@pytest.mark.integration
def test_job_dying_before_ray_is_ready_names_the_state_and_shows_its_output(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # A python whose environment has no `ray`: the head cannot start, the job ends.
    backend = get_backend(slurm_test_spec(slurm, tmp_path, python="/usr/bin/python3"))
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        backend.provision("pytest/slurm-dies")
    assert time.monotonic() - t0 < 120, "the failure is noticed without waiting out ready_timeout_s"
    msg = str(e.value)
    assert "Slurm job" in msg and ("FAILED" in msg or "COMPLETING" in msg or "COMPLETED" in msg)
    assert "the Ray head exited" in msg or "/usr/bin/ray" in msg
