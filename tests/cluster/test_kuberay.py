"""The KubeRay backend: manifests against KubeRay's v1 CRD schemas (strict), profile checks, and its API calls
against a small in-memory fake of the CustomObjects API (no Kubernetes API server can run here)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.kuberay import KubeRayBackend
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.exceptions import ClusterError, ConfigError

REPO = Path(__file__).resolve().parents[2]
# KubeRay's v1 CRD schemas live beside the checkout in ../shared/kuberay (or $KUBERAY_CRD_SCHEMAS).
SCHEMAS = Path(os.environ.get("KUBERAY_CRD_SCHEMAS") or next(
    (d / "shared" / "kuberay" for d in REPO.parents if (d / "shared" / "kuberay").is_dir()),
    REPO.parent / "shared" / "kuberay"))
PROFILES = sorted((REPO / "configs" / "clusters").glob("kuberay-*.yaml"))


def strict(schema: Any) -> Any:
    """The CRD schema as strict JSON Schema: ``nullable`` → "or null", unknown fields rejected."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators() -> dict[str, Any]:
    from jsonschema import Draft7Validator

    files = {"RayCluster": SCHEMAS / "ray.io_rayclusters.v1.schema.json",
             "RayJob": SCHEMAS / "ray.io_rayjobs.v1.schema.json"}
    if not all(f.is_file() for f in files.values()):
        pytest.skip(f"KubeRay CRD schemas not found in {SCHEMAS}")
    return {kind: Draft7Validator(strict(json.loads(f.read_text()))) for kind, f in files.items()}


def _errors(validator: Any, manifest: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_the_strict_schema_rejects_unknown_fields(validators: dict[str, Any]) -> None:
    m = KubeRayBackend.from_spec({"backend": "kuberay"}).raycluster_manifest("r")
    assert _errors(validators["RayCluster"], m) == []
    bad = copy.deepcopy(m)
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["gpuCount"] = 8
    assert any("gpuCount" in e for e in _errors(validators["RayCluster"], bad))
    bad = copy.deepcopy(m)
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # must be a string
    assert _errors(validators["RayCluster"], bad)


@pytest.mark.parametrize("profile", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_manifest_of_every_profile_validates(profile: Path, validators: dict[str, Any]) -> None:
    spec = yaml.safe_load(profile.read_text())["cluster"]
    variants = [spec, {**spec, "workers": {**(spec.get("workers") or {}), "replicas": 0}},
                {**spec, "volumes": [], "tolerations": [], "node_selector": {}, "env": {}},
                {**spec, "rayjob": {"active_deadline_seconds": 3600, "backoff_limit": 2,
                                    "ttl_seconds_after_finished": 0, "shutdown_after_job_finishes": False}}]
    for variant in variants:
        backend = get_backend(variant)
        assert isinstance(backend, KubeRayBackend)
        for m in backend.manifests("verl_ppo/manual__2026-11-30T01:00:00+00:00"):
            assert _errors(validators[m["kind"]], m) == [], (profile.name, m["kind"])
            assert len(m["metadata"]["name"]) <= 47


def test_manifest_carries_the_profile() -> None:
    spec = yaml.safe_load((REPO / "configs" / "clusters" / "kuberay-gpu.yaml").read_text())["cluster"]
    b = get_backend(spec)
    m = b.raycluster_manifest("run")  # type: ignore[attr-defined]
    head, worker = m["spec"]["headGroupSpec"], m["spec"]["workerGroupSpecs"][0]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    wpod = worker["template"]["spec"]
    assert wpod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(spec["workers"]["gpus"])
    assert worker["rayStartParams"]["num-gpus"] == str(spec["workers"]["gpus"])
    assert worker["replicas"] == spec["workers"]["replicas"]
    assert wpod["tolerations"] == spec["tolerations"] and wpod["nodeSelector"] == spec["node_selector"]
    # Shared volumes at identical paths on head and workers, plus a memory-backed /dev/shm.
    for pod in (head["template"]["spec"], wpod):
        mounts = {v["mountPath"] for v in pod["containers"][0]["volumeMounts"]}
        assert {v["mount_path"] for v in spec["volumes"]} | {"/dev/shm"} == mounts
    j = b.rayjob_manifest("run", "python -m verl.trainer.main_ppo")  # type: ignore[attr-defined]
    assert j["spec"]["shutdownAfterJobFinishes"] is True and j["spec"]["backoffLimit"] == 0
    assert j["spec"]["ttlSecondsAfterFinished"] == spec["rayjob"]["ttl_seconds_after_finished"]
    assert j["spec"]["activeDeadlineSeconds"] == spec["rayjob"]["active_deadline_seconds"]


@pytest.mark.parametrize("key,value", [
    ("namespace", "ML_Team"), ("image", ""), ("image", "ray latest"), ("mode", "deployment"),
    ("head", {"cpu": "lots"}), ("workers", {"replicas": -1}), ("workers", {"gpus": 1.5}),
    ("workers", {"memory": "64GB"}), ("workers", {"cpu": "0"}), ("workers", {"colour": "red"}),
    ("volumes", [{"name": "shared", "claim": "c", "mount_path": "shared"}]),
    ("volumes", [{"name": "Shared", "claim": "c", "mount_path": "/shared"}]),
    ("volumes", [{"name": "shared"}]), ("tolerations", [{"key": "k", "operator": "Maybe"}]),
    ("tolerations", [{"key": "k", "effect": "Sometimes"}]), ("tolerations", [{"kee": "typo"}]),
    ("node_selector", {"gpu": 1}), ("shm_size", "big"), ("dashboard_url", "head:8265"),
    ("rayjob", {"backoff_limit": -1}), ("rayjob", {"ttl": 5}), ("env", {"1BAD": "x"}), ("replicas", 2),
    ("env", {"RAY_AUTH_MODE": "token"}),
])
def test_invalid_profile_values_are_rejected_before_any_api_call(key: str, value: object) -> None:
    fake = FakeCustomObjects()
    with pytest.raises(ConfigError) as e:
        KubeRayBackend.from_spec({"backend": "kuberay", key: value}).with_api(fake).provision("r")
    assert e.value.key.startswith(f"cluster.{key}")
    assert fake.calls == []


# -- the API calls, against a fake of the CustomObjects API -------------------------------------------------
class ApiError(Exception):
    """Shaped like kubernetes.client.ApiException (status, reason, body)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"({status}) {reason}")
        self.status, self.reason, self.body = status, reason, None


class FakeCustomObjects:
    """In-memory ray.io/v1 objects; plays the operator by marking a RayCluster ready after ``ready_after`` reads."""

    def __init__(self, *, ready_after: int = 2, fail: dict[str, Exception] | None = None,
                 never_ready: bool = False) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.reads: dict[str, int] = {}
        self.ready_after, self.never_ready, self.fail = ready_after, never_ready, fail or {}
        self.timeouts: list[float] = []

    def _check(self, op: str, group: str, version: str, kwargs: dict[str, Any]) -> None:
        assert (group, version) == ("ray.io", "v1")
        self.timeouts.append(kwargs["_request_timeout"])
        if op in self.fail:
            raise self.fail[op]

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.calls.append(("create", body["metadata"]["name"]))
        self._check("create", group, version, kw)
        key = (namespace, plural, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists")
        self.objects[key] = {**copy.deepcopy(body), "status": {}}
        return self.objects[key]

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **kw: Any) -> dict[str, Any]:
        self.calls.append(("get", name))
        self._check("get", group, version, kw)
        obj = self.objects.get((namespace, plural, name))
        if obj is None:
            raise ApiError(404, "NotFound")
        self.reads[name] = self.reads.get(name, 0) + 1
        if plural == "rayclusters" and self.reads[name] >= self.ready_after and not self.never_ready:
            replicas = sum(g.get("replicas", 0) for g in obj["spec"].get("workerGroupSpecs", []))
            obj["status"] = {"state": "ready", "readyWorkerReplicas": replicas,
                             "conditions": [{"type": "HeadPodReady", "status": "True"}]}
        return copy.deepcopy(obj)

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                        **kw: Any) -> dict[str, Any]:
        self.calls.append(("delete", name))
        self._check("delete", group, version, kw)
        if self.objects.pop((namespace, plural, name), None) is None:
            raise ApiError(404, "NotFound")
        return {"status": "Success"}


@pytest.fixture(scope="module")
def open_ray_cluster() -> Iterator[ClusterHandle]:
    """A real local one-node Ray head with auth disabled, as the pipeline's KubeRay clusters run
    (the session's shared cluster uses token auth, which a KubeRay handle does not send)."""
    from verl_pipeline.cluster.local import LocalBackend

    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 2, "stop_grace_s": 3, "auth_mode": "disabled"})
    handle = backend.provision(f"pytest/kuberay-stand-in-{os.getpid()}")
    yield handle
    backend.teardown(handle)


@pytest.fixture
def kuberay_spec(open_ray_cluster: ClusterHandle) -> Iterator[dict[str, Any]]:
    """A profile whose dashboard URL reaches a real (local, one-node) Ray cluster: the readiness gate is real."""
    yield {"backend": "kuberay", "namespace": "ml", "workers": {"replicas": 0}, "head": {"cpu": "2"},
           "dashboard_url": open_ray_cluster.dashboard_url, "ready_timeout_s": 20, "poll_s": 0.05}


@pytest.mark.integration
def test_create_wait_delete(kuberay_spec: dict[str, Any]) -> None:
    fake = FakeCustomObjects(ready_after=3)
    backend = KubeRayBackend.from_spec(kuberay_spec).with_api(fake)
    handle = backend.provision("verl_ppo/run-1")
    name = handle.extra["resource"]
    assert ("ml", "rayclusters", name) in fake.objects and fake.reads[name] == 3
    assert handle.extra["created"] is True and handle.expected_nodes == 1
    assert backend.health(handle).alive
    assert all(t == 30.0 for t in fake.timeouts), "every call carries a request timeout"
    result = backend.teardown(handle)
    assert result == {"deleted": name, "already_gone": False, "seconds": result["seconds"]}
    assert fake.objects == {}
    assert [c[0] for c in fake.calls].count("delete") == 1
    health = backend.health(handle)
    assert not health.alive and health.state == "GONE" and health.infrastructure
    # Deleting again is harmless (404 = already gone).
    assert backend.teardown(handle)["already_gone"] is True


@pytest.mark.integration
def test_existing_cluster_409_is_reused_and_not_deleted_on_failure(kuberay_spec: dict[str, Any]) -> None:
    fake = FakeCustomObjects(ready_after=1)
    backend = KubeRayBackend.from_spec(kuberay_spec).with_api(fake)
    first = backend.provision("verl_ppo/run-1")
    again = backend.provision("verl_ppo/run-1")
    assert again.extra["resource"] == first.extra["resource"] and again.extra["created"] is False
    assert len(fake.objects) == 1
    with pytest.raises(ClusterError, match=r"already exists and cluster\.reuse is false"):
        KubeRayBackend.from_spec({**kuberay_spec, "reuse": False}).with_api(fake).provision("verl_ppo/run-1")
    assert len(fake.objects) == 1, "a cluster the pipeline did not create here is never deleted by a failure"


def test_forbidden_names_the_rbac_fix() -> None:
    fake = FakeCustomObjects(fail={"create": ApiError(403, "Forbidden")})
    with pytest.raises(ClusterError, match=r"403 Forbidden.*rayclusters.ray.io.*namespace ml"):
        KubeRayBackend.from_spec({"backend": "kuberay", "namespace": "ml"}).with_api(fake).provision("r")
    fake = FakeCustomObjects(fail={"create": ApiError(404, "NotFound")})
    with pytest.raises(ClusterError, match="KubeRay operator with its CRDs installed"):
        KubeRayBackend.from_spec({"backend": "kuberay"}).with_api(fake).provision("r")


def test_api_timeout_is_a_cluster_error() -> None:
    class ReadTimeoutError(Exception):
        pass

    fake = FakeCustomObjects(fail={"create": ReadTimeoutError("Read timed out. (read timeout=5)")})
    with pytest.raises(ClusterError, match="Kubernetes API timed out after 5s"):
        KubeRayBackend.from_spec({"backend": "kuberay", "request_timeout_s": 5}).with_api(fake).provision("r")


def test_pods_never_ready_times_out_and_deletes_what_it_created() -> None:
    fake = FakeCustomObjects(never_ready=True)
    backend = KubeRayBackend.from_spec({"backend": "kuberay", "workers": {"replicas": 2}, "ready_timeout_s": 0.3,
                                        "poll_s": 0.05}).with_api(fake)
    with pytest.raises(ClusterError, match=r"not ready after 0s.*0/2 workers ready.*kubectl describe raycluster"):
        backend.provision("r")
    assert fake.objects == {} and ("delete", backend.resource_name("r")) in fake.calls


@pytest.mark.integration
def test_ray_not_answering_behind_a_ready_resource_times_out(open_ray_cluster: ClusterHandle) -> None:
    # KubeRay says ready, but the dashboard expects 3 nodes and the Ray cluster has 1.
    fake = FakeCustomObjects(ready_after=1)
    backend = KubeRayBackend.from_spec({"backend": "kuberay", "workers": {"replicas": 2}, "head": {"cpu": "1"},
                                        "dashboard_url": open_ray_cluster.dashboard_url, "ready_timeout_s": 2,
                                        "poll_s": 0.2}).with_api(fake)
    with pytest.raises(ClusterError, match=r"expected 3 node\(s\)"):
        backend.provision("r")
    assert fake.objects == {}


def test_rayjob_is_created_with_its_lifecycle_settings() -> None:
    fake = FakeCustomObjects()
    backend = KubeRayBackend.from_spec({"backend": "kuberay", "rayjob": {"active_deadline_seconds": 7200}})
    obj = backend.with_api(fake).submit_rayjob("r", "python -m verl.trainer.main_ppo", "env_vars: {}\n")
    assert obj["kind"] == "RayJob" and obj["spec"]["activeDeadlineSeconds"] == 7200
    with pytest.raises(ClusterError, match="already exists"):
        backend.with_api(fake).submit_rayjob("r", "python -m verl.trainer.main_ppo")


def test_default_dashboard_url_is_the_head_service() -> None:
    fake = FakeCustomObjects(ready_after=1)
    backend = KubeRayBackend.from_spec({"backend": "kuberay", "namespace": "ml", "workers": {"replicas": 0},
                                        "ready_timeout_s": 0.5, "poll_s": 0.1}).with_api(fake)
    with pytest.raises(ClusterError) as e:
        backend.provision("r")
    assert f"http://{backend.resource_name('r')}-head-svc.ml.svc.cluster.local:8265" in str(e.value)
