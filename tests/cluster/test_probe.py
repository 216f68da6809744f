"""The environment probe on real local Ray clusters (CPU only: no GPUs, no vLLM, no flash-attn here).

A forced training run fails in the submit task within seconds, naming every node's missing
package; preflight reports the same and succeeds; a 2-node cluster reports both nodes, names a
model path that does not exist, and a node that stops answering is reported without hanging.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tests.airflow.context import provisioned, task_context
from tests.trainer.test_cluster_checks import _inputs
from verl_pipeline import steps
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.probe import run_probe
from verl_pipeline.constants import Mode
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.trainer.environment import evaluate, needs_for

pytestmark = pytest.mark.integration


def _probe_jobs(handle: ClusterHandle, before: set[str]) -> tuple[list[Any], list[Any]]:
    """Jobs submitted since ``before``: (probe jobs, any other job)."""
    new = [j for j in handle.client().list_jobs() if j.submission_id not in before]
    probes = [j for j in new if j.metadata.get("purpose") == "environment-probe"]
    return probes, [j for j in new if j not in probes]


def test_forced_train_on_a_cpu_cluster_fails_in_submit_naming_what_is_missing(
    ray_cluster: ClusterHandle, tiny_model_path: Path
) -> None:
    from verl_pipeline.airflow.operators import SubmitVerlJobOperator

    spec = build_run_spec({"mode": "train"}, run_name="manual__probe_train")
    data, models = _inputs(spec, tiny_model_path)
    before = {j.submission_id for j in ray_cluster.client().list_jobs()}
    ctx = task_context({"provision_ray_cluster": ray_cluster.to_dict(), "preprocess_data": data,
                        "prefetch_model": models}, {"mode": "train"}, run_id="manual__probe_train")
    provisioned(ctx)
    t0 = time.monotonic()
    with pytest.raises(AirflowFailException) as err:
        SubmitVerlJobOperator(task_id="submit_verl_job").execute(ctx)
    seconds = time.monotonic() - t0
    text = str(err.value)
    assert text.startswith("EnvironmentCheckError: the cluster cannot run this verl training job")
    assert "\n" not in text
    # The cluster's totals, then each node's missing packages with the fix.
    assert re.search(r"cluster\.CPU=2\.0: a verl training job .* TransferQueue storage actors", text)
    assert "cluster.GPU=0.0" in text
    assert "(head " in text and "torch='2.13.0+cpu': is a CPU build" in text
    assert "vllm=\"ModuleNotFoundError: No module named 'vllm'\"" in text and "requirements/gpu.txt" in text
    assert "flash-attn=\"ModuleNotFoundError: No module named 'flash_attn'\"" in text and "load_valuehead_model" in text
    # No verl job was submitted: only the probe ran, and it finished.
    probes, others = _probe_jobs(ray_cluster, before)
    assert others == [] and len(probes) == 1
    assert seconds < 60, f"the submit task took {seconds:.1f}s to fail"
    print(f"\nforced train failed in the submit task after {seconds:.1f}s")


def test_preflight_reports_what_a_gpu_run_would_miss_and_submits(
    ray_cluster: ClusterHandle, tiny_model_path: Path
) -> None:
    spec = build_run_spec({"mode": "preflight"}, run_name="manual__probe_preflight")
    data, models = _inputs(spec, tiny_model_path)
    prepared = steps.prepare_job(spec, ray_cluster, ray_cluster.client(), data=data, models=models,
                                 id_prefix="verl-test-preflight")
    env = prepared.environment
    assert prepared.mode is Mode.PREFLIGHT and not env["enforced"] and not env["ok"]
    assert [n["answered"] for n in env["nodes"]] == [True]
    node = env["nodes"][0]
    assert node["modules"]["vllm"].startswith("missing") and node["modules"]["flash_attn"].startswith("missing")
    assert node["modules"]["verl"] == "0.9.1" and node["torch"].startswith("2.13.0") and node["cuda"] is None
    assert all(node["paths"].values()) and str(tiny_model_path) in node["paths"]
    whats = {p.split(": ")[1].split("=")[0] for p in env["problems"] if p.startswith("node ")}
    assert whats == {"torch", "vllm", "flash-attn"}
    assert any(p.startswith("cluster.GPU=0.0") for p in env["problems"])
    assert RunDir(spec.run_dir).environment_file.is_file() and RunDir(spec.run_dir).job_file.is_file()
    # Where the probe's time went is kept (a GPU node's imports take seconds; the job's start is Ray's).
    phases = env["phases_s"]
    assert all(isinstance(phases[k], float) and phases[k] >= 0 for k in ("submit", "ray_init", "node_tasks"))
    # Inside the probe's wall time (the driver may start while the submit call returns: a little slack).
    assert phases["submit"] + phases["ray_init"] + phases["node_tasks"] <= env["seconds"] + 1.0
    assert set(node["module_seconds"]) == set(node["modules"])
    # What the decisions read: the versions every node reports; no GPU node here, so nothing is decided
    # for nodes (the job keeps the run's settings, and the preflight job its provision's validation).
    assert node["versions"]["verl"] == "0.9.1" and node["versions"]["torch"].startswith("2.13.0")
    assert env["found"]["probed"] and env["found"]["gpu_nodes"] == [] and env["decided"].startswith(
        "attention: undecided")
    assert prepared.decision is not None and prepared.decision.settings == {} and not prepared.decision.caches.enabled
    assert prepared.job.decision == prepared.decision.to_dict() == RunDir(spec.run_dir).job()["decision"]
    print(f"\nprobe of the embedded default: {env['seconds']}s ({phases})")


def test_two_nodes_are_probed_a_missing_model_is_named_and_a_hung_node_is_reported(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    from verl_pipeline.cluster.local import LocalBackend

    backend = LocalBackend.from_spec({"backend": "local", "nodes": 2, "num_cpus": 1, "object_store_memory_mb": 200,
                                      "ready_timeout_s": 180, "stop_grace_s": 2})
    handle = backend.provision(f"pytest/probe-2node-{os.getpid()}")
    try:
        spec = build_run_spec({"mode": "train", "model_source": str(tiny_model_path)}, run_name="probe/2node")
        data, _ = _inputs(spec, tiny_model_path)
        missing = tmp_path / "no-such-model"
        job = steps.render(spec, data=data, models={"actor": {"path": str(missing)}}, mode=Mode.TRAIN)
        needs = needs_for(job.settings)
        raw = run_probe(handle.client(), request=needs.request(), runtime_env=job.runtime_env,
                        id_prefix="verl-test-2node", timeout_s=60)
        assert sorted(n["is_head"] for n in raw["nodes"]) == [False, True]
        assert all(n["facts"] for n in raw["nodes"]) and len({n["node_id"] for n in raw["nodes"]}) == 2
        lines = [f.line() for f in evaluate(needs, raw["nodes"]) if "no-such-model" in f.line()]
        # Both nodes name the path, for the actor and for the critic that reads the same model.
        assert {line.split(": ")[0] for line in lines} == {f"node {n['ip']} ({'head' if n['is_head'] else 'worker'} "
                                                           f"{n['node_id'][:8]})" for n in raw["nodes"]}
        assert all("does not exist on this node" in line and "storage.root" in line for line in lines)
        assert len(lines) == 4

        # A node that stops answering (frozen) is reported after the timeout; the probe does not hang.
        worker = next(n for n in handle.extra["nodes"] if n["rank"] == 1)
        os.killpg(int(worker["pgid"]), signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hung = run_probe(handle.client(), request=needs.request(), runtime_env=job.runtime_env,
                             id_prefix="verl-test-2node", timeout_s=5)
            elapsed = time.monotonic() - t0
        finally:
            os.killpg(int(worker["pgid"]), signal.SIGKILL)
        by_head = {n["is_head"]: n for n in hung["nodes"]}
        assert by_head[True]["facts"] and not by_head[False].get("facts")
        assert "no answer within 5s" in by_head[False]["error"] or "died" in by_head[False]["error"]
        findings = evaluate(needs, hung["nodes"])
        assert [f.blocking for f in findings if f.what == "probe"] == [False]
        assert elapsed < 60
    finally:
        backend.teardown(handle)
