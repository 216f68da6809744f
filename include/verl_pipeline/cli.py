"""``verl-pipeline``: every step of the DAG by hand, calling the same functions the DAG calls.

Examples::

    verl-pipeline cluster up                      # local Ray head of the default profile
    verl-pipeline preprocess --json
    verl-pipeline prefetch
    verl-pipeline render --mode preflight         # exact entrypoint + runtime_env
    verl-pipeline submit && verl-pipeline logs --follow
    verl-pipeline cluster down
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from verl_pipeline.config import RunSpec, build_run_spec
from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import PipelineError

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
    g.add_argument("--json", action="store_true", help="machine-readable output")


def _spec(args: argparse.Namespace) -> RunSpec:
    params = {
        "profile": args.profile,
        "data_source": getattr(args, "data_source", None),
        "model_source": getattr(args, "model_source", None),
        "nnodes": args.nnodes,
        "n_gpus_per_node": args.n_gpus_per_node,
        "total_training_steps": args.total_training_steps,
        "mode": args.mode,
    }
    return build_run_spec({k: v for k, v in params.items() if v is not None}, run_name=args.run_name,
                          model_profile=args.model_profile, cluster_profile=args.cluster_profile)


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


def cmd_cluster(args: argparse.Namespace) -> int:
    from verl_pipeline import steps
    from verl_pipeline.cluster.base import probe

    spec = _spec(args)
    if args.action == "up":
        endpoint = (args.address, None) if args.address else None
        t0 = time.monotonic()
        handle = steps.provision(spec, endpoint=endpoint)
        _out(args, handle.to_dict(),
             f"Ray cluster {handle.name} ready in {time.monotonic() - t0:.1f}s: dashboard {handle.dashboard_url}")
    elif args.action == "down":
        result = steps.teardown(steps.find_handle(spec), run_dir=spec.run_dir)
        _out(args, result)
    else:
        handle = _handle(spec)
        status = probe(handle.client())
        _out(args, {"cluster": handle.to_dict(), "status": status.to_dict()},
             f"{handle.name}: {'ready' if status.ready else 'NOT READY'} — {status.nodes_alive} node(s), "
             f"{status.cpus:g} CPU, {status.gpus:g} GPU, Ray {status.ray_version} ({status.detail})")
        return 0 if status.ready else 1
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from verl_pipeline.config import DataSource
    from verl_pipeline.data.preprocess import preprocess_for_spec

    spec = _spec(args)
    if args.tokenizer or args.max_prompt_length or args.max_reject_fraction is not None:
        extra = {"tokenizer": args.tokenizer, "max_prompt_length": args.max_prompt_length,
                 "max_reject_fraction": args.max_reject_fraction}
        spec = dataclasses.replace(spec, data_options={**spec.data_options,
                                                       **{k: v for k, v in extra.items() if v is not None}})
    sources = [DataSource.parse(text, key="--input") for text in args.input] if args.input else None
    out = Path(args.output).resolve() if args.output else None
    result = preprocess_for_spec(spec, sources, out, recipe=args.recipe)
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
    import os

    from verl_pipeline.config import ModelSource
    from verl_pipeline.models.prefetch import prefetch

    token = os.environ.get("HF_TOKEN")
    cache_root = Path(cache).resolve() if cache else spec.model_cache
    actor = ModelSource.parse(model) if model else spec.model
    out = {"actor": prefetch(actor, cache_root, token=token).to_dict()}
    if spec.critic_model and spec.critic_model != actor and not model:
        out["critic"] = prefetch(spec.critic_model, cache_root, token=token).to_dict()
    return out


def cmd_prefetch(args: argparse.Namespace) -> int:
    spec = _spec(args)
    out = _prefetch_all(spec, args.model, args.cache)
    lines = [f"{role}: {r['path']} ({r['files']} files, {r['bytes']} bytes)" for role, r in out.items()]
    _out(args, out, "\n".join(lines))
    return 0


def _inputs(spec: RunSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    from verl_pipeline.data.preprocess import preprocess_for_spec

    return preprocess_for_spec(spec).to_dict(), _prefetch_all(spec)


def cmd_render(args: argparse.Namespace) -> int:
    from verl_pipeline import steps

    spec = _spec(args)
    mode = Mode(args.mode) if args.mode else spec.mode
    if mode is Mode.AUTO:
        mode = Mode.TRAIN  # what a GPU cluster would get; `submit` resolves auto against the real cluster
    data, models = _inputs(spec)
    job = steps.render(spec, data=data, models=models, mode=mode)
    text = [f"# mode: {mode.value}", f"# target: {spec.nnodes} node(s) x {spec.n_gpus_per_node} GPU(s)"]
    text += [f"# derived {k}: {rule}" for k, rule in spec.derived.items()]
    text += ["entrypoint:", job.entrypoint, "runtime_env:", json.dumps(job.runtime_env, indent=2)]
    _out(args, {**job.to_dict(), "spec": spec.to_dict()}, "\n".join(text))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from verl_pipeline import steps
    from verl_pipeline.jobs.submit import submit_or_reattach

    spec = _spec(args)
    handle = _handle(spec)
    data, models = _inputs(spec)
    mode = steps.resolve_mode(spec, handle)
    job = steps.render(spec, data=data, models=models, mode=mode)
    steps.save_run_files(spec, job)
    sub = submit_or_reattach(handle.client(), job, dag_id=CLI_DAG_ID, run_id=spec.run_name, task_id=CLI_TASK_ID)
    _out(args, {**sub.to_dict(), "mode": mode.value, "dashboard_url": handle.dashboard_url},
         f"{sub.action}: {sub.submission_id} ({mode.value}) on {handle.dashboard_url}")
    return 0


def _job_id(args: argparse.Namespace, spec: RunSpec, client: Any) -> str:
    from verl_pipeline.jobs.ids import attempt_of, submission_id

    if args.job_id:
        return str(args.job_id)
    prefix = submission_id(CLI_DAG_ID, spec.run_name, CLI_TASK_ID)[: -len("-a1")]
    mine = [(n, j.submission_id) for j in client.list_jobs() if (n := attempt_of(j.submission_id, prefix))]
    if not mine:
        raise PipelineError(f"no job submitted for run {spec.run_name!r}: pass a job id or run `submit`")
    return max(mine)[1]


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
    spec = _spec(args)
    client = _handle(spec).client()
    job_id = _job_id(args, spec, client)
    offset = 0
    while True:
        logs = client.logs(job_id)
        sys.stdout.write(logs[offset:])
        sys.stdout.flush()
        offset = len(logs)
        info = client.get_job(job_id)
        if not args.follow or info is None or info.status.is_terminal():
            return 0
        time.sleep(2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", help="provision / tear down / inspect the run's Ray cluster")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--address", default=None, help="dashboard URL of an existing cluster (address backend)")
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

    p = sub.add_parser("prefetch", help="fetch or build the run's model(s)")
    p.add_argument("--model", default=None, help="model source (overrides the profile's)")
    p.add_argument("--cache", default=None, help="cache root (default: <storage>/models)")
    _add_run_args(p)
    p.set_defaults(func=cmd_prefetch)

    p = sub.add_parser("render", help="print the exact entrypoint and runtime_env that would be submitted")
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
