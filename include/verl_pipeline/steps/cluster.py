"""The cluster steps: provision (or find) the run's Ray cluster, its health and status, which mode it can
run, and its teardown."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.cluster.address import Endpoint
from verl_pipeline.cluster.base import ClusterHandle, ClusterHealth, ClusterStatus, probe
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode
from verl_pipeline.exceptions import ClusterError, ConfigError, PipelineError
from verl_pipeline.jobs.client import RayJobsClient, wait_job_ended
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec

if TYPE_CHECKING:  # pyarrow and numpy stay out of DAG parsing
    pass

log = logging.getLogger(__name__)


def provision(spec: RunSpec, *, endpoint: tuple[str, str | None] | Endpoint | None = None) -> ClusterHandle:
    """Start (or reach) the run's cluster and wait until it is ready.

    ``endpoint`` is ``(dashboard_url, token)`` resolved from an Airflow connection for the
    ``address`` backend.
    """
    existing = find_handle(spec)
    if existing is not None and existing.backend == spec.cluster.get("backend") and existing.owned:
        status = probe(existing.client())
        alive = get_backend({"backend": existing.backend, **backend_spec(existing)}).health(existing).alive
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
    RunDir(spec.run_dir).save_cluster(handle.to_dict())
    return handle


def cluster_health(handle: ClusterHandle) -> ClusterHealth:
    """What the backend says of the run's cluster (e.g. the Slurm job's state), never raising."""
    try:
        return get_backend({"backend": handle.backend, **backend_spec(handle)}).health(handle)
    except PipelineError as e:
        return ClusterHealth(False, "UNKNOWN", f"cannot ask the {handle.backend} backend: {e}")


def ensure_cluster(
    spec: RunSpec,
    handle: ClusterHandle,
    client: RayJobsClient,
    *,
    endpoint: tuple[str, str | None] | Endpoint | None = None,
) -> ClusterHandle:
    """The run's cluster if it is healthy (every expected node, CPU and GPU alive), else a new one.

    ``client`` reaches ``handle``'s cluster. An owned cluster is torn down and provisioned again; a
    cluster the pipeline does not own is only waited for (its owner has to bring it back).
    """
    backend = get_backend({"backend": handle.backend, **backend_spec(handle)})
    health = backend.health(handle)
    status = probe(client)
    healthy = (health.alive and status.ready and status.nodes_alive >= handle.expected_nodes
               and status.gpus >= handle.expected_gpus and status.cpus >= handle.expected_cpus)
    if healthy:
        return handle
    log.warning("Cluster %s is unhealthy (%s: %s; Ray sees %d/%d nodes, %g/%g GPU, %s): %s", handle.name,
                health.state, health.detail, status.nodes_alive, handle.expected_nodes, status.gpus,
                handle.expected_gpus, status.detail, "re-provisioning" if handle.owned else "waiting for it")
    if not handle.owned:
        from verl_pipeline.cluster.base import wait_ready

        wait_ready(handle, timeout_s=float(spec.cluster.get("ready_timeout_s", 300)), client=client)
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
    import json

    recorded = RunDir(spec.run_dir).cluster()
    if recorded is not None:
        return ClusterHandle.from_dict(recorded)
    state = None
    if spec.cluster.get("backend") == "local":
        from verl_pipeline.cluster.local import STATE_FILE, LocalBackend

        state = LocalBackend.from_spec(spec.cluster).temp_dir_for(spec.cluster_name) / STATE_FILE
    if spec.cluster.get("backend") == "slurm":
        from verl_pipeline.cluster.slurm import STATE_FILE as SLURM_STATE

        # Written right after sbatch: a provision killed while waiting still leaves the job id here.
        state = RunDir(spec.run_dir).slurm_dir / SLURM_STATE
    if state is not None and state.is_file():
        return ClusterHandle.from_dict(json.loads(state.read_text()))
    return None


def cluster_problems(spec: RunSpec, status: ClusterStatus, mode: Mode) -> list[ConfigError]:
    """What the cluster as a whole lacks for ``mode``: Ray version, and CPUs and GPUs for training."""
    from verl_pipeline.trainer.scaling import MIN_RAY_VERSION, parse_version, required_cpus

    problems = []
    version = parse_version(status.ray_version)
    wanted = ".".join(map(str, MIN_RAY_VERSION))
    if version is None or version[:2] < MIN_RAY_VERSION:
        problems.append(ConfigError("cluster.ray_version", status.ray_version,
                                    f"verl 0.9 needs Ray >= {wanted} on the cluster",
                                    f"a cluster image with ray>={wanted}"))
    if mode is Mode.TRAIN and spec.trainer_command == DEFAULT_TRAINER_COMMAND:
        need, why = required_cpus(spec.n_gpus, spec.verl)
        if status.cpus < need:
            problems.append(ConfigError(
                "cluster.CPU", status.cpus,
                f"a verl training job for {spec.nnodes} x {spec.n_gpus_per_node} GPU(s) reserves {why} CPUs; the "
                f"cluster has {status.cpus:g} (it would wait forever for resources)",
                f"a cluster with >= {need} CPUs, or mode=preflight",
            ))
        if status.gpus < spec.n_gpus:
            problems.append(ConfigError(
                "cluster.GPU", status.gpus, f"the target shape needs {spec.n_gpus} GPU(s) ({spec.nnodes} x "
                f"{spec.n_gpus_per_node})", f"nnodes x n_gpus_per_node <= {status.gpus:g}, or mode=preflight"))
    return problems


def choose_mode(spec: RunSpec, status: ClusterStatus) -> Mode:
    """The run's mode on this cluster: ``auto`` is ``train`` with GPUs, ``preflight`` without (logged)."""
    if spec.mode is not Mode.AUTO:
        return spec.mode
    if status.gpus > 0:
        log.warning("MODE auto -> train: the cluster has %g GPU(s); submitting verl.trainer.main_ppo", status.gpus)
        return Mode.TRAIN
    log.warning(
        "MODE auto -> PREFLIGHT: the cluster has no GPUs, so verl cannot train here. The job composes and "
        "validates verl's config for %d x %d GPU(s), checks data and model and scores the ground truths, "
        "but does NOT train.", spec.nnodes, spec.n_gpus_per_node,
    )
    return Mode.PREFLIGHT


def cluster_status(handle: ClusterHandle, client: RayJobsClient) -> ClusterStatus:
    """One look at the cluster (nodes, CPUs, GPUs, Ray version); ClusterError when it does not answer."""
    status = probe(client)
    if not status.ready:
        raise ClusterError(f"cannot reach cluster {handle.name} to check it: {status.detail}")
    return status


def teardown(
    handle: ClusterHandle | None,
    *,
    client: RayJobsClient | None = None,
    job_id: str | None = None,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """Stop the run's job if it still runs (through ``client``, else one of ``handle``'s), then
    release the cluster when the pipeline owns it; with ``run_dir``, its cluster record is retired."""
    result: dict[str, Any] = {"job_stopped": False}
    if handle is None:
        log.info("No cluster was provisioned for this run: nothing to tear down")
        return result
    if job_id:
        try:
            client = client or handle.client()
            info = client.get_job(job_id)
            if info is not None and not info.status.is_terminal():
                log.warning("Ray job %s is still %s: stopping it", job_id, info.status.value)
                result["job_stopped"] = client.stop(job_id)
                wait_job_ended(client, job_id)
        except ClusterError as e:
            # An unreachable cluster cannot run the job any more; the backend teardown still runs.
            log.warning("Could not reach cluster %s to stop job %s: %s", handle.name, job_id, e)
    backend = get_backend({"backend": handle.backend, **backend_spec(handle)})
    result.update(backend.teardown(handle))
    if run_dir is not None:
        RunDir(run_dir).retire_cluster()
    return result


def backend_spec(handle: ClusterHandle) -> dict[str, Any]:
    if handle.backend == "address":
        return {"dashboard_url": handle.dashboard_url, "auth_mode": handle.auth_mode,
                "allow_insecure": bool(handle.extra.get("allow_insecure", False))}
    return {}
