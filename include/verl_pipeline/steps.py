"""The pipeline's steps as plain functions: the Airflow operators and the CLI both call these."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from verl_pipeline.cluster.base import ClusterHandle, ClusterHealth, ClusterStatus, get_backend, probe
from verl_pipeline.config import RunSpec
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode
from verl_pipeline.exceptions import ClusterError, ConfigError, PipelineError
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.trainer.render import RenderedJob, render_job

log = logging.getLogger(__name__)


def validate_spec_with_verl(spec: RunSpec) -> dict[str, Any]:
    """Run verl's own composition + validation for the run's target shape, before any cluster.

    verl's model config loads a tokenizer, so the built-in tiny model stands in for the run's
    model here (a seconds-long structural check of batch sizes, parallelism and keys); the job
    repeats the validation on the cluster with the real model and data.
    """
    from verl_pipeline.config import ModelSource
    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.paths import pipeline_home
    from verl_pipeline.trainer.overrides import render_overrides
    from verl_pipeline.trainer.render import job_settings
    from verl_pipeline.trainer.validate import validate

    # The stand-in is read only here, so it lives in this machine's home, not on the cluster's storage.
    stand_in = prefetch(ModelSource("builtin", "tiny-qwen2"), pipeline_home() / "models").path
    settings = job_settings(spec, train_files="/placeholder/train.parquet", val_files="/placeholder/val.parquet",
                            model_path=stand_in)
    v = validate(render_overrides(settings))
    import verl

    log.info("verl %s accepted the configuration for %d x %d GPU(s) in %.1fs (critic: %s, reference: %s)",
             verl.__version__, spec.nnodes, spec.n_gpus_per_node, v.seconds, v.use_critic, v.use_reference_policy)
    return {"n_gpus": v.n_gpus, "use_critic": v.use_critic, "use_reference_policy": v.use_reference_policy,
            "seconds": v.seconds, "verl_version": str(verl.__version__)}


def provision(spec: RunSpec, *, endpoint: tuple[str, str | None] | None = None) -> ClusterHandle:
    """Start (or reach) the run's cluster and wait until it is ready.

    ``endpoint`` is ``(dashboard_url, token)`` resolved from an Airflow connection for the
    ``address`` backend.
    """
    existing = find_handle(spec)
    if existing is not None and existing.backend == spec.cluster.get("backend") and existing.owned:
        status = probe(existing.client())
        alive = get_backend({"backend": existing.backend, **_backend_spec(existing)}).health(existing).alive
        if alive and status.ready and status.nodes_alive >= existing.expected_nodes \
                and status.gpus >= existing.expected_gpus:
            # A retried or re-run provision of the same run: keep the live cluster (and the job on it).
            log.info("Reusing the run's healthy cluster %s at %s", existing.name, existing.dashboard_url)
            return existing
    backend = get_backend(spec.cluster).for_run(spec.run_dir)
    if endpoint is not None:
        from verl_pipeline.cluster.address import AddressBackend

        if isinstance(backend, AddressBackend):
            backend = backend.with_endpoint(*endpoint)
    handle = backend.provision(spec.cluster_name)
    write_json_atomic(spec.run_dir / "cluster.json", handle.to_dict())
    return handle


def cluster_health(handle: ClusterHandle) -> ClusterHealth:
    """What the backend says of the run's cluster (e.g. the Slurm job's state), never raising."""
    try:
        return get_backend({"backend": handle.backend, **_backend_spec(handle)}).health(handle)
    except PipelineError as e:
        return ClusterHealth(False, "UNKNOWN", f"cannot ask the {handle.backend} backend: {e}")


def ensure_cluster(
    spec: RunSpec,
    handle: ClusterHandle,
    *,
    token: str | None = None,
    endpoint: tuple[str, str | None] | None = None,
) -> ClusterHandle:
    """The run's cluster if it is healthy (every expected node, CPU and GPU alive), else a new one.

    An owned cluster is torn down and provisioned again; a cluster the pipeline does not own is
    only waited for (its owner has to bring it back).
    """
    backend = get_backend({"backend": handle.backend, **_backend_spec(handle)})
    health = backend.health(handle)
    status = probe(handle.client(token))
    healthy = (health.alive and status.ready and status.nodes_alive >= handle.expected_nodes
               and status.gpus >= handle.expected_gpus and status.cpus >= handle.expected_cpus)
    if healthy:
        return handle
    log.warning("Cluster %s is unhealthy (%s: %s; Ray sees %d/%d nodes, %g/%g GPU, %s): %s", handle.name,
                health.state, health.detail, status.nodes_alive, handle.expected_nodes, status.gpus,
                handle.expected_gpus, status.detail, "re-provisioning" if handle.owned else "waiting for it")
    if not handle.owned:
        from verl_pipeline.cluster.base import wait_ready

        wait_ready(handle, timeout_s=float(spec.cluster.get("ready_timeout_s", 300)), client=handle.client(token))
        return handle
    backend.teardown(handle)
    return provision(spec, endpoint=endpoint)


def current_handle(spec: RunSpec, fallback: dict[str, Any] | None = None) -> ClusterHandle | None:
    """The run's latest cluster (a re-provisioned one replaces the first), else ``fallback`` (XCom)."""
    handle = find_handle(spec)
    if handle is None and fallback:
        handle = ClusterHandle.from_dict(fallback)
    return handle


def find_handle(spec: RunSpec) -> ClusterHandle | None:
    """The run's cluster handle from its run directory (when XCom does not have it)."""
    path = spec.run_dir / "cluster.json"
    if path.is_file():
        return ClusterHandle.from_dict(json.loads(path.read_text()))
    if spec.cluster.get("backend") == "local":
        from verl_pipeline.cluster.local import STATE_FILE, LocalBackend

        state = LocalBackend.from_spec(spec.cluster).temp_dir_for(spec.cluster_name) / STATE_FILE
        if state.is_file():
            return ClusterHandle.from_dict(json.loads(state.read_text()))
    if spec.cluster.get("backend") == "slurm":
        from verl_pipeline.cluster.slurm import STATE_FILE as SLURM_STATE

        # Written right after sbatch: a provision killed while waiting still leaves the job id here.
        state = spec.run_dir / "slurm" / SLURM_STATE
        if state.is_file():
            return ClusterHandle.from_dict(json.loads(state.read_text()))
    return None


def check_cluster(spec: RunSpec, status: ClusterStatus, mode: Mode) -> None:
    """The checks that need the real cluster: Ray version, and CPUs for a training job.

    Raises ConfigError naming what is short and what would pass; nothing is submitted then.
    """
    from verl_pipeline.trainer.scaling import MIN_RAY_VERSION, parse_version, required_cpus

    version = parse_version(status.ray_version)
    wanted = ".".join(map(str, MIN_RAY_VERSION))
    if version is None or version[:2] < MIN_RAY_VERSION:
        raise ConfigError("cluster.ray_version", status.ray_version, f"verl 0.9 needs Ray >= {wanted} on the cluster",
                          f"a cluster image with ray>={wanted}")
    if mode is Mode.TRAIN and spec.trainer_command != DEFAULT_TRAINER_COMMAND:
        log.warning("Custom trainer_command %s: verl's CPU/GPU requirements are not checked for it",
                    " ".join(spec.trainer_command))
    elif mode is Mode.TRAIN:
        need, why = required_cpus(spec.n_gpus, spec.verl)
        if status.cpus < need:
            raise ConfigError(
                "cluster.CPU", status.cpus,
                f"a verl training job for {spec.nnodes} x {spec.n_gpus_per_node} GPU(s) reserves {why} CPUs; the "
                f"cluster has {status.cpus:g} (it would wait forever for resources)",
                f"a cluster with >= {need} CPUs, or mode=preflight",
            )
        if status.gpus < spec.n_gpus:
            raise ConfigError("cluster.GPU", status.gpus,
                              f"the target shape needs {spec.n_gpus} GPU(s) ({spec.nnodes} x {spec.n_gpus_per_node})",
                              f"nnodes x n_gpus_per_node <= {status.gpus:g}, or mode=preflight")
    log.info("Cluster checks passed for %s: Ray %s, %g CPU, %g GPU", mode.value, status.ray_version, status.cpus,
             status.gpus)


def resolve_mode(spec: RunSpec, handle: ClusterHandle, token: str | None = None) -> Mode:
    """``auto`` → ``train`` when the cluster has GPUs, ``preflight`` when it has none; then the
    cluster checks of :func:`check_cluster` for the resolved mode."""
    status = probe(handle.client(token))
    if not status.ready:
        raise ClusterError(f"cannot reach cluster {handle.name} to check it: {status.detail}")
    if spec.mode is not Mode.AUTO:
        check_cluster(spec, status, spec.mode)
        return spec.mode
    mode = Mode.TRAIN if status.gpus > 0 else Mode.PREFLIGHT
    check_cluster(spec, status, mode)
    if status.gpus > 0:
        log.warning("MODE auto -> train: the cluster has %g GPU(s); submitting verl.trainer.main_ppo", status.gpus)
        return Mode.TRAIN
    log.warning(
        "MODE auto -> PREFLIGHT: the cluster has no GPUs, so verl cannot train here. The job composes and "
        "validates verl's config for %d x %d GPU(s), checks data and model and scores the ground truths, "
        "but does NOT train.", spec.nnodes, spec.n_gpus_per_node,
    )
    return Mode.PREFLIGHT


def check_paths_visible(spec: RunSpec, paths: dict[str, str]) -> None:
    """Data and model paths must be on storage every Ray node mounts (a local head shares this disk)."""
    from verl_pipeline.config import under_shared

    if spec.cluster.get("backend") == "local":
        return
    for key, path in paths.items():
        if path and not under_shared(path, spec.shared_roots):
            raise ConfigError(key, path, f"is not under a shared mount {list(spec.shared_roots)}: the cluster's "
                              "nodes would not find it", f"a path under {spec.shared_roots[0]}")


def render(spec: RunSpec, *, data: dict[str, Any], models: dict[str, Any], mode: Mode) -> RenderedJob:
    critic = models.get("critic") or {}
    check_paths_visible(spec, {"data.train_files": data["train_path"], "data.val_files": data["val_path"],
                               "actor_rollout_ref.model.path": models["actor"]["path"],
                               "critic.model.path": critic.get("path", ""),
                               "reward.reward_model.model_path": (models.get("reward") or {}).get("path", "")})
    return render_job(
        spec, mode=mode, train_files=data["train_path"], val_files=data["val_path"],
        model_path=models["actor"]["path"], critic_path=critic.get("path"),
        reward_path=(models.get("reward") or {}).get("path"),
    )


def save_run_files(spec: RunSpec, job: RenderedJob) -> Path:
    """Log the merged configuration and keep it, with the exact job, in the run dir and next to the checkpoints."""
    for key in sorted(job.settings):
        rule = job.derived.get(key)
        log.info("verl %s = %s", key, rule if rule else repr(job.settings[key]))
    merged = {"spec": spec.to_dict(), "job": job.to_dict()}
    write_json_atomic(spec.run_dir / "run_spec.json", spec.to_dict())
    write_json_atomic(spec.run_dir / "job.json", job.to_dict())
    write_json_atomic(spec.checkpoint_dir / "run_config.json", merged)
    return spec.run_dir


def teardown(
    handle: ClusterHandle | None,
    *,
    job_id: str | None = None,
    token: str | None = None,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """Stop the run's job if it still runs, then release the cluster when the pipeline owns it.

    With ``run_dir``, the run's ``cluster.json`` is renamed ``cluster.stopped.json`` afterwards.
    """
    result: dict[str, Any] = {"job_stopped": False}
    if handle is None:
        log.info("No cluster was provisioned for this run: nothing to tear down")
        return result
    if job_id:
        try:
            client = handle.client(token)
            info = client.get_job(job_id)
            if info is not None and not info.status.is_terminal():
                log.warning("Ray job %s is still %s: stopping it", job_id, info.status.value)
                result["job_stopped"] = client.stop(job_id)
                _wait_terminal(client, job_id)
        except ClusterError as e:
            # An unreachable cluster cannot run the job any more; the backend teardown still runs.
            log.warning("Could not reach cluster %s to stop job %s: %s", handle.name, job_id, e)
    backend = get_backend({"backend": handle.backend, **_backend_spec(handle)})
    result.update(backend.teardown(handle))
    record = run_dir / "cluster.json" if run_dir else None
    if record is not None and record.exists():
        record.replace(record.with_name("cluster.stopped.json"))
    return result


def _backend_spec(handle: ClusterHandle) -> dict[str, Any]:
    if handle.backend == "address":
        return {"dashboard_url": handle.dashboard_url, "auth_mode": handle.auth_mode}
    return {}


def _wait_terminal(client: Any, job_id: str, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.get_job(job_id)
        if info is None or info.status.is_terminal():
            return
        time.sleep(0.5)
    log.warning("Ray job %s did not stop within %.0fs", job_id, timeout_s)


__all__ = ["check_cluster", "check_paths_visible", "find_handle", "provision", "render", "resolve_mode",
           "save_run_files", "teardown", "validate_spec_with_verl"]
