"""Backend settings read from the backends' own fields: one default per field, every refusal naming the
key, the value and a fix to copy, the same keys accepted as before."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from verl_pipeline.admission import POOL_KEY
from verl_pipeline.cluster.address import AddressBackend
from verl_pipeline.cluster.base import COMMON_SETTINGS
from verl_pipeline.cluster.kuberay import Group, KubeRayBackend
from verl_pipeline.cluster.local import LocalBackend
from verl_pipeline.cluster.settings import known_keys, read_settings, setting
from verl_pipeline.cluster.slurm import SlurmBackend
from verl_pipeline.exceptions import ConfigError

#: Each backend with the least profile it takes (and the keys it accepts that no field reads).
BACKENDS: list[tuple[type[Any], dict[str, Any], tuple[str, ...]]] = [
    (SlurmBackend, {"backend": "slurm"}, ()),
    (KubeRayBackend, {"backend": "kuberay"}, ()),
    (LocalBackend, {"backend": "local"}, ()),
    (AddressBackend, {"backend": "address", "conn_id": "ray_default"}, (POOL_KEY,)),
]
IDS = [cls.kind for cls, _, _ in BACKENDS]


def with_default(cls: type[Any], name: str, value: Any) -> type[Any]:
    """``cls`` with the default of field ``name`` changed, its checks (metadata) kept: nothing else edited."""
    old = {f.name: f for f in dataclasses.fields(cls)}[name]
    namespace = {"__annotations__": {name: old.type}, "__module__": cls.__module__,
                 name: field(default=value, metadata=old.metadata)}
    return dataclass(frozen=True)(type(cls.__name__, (cls,), namespace))


@pytest.mark.parametrize(("cls", "spec", "also"), BACKENDS, ids=IDS)
def test_a_profile_that_says_nothing_gets_the_fields_defaults(cls: type[Any], spec: dict[str, Any],
                                                              also: tuple[str, ...]) -> None:
    given = {k: v for k, v in spec.items() if k != "backend"}
    assert cls.from_spec(spec) == cls(**given)


def test_a_default_changed_on_its_field_is_the_default_the_backend_gets() -> None:
    slurm = with_default(with_default(SlurmBackend, "nodes", 3), "time_limit", "08:00:00")
    script = slurm.from_spec({"backend": "slurm"}).render_script("r")
    assert "#SBATCH --nodes=3" in script.splitlines() and "#SBATCH --time=08:00:00" in script.splitlines()
    # A setting in a profile section (rayjob: {...}) and one read by its own parser take theirs from the field too.
    kuberay = with_default(with_default(KubeRayBackend, "backoff_limit", 2), "workers", Group("2", "8Gi", 1, 1))
    b = kuberay.from_spec({"backend": "kuberay", "workers": {"replicas": 5}})
    assert b.rayjob_manifest("r", "python x.py")["spec"]["backoffLimit"] == 2
    assert b.workers == Group("2", "8Gi", 1, 5)
    assert with_default(LocalBackend, "num_cpus", 3).from_spec({"backend": "local"}).num_cpus == 3
    address = with_default(AddressBackend, "ready_timeout_s", 7.5)
    assert address.from_spec({"backend": "address", "conn_id": "c"}).ready_timeout_s == 7.5
    # The field's checks still apply to what a profile sets.
    with pytest.raises(ConfigError, match=r"cluster\.num_cpus=0"):
        with_default(LocalBackend, "num_cpus", 3).from_spec({"backend": "local", "num_cpus": 0})


@pytest.mark.parametrize(("cls", "spec", "key", "value", "path"), [
    (SlurmBackend, {}, "nodes", "two", "cluster.nodes"),
    (SlurmBackend, {}, "pending_timeout_s", "soon", "cluster.pending_timeout_s"),
    (SlurmBackend, {}, "partition", ["gpu"], "cluster.partition"),
    (KubeRayBackend, {}, "reuse", "yes", "cluster.reuse"),
    (KubeRayBackend, {}, "rayjob", {"backoff_limit": "0"}, "cluster.rayjob.backoff_limit"),
    (KubeRayBackend, {}, "mode", 1, "cluster.mode"),
    (LocalBackend, {}, "num_cpus", "2", "cluster.num_cpus"),
    (LocalBackend, {}, "auth_mode", True, "cluster.auth_mode"),
    (AddressBackend, {"conn_id": "c"}, "expected_gpus", "eight", "cluster.expected_gpus"),
    (AddressBackend, {"conn_id": "c"}, "allow_insecure", "no", "cluster.allow_insecure"),
], ids=lambda v: v.kind if isinstance(v, type) else None)
def test_a_wrong_type_is_refused_naming_the_key_the_value_and_a_fix_to_copy(
    cls: type[Any], spec: dict[str, Any], key: str, value: Any, path: str
) -> None:
    base = {"backend": cls.kind, **spec}
    with pytest.raises(ConfigError) as e:
        cls.from_spec({**base, key: value})
    bad = value["backoff_limit"] if isinstance(value, dict) else value
    assert (e.value.key, e.value.value) == (path, bad)
    assert f"{path}={bad!r}" in str(e.value) and f"(fix: {e.value.fix})" in str(e.value)
    # The fix is a profile line that the backend accepts, in the place the refusal named.
    assert e.value.fix is not None
    fixed = yaml.safe_load(e.value.fix)
    name = path.rsplit(".", 1)[-1]
    assert isinstance(fixed, dict) and list(fixed) == [name]
    cls.from_spec({**base, key: {name: fixed[name]} if isinstance(value, dict) else fixed[name]})


@pytest.mark.parametrize(("cls", "spec", "also"), BACKENDS, ids=IDS)
def test_every_setting_refuses_a_value_of_the_wrong_shape(cls: type[Any], spec: dict[str, Any],
                                                         also: tuple[str, ...]) -> None:
    # Not read by the backend: the submit step (probe_timeout_s) and the admission policy (pool) check them.
    keys = [k for k in known_keys(cls, also) if k not in (*COMMON_SETTINGS, *also)]
    assert keys
    for key in keys:
        with pytest.raises(ConfigError) as e:
            cls.from_spec({**spec, key: [["x"]]})
        assert e.value.key.startswith(f"cluster.{key}"), key
        assert "'x'" in str(e.value) and e.value.fix and not e.value.fix.endswith(": null"), (key, e.value.fix)


@pytest.mark.parametrize(("cls", "spec", "also"), BACKENDS, ids=IDS)
def test_an_unknown_key_is_refused_naming_it_and_the_known_ones(cls: type[Any], spec: dict[str, Any],
                                                               also: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match=rf"unknown setting of the {cls.kind} backend") as e:
        cls.from_spec({**spec, "colour": "blue"})
    assert (e.value.key, e.value.value) == ("cluster.colour", "blue")
    assert e.value.fix == f"use one of {known_keys(cls, also)}"
    # Every key it names is one the backend takes.
    for key in known_keys(cls, also):
        assert key in e.value.fix
    with pytest.raises(ConfigError, match=r"cluster\.rayjob\.ttl=5: unknown setting of the kuberay backend's rayjob"):
        KubeRayBackend.from_spec({"backend": "kuberay", "rayjob": {"ttl": 5}})


def test_the_accepted_keys_are_the_ones_accepted_before_the_fields_drove_them() -> None:
    assert known_keys(SlurmBackend) == sorted([
        "nodes", "cpus_per_node", "gpus_per_node", "time", "partition", "account", "qos", "mem", "extra_sbatch",
        "container", "env", "python", "dashboard_host", "gcs_port", "dashboard_port", "client_server_port",
        "port_base", "port_stride", "object_store_memory_mb", "temp_dir", "shared_dir", "slurm_conf", "slurm_bin",
        "pending_timeout_s", "ready_timeout_s", "cancel_timeout_s", "poll_s", "slurmrestd", "auth_mode",
        "probe_timeout_s"])
    assert known_keys(KubeRayBackend) == sorted([
        "namespace", "image", "ray_version", "mode", "name_prefix", "head", "workers", "volumes", "shm_size", "env",
        "tolerations", "node_selector", "service_account", "image_pull_secrets", "reuse", "dashboard_url",
        "conn_id", "in_cluster", "kube_config_path", "kube_context", "ready_timeout_s", "request_timeout_s",
        "poll_s", "rayjob", "probe_timeout_s"])
    assert known_keys(LocalBackend) == sorted([
        "num_cpus", "num_gpus", "nodes", "object_store_memory_mb", "ready_timeout_s", "temp_dir", "ports",
        "min_worker_port", "stop_grace_s", "auth_mode", "gpu_devices", "probe_timeout_s"])
    assert known_keys(AddressBackend, (POOL_KEY,)) == sorted([
        "dashboard_url", "conn_id", "auth_mode", "allow_insecure", "ca_bundle", "expected_nodes", "expected_gpus",
        "ready_timeout_s", "pool", "probe_timeout_s"])


def test_null_keeps_the_default_where_a_field_may_be_empty_and_a_required_number_refuses_it() -> None:
    b = SlurmBackend.from_spec({"backend": "slurm", "env": None, "container": None, "partition": None,
                                "extra_sbatch": None, "time": None})
    assert (b.env, b.container, b.partition, b.extra_sbatch, b.time_limit) == ({}, None, None, (), "04:00:00")
    with pytest.raises(ConfigError, match=r"cluster\.nodes=None: must be an integer between 1 and 4096"):
        SlurmBackend.from_spec({"backend": "slurm", "nodes": None})


def test_a_setting_that_is_not_a_scalar_needs_its_own_parser() -> None:
    @dataclass(frozen=True)
    class Listy:
        hosts: list[str] = field(default_factory=list, metadata=setting())
        kind: str = "listy"

    with pytest.raises(TypeError, match=r"Listy\.hosts: a list\[str\] setting needs parse="):
        read_settings(Listy, {"hosts": ["a"]})


@pytest.mark.parametrize(("cls", "fix"), [(SlurmBackend, "cluster.auth_mode: token"),
                                          (KubeRayBackend, "auth disabled")], ids=["slurm", "kuberay"])
@pytest.mark.parametrize("name", ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"])
def test_rays_auth_in_a_profiles_env_is_refused_without_echoing_it(cls: type[Any], fix: str, name: str) -> None:
    """The backend sets Ray's auth: a profile's env that sets it would fight the handle's auth mode and
    put a token in clear in the sbatch script or the RayCluster manifest."""
    with pytest.raises(ConfigError) as e:
        cls.from_spec({"backend": cls.kind, "env": {"NCCL_DEBUG": "WARN", name: "secret-value"}})
    assert e.value.key == f"cluster.env.{name}" and "secret-value" not in str(e.value)
    assert fix in str(e.value)
