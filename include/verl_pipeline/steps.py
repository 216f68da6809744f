"""The pipeline's steps as plain functions: the Airflow operators and the CLI both call these."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.cluster.address import Endpoint
from verl_pipeline.cluster.base import ClusterHandle, ClusterHealth, ClusterStatus, probe
from verl_pipeline.cluster.registry import cluster_deadline, get_backend
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode, SubmitAction
from verl_pipeline.exceptions import ClusterError, ConfigError, PipelineError
from verl_pipeline.jobs.client import RayJobsClient, wait_job_ended
from verl_pipeline.jobs.deadlines import Deadline, earliest
from verl_pipeline.jobs.ids import submission_prefix
from verl_pipeline.jobs.submit import Submission, existing_job, submit_or_reattach
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import RunDir, now
from verl_pipeline.spec import DataSource, ModelSource, RunSpec
from verl_pipeline.trainer.jobfiles import stage
from verl_pipeline.trainer.nodes.decisions import Decision, decide_for_spec
from verl_pipeline.trainer.render import RenderedJob, render_job

if TYPE_CHECKING:  # pyarrow and numpy stay out of DAG parsing
    from verl_pipeline.data.preprocess import PreprocessResult
    from verl_pipeline.profiles import Asked

log = logging.getLogger(__name__)


def validate_spec_with_verl(spec: RunSpec, *, record_in: RunDir | None = None, reuse: bool = False,
                            decision: Decision | None = None) -> dict[str, Any]:
    """Run verl's own composition + validation for the run's target shape, before any cluster.

    ``decision`` is what was decided for the nodes (:mod:`verl_pipeline.trainer.nodes.decisions`; the submit
    validates a training job's decided shape); without one, what is decided without a probe.

    verl's model config loads a tokenizer, so the built-in tiny model stands in for the run's
    model here (a seconds-long structural check of batch sizes, parallelism and keys). Each
    validation verl passes is kept on this machine (``trainer.validate.keep``); with ``reuse`` a
    configuration validated before (same overrides but the run's names and data, same verl
    installation) is not composed or validated again. With ``record_in`` (the provision task's run
    directory) the validation is recorded there: a preflight job whose overrides differ from these only
    in the data it was given (and whose model is the stand-in, as on the embedded default) trusts it
    instead of composing and validating again; any other job repeats the validation on the cluster
    with its real model.
    """
    import time
    from importlib.metadata import version

    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.paths import pipeline_home
    from verl_pipeline.spec import ModelSource
    from verl_pipeline.trainer import reward
    from verl_pipeline.trainer.overrides import render_overrides
    from verl_pipeline.trainer.render import job_settings
    from verl_pipeline.trainer.validate import ValidationRecord, earlier_record, keep, validate, validation_key

    t0 = time.monotonic()
    # The stand-in is read only here, so it lives in this machine's home, not on the cluster's storage.
    stand_in = prefetch(ModelSource("builtin", "tiny-qwen2"), pipeline_home() / "models").path
    settings = job_settings(spec, train_files="/placeholder/train.parquet", val_files="/placeholder/val.parquet",
                            model_path=stand_in)
    settings.update((decision or decide_for_spec(spec, settings)).settings)
    reward.check_manager(settings)  # verl's config accepts any name; its reward loop fails at the first step
    overrides = render_overrides(settings)
    key = validation_key(overrides)
    record, kept = earlier_record(key) if reuse else (None, None)
    reused = record is not None
    if record is not None:
        seconds = round(time.monotonic() - t0, 2)
        log.info("verl %s accepted this configuration for %d x %d GPU(s) before (%s, same verl installation, same "
                 "overrides but the run's names and data): not composed or validated again (%.1fs)",
                 record.verl_version, spec.nnodes, spec.n_gpus_per_node, kept, seconds)
    else:
        v = validate(overrides)
        seconds = v.seconds
        record = ValidationRecord.of(v, overrides, key)
        kept = keep(record)
        log.info("verl %s accepted the configuration for %d x %d GPU(s) in %.1fs (critic: %s, reference: %s)",
                 record.verl_version, spec.nnodes, spec.n_gpus_per_node, v.seconds, v.use_critic,
                 v.use_reference_policy)
    for line in record.unchecked:
        log.warning("verl's validation here left unchecked: %s", line)
    if record_in is not None:
        record_in.save_validation(record.to_dict())
        log.info("verl's validation recorded in %s (key %s): the preflight job trusts it for the same overrides "
                 "and verl installation", record_in.validation_file, record.key)
    return {"n_gpus": record.n_gpus, "use_critic": record.use_critic,
            "use_reference_policy": record.use_reference_policy, "seconds": seconds, "verl_version": version("verl"),
            "reused": str(kept) if reused else None, "unchecked": list(record.unchecked)}


def frozen_or(spec: RunSpec, asked: Asked | None = None, *, starts: str = "where the run starts") -> RunSpec:
    """The run's frozen spec when it has one (a retried provision, the CLI on a run already up), else ``spec``.

    Like Airflow keeps a run on the DAG version it started with, a run keeps the spec it started
    with: a retry two days in renders what the run started with, whatever ``configs/`` says by
    then (a difference is logged). A run that should use edited profiles is a new run.

    ``asked``: what the caller set explicitly (``spec`` was built from it). A value the frozen run does
    not have is refused, not dropped: a ConfigError naming each difference and the two ways out (a new
    run name, or the same value ``starts``: where this run is started). A DAG run's params are the same
    on every try, so they agree with the run they froze.
    """
    run_dir = RunDir(spec.run_dir)
    frozen = _frozen(run_dir)
    if frozen is None:
        return spec
    if asked is not None:
        _refuse_conflicts(asked.conflicts(spec, frozen), frozen, run_dir, starts)
    now, then = spec.to_dict(), frozen.to_dict()
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if changed:
        log.warning("Run %s: using its frozen spec %s; the profiles and params now differ in %s, which this run "
                    "ignores (start a new run to use them)", spec.run_name, run_dir.spec_file, ", ".join(changed))
    else:
        log.info("Run %s: using its frozen spec %s", spec.run_name, run_dir.spec_file)
    return frozen


def _refuse_conflicts(conflicts: dict[str, tuple[Any, Any]], frozen: RunSpec, run_dir: RunDir, starts: str) -> None:
    if not conflicts:
        return
    names = ", ".join(conflicts)
    asked = {name: now for name, (now, _) in conflicts.items()}
    had = ", ".join(f"{name}={then!r}" for name, (_, then) in conflicts.items())
    raise ConfigError(names, asked[names] if len(asked) == 1 else asked,
                      f"run {frozen.run_name!r} was started with {had} (frozen in {run_dir.spec_file}): a run keeps "
                      "what it started with",
                      f"a new run name to run with {names} as asked, or the same value(s) {starts}")


def freeze(spec: RunSpec) -> None:
    """Save ``spec`` (checked) as the run's frozen spec, unless the run has one already."""
    if _frozen(RunDir(spec.run_dir)) is None:
        RunDir(spec.run_dir).save_spec(spec.to_dict())
        log.info("Run %s: spec frozen in %s (every later task, retry and CLI command of this run reads it)",
                 spec.run_name, RunDir(spec.run_dir).spec_file)


def _frozen(run_dir: RunDir) -> RunSpec | None:
    """The run's frozen spec; None when it has none, or only the copy an earlier release wrote when it
    submitted (it has no ``sources``: never read back, and not enough to rebuild the spec from)."""
    if not run_dir.has_spec() or "sources" not in run_dir.spec_dict():
        return None
    return RunSpec.load(run_dir)


def load_frozen(run_dir: Path) -> RunSpec:
    """The frozen spec of the run in ``run_dir`` (what provision saved), logged as such."""
    spec = RunSpec.load(RunDir(run_dir))
    log.info("Run %s: frozen spec %s used (saved at provision; configs/ is not read again)", spec.run_name,
             RunDir(run_dir).spec_file)
    return spec


def tokenizer_for_model(model: ModelSource, cache_root: Path) -> str:
    """The directory whose tokenizer the run's model uses (the built-in model is built if needed)."""
    from verl_pipeline.models.prefetch import prefetch

    if model.kind == "path":
        return str(model.ref)
    return prefetch(model, cache_root).path


def preprocess(spec: RunSpec, sources: DataSource | Sequence[DataSource] | None = None,
               out_root: Path | None = None, recipe: str | None = None) -> PreprocessResult:
    """The run's data as verl's parquet (:func:`verl_pipeline.data.preprocess.preprocess`): its data
    options, its model's tokenizer (prefetched, or the built-in model built) and its max_prompt_length."""
    from verl_pipeline.data.preprocess import preprocess as write_parquet

    options = dict(spec.data_options)
    if recipe:
        options["recipe"] = recipe
    max_len = options.get("max_prompt_length") or spec.verl.get("data.max_prompt_length")
    tokenizer = options.get("tokenizer") or (tokenizer_for_model(spec.model, spec.model_cache) if max_len else None)
    return write_parquet(sources if sources is not None else spec.data, options,
                          out_root if out_root is not None else spec.data_root, tokenizer=tokenizer,
                          max_prompt_length=int(max_len) if max_len else None)


def provision(spec: RunSpec, *, endpoint: tuple[str, str | None] | Endpoint | None = None) -> ClusterHandle:
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
    RunDir(spec.run_dir).save_cluster(handle.to_dict())
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
    client: RayJobsClient,
    *,
    endpoint: tuple[str, str | None] | Endpoint | None = None,
) -> ClusterHandle:
    """The run's cluster if it is healthy (every expected node, CPU and GPU alive), else a new one.

    ``client`` reaches ``handle``'s cluster. An owned cluster is torn down and provisioned again; a
    cluster the pipeline does not own is only waited for (its owner has to bring it back).
    """
    backend = get_backend({"backend": handle.backend, **_backend_spec(handle)})
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


def check_paths_visible(spec: RunSpec, paths: dict[str, str]) -> None:
    """Data and model paths must be on storage every Ray node mounts (a local head shares this disk)."""
    from verl_pipeline.spec import under_shared

    if spec.cluster.get("backend") == "local":
        return
    for key, path in paths.items():
        if path and not under_shared(path, spec.shared_roots):
            raise ConfigError(key, path, f"is not under a shared mount {list(spec.shared_roots)}: the cluster's "
                              "nodes would not find it", f"a path under {spec.shared_roots[0]}")


def render(spec: RunSpec, *, data: dict[str, Any], models: dict[str, Any], mode: Mode,
           decision: Decision | None = None) -> RenderedJob:
    """The job for the run's data and models in ``mode``, with what was decided for the nodes (``decision``;
    without one, what can be decided without a probe)."""
    critic = models.get("critic") or {}
    check_paths_visible(spec, {"data.train_files": data["train_path"], "data.val_files": data["val_path"],
                               "actor_rollout_ref.model.path": models["actor"]["path"],
                               "critic.model.path": critic.get("path", ""),
                               "reward.reward_model.model_path": (models.get("reward") or {}).get("path", "")})
    return render_job(
        spec, mode=mode, train_files=data["train_path"], val_files=data["val_path"],
        model_path=models["actor"]["path"], critic_path=critic.get("path"),
        reward_path=(models.get("reward") or {}).get("path"),
        length_filter=(data.get("counts") or {}).get("length_filter"), decision=decision,
        train_rows=(data.get("counts") or {}).get("train_rows"),
    )


def stage_job_files(spec: RunSpec, job: RenderedJob) -> None:
    """Copy the files ``job`` ships into its ``runtime_env`` working_dir, before any Ray job uses that
    runtime_env (the environment probe runs with it too)."""
    if job.files.shipped:
        stage(job.files, RunDir(spec.run_dir).job_files_dir)


def save_run_files(spec: RunSpec, job: RenderedJob) -> Path:
    """Log the merged configuration and keep the exact job in the run dir and, with the spec, next to the
    checkpoints (the spec itself was frozen in the run dir at provision)."""
    for key in sorted(job.settings):
        rule = job.derived.get(key)
        log.info("verl %s = %s", key, rule if rule else repr(job.settings[key]))
    merged = {"spec": spec.to_dict(), "job": job.to_dict()}
    stage_job_files(spec, job)
    RunDir(spec.run_dir).save_job(job.to_dict())
    write_json_atomic(spec.checkpoint_dir / "run_config.json", merged)
    return spec.run_dir


def probe_cluster(spec: RunSpec, job: RenderedJob, *, client: RayJobsClient, status: ClusterStatus,
                  id_prefix: str) -> dict[str, Any]:
    """Run the environment probe (:mod:`verl_pipeline.cluster.probe`) with ``job``'s runtime_env, for what
    it needs and what the decisions read (flash-attn, the GPUs, the versions): the probe's raw report. A
    restart on nodes where nothing changed reuses the run's last probe instead
    (:func:`verl_pipeline.jobs.reprobe.decide`; the report then says ``reused`` and why)."""
    from verl_pipeline.cluster.probe import DEFAULT_TIMEOUT_S, run_probe
    from verl_pipeline.jobs.reprobe import decide, latest_failure
    from verl_pipeline.trainer.environment import installed_verl_pins, needs_for

    hard = cluster_problems(spec, status, Mode.PREFLIGHT)  # too old a Ray: nothing else is worth probing
    if hard:
        raise hard[0]
    request = needs_for(job.settings, installed_verl_pins()).request()
    run = RunDir(spec.run_dir)
    kept = run.kept_probe()
    failure = latest_failure(run)
    if failure is not None:
        reuse = decide(spec.restarts.reprobe, kept, request=request, alive=client.nodes, failure=failure, now=now())
        if reuse.reuse and kept is not None:
            log.info("Run %s: no probe before this restart: %s", spec.run_name, reuse.why)
            return {**kept["report"], "reused": reuse.why, "wall_seconds": 0.0}
        log.info("Run %s: probing the nodes again before this restart: %s", spec.run_name, reuse.why)
    timeout = float(spec.cluster.get("probe_timeout_s", DEFAULT_TIMEOUT_S))
    stage_job_files(spec, job)
    raw = run_probe(client, request=request, runtime_env=job.runtime_env, id_prefix=id_prefix, timeout_s=timeout)
    run.keep_probe(request, raw)
    return raw


def check_environment(spec: RunSpec, job: RenderedJob, raw: dict[str, Any], *, status: ClusterStatus,
                      decision: Decision | None = None) -> dict[str, Any]:
    """Judge the probe's report ``raw`` for ``job`` (its settings as decided for these nodes).

    A training job that would miss anything fails here, before it is submitted, with one
    :class:`~verl_pipeline.exceptions.EnvironmentCheckError` listing every problem (the cluster's
    totals and each node's). In preflight mode, and for a custom ``trainer_command``, the same
    findings are only reported: what a GPU run on this cluster would miss. Returns the report
    (for XCom; also written to the run dir as ``environment.json``, with what the probe found on the
    GPU nodes and the decision's summary).
    """
    from verl_pipeline.exceptions import EnvironmentCheckError
    from verl_pipeline.trainer.environment import evaluate, installed_verl_pins, needs_for, node_label

    needs = needs_for(job.settings, installed_verl_pins())
    findings = evaluate(needs, raw["nodes"])
    problems = [str(e) for e in cluster_problems(spec, status, Mode.TRAIN)]
    problems += [f.line() for f in findings if f.blocking]
    unreachable = [f.line() for f in findings if not f.blocking]
    enforced = job.mode is Mode.TRAIN and spec.trainer_command == DEFAULT_TRAINER_COMMAND
    report = {
        "mode": job.mode.value, "enforced": enforced, "ok": not problems, "problems": problems,
        "unreachable": unreachable, "needs": [n.to_dict() for n in needs.modules],
        "nodes": [_node_summary(n, node_label(n)) for n in raw["nodes"]],
        "probe_job_id": raw["job_id"], "seconds": raw["wall_seconds"], "reused": raw.get("reused"),
        # Where the probe's seconds went: submitting it, its driver's ray.init, the pinned node tasks.
        "phases_s": {"submit": raw.get("submit_s"), "ray_init": (raw.get("driver") or {}).get("ray_init_s"),
                     "node_tasks": raw.get("seconds")},
        # What the decisions read, and what they decided (job.json and decisions.jsonl have it all).
        "found": decision.nodes.to_dict() if decision else None,
        "decided": decision.summary() if decision else None,
    }
    log.info("Environment probe of %d node(s) %s (Ray job %s): %s", len(raw["nodes"]),
             "reused" if raw.get("reused") else f"in {raw['wall_seconds']:.1f}s", raw["job_id"],
             f"{len(problems)} problem(s)" if problems else "nothing missing")
    for node in report["nodes"]:
        log.info("Probe of node %s: %s", node["node"], node)
    for line in unreachable:
        log.warning("Probe: %s", line)
    write_json_atomic(RunDir(spec.run_dir).environment_file, report)
    if job.mode is Mode.PREFLIGHT:
        for line in problems:
            log.warning("A GPU training run on this cluster would miss: %s", line)
    elif problems and not enforced:
        for line in problems:
            log.warning("Custom trainer_command (not enforced): verl's trainer would miss: %s", line)
    elif problems:
        raise EnvironmentCheckError(problems)
    return report


def _node_summary(node: dict[str, Any], label: str) -> dict[str, Any]:
    facts = node.get("facts") or {}
    torch = facts.get("torch") or {}
    modules = facts.get("modules") or {}
    return {
        "node": label, "node_id": node.get("node_id"), "cpus": node.get("cpus"), "gpus": node.get("gpus"),
        "answered": bool(facts), "error": node.get("error"),
        "torch": torch.get("version") or torch.get("error"), "cuda": torch.get("cuda"),
        "visible_gpus": torch.get("device_count"), "transformers": facts.get("transformers"),
        "verl_transformers": facts.get("verl_transformers"),
        "modules": {m: (e.get("version") or "ok") if e.get("ok") else f"missing ({e.get('error')})"
                    for m, e in modules.items()},
        "paths": {p: bool(v.get("exists")) for p, v in (facts.get("paths") or {}).items()},
        "gpu": facts.get("gpu"), "flash_attn_kernel": facts.get("flash_attn_kernel"),
        "versions": facts.get("versions"),
        "seconds": facts.get("seconds"),
        "module_seconds": {m: e.get("seconds") for m, e in modules.items()},
    }


def resume_point(spec: RunSpec, settings: dict[str, Any]) -> int:
    """The run step the next training attempt resumes from (0: from the start): the run's newest complete
    checkpoint, as the restart budget reads it too (:func:`~verl_pipeline.jobs.checkpoints.newest_run_step`)."""
    from verl_pipeline.jobs.checkpoints import newest_run_step

    return newest_run_step(spec.checkpoint_dir, settings)


def decide_for_nodes(spec: RunSpec, intent: RenderedJob, raw: dict[str, Any]) -> Decision:
    """What the job uses on the nodes the probe (``raw``) found (:mod:`verl_pipeline.trainer.nodes.decisions`),
    logged — with what changed since the run's previous attempt, which may have run on other nodes — and
    kept for ``render`` as the cluster's latest probe (:attr:`RunSpec.cluster_facts_file`)."""
    from verl_pipeline.trainer.nodes.facts import NodeFacts

    nodes = NodeFacts.from_probe(raw["nodes"], source=f"probe job {raw['job_id']}")
    settings = intent.undecided_settings()
    resume = resume_point(spec, settings) if intent.mode is Mode.TRAIN else 0
    probe = f"reused probe job {raw['job_id']}: {raw['reused']}" if raw.get("reused") else f"ran (job {raw['job_id']})"
    decision = decide_for_spec(spec, settings, nodes, resume_step=resume, probe=probe)
    log.info("Run %s: %s", spec.run_name, nodes.describe())
    log.info("Run %s: decided for these nodes: %s", spec.run_name, decision.summary())
    for note in decision.notes:
        log.warning("Run %s: %s", spec.run_name, note)
    earlier = RunDir(spec.run_dir).decisions()
    if earlier:
        changes = decision.changes_from(earlier[-1])
        attempt = earlier[-1].get("attempt")
        if changes:
            log.warning("Run %s: decided again for the nodes as they are now; since attempt %s: %s", spec.run_name,
                        attempt, "; ".join(changes))
        else:
            log.info("Run %s: the same nodes and decision as attempt %s", spec.run_name, attempt)
    _keep_probe_facts(spec, decision)
    return decision


def _keep_probe_facts(spec: RunSpec, decision: Decision) -> None:
    """The cluster's latest probe (for ``render --cluster-profile``) and the cache folder's ``key.json``; a
    shared storage this worker cannot write is only logged (the job does not need either file)."""
    try:
        write_json_atomic(spec.cluster_facts_file, {"run": spec.run_name, "nodes": decision.nodes.to_dict()})
        key_file = decision.caches.key_file
        if key_file is not None and not key_file.is_file():
            write_json_atomic(key_file, {"key": decision.caches.key, "built_for": decision.caches.facts})
    except OSError as e:
        log.warning("Run %s: could not record the probe's findings on the storage (%s)", spec.run_name, e)


def validate_decided(spec: RunSpec, job: RenderedJob, decision: Decision) -> dict[str, Any] | None:
    """verl's validation of a training job's shape as decided for the nodes, when it differs from what the
    provision task validated (reused when this machine validated it before); None when nothing differs."""
    if job.mode is not Mode.TRAIN or spec.trainer_command != DEFAULT_TRAINER_COMMAND:
        return None
    if decision.settings == decide_for_spec(spec, job.undecided_settings()).settings:
        return None
    result = validate_spec_with_verl(spec, reuse=True, decision=decision)
    log.info("Run %s: verl %s accepts the job as decided for these nodes (%s)", spec.run_name,
             result["verl_version"], f"validated before: {result['reused']}" if result["reused"] else
             f"validated in {result['seconds']}s")
    return result


@dataclass(frozen=True)
class PreparedJob:
    """What the submit step decided: the mode, the exact job, the environment probe's report and what was
    decided for the nodes."""

    mode: Mode
    job: RenderedJob
    environment: dict[str, Any]
    decision: Decision | None = None


def prepare_job(
    spec: RunSpec,
    handle: ClusterHandle,
    client: RayJobsClient,
    *,
    data: dict[str, Any],
    models: dict[str, Any],
    id_prefix: str,
) -> PreparedJob:
    """Everything before submitting, for every submission alike: the mode (resolved against the cluster
    at the run's first submission, the same for every later one), the nodes probed (:func:`probe_cluster`),
    what the job uses on them decided (:func:`decide_for_nodes`), the job rendered from the frozen spec
    and that decision, judged against the probe (:func:`check_environment`) and verl's validation
    (:func:`validate_decided`), ``job.json`` written."""
    status = cluster_status(handle, client)
    earlier = RunDir(spec.run_dir).job()
    mode = Mode(earlier["mode"]) if earlier else choose_mode(spec, status)
    if mode is Mode.TRAIN and spec.trainer_command != DEFAULT_TRAINER_COMMAND:
        log.warning("Custom trainer_command %s: verl's CPU/GPU/package requirements are reported, not enforced",
                    " ".join(spec.trainer_command))
    intent = render(spec, data=data, models=models, mode=mode)  # the run's settings: nothing decided for nodes yet
    raw = probe_cluster(spec, intent, client=client, status=status, id_prefix=id_prefix)
    decision = decide_for_nodes(spec, intent, raw)
    job = render(spec, data=data, models=models, mode=mode, decision=decision)
    environment = check_environment(spec, job, raw, status=status, decision=decision)
    validate_decided(spec, job, decision)
    save_run_files(spec, job)
    return PreparedJob(mode, job, environment, decision)


@dataclass(frozen=True)
class Submitted:
    """What :func:`submit_attempt` did: the job (new, or the run's live one) and, for a new one, what
    was prepared for it (mode, job, probe report)."""

    submission: Submission
    prepared: PreparedJob | None

    @property
    def mode(self) -> Mode | None:
        return self.prepared.mode if self.prepared else None


def submit_attempt(
    spec: RunSpec,
    handle: ClusterHandle,
    client: RayJobsClient,
    *,
    data: dict[str, Any],
    models: dict[str, Any],
    dag_id: str,
    run_id: str,
    task_id: str,
    deadline: Deadline | None = None,
    secret_env: Mapping[str, str] | None = None,
) -> Submitted:
    """The one submit path: the first submission, a shared cluster's admitted one, a resubmission after
    a failure, and the CLI's.

    A live (or succeeded) job of the run is reattached to as it is. Otherwise the cluster as it is
    now (a re-provisioned one included) is probed, the job rendered and saved (:func:`prepare_job`),
    and the next attempt submitted (:func:`~verl_pipeline.jobs.submit.submit_or_reattach`: resumed
    from the newest complete checkpoint, told the earliest of ``deadline`` and the end of the
    cluster's allocation, tracker credentials in a private file, recorded in the run's attempts).
    """
    found = existing_job(client, dag_id=dag_id, run_id=run_id, task_id=task_id)
    if found is not None:
        return Submitted(found, None)
    prepared = prepare_job(spec, handle, client, data=data, models=models,
                           id_prefix=submission_prefix(dag_id, run_id, task_id))
    if prepared.job.mode is Mode.TRAIN and spec.model_facts is not None:
        warn_checkpoint_room(spec.checkpoint_dir, prepared.job.settings, spec.model_facts.params_b)
    ends = earliest([deadline, cluster_deadline(handle, _backend_spec(handle))])
    sub = submit_or_reattach(client, prepared.job, dag_id=dag_id, run_id=run_id, task_id=task_id,
                             run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir, deadline=ends,
                             secret_env=secret_env)
    if prepared.decision is not None and sub.action is SubmitAction.SUBMITTED:
        RunDir(spec.run_dir).record_decision({"attempt": sub.attempt, "submission_id": sub.submission_id,
                                              "at": now(), **prepared.decision.to_dict()})
    return Submitted(sub, prepared)


def warn_checkpoint_room(checkpoint_dir: Path, settings: dict[str, Any], params_b: float) -> None:
    """Warn when the run's checkpoints may outgrow the free space of their storage (an estimate from the model's
    size: a save cut short by a full disk fails the attempt hours in, and every retry after it)."""
    from verl_pipeline.jobs.checkpoints import checkpoint_room

    try:
        room = checkpoint_room(checkpoint_dir, settings, params_b)
    except OSError as e:  # a warning never stops a submit: the storage's own errors come with the job
        log.info("Could not estimate the room for the run's checkpoints in %s: %s", checkpoint_dir, e)
        return
    if room.short:
        log.warning("The run's checkpoints may not fit in %s: up to %d save(s) at once of ~%.1f GB each (the "
                    "models' fp32 weights and Adam's moments) may need %.1f GB more and %.1f GB are free; keep fewer "
                    "(trainer.max_actor_ckpt_to_keep) or give the cluster profile's storage.checkpoints more room",
                    checkpoint_dir, room.saves, room.save_bytes / 1e9, room.need / 1e9, room.free / 1e9)


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
    backend = get_backend({"backend": handle.backend, **_backend_spec(handle)})
    result.update(backend.teardown(handle))
    if run_dir is not None:
        RunDir(run_dir).retire_cluster()
    return result


def _backend_spec(handle: ClusterHandle) -> dict[str, Any]:
    if handle.backend == "address":
        return {"dashboard_url": handle.dashboard_url, "auth_mode": handle.auth_mode,
                "allow_insecure": bool(handle.extra.get("allow_insecure", False))}
    return {}


__all__ = [
    "PreparedJob",
    "Submitted",
    "check_environment",
    "check_paths_visible",
    "choose_mode",
    "cluster_problems",
    "decide_for_nodes",
    "ensure_cluster",
    "find_handle",
    "freeze",
    "frozen_or",
    "load_frozen",
    "prepare_job",
    "preprocess",
    "probe_cluster",
    "provision",
    "render",
    "resume_point",
    "save_run_files",
    "submit_attempt",
    "teardown",
    "validate_decided",
    "validate_spec_with_verl",
    "wait_job_ended",
]
