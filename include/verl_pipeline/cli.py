"""``verl-pipeline``: every step of the DAG by hand, calling the same functions the DAG calls.

Examples::

    verl-pipeline cluster up                      # local Ray head of the default profile
    verl-pipeline cluster up --backend slurm      # the cluster profile that uses Slurm (sbatch)
    verl-pipeline preprocess --json
    verl-pipeline prefetch
    verl-pipeline render --mode preflight         # exact entrypoint + runtime_env
    verl-pipeline submit && verl-pipeline logs --follow
    eval "$(verl-pipeline cluster env)"          # then Ray's own CLI: ray job list / logs <id> / status <id>
    verl-pipeline cluster down
    verl-pipeline report .work/home/runs/<run>   # (re)build a run's report.json, plots, report.html
    verl-pipeline evaluate .work/home/runs/<run> # score its trained, base and champion models: evaluation.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.constants import DEFAULT_RECIPE, BackendKind, Mode, Placement
from verl_pipeline.evaluation.request import DEFAULT_SAMPLE
from verl_pipeline.evaluation.run import DEFAULT_TIMEOUT_S
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.profiles import Asked, build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec

if TYPE_CHECKING:
    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.scores import Evaluation

CLI_DAG_ID = "cli"
CLI_TASK_ID = "submit"


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--profile", default=None, help="run profile in configs/profiles (default: smoke)")
    g.add_argument("--model-profile", default=None, help="replace the run profile's model profile")
    g.add_argument("--cluster-profile", default=None, help="replace the run profile's cluster profile")
    g.add_argument("--run-name", default="cli/manual", help="names the cluster, run dir and job ids")
    g.add_argument("--data-source", default=None)
    g.add_argument("--model-source", default=None)
    g.add_argument("--nnodes", type=int, default=None)
    g.add_argument("--n-gpus-per-node", type=int, default=None)
    g.add_argument("--total-training-steps", type=int, default=None)
    g.add_argument("--mode", choices=[m.value for m in Mode], default=None)
    g.add_argument("--placement", choices=[p.value for p in Placement], default=None,
                   help="colocated (hybrid engine) or separate (rollout on its own GPU pool)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one verl setting (wins over profiles and scaling rules); repeatable")
    g.add_argument("--nccl-debug", action="store_true", default=None, help="set NCCL_DEBUG=INFO in the job")
    g.add_argument("--json", action="store_true", help="machine-readable output")


def _spec(args: argparse.Namespace, *, refuse_changes: bool = True) -> RunSpec:
    """The run's frozen spec once ``cluster up`` saved it, else the spec the flags and profiles make now.

    A flag given with a value the frozen run does not have is refused, naming the difference (unless
    ``refuse_changes`` is off: then it is logged, as a changed profile file is)."""
    from verl_pipeline import steps
    from verl_pipeline.models.prefetch import config_on_this_machine

    params = {
        "profile": args.profile,
        "data_source": getattr(args, "data_source", None),
        "model_source": getattr(args, "model_source", None),
        "nnodes": args.nnodes,
        "n_gpus_per_node": args.n_gpus_per_node,
        "total_training_steps": args.total_training_steps,
        "mode": args.mode,
        "placement": getattr(args, "placement", None),
    }
    request: dict[str, Any] = {"model_profile": args.model_profile, "cluster_profile": args.cluster_profile,
                               "overrides": _parse_sets(getattr(args, "overrides", None) or []),
                               "nccl_debug": getattr(args, "nccl_debug", None)}
    given = {k: v for k, v in params.items() if v is not None}
    built = build_run_spec(given, run_name=args.run_name, model_config=config_on_this_machine, **request)
    asked = Asked.of(given, **request) if refuse_changes else None
    starts = f"to `verl-pipeline cluster up --run-name {shlex.quote(args.run_name)}`"
    return steps.frozen_or(built, asked, starts=starts)


def _parse_sets(items: list[str]) -> dict[str, Any]:
    from verl_pipeline.trainer.overrides import parse_overrides

    return parse_overrides(items, field="--set")


def _out(args: argparse.Namespace, data: Any, text: str | None = None) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        print(text if text is not None else json.dumps(data, indent=2, sort_keys=True, default=str))


def _handle(spec: RunSpec) -> Any:
    from verl_pipeline import steps

    handle = steps.find_handle(spec)
    if handle is None:
        raise PipelineError(f"no cluster recorded for run {spec.run_name!r}: run `verl-pipeline cluster up` first")
    return handle


def _select_backend(args: argparse.Namespace) -> None:
    """``--backend`` picks the cluster profile: the given one must use it, else the only profile that does."""
    from verl_pipeline.exceptions import ConfigError
    from verl_pipeline.profiles import list_profiles, load_yaml_profile

    def backend_of(name: str) -> str:
        return str((load_yaml_profile("clusters", name).get("cluster") or {}).get("backend"))

    if args.cluster_profile:
        if backend_of(args.cluster_profile) != args.backend:
            raise ConfigError("--backend", args.backend, f"cluster profile {args.cluster_profile} uses backend "
                              f"{backend_of(args.cluster_profile)}", "drop --backend or pick a matching profile")
        return
    run_profile = load_yaml_profile("profiles", args.profile or "smoke")
    if backend_of(str(run_profile.get("cluster_profile", ""))) == args.backend:
        return
    matches = [name for name in list_profiles("clusters") if backend_of(name) == args.backend]
    if len(matches) != 1:
        raise ConfigError("--backend", args.backend,
                          f"{len(matches)} cluster profiles in configs/clusters use this backend: {matches}",
                          "pass --cluster-profile NAME" if matches else
                          f"add configs/clusters/<name>.yaml with `backend: {args.backend}` (see docs/backends.md)")
    args.cluster_profile = matches[0]


def cmd_cluster(args: argparse.Namespace) -> int:
    from verl_pipeline import steps
    from verl_pipeline.cluster.registry import get_backend

    if args.run_dir and args.action != "env":
        from verl_pipeline.exceptions import ConfigError

        raise ConfigError("--run-dir", args.run_dir, f"only `cluster env` reads a run directory, not `cluster "
                          f"{args.action}`", "name the run with --run-name, and --profile when it is not smoke")
    if args.backend:
        _select_backend(args)
    if args.action == "env":
        return _cluster_env(args)
    spec = _spec(args, refuse_changes=args.action != "down")  # a teardown is never refused
    if args.action == "up":
        endpoint = (args.address, None) if args.address else None
        t0 = time.monotonic()
        from verl_pipeline.evaluation.held_out import check_held_out

        check_held_out(spec)  # as the DAG's provision task: before any cluster starts
        steps.freeze(spec)  # as the DAG's provision task: later commands of this run read this spec
        handle = steps.provision(spec, endpoint=endpoint)
        _out(args, handle.to_dict(),
             f"Ray cluster {handle.name} ready in {time.monotonic() - t0:.1f}s: dashboard {handle.dashboard_url}")
    elif args.action == "down":
        result = steps.teardown(steps.find_handle(spec), run_dir=spec.run_dir)
        _out(args, result)
    else:
        handle = _handle(spec)
        backend = get_backend({"backend": handle.backend, **steps.backend_spec(handle)})
        status = backend.status(handle)
        health = backend.health(handle)
        _out(args, {"cluster": handle.to_dict(), "status": status.to_dict(), "health": health.to_dict()},
             f"{handle.name} ({handle.backend}): {'ready' if status.ready else 'NOT READY'} — "
             f"{status.nodes_alive} node(s), {status.cpus:g} CPU, {status.gpus:g} GPU, Ray {status.ray_version} "
             f"({status.detail}); infrastructure: {health.detail}")
        return 0 if status.ready and health.alive else 1
    return 0


#: Where Ray's CLI (``ray job …``) finds the Jobs API when ``--address`` is not given.
RAY_ADDRESS_VAR = "RAY_ADDRESS"


@dataclasses.dataclass(frozen=True)
class RayShellEnv:
    """The shell environment under which Ray's own CLI (``ray job list/logs/status``) reaches one cluster.

    It holds addresses, modes and paths, never a token: where the token lives only in a variable of
    the caller's shell, ``copies`` names that variable and the shell expands it when it evaluates the lines.
    """

    #: Variable -> value (None: unset it, so that an inherited one cannot win over the cluster's).
    values: dict[str, str | None]
    #: Variable -> the caller's variable it takes its value from.
    copies: dict[str, str] = dataclasses.field(default_factory=dict)
    #: What else helps with this cluster (printed as shell comments).
    notes: tuple[str, ...] = ()
    #: Why Ray's CLI may still be refused with these lines (printed on stderr).
    warnings: tuple[str, ...] = ()

    def shell(self) -> str:
        """``export``/``unset`` lines for ``eval``; values quoted for the shell, notes as comments."""
        lines = [f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}"
                 for name, value in self.values.items()]
        lines += [f'export {name}="${{{source}}}"' for name, source in self.copies.items()]
        # One line each: a line break in a note would end the comment and run the rest.
        lines += ["# " + " ".join(note.splitlines()) for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"env": dict(self.values), "copies": dict(self.copies), "notes": list(self.notes),
                "warnings": list(self.warnings)}


def ray_shell_env(handle: ClusterHandle, environ: Mapping[str, str]) -> RayShellEnv:
    """What Ray's CLI needs to reach ``handle``'s cluster: the Jobs API's URL, the cluster's auth mode and
    where the token is — the token file's path (local, Slurm), or for a cluster the pipeline did not
    start (``address``) ``$VERL_PIPELINE_RAY_TOKEN`` when ``environ`` has it. The token is never read."""
    from urllib.parse import urlsplit

    from verl_pipeline import auth

    if not handle.dashboard_url:
        raise PipelineError(f"cluster {handle.name} has no dashboard URL yet (its {handle.backend} start has not "
                            "finished): wait until `verl-pipeline cluster status` says ready, then run this again")
    mode = auth.AuthMode(handle.auth_mode)
    copies: dict[str, str] = {}
    warnings: list[str] = []
    if mode is auth.AuthMode.TOKEN and handle.token_file:
        changes = auth.ray_env(mode, auth.check_token_file(Path(handle.token_file)))
    elif mode is auth.AuthMode.TOKEN:
        changes = {auth.MODE_VAR: mode.value}
        if environ.get(auth.PIPELINE_TOKEN_VAR):
            changes[auth.TOKEN_PATH_VAR] = None
            copies[auth.TOKEN_VAR] = auth.PIPELINE_TOKEN_VAR
        else:
            source = (f"the password of the Airflow connection {handle.conn_id!r}" if handle.conn_id
                      else f"${auth.PIPELINE_TOKEN_VAR}")
            warnings.append(
                f"cluster {handle.name} uses token auth and its token is {source}, which this shell does not have "
                f"(${auth.PIPELINE_TOKEN_VAR} is not set): Ray's CLI reads ${auth.TOKEN_VAR}, "
                f"${auth.TOKEN_PATH_VAR} or ~/.ray/auth_token (fix: put the token in a file only you can read and "
                f"export {auth.TOKEN_PATH_VAR}=<that file>, or export {auth.PIPELINE_TOKEN_VAR} and run this again)")
    else:
        changes = auth.ray_env(mode, None)
    notes = []
    if handle.gcs_address:
        notes.append(f"ray status --address {shlex.quote(handle.gcs_address)}   (`ray status` reads the GCS; "
                     f"{RAY_ADDRESS_VAR} is the Jobs API)")
    if handle.ca_bundle:
        notes.append(f"the dashboard's certificate is checked against {handle.ca_bundle}: add --verify "
                     f"{shlex.quote(handle.ca_bundle)} to `ray job` commands")
    url = urlsplit(handle.dashboard_url)
    host = url.hostname or ""
    if handle.backend == BackendKind.KUBERAY.value and ".svc" in host:
        namespace, service, port = handle.extra.get("namespace", "default"), host.split(".")[0], url.port or 80
        notes.append(f"{handle.dashboard_url} is the head Service inside Kubernetes; from outside it: kubectl "
                     f"port-forward -n {namespace} svc/{service} {port}:{port}, then export "
                     f"{RAY_ADDRESS_VAR}=http://127.0.0.1:{port}")
    return RayShellEnv(values={RAY_ADDRESS_VAR: handle.dashboard_url, **changes}, copies=copies,
                       notes=tuple(notes), warnings=tuple(warnings))


def _cluster_env(args: argparse.Namespace) -> int:
    """``cluster env``: the lines that point Ray's CLI at the run's cluster (``eval "$(…)"``)."""
    from verl_pipeline.cluster.base import ClusterHandle

    if args.run_dir:
        run_dir = RunDir(Path(args.run_dir))
        recorded = run_dir.cluster()
        if recorded is None:
            raise PipelineError(f"no cluster recorded in {args.run_dir} (no {run_dir.cluster_file.name}: the run's "
                                "cluster is not up, or was torn down): run `verl-pipeline cluster up` first (a DAG "
                                "run: its provision task)")
        handle = ClusterHandle.from_dict(recorded)
    else:
        handle = _handle(_spec(args))
    env = ray_shell_env(handle, os.environ)
    for warning in env.warnings:
        print(f"verl-pipeline: warning: {warning}", file=sys.stderr)
    _out(args, {"cluster": handle.name, "backend": handle.backend, **env.to_dict()}, env.shell())
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from verl_pipeline import steps
    from verl_pipeline.spec import DataSource

    spec = _spec(args)
    if args.tokenizer or args.max_prompt_length or args.max_reject_fraction is not None:
        extra = {"tokenizer": args.tokenizer, "max_prompt_length": args.max_prompt_length,
                 "max_reject_fraction": args.max_reject_fraction}
        spec = dataclasses.replace(spec, data_options={**spec.data_options,
                                                       **{k: v for k, v in extra.items() if v is not None}})
    sources = [DataSource.parse(text, key="--input") for text in args.input] if args.input else None
    out = Path(args.output).resolve() if args.output else None
    result = steps.preprocess(spec, sources, out, recipe=args.recipe)
    c = result.counts
    lines = [f"train: {result.train_path}", f"val:   {result.val_path}",
             f"rows in {c['records_in']}, written {c['written']} (train {c['train_rows']}, val {c['val_rows']}), "
             f"rejected {sum(c['rejected'].values())} {c['rejected']}, deduplicated {c['deduplicated']}, "
             f"filtered for length {c['too_long']}" + (" (cached: nothing to do)" if result.cached else "")]
    if isinstance(c.get("length_filter"), dict):
        lf = c["length_filter"]
        lines.append(f"longest prompt: {lf['longest_prompt']} (max_prompt_length {lf['max_prompt_length']})")
    _out(args, result.to_dict(), "\n".join(lines))
    return 0


def _prefetch_all(spec: RunSpec, model: str | None = None, cache: str | None = None) -> dict[str, Any]:
    """Every model of the run by role (``--model`` replaces them all with one actor). Token: ``HF_TOKEN``."""
    import os

    from verl_pipeline.models.prefetch import prefetch, prefetch_run
    from verl_pipeline.spec import ModelSource

    token = os.environ.get("HF_TOKEN") or None
    cache_root = Path(cache).resolve() if cache else spec.model_cache
    if model:
        return {"actor": {**prefetch(ModelSource.parse(model, key="--model"), cache_root, token=token).to_dict(),
                          "role": "actor"}}
    return prefetch_run(spec, token=token, cache_root=cache_root)


def cmd_prefetch(args: argparse.Namespace) -> int:
    spec = _spec(args)
    out = _prefetch_all(spec, args.model, args.cache)
    lines = [f"{role}: {r['path']} ({r['files']} files, {r['bytes']} bytes, "
             f"{'cache hit' if r.get('cached') else 'fetched'} in {r['seconds']:.2f}s)"
             + (f" commit {r['commit']}" if r.get("commit") else "") for role, r in out.items()]
    _out(args, out, "\n".join(lines))
    return 0


def _inputs(spec: RunSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    from verl_pipeline import steps

    return steps.preprocess(spec).to_dict(), _prefetch_all(spec)


def _render_inputs(spec: RunSpec) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Data and model paths for ``render``.

    Built for real when the run's storage is this machine's (the local backend); for any other cluster
    planned (data: the content-keyed directory preprocess would write; a model directory read, not
    recorded), so that rendering for a cluster writes nothing under its storage, whether or not its
    mounts exist here.
    """
    from verl_pipeline import steps
    from verl_pipeline.data import preprocess as pre
    from verl_pipeline.exceptions import ModelError
    from verl_pipeline.models.prefetch import prefetch

    notes = []
    local = spec.cluster.get("backend") == "local"
    if local:
        data = steps.preprocess(spec).to_dict()
    else:
        # The directory is keyed by the data's content and the model's tokenizer, which only the
        # preprocess task (on the shared storage) can hash.
        recipe = str(spec.data_options.get("recipe") or DEFAULT_RECIPE)
        out_dir = pre.output_dir(spec.data_root, recipe, "<content-key>")
        data = {"train_path": str(pre.split_file(out_dir, "train")), "val_path": str(pre.split_file(out_dir, "val"))}
        notes.append(f"data paths on the cluster's storage {list(spec.shared_roots)} are where the preprocess "
                     "task will write (<content-key> is computed there)")
    models: dict[str, Any] = {}
    for role, source in spec.model_sources().items():  # every model of the run, the reward model too
        if role == "critic" and source == spec.model:
            continue
        if local:
            try:
                models[role] = prefetch(source, spec.model_cache).to_dict()
                continue
            except ModelError as e:
                notes.append(f"{role} model path is a placeholder until prefetch runs ({e})")
        elif source.kind == "path":  # prefetch would record its verification in the cluster's model cache
            models[role] = {"path": source.ref}
            notes.append(f"{role} model {source.ref}: the prefetch task verifies it and records that on the "
                         "cluster's storage")
            continue
        else:
            notes.append(f"{role} model path is a placeholder until the prefetch task resolves {source}")
        ref = f"{source.ref}@{source.revision}" if source.revision else source.ref
        models[role] = {"path": str(spec.model_cache / source.kind / ref)}
    return data, models, notes


def _render_nodes(spec: RunSpec, path: str | None) -> Any:
    """What the probe found on the nodes ``render`` decides for: ``--nodes FILE`` (a run's environment.json,
    job.json or decisions.jsonl, or a cluster's latest probe), else the cluster profile's latest probe on
    its storage when this machine sees it; None when neither is there."""
    from verl_pipeline.trainer.nodes.facts import NodeFacts

    file = Path(path) if path else spec.cluster_facts_file
    if not file.is_file():
        if path:
            raise PipelineError(f"--nodes {path}: no such file (a run's environment.json, job.json or decisions.jsonl, "
                                "or <storage>/clusters/<cluster profile>.json)")
        return None
    try:
        lines = [line for line in file.read_text().splitlines() if line.strip()]
        data = json.loads(lines[-1]) if file.suffix == ".jsonl" else json.loads("\n".join(lines))
    except (OSError, ValueError, IndexError) as e:
        raise PipelineError(f"--nodes {file}: not a JSON record the pipeline wrote ({e})") from None
    facts = NodeFacts.from_record(data, source=str(file)) if isinstance(data, dict) else None
    if facts is None and path:
        raise PipelineError(f"--nodes {path}: it holds no probe findings (environment.json and job.json of runs "
                            "submitted since the probe reports them)")
    return facts


def _both_ways(spec: RunSpec, settings: dict[str, Any]) -> list[str]:
    """What ``submit`` would decide with and without flash-attn on the GPU nodes, for a render without a probe."""
    from verl_pipeline.trainer.nodes.decisions import decide_for_spec
    from verl_pipeline.trainer.nodes.facts import GpuNode, NodeFacts
    from verl_pipeline.trainer.scaling import uses_critic

    memory = spec.hardware.gpu_memory_gb if spec.hardware else None
    out = []
    for usable in (True, False):
        node = GpuNode(node="a GPU node (assumed)", node_id="assumed", gpus=float(spec.n_gpus_per_node),
                       gpu_memory_gb=memory, flash_attn="installed" if usable else None,
                       flash_attn_error=None if usable else "not installed")
        nodes = NodeFacts((node,), True, 0, f"assumed: {spec.cluster_profile}'s hardware, not probed")
        decision = decide_for_spec(spec, settings, nodes)
        what = ", ".join(f"{k}={v!r}" for k, v in sorted(decision.settings.items())) or "nothing"
        if not usable and uses_critic(settings):
            what += " (and the probe refuses the run: verl 0.9.1 loads a critic with flash-attn only)"
        out.append(f"with{'' if usable else 'out'} flash-attn on every GPU node: {what}")
    return out


def cmd_render(args: argparse.Namespace) -> int:
    from verl_pipeline import steps
    from verl_pipeline.evaluation.held_out import check_held_out
    from verl_pipeline.trainer.nodes.decisions import decide_for_spec
    from verl_pipeline.trainer.render import job_settings

    spec = _spec(args)
    check_held_out(spec)
    mode = Mode(args.mode) if args.mode else spec.mode
    if mode is Mode.AUTO:
        mode = Mode.TRAIN  # what a GPU cluster would get; `submit` resolves auto against the real cluster
    data, models, notes = _render_inputs(spec)
    nodes = _render_nodes(spec, args.nodes)
    settings = job_settings(spec, train_files=data["train_path"], val_files=data["val_path"],
                            model_path=models["actor"]["path"], critic_path=(models.get("critic") or {}).get("path"))
    decision = decide_for_spec(spec, settings, nodes) if nodes is not None else None
    verl_check = None if args.no_verl_check else steps.validate_spec_with_verl(spec, decision=decision)
    job = steps.render(spec, data=data, models=models, mode=mode, decision=decision)
    from verl_pipeline.trainer.environment import render_notes

    needs = render_notes(steps.job_needs(spec, job), n_gpus=spec.n_gpus, settings=job.settings)
    needs += job.files.notes()
    text = [
        f"# mode: {mode.value}; target: {spec.nnodes} node(s) x {spec.n_gpus_per_node} GPU(s) = {spec.n_gpus}; "
        f"profiles: run {spec.profile}, model {spec.model_profile}, cluster {spec.cluster_profile}",
    ]
    if verl_check is not None:
        text.append(f"# verl {verl_check['verl_version']}: composed ppo_trainer.yaml and passed validate_config + "
                    f"the actor/critic/rollout dataclass checks in {verl_check['seconds']}s "
                    f"(critic: {verl_check['use_critic']}, reference: {verl_check['use_reference_policy']})")
        text += [f"# verl check not run here: {line}" for line in verl_check.get("unchecked") or []]
    if spec.admission is not None:
        text.append(f"# shared cluster: a verl_ppo run waits for {spec.admission.describe()} (verl-pipeline "
                    "submit does not queue)")
    text += [f"# note: {n}" for n in notes]
    text += [f"# needs: {n}" for n in needs]
    if decision is not None:
        text.append(f"# nodes: {decision.nodes.describe()}")
        text.append(f"# decided for these nodes: {decision.summary()}")
        text += [f"# note: {n}" for n in decision.notes]
    else:
        text.append(f"# nodes: cluster {spec.cluster_profile} has no probe on record here ({spec.cluster_facts_file}; "
                    "--nodes FILE reads one): submit decides from its probe")
        text += [f"# decided at submit, {line}" for line in _both_ways(spec, settings)]
    text.append("derived values (value — rule):")
    width = max((len(k) for k in job.derived), default=0)
    text += [f"  {k.ljust(width)} = {rule}" for k, rule in job.derived.items()]
    text += ["entrypoint:", job.entrypoint, "runtime_env:", json.dumps(job.runtime_env, indent=2, sort_keys=True)]
    _out(args, {**job.to_dict(), "spec": spec.to_dict(), "verl_check": verl_check, "notes": notes, "needs": needs},
         "\n".join(text))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from verl_pipeline import steps

    spec = _spec(args)
    handle = _handle(spec)
    client = handle.client()
    data, models = _inputs(spec)
    secret_env, tracker_links = _trackers(spec, handle)
    # The DAG's one submit path: probe, render, job.json, attempts numbered and recorded in the run
    # directory, so a re-submit after a failure resumes from the run's checkpoints.
    done = steps.submit_attempt(spec, handle, client, data=data, models=models, dag_id=CLI_DAG_ID,
                                run_id=spec.run_name, task_id=CLI_TASK_ID, secret_env=secret_env)
    sub, lines = done.submission, []
    out: dict[str, Any] = {**sub.to_dict(), "dashboard_url": handle.dashboard_url, "tracker_links": tracker_links}
    if done.prepared is not None:
        env = done.prepared.environment
        lines.append(f"environment probe: {len(env['nodes'])} node(s) in {env['seconds']}s, "
                     + ("nothing missing" if env["ok"] else "a GPU training run would miss:"))
        lines += [f"  {p}" for p in env["problems"]] + [f"  (unreachable) {u}" for u in env["unreachable"]]
        if done.prepared.decision is not None:
            lines.append(f"decided for these nodes: {done.prepared.decision.summary()}")
        out.update(mode=done.prepared.mode.value, environment=env, decision=done.prepared.job.decision)
    lines.append(f"{sub.action.value}: {sub.submission_id} ({out.get('mode', 'its mode as submitted')}) on "
                 f"{handle.dashboard_url}")
    lines += [f"{name}: {url}" for name, url in tracker_links.items()]
    _out(args, out, "\n".join(lines))
    return 0


def _trackers(spec: RunSpec, handle: Any) -> tuple[dict[str, str] | None, dict[str, str]]:
    """What the submit task passes for the run's trackers, from the same Airflow connections
    (``AIRFLOW_CONN_*`` variables or Airflow's database): Airflow is imported only when a tracker needs it."""
    from verl_pipeline.trackers import LOGGER_KEY, chosen_trackers, logger_backends

    if not chosen_trackers(logger_backends(spec.verl.get(LOGGER_KEY))):
        return None, {}
    from verl_pipeline.airflow.tracker_connections import job_trackers

    trackers = job_trackers(spec, handle)
    return trackers.env.values, trackers.links


def _job_id(args: argparse.Namespace, spec: RunSpec, client: Any) -> str:
    from verl_pipeline.jobs.submit import jobs_of

    if args.job_id:
        return str(args.job_id)
    mine = jobs_of(client, dag_id=CLI_DAG_ID, run_id=spec.run_name, task_id=CLI_TASK_ID)
    if not mine:
        raise PipelineError(f"no job submitted for run {spec.run_name!r}: pass a job id or run `submit`")
    return str(mine[-1][1].submission_id)


def cmd_status(args: argparse.Namespace) -> int:
    spec = _spec(args)
    client = _handle(spec).client()
    job_id = _job_id(args, spec, client)
    info = client.get_job(job_id)
    if info is None:
        raise PipelineError(f"Ray job {job_id} does not exist on {client.dashboard_url}")
    _out(args, info.to_dict(), f"{job_id}: {info.status.value} {info.message}")
    return 0 if info.status.value != "FAILED" else 1


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the job's log; ``--follow``: then its new bytes every 2 s until the job ends.

    Reads byte ranges of the driver's log file, as the wait task's trigger does: each poll
    transfers only the bytes written since the last one, never the whole log again.
    """
    import asyncio

    import aiohttp

    from verl_pipeline.jobs.client import follow_log

    spec = _spec(args)
    handle = _handle(spec)
    job_id = _job_id(args, spec, handle.client())
    out = sys.stdout.buffer

    def write(data: bytes) -> None:
        out.write(data)
        out.flush()

    async def follow() -> None:
        async with aiohttp.ClientSession() as session:
            await follow_log(handle.client(session=session), job_id, write, follow=args.follow)

    asyncio.run(follow())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """(Re)build a run's report with the function the report task calls."""
    from verl_pipeline.report.build import RunOutcome
    from verl_pipeline.report.write import write_report

    run_dir = Path(args.run_dir)
    if not RunDir(run_dir).spec_file.is_file() and not RunDir(run_dir).attempts_file.is_file():
        raise PipelineError(f"{run_dir} is not a run directory (no run_spec.json or attempts.jsonl): pass "
                            "<storage>/runs/<run_key>")
    files = write_report(run_dir, status=RunOutcome(args.status) if args.status else None, plots=not args.no_plots)
    out = files.to_dict()
    _out(args, out, f"{out['html']} ({out['status']}, {out['steps_done']}/{out['total_steps']} steps, "
                    f"flags: {', '.join(out['flags']) or 'none'})")
    return 0


@contextlib.contextmanager
def _evaluation_cluster(spec: RunSpec) -> Iterator[ClusterHandle]:
    """The run's cluster when one is recorded (as ``submit`` finds it); else a local Ray head started for
    the evaluation (the run's own cluster profile when it is a local one, else the local backend's
    defaults) and stopped after it, by its processes' ids."""
    from verl_pipeline import steps
    from verl_pipeline.cluster.local import LocalBackend

    handle = steps.find_handle(spec)
    if handle is not None:
        yield handle
        return
    local = BackendKind.LOCAL.value
    backend = LocalBackend.from_spec(spec.cluster if spec.cluster.get("backend") == local else {"backend": local})
    started = backend.provision(f"{spec.cluster_name}-evaluate")
    try:
        yield started
    finally:
        backend.teardown(started)


def evaluation_lines(evaluation: Evaluation, notes: tuple[str, ...] = ()) -> list[str]:
    """The evaluation as ``evaluate`` prints it: the rows, then one line per model (role, mean reward, pass
    rate, mean response length in tokens, rows scored), the models not scored, the notes."""
    from verl_pipeline.scores import Role

    if evaluation.smoke:
        scope = (f"a smoke evaluation: {evaluation.engine.value} on the first "
                 f"{evaluation.sampling.get('sample')} of {evaluation.rows_total} rows")
    else:
        scope = f"{evaluation.engine.value}, every row"
    lines = [f"rows: {evaluation.data_path} (sha256 {evaluation.data_hash[:12]}…), {scope}, greedy, "
             f"{evaluation.sampling.get('max_new_tokens')} new tokens at most",
             f"{'role':<9} {'mean reward':>11} {'pass rate':>9} {'length':>7} {'n':>5}"]
    for role in Role:
        score = evaluation.score(role)
        if score is not None:
            lines.append(f"{role.value:<9} {score.mean_reward:>11.3f} {score.pass_rate:>9.1%} "
                         f"{score.mean_response_length:>7.1f} {score.n:>5}")
        elif role.value in evaluation.errors:
            lines.append(f"{role.value:<9} not scored: {evaluation.errors[role.value]}")
    return lines + [f"note: {n}" for n in notes]


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score the run's exported model, its base model and a champion on its validation rows with its reward
    function, on the run's cluster (else a local Ray head started for it); write ``evaluation.json``."""
    from verl_pipeline.evaluation.run import evaluate_run
    from verl_pipeline.paths import slug

    run = RunDir(Path(args.run_dir))
    if not run.has_spec():
        raise PipelineError(f"{args.run_dir} is not a run directory (no run_spec.json): pass <storage>/runs/<run_key>")
    spec = RunSpec.load(run)
    with _evaluation_cluster(spec) as handle:
        outcome = evaluate_run(handle.client(), run.path, id_prefix=f"cli-{slug(spec.run_key, 40)}",
                               against=Path(args.against) if args.against else None, sample=args.sample,
                               max_new_tokens=args.max_new_tokens, timeout_s=args.timeout)
    lines = [*evaluation_lines(outcome.evaluation, outcome.notes), f"written: {outcome.path}"]
    _out(args, {"evaluation": outcome.evaluation.to_dict(), "file": str(outcome.path), "notes": list(outcome.notes)},
         "\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", help="provision / tear down / inspect the run's Ray cluster, or print the shell "
                                       "environment for Ray's own CLI (env)",
                       description="up / down / status: the run's Ray cluster. env: `export` lines (address, auth "
                                   "mode, the token file's path, never the token) after which Ray's own CLI reaches "
                                   "the cluster: eval \"$(verl-pipeline cluster env --run-name NAME)\"; ray job list")
    p.add_argument("action", choices=["up", "down", "status", "env"])
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="env only: the run directory (<storage>/runs/<run key>, as the wait task's log names it) "
                        "instead of --run-name and the profile flags")
    p.add_argument("--address", default=None, help="dashboard URL of an existing cluster (address backend)")
    p.add_argument("--backend", choices=[k.value for k in BackendKind], default=None,
                   help="where the cluster comes from; picks the cluster profile using it (with --cluster-profile: "
                        "checks it)")
    _add_run_args(p)
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("preprocess", help="write verl parquet (train/val) for the run's data")
    p.add_argument("--input", action="append", default=None, metavar="PATH",
                   help="data source, repeatable: file, glob, directory, URL (s3://, gs://, ...), "
                        "hf://name?config=..., builtin:arithmetic (default: the profile's)")
    p.add_argument("--output", default=None, metavar="DIR", help="output root (default: <storage>/data)")
    p.add_argument("--recipe", default=None, help="recipe in configs/recipes (gsm8k, math, generic, ...)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory for the length filter (default: the run's model)")
    p.add_argument("--max-prompt-length", type=int, default=None, help="default: the model profile's")
    p.add_argument("--max-reject-fraction", type=float, default=None, help="default: the profile's (0)")
    _add_run_args(p)
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser("prefetch", help="fetch or build the run's model(s) into the shared cache, verified",
                       description="Fetch every model of the run (actor, critic, reward) into the cache, pinned "
                                   "to a commit and verified; a repeat run only checks the manifest. Hub token: "
                                   "HF_TOKEN. Hub endpoint: HF_ENDPOINT.")
    p.add_argument("--model", default=None,
                   help="one model source instead of the profile's: hf://org/name@rev, a directory, an fsspec "
                        "URL or builtin:tiny-qwen2")
    p.add_argument("--cache", default=None, help="cache root (default: <storage>/models)")
    _add_run_args(p)
    p.set_defaults(func=cmd_prefetch)

    p = sub.add_parser("render", help="print the exact entrypoint and runtime_env that would be submitted, and "
                                      "every derived value with its rule")
    p.add_argument("--no-verl-check", action="store_true", help="skip composing + validating with verl (~1-5 s)")
    p.add_argument("--nodes", default=None, metavar="FILE",
                   help="decide for the nodes a probe found: a run's environment.json, job.json or decisions.jsonl "
                        "(default: the cluster profile's latest probe, <storage>/clusters/<cluster profile>.json)")
    _add_run_args(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("submit", help="submit the job to the run's cluster (or reattach to its live job)")
    _add_run_args(p)
    p.set_defaults(func=cmd_submit)

    for name, func, helptext in (("status", cmd_status, "show a job's status"),
                                 ("logs", cmd_logs, "print a job's logs")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("job_id", nargs="?", default=None, help="default: the run's latest job")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true")
        _add_run_args(p)
        p.set_defaults(func=func)

    p = sub.add_parser("report", help="(re)build a run's report (report.json, PNG plots, report.html)")
    p.add_argument("run_dir", help="the run directory, <storage>/runs/<run_key>")
    p.add_argument("--status", choices=["succeeded", "failed"], default=None,
                   help="how the run ended (default: its last report's or manifest's word, else its files')")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib import)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("evaluate", help="score a run's trained, base and champion models on its validation rows "
                                        "(evaluation.json)",
                       description="Generate greedy responses of the run's exported model, its base model and the "
                                   "profile's champion (or --against RUN_DIR) to the run's validation rows and score "
                                   "them with the run's reward function, as a Ray job on the run's cluster (none "
                                   "recorded: a local Ray head started for it). On GPUs with vLLM every row; else "
                                   "transformers on the first --sample rows, a smoke evaluation.")
    p.add_argument("run_dir", help="the run directory, <storage>/runs/<run_key>")
    p.add_argument("--against", default=None, metavar="RUN_DIR",
                   help="another run directory whose exported model is the champion (default: the profile's "
                        "latest run, when it was evaluated on the same rows)")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                   help=f"rows a transformers (CPU) evaluation scores, the first ones (default {DEFAULT_SAMPLE})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per response at most (default: the run's data.max_response_length)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds the evaluation job has to finish (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except PipelineError as e:
        print(f"verl-pipeline: error: {e}", file=sys.stderr)
        return 2
