"""A Ray cluster on Kubernetes through the KubeRay operator: a ``RayCluster`` (or a ``RayJob``) resource.

Provision = validate the profile, create the ``RayCluster`` (or reuse the one of the same name),
wait until KubeRay reports the head and every worker ready, then the readiness gate every backend
shares against the dashboard Service. Teardown deletes the ``RayCluster`` only (never the operator).
All API calls go through ``kubernetes.client.CustomObjectsApi``; the cluster credentials come from
an Airflow connection (in-cluster or a kubeconfig) or the profile.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from verl_pipeline import auth
from verl_pipeline.cluster.base import RAY_NODE_ENV, ClusterBackend, ClusterHandle, ClusterHealth, wait_ready
from verl_pipeline.cluster.settings import Key, Parser, environment, read_settings, setting
from verl_pipeline.exceptions import ClusterError, ConfigError
from verl_pipeline.paths import short_hash, slug

log = logging.getLogger(__name__)

GROUP = "ray.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURALS = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}
DASHBOARD_PORT = 8265

_DNS_LABEL = re.compile(r"(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_RULE = "must be a DNS-1123 label (lowercase letters, digits, '-', <= 63)"
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
MODES = ("raycluster", "rayjob")
#: Ray's auth on the clusters this backend starts: none yet (docs/security.md says how to restrict the Service).
AUTH_MODE = auth.AuthMode.DISABLED


@dataclass(frozen=True)
class Group:
    """Pod shape of the head or of one worker group."""

    cpu: str
    memory: str
    gpus: int = 0
    replicas: int = 1

    def resources(self) -> dict[str, Any]:
        amounts: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            amounts["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True)
class Volume:
    name: str
    claim: str
    mount_path: str


def _cpu_count(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _label(path: str, value: Any, example: str) -> str:
    if not isinstance(value, str) or not _DNS_LABEL.fullmatch(value):
        raise ConfigError(path, value, _LABEL_RULE, f"{path.rsplit('.', 1)[-1]}: {example}")
    return value


def _group(*, replicas: bool) -> Parser:
    """A parser of the head's (``replicas=False``) or the workers' pod shape: what it leaves out is the default's."""

    def parse(key: Key, value: Any) -> Group:
        default: Group = key.default
        if not isinstance(value, dict):
            raise key.refuse(value, "must be a mapping", "{cpu: '8', memory: 64Gi}")
        allowed = {"cpu", "memory", "gpus"} | ({"replicas"} if replicas else set())
        for k in value:
            if k not in allowed:
                raise ConfigError(f"{key.path}.{k}", value[k], f"unknown setting of {key.name}",
                                  f"use one of {sorted(allowed)}")
        cpu, memory = str(value.get("cpu", default.cpu)), str(value.get("memory", default.memory))
        for k, v in (("cpu", cpu), ("memory", memory)):
            if not _QUANTITY.match(v) or (k == "cpu" and _cpu_count(v) <= 0):
                raise ConfigError(f"{key.path}.{k}", value.get(k), "must be a positive Kubernetes quantity",
                                  "cpu: '8' or '500m'; memory: 64Gi")
        gpus = value.get("gpus", default.gpus)
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 16:
            raise ConfigError(f"{key.path}.gpus", gpus, "must be an integer 0-16", "gpus: 8")
        n = value.get("replicas", default.replicas)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1000:
            raise ConfigError(f"{key.path}.replicas", n, "must be an integer 0-1000", "replicas: 2")
        return Group(cpu, memory, gpus, n)

    return parse


def _volumes(key: Key, value: Any) -> tuple[Volume, ...]:
    if not isinstance(value, list):
        raise key.refuse(value, "must be a list", "[{name: shared, claim: verl-shared, mount_path: /shared}]")
    volumes = []
    for i, v in enumerate(value):
        if not isinstance(v, dict) or set(v) != {"name", "claim", "mount_path"}:
            raise ConfigError(f"{key.path}[{i}]", v, "needs exactly name, claim (a PVC) and mount_path",
                              "{name: shared, claim: verl-shared, mount_path: /shared}")
        if not str(v["mount_path"]).startswith("/"):
            raise ConfigError(f"{key.path}[{i}].mount_path", v["mount_path"], "must be absolute "
                              "(and the same path the Airflow workers use)", "mount_path: /shared")
        volumes.append(Volume(_label(f"{key.path}[{i}].name", v["name"], "shared"),
                              _label(f"{key.path}[{i}].claim", v["claim"], "verl-shared"), str(v["mount_path"])))
    return tuple(volumes)


def _tolerations(key: Key, value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise key.refuse(value, "must be a list", "[]")
    for i, t in enumerate(value):
        if not isinstance(t, dict) or not set(t) <= _TOLERATION_KEYS:
            raise ConfigError(f"{key.path}[{i}]", t, f"may only have {sorted(_TOLERATION_KEYS)}",
                              "{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}")
        if t.get("operator", "Equal") not in ("Equal", "Exists"):
            raise ConfigError(f"{key.path}[{i}].operator", t.get("operator"), "must be Equal or Exists",
                              "operator: Exists")
        if "effect" in t and t["effect"] not in _EFFECTS:
            raise ConfigError(f"{key.path}[{i}].effect", t["effect"], f"must be one of {sorted(_EFFECTS)}",
                              "effect: NoSchedule")
        if "tolerationSeconds" in t and not isinstance(t["tolerationSeconds"], int):
            raise ConfigError(f"{key.path}[{i}].tolerationSeconds", t["tolerationSeconds"], "must be an integer",
                              "tolerationSeconds: 300")
    return tuple(dict(t) for t in value)


def _node_selector(key: Key, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and _LABEL_KEY.match(k) and isinstance(v, str) for k, v in value.items()
    ):
        raise key.refuse(value, "must map label keys to string values",
                         "{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}")
    return dict(value)


def _image_pull_secrets(key: Key, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise key.refuse(value, "must be a list of Secret names", "[regcred]")
    return tuple(_label(key.path, s, "regcred") for s in value)


def _dashboard_url(key: Key, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise key.refuse(value, "must be an http(s) URL", "http://127.0.0.1:8265")
    return value.rstrip("/")


@dataclass(frozen=True)
class KubeApi:
    """The Kubernetes API as a KubeRay backend reaches it: its ``CustomObjectsApi`` built from an Airflow
    connection, in-cluster credentials or a kubeconfig, and its errors as ClusterErrors saying what to
    grant or install."""

    namespace: str
    conn_id: str | None = None
    in_cluster: bool = False
    kube_config_path: str | None = None
    kube_context: str | None = None
    request_timeout_s: float = 30.0
    #: A CustomObjectsApi-compatible object (tests); None = built from the credentials.
    api: Any = field(default=None, repr=False, compare=False)

    def objects(self) -> Any:
        """The ``CustomObjectsApi``."""
        if self.api is not None:
            return self.api
        from kubernetes import client, config

        in_cluster, path, context = self.in_cluster, self.kube_config_path, self.kube_context
        inline: dict[str, Any] | None = None
        if self.conn_id:
            in_cluster, path, context, inline = _from_airflow_connection(self.conn_id, in_cluster, path, context)
        try:
            if in_cluster:
                config.load_incluster_config()
                return client.CustomObjectsApi()
            api_client = (config.new_client_from_config_dict(inline, context=context) if inline is not None
                          else config.new_client_from_config(config_file=path, context=context))
        except Exception as e:  # ConfigException, missing files …
            raise ClusterError(f"cannot load the Kubernetes configuration (in_cluster={in_cluster}, "
                               f"kube_config_path={path}, connection={self.conn_id}): {e}") from e
        return client.CustomObjectsApi(api_client)

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with the request timeout; a refusal, a missing API or a timeout as a ClusterError."""
        try:
            return fn(*args, _request_timeout=self.request_timeout_s, **kwargs)
        except Exception as e:
            status = getattr(e, "status", None)
            if status == 403:
                raise ClusterError(
                    f"Kubernetes refused to {what} (403 Forbidden): grant the Airflow identity get/create/delete "
                    f"on rayclusters.ray.io (and rayjobs.ray.io) in namespace {self.namespace}: {_reason(e)}"
                ) from e
            if status == 404 and what.startswith("create"):
                raise ClusterError(f"cannot {what}: the ray.io/v1 API is not served in namespace {self.namespace} "
                                   f"(is the KubeRay operator with its CRDs installed?): {_reason(e)}") from e
            timed_out = type(e).__name__.endswith("TimeoutError") or "timed out" in str(e).lower()
            if status is None and timed_out:
                raise ClusterError(f"the Kubernetes API timed out after {self.request_timeout_s:.0f}s while trying "
                                   f"to {what}: {e}") from e
            raise

    def get(self, api: Any, plural: str, name: str) -> dict[str, Any] | None:
        """The namespace's object ``plural/name``; None when it does not exist."""
        try:
            obj: dict[str, Any] = self.call(f"get {plural}/{name}", api.get_namespaced_custom_object, GROUP, VERSION,
                                            self.namespace, plural, name)
            return obj
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return None
            raise


_SECONDS = setting(gt=0)
_LABEL = setting(pattern=_DNS_LABEL, rule=_LABEL_RULE)
_RAYJOB_COUNT = setting(section="rayjob", ge=0)


@dataclass(frozen=True)
class KubeRayBackend(ClusterBackend):
    """Settings of a ``kuberay`` cluster profile (see configs/clusters/kuberay-*.yaml)."""

    namespace: str = field(default="default", metadata=_LABEL)
    image: str = field(default="rayproject/ray:2.60.0-py311-gpu",
                       metadata=setting(pattern=re.compile(r"\S+"), rule="must be a container image reference"))
    ray_version: str = field(default="2.60.0", metadata=setting())
    mode: str = field(default="raycluster", metadata=setting(choices=MODES))
    name_prefix: str = field(default="verl", metadata=_LABEL)
    head: Group = field(default=Group("4", "16Gi", 0, 1), metadata=setting(parse=_group(replicas=False)))
    workers: Group = field(default=Group("8", "64Gi", 0, 1), metadata=setting(parse=_group(replicas=True)))
    worker_group: str = "workers"
    volumes: tuple[Volume, ...] = field(default=(), metadata=setting(parse=_volumes))
    shm_size: str = field(default="16Gi", metadata=setting(pattern=_QUANTITY, rule="must be a Kubernetes quantity",
                                                          example="64Gi"))
    env: dict[str, str] = field(default_factory=dict, metadata=setting(parse=environment(
        auth_fix="a KubeRay cluster runs with Ray's auth disabled, its dashboard a Service inside Kubernetes "
                 "(docs/security.md)")))
    tolerations: tuple[dict[str, Any], ...] = field(default=(), metadata=setting(parse=_tolerations))
    node_selector: dict[str, str] = field(default_factory=dict, metadata=setting(parse=_node_selector))
    service_account: str | None = field(default=None, metadata=setting(pattern=_DNS_LABEL, rule=_LABEL_RULE,
                                                                       example="verl-ray"))
    image_pull_secrets: tuple[str, ...] = field(default=(), metadata=setting(parse=_image_pull_secrets))
    reuse: bool = field(default=True, metadata=setting())
    dashboard_url: str | None = field(default=None, metadata=setting(parse=_dashboard_url))
    conn_id: str | None = field(default=None, metadata=setting(example="kubernetes_default"))
    in_cluster: bool = field(default=False, metadata=setting())
    kube_config_path: str | None = field(default=None, metadata=setting(example="~/.kube/config"))
    kube_context: str | None = field(default=None, metadata=setting(example="<a context of the kubeconfig>"))
    ready_timeout_s: float = field(default=900.0, metadata=_SECONDS)
    request_timeout_s: float = field(default=30.0, metadata=_SECONDS)
    poll_s: float = field(default=5.0, metadata=_SECONDS)
    shutdown_after_job_finishes: bool = field(default=True, metadata=setting(section="rayjob"))
    ttl_seconds_after_finished: int = field(default=600, metadata=_RAYJOB_COUNT)
    active_deadline_seconds: int | None = field(default=None, metadata=setting(section="rayjob", ge=0,
                                                                               example="7200"))
    backoff_limit: int = field(default=0, metadata=_RAYJOB_COUNT)
    #: A CustomObjectsApi-compatible object (tests); None = built from the connection on first use.
    api: Any = field(default=None, repr=False, compare=False)
    kind: str = "kuberay"

    # -- configuration -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> KubeRayBackend:
        return read_settings(cls, spec)

    def with_api(self, api: Any) -> KubeRayBackend:
        return replace(self, api=api)

    # -- manifests -------------------------------------------------------------------------------
    def resource_name(self, name: str) -> str:
        """A DNS-1123 name short enough for KubeRay's derived names (``<name>-head-svc`` …)."""
        return f"{self.name_prefix}-{slug(name, 24)}-{short_hash(name, length=8)}"[:47].strip("-")

    def _pod_template(self, container_name: str, group: Group, ports: list[dict[str, Any]]) -> dict[str, Any]:
        env = [{"name": auth.MODE_VAR, "value": AUTH_MODE.value}]
        env += [{"name": k, "value": v} for k, v in {**RAY_NODE_ENV, **self.env}.items()]
        mounts = [{"name": v.name, "mountPath": v.mount_path} for v in self.volumes]
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes: list[dict[str, Any]] = [{"name": v.name, "persistentVolumeClaim": {"claimName": v.claim}}
                                         for v in self.volumes]
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}})
        container: dict[str, Any] = {"name": container_name, "image": self.image, "resources": group.resources(),
                                     "env": env, "volumeMounts": mounts}
        if ports:
            container["ports"] = ports
        pod: dict[str, Any] = {"containers": [container], "volumes": volumes}
        if self.tolerations:
            pod["tolerations"] = [dict(t) for t in self.tolerations]
        if self.node_selector:
            pod["nodeSelector"] = dict(self.node_selector)
        if self.service_account:
            pod["serviceAccountName"] = self.service_account
        if self.image_pull_secrets:
            pod["imagePullSecrets"] = [{"name": s} for s in self.image_pull_secrets]
        return {"spec": pod}

    def cluster_spec(self) -> dict[str, Any]:
        head_ports = [{"containerPort": 6379, "name": "gcs-server"},
                      {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                      {"containerPort": 10001, "name": "client"}]
        spec: dict[str, Any] = {
            "rayVersion": self.ray_version,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": str(int(_cpu_count(self.head.cpu))),
                                   "num-gpus": str(self.head.gpus)},
                "template": self._pod_template("ray-head", self.head, head_ports),
            },
            "workerGroupSpecs": [],
        }
        if self.workers.replicas:
            spec["workerGroupSpecs"].append({
                "groupName": self.worker_group,
                "replicas": self.workers.replicas,
                "minReplicas": self.workers.replicas,
                "maxReplicas": self.workers.replicas,
                "rayStartParams": {"num-cpus": str(int(_cpu_count(self.workers.cpu))),
                                   "num-gpus": str(self.workers.gpus)},
                "template": self._pod_template("ray-worker", self.workers, []),
            })
        return spec

    def _metadata(self, name: str) -> dict[str, Any]:
        return {"name": self.resource_name(name), "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": "verl-pipeline",
                           "verl-pipeline/run": short_hash(name, length=16)}}

    def raycluster_manifest(self, name: str) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": "RayCluster", "metadata": self._metadata(name),
                "spec": self.cluster_spec()}

    def rayjob_manifest(self, name: str, entrypoint: str, runtime_env_yaml: str | None = None) -> dict[str, Any]:
        """A ``RayJob`` running ``entrypoint`` on its own cluster, deleted after it finishes."""
        spec: dict[str, Any] = {
            "entrypoint": entrypoint,
            "shutdownAfterJobFinishes": self.shutdown_after_job_finishes,
            "ttlSecondsAfterFinished": self.ttl_seconds_after_finished,
            "backoffLimit": self.backoff_limit,
            "rayClusterSpec": self.cluster_spec(),
        }
        if self.active_deadline_seconds is not None:
            spec["activeDeadlineSeconds"] = self.active_deadline_seconds
        if runtime_env_yaml:
            spec["runtimeEnvYAML"] = runtime_env_yaml
        return {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": self._metadata(name), "spec": spec}

    def manifests(self, name: str, entrypoint: str = "python -m verl.trainer.main_ppo") -> list[dict[str, Any]]:
        """Every manifest this profile can produce (what the schema tests validate)."""
        return [self.raycluster_manifest(name), self.rayjob_manifest(name, entrypoint, "env_vars: {A: '1'}\n")]

    # -- the Kubernetes API ----------------------------------------------------------------------
    def _kube(self) -> KubeApi:
        return KubeApi(self.namespace, self.conn_id, self.in_cluster, self.kube_config_path, self.kube_context,
                       self.request_timeout_s, self.api)

    # -- lifecycle -------------------------------------------------------------------------------
    def provision(self, name: str) -> ClusterHandle:
        if self.mode != "raycluster":
            raise ConfigError("cluster.mode", self.mode, "the pipeline provisions a RayCluster and submits the job "
                              "itself; RayJob manifests come from submit_rayjob()", "mode: raycluster")
        kube = self._kube()
        api = kube.objects()
        manifest = self.raycluster_manifest(name)
        rname = manifest["metadata"]["name"]
        created = True
        try:
            kube.call(f"create RayCluster {rname}", api.create_namespaced_custom_object, GROUP, VERSION,
                       self.namespace, PLURALS["RayCluster"], manifest)
            log.info("Created RayCluster %s/%s (%d worker(s) x %s GPU)", self.namespace, rname,
                     self.workers.replicas, self.workers.gpus)
        except Exception as e:
            if getattr(e, "status", None) != 409:
                if isinstance(e, ClusterError):
                    raise
                raise ClusterError(f"cannot create RayCluster {self.namespace}/{rname}: {_reason(e)}") from e
            if not self.reuse:
                raise ClusterError(f"RayCluster {self.namespace}/{rname} already exists and cluster.reuse is false: "
                                   "delete it or set reuse: true") from e
            created = False
            log.info("RayCluster %s/%s already exists: reusing it", self.namespace, rname)
        handle = ClusterHandle(
            backend=self.kind, name=name,
            dashboard_url=self.dashboard_url or f"http://{rname}-head-svc.{self.namespace}.svc.cluster.local:"
                                                f"{DASHBOARD_PORT}",
            # handle.conn_id names the Ray token's connection; the Kubernetes one goes in extra.
            owned=True, auth_mode=AUTH_MODE.value,
            expected_nodes=1 + self.workers.replicas,
            expected_cpus=_cpu_count(self.head.cpu) // 1 + self.workers.replicas * (_cpu_count(self.workers.cpu) // 1),
            expected_gpus=self.head.gpus + self.workers.replicas * self.workers.gpus,
            extra={"resource": rname, "namespace": self.namespace, "created": created, "kube_conn_id": self.conn_id,
                   "in_cluster": self.in_cluster, "kube_config_path": self.kube_config_path,
                   "kube_context": self.kube_context, "request_timeout_s": self.request_timeout_s},
        )
        try:
            self._wait_pods_ready(api, rname)
            wait_ready(handle, timeout_s=self.ready_timeout_s, poll_s=self.poll_s)
        except BaseException:
            if created:
                self.teardown(handle)
            raise
        return handle

    def _wait_pods_ready(self, api: Any, rname: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.ready_timeout_s
        status: dict[str, Any] = {}
        while True:
            obj = self._kube().get(api, PLURALS["RayCluster"], rname)
            if obj is None:
                raise ClusterError(f"RayCluster {self.namespace}/{rname} disappeared while starting")
            status = obj.get("status") or {}
            conds = {c.get("type"): c for c in status.get("conditions") or []}
            head_ready = (conds.get("HeadPodReady") or {}).get("status") == "True" or status.get("state") == "ready"
            workers_ready = int(status.get("readyWorkerReplicas") or 0) >= self.workers.replicas
            if head_ready and workers_ready:
                log.info("RayCluster %s/%s: head and %d worker(s) ready", self.namespace, rname,
                         int(status.get("readyWorkerReplicas") or 0))
                return status
            failed = conds.get("ReplicaFailure") or {}
            if failed.get("status") == "True":
                raise ClusterError(f"RayCluster {self.namespace}/{rname} failed: {failed.get('reason')}: "
                                   f"{failed.get('message')}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"RayCluster {self.namespace}/{rname} not ready after {self.ready_timeout_s:.0f}s: state "
                    f"{status.get('state')!r}, head ready {head_ready}, {status.get('readyWorkerReplicas', 0)}/"
                    f"{self.workers.replicas} workers ready, reason {status.get('reason')!r} (check `kubectl "
                    f"describe raycluster {rname} -n {self.namespace}` and the pods' events)")
            time.sleep(self.poll_s)

    def _for_handle(self, handle: ClusterHandle) -> KubeRayBackend:
        x = handle.extra
        return replace(self, namespace=str(x.get("namespace", self.namespace)),
                       conn_id=x.get("kube_conn_id", self.conn_id),
                       in_cluster=bool(x.get("in_cluster", self.in_cluster)),
                       kube_config_path=x.get("kube_config_path"), kube_context=x.get("kube_context"),
                       request_timeout_s=float(x.get("request_timeout_s") or self.request_timeout_s))

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        """Delete the run's RayCluster (only that resource; the operator stays) and wait until it is gone."""
        b = self._for_handle(handle)
        rname = str(handle.extra.get("resource", ""))
        if not rname:
            return {"deleted": None}
        kube = b._kube()
        api = kube.objects()
        t0 = time.monotonic()
        try:
            kube.call(f"delete RayCluster {rname}", api.delete_namespaced_custom_object, GROUP, VERSION, b.namespace,
                    PLURALS["RayCluster"], rname, propagation_policy="Foreground")
        except Exception as e:
            if getattr(e, "status", None) != 404:
                raise
            log.info("RayCluster %s/%s was already gone", b.namespace, rname)
            return {"deleted": rname, "already_gone": True, "seconds": 0.0}
        deadline = time.monotonic() + max(60.0, b.request_timeout_s)
        while kube.get(api, PLURALS["RayCluster"], rname) is not None:
            if time.monotonic() > deadline:
                raise ClusterError(f"RayCluster {b.namespace}/{rname} still exists {deadline - t0:.0f}s after delete")
            time.sleep(min(b.poll_s, 2.0))
        log.info("Deleted RayCluster %s/%s in %.1fs", b.namespace, rname, time.monotonic() - t0)
        return {"deleted": rname, "already_gone": False, "seconds": round(time.monotonic() - t0, 2)}

    def health(self, handle: ClusterHandle) -> ClusterHealth:
        b = self._for_handle(handle)
        rname = str(handle.extra.get("resource"))
        kube = b._kube()
        obj = kube.get(kube.objects(), PLURALS["RayCluster"], rname)
        if obj is None:
            return ClusterHealth(False, "GONE", f"RayCluster {b.namespace}/{rname} no longer exists",
                                 infrastructure=True)
        state = str((obj.get("status") or {}).get("state") or "unknown")
        return ClusterHealth(state == "ready", state, f"RayCluster {b.namespace}/{rname} is {state}",
                             infrastructure=state != "ready")

    def submit_rayjob(self, name: str, entrypoint: str, runtime_env_yaml: str | None = None) -> dict[str, Any]:
        """Create a ``RayJob`` (its own cluster, deleted after the job). Returns the created object."""
        kube = self._kube()
        api = kube.objects()
        manifest = self.rayjob_manifest(name, entrypoint, runtime_env_yaml)
        rname = manifest["metadata"]["name"]
        try:
            obj: dict[str, Any] = kube.call(f"create RayJob {rname}", api.create_namespaced_custom_object, GROUP,
                                             VERSION, self.namespace, PLURALS["RayJob"], copy.deepcopy(manifest))
        except Exception as e:
            if getattr(e, "status", None) == 409:
                raise ClusterError(f"RayJob {self.namespace}/{rname} already exists") from e
            raise
        return obj


def _reason(e: Exception) -> str:
    return str(getattr(e, "reason", None) or getattr(e, "body", None) or e)


def _from_airflow_connection(
    conn_id: str, in_cluster: bool, path: str | None, context: str | None
) -> tuple[bool, str | None, str | None, dict[str, Any] | None]:
    """Kubernetes settings from an Airflow connection's extras (the cncf.kubernetes provider's keys)."""
    import json

    import yaml

    try:
        from airflow.sdk import BaseHook
    except ImportError as e:
        raise ClusterError(f"cluster.conn_id={conn_id!r} needs Airflow to read the connection") from e
    extra = BaseHook.get_connection(conn_id).extra_dejson or {}
    in_cluster = bool(extra.get("in_cluster", in_cluster))
    path = extra.get("kube_config_path") or path
    context = extra.get("cluster_context") or context
    inline = extra.get("kube_config")
    parsed: dict[str, Any] | None = None
    if inline:
        parsed = json.loads(inline) if isinstance(inline, str) and inline.lstrip().startswith("{") else (
            yaml.safe_load(inline) if isinstance(inline, str) else dict(inline))
    return in_cluster, path, context, parsed
