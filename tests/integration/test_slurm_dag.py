"""The verl_ppo DAG end to end on a real (throwaway, single-host) Slurm: two Ray nodes in one allocation."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.slurm_fixture import SlurmCluster, processes_of_job, slurm_cluster
from tests.cluster.test_slurm import nothing_left, slurm_test_spec
from tests.conftest import ray_processes
from tests.integration.test_verl_ppo_dag import _states, _xcom

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    yield from slurm_cluster(nodes=2, cpus_per_node=2)


@pytest.fixture
def slurm_configs(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of configs/ with a ``slurm-smoke`` run profile whose cluster profile selects this Slurm."""
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    cluster = {"description": "two Ray nodes in a test Slurm allocation", "cluster": slurm_test_spec(
        slurm, tmp_path / "shared"), "storage": {"root": None}, "runtime": {"ship_package": True, "env": {}},
        # The GPUs the configuration is validated for (preflight runs on these CPU-only nodes).
        "hardware": {"gpu_memory_gb": 24}}
    (configs / "clusters" / "slurm-test.yaml").write_text(yaml.safe_dump(cluster))
    smoke = yaml.safe_load((configs / "profiles" / "smoke.yaml").read_text())
    smoke["cluster_profile"] = "slurm-test"
    (configs / "profiles" / "slurm-smoke.yaml").write_text(yaml.safe_dump(smoke))
    # The only Slurm cluster profile here, so `--backend slurm` selects it.
    (configs / "clusters" / "slurm-gpu.yaml").unlink()
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(configs))
    return configs


def _job_outputs(*roots: Path) -> str:
    """The tails of every Slurm job output under ``roots`` (the reason a provision failed, in the failure)."""
    import os

    roots = (*roots, Path(os.environ["VERL_PIPELINE_HOME"]))
    outs = sorted({p for r in roots if r.is_dir() for p in r.rglob("slurm-*.out")}, key=lambda p: p.stat().st_mtime)
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in outs[-3:])


def _dag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "verl_ppo.py"))
    assert bag.import_errors == {}
    return bag.dags["verl_ppo"]


def test_dag_on_slurm_two_ray_nodes_preflight_then_scancel(
    airflow_db: Path, slurm_configs: Path, slurm: SlurmCluster
) -> None:
    dr = _dag().test(run_conf={"profile": "slurm-smoke", "total_training_steps": 2})
    states = _states(dr)
    assert str(dr.state) == "success", f"{states}\n{_job_outputs(slurm_configs.parent)}"

    cluster = _xcom(dr, "provision_ray_cluster")
    sub = _xcom(dr, "submit_verl_job")
    waited = _xcom(dr, "wait_for_verl_job")
    teardown = _xcom(dr, "teardown_ray_cluster")
    job_id = cluster["extra"]["job_id"]

    # Two Ray nodes came up inside the allocation, and the preflight job ran on them.
    assert cluster["backend"] == "slurm" and cluster["expected_nodes"] == 2
    assert sub["mode"] == "preflight"
    assert waited["status"] == "SUCCEEDED" and waited["preflight"]["ok"] is True
    seen = waited["preflight"]["cluster"]
    assert {k: seen[k] for k in ("nodes", "CPU", "GPU")} == {"nodes": 2, "CPU": 2, "GPU": 0}, seen
    # The script that ran is kept in the run directory, beside Slurm's output of the job.
    script = Path(cluster["extra"]["script"])
    assert script == Path(sub["run_dir"]) / "slurm" / "ray-cluster.sbatch"
    assert (script.parent / f"slurm-{job_id}.out").is_file()
    assert "#SBATCH --nodes=2" in script.read_text()

    # Teardown cancelled the allocation: it left the queue and none of its processes survive.
    assert teardown["slurm_job_id"] == job_id and teardown["final_state"] == "CANCELLED"
    assert slurm.run("squeue", "-h", "-j", job_id).stdout.strip() == ""
    assert processes_of_job(job_id) == []
    assert ray_processes(cluster["extra"]["temp_dir"]) == []


def test_cli_backend_slurm_cancel_from_outside_then_a_fresh_allocation(
    slurm_configs: Path, slurm: SlurmCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cluster up/status/down --backend slurm` by hand; the site cancels the allocation mid-run: the backend
    reports it as an infrastructure failure naming the Slurm state, and the next provision (what a retry
    does) gets a fresh allocation."""

    from verl_pipeline.cli import main
    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.cluster.registry import get_backend

    run = ["--run-name", "cli/slurm", "--json"]
    rc = main(["cluster", "up", "--backend", "slurm", *run])
    out = capsys.readouterr()
    assert rc == 0, f"{out.err[-3000:]}\n{_job_outputs(slurm_configs.parent)}"
    first = json.loads(out.out)
    handle = ClusterHandle.from_dict(first)
    backend = get_backend({"backend": "slurm"})
    try:
        assert first["backend"] == "slurm" and first["expected_nodes"] == 2
        assert main(["cluster", "status", "--backend", "slurm", *run]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["status"]["nodes_alive"] == 2 and status["status"]["cpus"] == 2
        assert status["health"] == {"alive": True, "state": "RUNNING", "infrastructure": False,
                                    "detail": f"Slurm job {first['extra']['job_id']} is RUNNING"}
        assert processes_of_job(first["extra"]["job_id"]), "the Ray nodes run inside the allocation"

        # The site takes the allocation away mid-run.
        assert slurm.run("scancel", first["extra"]["job_id"]).returncode == 0
        deadline = time.monotonic() + 30
        while backend.health(handle).alive and time.monotonic() < deadline:
            time.sleep(0.5)
        health = backend.health(handle)
        assert not health.alive and health.infrastructure and health.state in ("CANCELLED", "COMPLETING")
        assert f"Slurm job {first['extra']['job_id']} is {health.state}" in health.detail
        nothing_left(first["extra"])
        assert main(["cluster", "status", "--backend", "slurm", *run]) == 1
        status = json.loads(capsys.readouterr().out)
        assert status["status"]["ready"] is False and status["health"]["state"] in ("CANCELLED", "COMPLETING")

        # Provisioning again (what a retry does) gets a fresh allocation with two Ray nodes.
        assert main(["cluster", "up", "--backend", "slurm", *run]) == 0
        handle = ClusterHandle.from_dict(json.loads(capsys.readouterr().out))
        assert handle.extra["job_id"] != first["extra"]["job_id"]
        assert backend.status(handle).nodes_alive == 2
    finally:
        assert main(["cluster", "down", "--backend", "slurm", *run]) == 0
    down = json.loads(capsys.readouterr().out)
    assert down["slurm_job_id"] == handle.extra["job_id"] and down["final_state"] == "CANCELLED"
    assert slurm.run("squeue", "-h", "-j", handle.extra["job_id"]).stdout.strip() == ""
    nothing_left(handle.extra)
    # A second `down` finds nothing left to cancel.
    assert main(["cluster", "down", "--backend", "slurm", *run]) == 0
    assert json.loads(capsys.readouterr().out) == {"job_stopped": False}

    # A cluster profile of another backend is refused; so is a backend no profile uses.
    assert main(["cluster", "up", "--backend", "slurm", "--cluster-profile", "local-cpu", *run]) == 2
    assert "cluster profile local-cpu uses backend local" in capsys.readouterr().err
    (slurm_configs / "clusters" / "kuberay-gpu.yaml").unlink()
    assert main(["cluster", "up", "--backend", "kuberay", *run]) == 2
    assert "0 cluster profiles in configs/clusters use this backend" in capsys.readouterr().err


def test_provision_killed_while_waiting_still_gets_its_allocation_cancelled(
    slurm_configs: Path, slurm: SlurmCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from verl_pipeline.cli import main
    from verl_pipeline.profiles import build_run_spec

    run = ["--profile", "slurm-smoke", "--run-name", "pytest/killed", "--json"]
    spec = build_run_spec({"profile": "slurm-smoke"}, run_name="pytest/killed")
    state = spec.run_dir / "slurm" / "slurm-job.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "include"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "verl_pipeline", "cluster", "up", *run], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not state.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.is_file(), "the backend records the job right after sbatch"
    finally:
        proc.send_signal(signal.SIGKILL)  # the provision task is killed mid-wait (worker lost)
        proc.wait()
    job_id = json.loads(state.read_text())["extra"]["job_id"]
    assert slurm.run("squeue", "-h", "-j", job_id).stdout.strip() != ""
    # Teardown finds the job from the run directory and cancels it.
    assert main(["cluster", "down", *run]) == 0
    assert json.loads(capsys.readouterr().out)["slurm_job_id"] == job_id
    assert slurm.run("squeue", "-h", "-j", job_id).stdout.strip() == ""
    deadline = time.monotonic() + 15
    while processes_of_job(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_job(job_id) == []


def test_allocation_time_limit_ends_mid_training_verl_saves_ahead_and_the_retry_resumes(
    airflow_db: Path, slurm_configs: Path, slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A 2-minute Slurm allocation (``--time``) ends while the (fake, GPU-less) trainer is mid-run, with
    ``save_freq=100``: the pipeline passed the allocation's end to verl, whose own
    ``should_save_ckpt_esi`` saved after each step; Slurm's time limit kills the job; the wait task's
    retry gets a fresh allocation and resumes from the last step saved (at most one step lost; with
    save_freq alone every step would be). Nothing of either allocation survives the run."""
    from tests.faults.conftest import RESULTS_FILE, _profile, gate_path, load_dag, metric_lines, record_result, run_dir
    from verl_pipeline.rundir import RunDir

    held_after, total = 3, 5
    home = tmp_path / "home"
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(home))
    cluster = yaml.safe_load((slurm_configs / "clusters" / "slurm-test.yaml").read_text())
    cluster["cluster"]["time"] = "00:02:00"  # Slurm counts limits in whole minutes
    (slurm_configs / "clusters" / "slurm-2min.yaml").write_text(yaml.safe_dump(cluster))
    # The trainer holds after step 3 at a gate nobody opens, so the time limit lands mid-run whatever
    # the machine's speed; the resumed attempt starts past the gate. verl saves when the time left is at most
    # the longest step + 60 s + esi_redundant_time: with 120 s that is every step of a 2-minute allocation.
    prof = _profile("slurm time limit", {
        "trainer": {"save_freq": 100, "use_v1": False, "esi_redundant_time": 120},
        "+fake": {"step_seconds": 0.5, "gate_file": str(gate_path(home)), "gate_after_step": held_after}},
        total=total)
    prof["cluster_profile"] = "slurm-2min"
    (slurm_configs / "profiles" / "slurm-time-limit.yaml").write_text(yaml.safe_dump(prof))

    dr = load_dag().test(run_conf={"profile": "slurm-time-limit"})
    assert str(dr.state) == "success", f"{_states(dr)}\n{_job_outputs(home)}"
    # Ended by the time limit once (infrastructure), restarted within the wait task's try; on a machine so
    # busy that the first allocation ends before its trainer starts, a second allocation is cut short the
    # same way (an attempt without progress: the budget's default allows two in a row).
    assert next(int(ti.try_number) for ti in dr.get_task_instances() if ti.task_id == "wait_for_verl_job") == 1
    rd = run_dir(home)
    assert rd is not None
    n_attempts = len(RunDir(rd).attempts())
    assert n_attempts in (2, 3), n_attempts
    printed = capfd.readouterr()
    out = printed.out + printed.err
    # The job got the allocation's end and verl saved ahead of it; the failure names the Slurm state.
    assert "Force saving checkpoint: ESI instance expiration approaching." in out
    ended = re.findall(r"\[infrastructure failure: Slurm job (\d+) is (?:TIMEOUT|COMPLETING \(reason: TimeLimit\))",
                       out)
    assert len(set(ended)) == n_attempts - 1, ended
    final = json.loads((rd / "cluster.stopped.json").read_text())
    assert final["extra"]["job_id"] not in (*ended, None) and final["expected_nodes"] == 2
    for job_id in ended:
        assert slurm.run("squeue", "-h", "-j", job_id).stdout.strip() == ""
    attempts = RunDir(rd).attempts()
    assert [a.attempt for a in attempts] == list(range(1, n_attempts + 1))
    steps = {a.attempt: [m["step"] for m in metric_lines(rd / f"metrics-a{a.attempt}.jsonl")] for a in attempts}
    # The attempt the time limit cut mid-run held after step 3; the next resumed at most one step back.
    trained = [a for a in range(1, n_attempts) if steps[a]]
    assert trained, steps
    cut = trained[-1]
    resumed = attempts[cut].resume_from_step  # of the attempt after ``cut`` (attempt numbers start at 1)
    assert max(steps[cut]) == held_after and 0 <= max(steps[cut]) - resumed <= 1, (steps, resumed)
    assert steps[n_attempts] == list(range(resumed + 1, total + 1))
    teardown = _xcom(dr, "teardown_ray_cluster")
    assert teardown["slurm_job_id"] == final["extra"]["job_id"]
    for extra in (_xcom(dr, "provision_ray_cluster")["extra"], final["extra"]):
        nothing_left(extra)
    first = steps[cut]
    record_result(RESULTS_FILE, "Slurm allocation time limit, verl saving ahead", {
        "killed_after_step": max(first), "resumed_from_step": resumed, "steps_redone": max(first) - resumed})


def test_slurmrestd_submits_watches_and_cancels_the_allocation(slurm: SlurmCluster) -> None:
    """The backend's Slurm calls through slurmrestd's REST API (UNIX socket, rest_auth/local): the
    allocation is submitted as the JSON job properties built from the profile, watched, found by
    name, and cancelled by teardown. (slurmrestd runs jobs as its own user, `nobody` here, who cannot
    execute this root-owned Python: the job holds the allocation with srun instead of starting Ray;
    Ray inside an allocation is covered by the sbatch tests above.)"""
    import os
    import tempfile

    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.cluster.registry import get_backend

    sock = slurm.start_rest()
    shared = Path(tempfile.mkdtemp(prefix="vp-rest-"))
    shared.chmod(0o777)  # written by the job's user
    try:
        backend = get_backend(slurm_test_spec(slurm, shared, slurmrestd={"url": f"unix:{sock}"}))
        name = f"pytest/rest-{os.getpid()}"
        workdir = backend.workdir_for(name)
        workdir.mkdir(parents=True)
        workdir.chmod(0o777)
        script = ('#!/bin/bash\nmapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\n'
                  'echo "nodes: ${NODES[*]} cpus: $SLURM_CPUS_PER_TASK"\n'
                  'for n in "${NODES[@]}"; do srun --overlap --nodes=1 --ntasks=1 -w "$n" sleep 600 & done\nwait\n')
        props = backend.rest_job_properties(name)
        assert props["nodes"] == 2 and props["cpus_per_task"] == 1 and props["time_limit"] == 30
        job_id = backend.rest.submit(script, props)
        handle = ClusterHandle(backend="slurm", name=name, dashboard_url="", owned=True, auth_mode="disabled",
                               expected_nodes=2, extra={"job_id": job_id, "workdir": str(workdir),
                                                        "slurmrestd": backend.rest.to_dict(), "cancel_timeout_s": 60})
        down: dict[str, Any] | None = None
        try:
            deadline = time.monotonic() + 60
            while backend.job(job_id).state != "RUNNING" and time.monotonic() < deadline:
                time.sleep(0.5)
            job = backend.job(job_id)
            assert job.state == "RUNNING" and job.nodes == "c[1-2]", job
            assert backend.jobs_named(backend.job_name(name)) == [job_id]
            assert backend.health(handle).alive
            # Slurm ran what the properties asked for, where they asked.
            info = slurm.run("scontrol", "show", "job", "-o", job_id).stdout
            assert "NumNodes=2" in info and "CPUs/Task=1" in info and "TimeLimit=00:30:00" in info
            assert f"JobName={backend.job_name(name)}" in info and "Partition=debug" in info
            output = workdir / f"slurm-{job_id}.out"
            while "nodes:" not in (output.read_text() if output.exists() else "") and time.monotonic() < deadline:
                time.sleep(0.5)
            assert output.read_text().startswith("nodes: c1 c2 cpus: 1")
            down = backend.teardown(handle)
        finally:
            if down is None:  # a failed check above: never leave the allocation running
                backend.teardown(handle)
        assert down["final_state"] == "CANCELLED" and down["state_before"] == "RUNNING"
        assert slurm.run("squeue", "-h", "-j", job_id).stdout.strip() == ""
        health = backend.health(handle)
        assert not health.alive and health.infrastructure
        assert backend.jobs_named(backend.job_name(name)) == []
        assert backend.job("999999").state == "GONE"
        deadline = time.monotonic() + 15
        while processes_of_job(job_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_of_job(job_id) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
