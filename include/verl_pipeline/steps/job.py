"""The job a run submits, prepared: rendered, its files staged and recorded, the cluster probed, the
environment checked, decided for the nodes found and validated by verl as decided."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.cluster.base import ClusterHandle, ClusterStatus
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import RunDir, now
from verl_pipeline.spec import RunSpec
from verl_pipeline.steps.cluster import choose_mode, cluster_problems, cluster_status
from verl_pipeline.steps.spec import validate_spec_with_verl
from verl_pipeline.trainer.jobfiles import stage
from verl_pipeline.trainer.nodes.decisions import Decision, decide_for_spec
from verl_pipeline.trainer.render import RenderedJob, render_job

if TYPE_CHECKING:
    from verl_pipeline.trainer.environment import Needs

log = logging.getLogger(__name__)


def check_paths_visible(spec: RunSpec, paths: dict[str, str]) -> None:
    """Data and model paths must be on storage every Ray node mounts (a local head shares this disk)."""
    from verl_pipeline.spec import require_shared

    if spec.cluster.get("backend") == "local":
        return
    for key, path in paths.items():
        if path:
            require_shared(key, path, spec.shared_roots, "the cluster's nodes would not find it")


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


def job_needs(spec: RunSpec, job: RenderedJob) -> Needs:
    """What the run needs on every node: its job's packages and paths, and the held-out rows its evaluation
    scores (``evaluation.data``) when it names them."""
    from verl_pipeline.scores import HELD_OUT_KEY
    from verl_pipeline.trainer.environment import installed_verl_pins, needs_for

    needs = needs_for(job.settings, installed_verl_pins())
    held_out = spec.evaluation.data if spec.evaluation.enabled else None
    return replace(needs, paths=(*needs.paths, (HELD_OUT_KEY, held_out))) if held_out else needs


def probe_cluster(spec: RunSpec, job: RenderedJob, *, client: RayJobsClient, status: ClusterStatus,
                  id_prefix: str) -> dict[str, Any]:
    """Run the environment probe (:mod:`verl_pipeline.cluster.probe`) with ``job``'s runtime_env, for what
    it needs and what the decisions read (flash-attn, the GPUs, the versions): the probe's raw report. A
    restart on nodes where nothing changed reuses the run's last probe instead
    (:func:`verl_pipeline.jobs.reprobe.decide`; the report then says ``reused`` and why)."""
    from verl_pipeline.cluster.probe import DEFAULT_TIMEOUT_S, run_probe
    from verl_pipeline.jobs.reprobe import decide, latest_failure

    hard = cluster_problems(spec, status, Mode.PREFLIGHT)  # too old a Ray: nothing else is worth probing
    if hard:
        raise hard[0]
    request = job_needs(spec, job).request()
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
    from verl_pipeline.trainer.environment import evaluate
    from verl_pipeline.trainer.nodes.facts import node_label

    needs = job_needs(spec, job)
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
