"""The environment probe: one short Ray task per alive node, pinned to it, reporting what is there.

Each task reports the node's CPUs (their count and model), torch and its CUDA build, the GPUs torch
sees (on nodes with GPUs: their name, memory and compute capability, and the driver), whether each
module the job needs imports (flash-attn, sglang; verl and vllm are looked up, with the torch they
require) with its version, transformers' version and the range the node's verl supports, the
versions of the distributions the request names, and whether each path the job reads exists. On a
node with GPUs flash-attn is also run once on a GPU (a build for another GPU or CUDA imports, then
fails there): whether it is *usable* decides the attention path (:mod:`verl_pipeline.trainer.nodes.fastpath`).
The tasks ask for no CPU, so they run on a node that is busy.

The probe runs as a short Ray job through the Jobs API (the same path, cluster and
``runtime_env`` as the verl job it checks), started by :func:`run_probe` on the Airflow worker or
the CLI: ``python -m verl_pipeline.cluster.probe --request JSON --timeout S``, the request built from the
job's settings (:meth:`verl_pipeline.trainer.environment.Needs.request`). It prints its
report after :data:`PROBE_REPORT_MARKER`. A node that dies or hangs during the probe is reported,
not waited for. :mod:`verl_pipeline.trainer.environment` turns the report into findings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import uuid
from typing import Any

from verl_pipeline.exceptions import ClusterError, PipelineError
from verl_pipeline.jobs.client import RayJobsClient

log = logging.getLogger(__name__)

PROBE_REPORT_MARKER = "VERL_PIPELINE_PROBE_REPORT "
PROBE_COMMAND = ("python", "-m", "verl_pipeline.cluster.probe")
#: Seconds each node has to answer (cluster profile ``probe_timeout_s``).
DEFAULT_TIMEOUT_S = 60.0
#: Extra seconds for the probe job itself to start and finish (worker startup, imports).
JOB_SLACK_S = 60.0


#: Modules only looked up (installed, its version, the torch its distribution requires), not imported.
#: verl: its import takes seconds and the job's first line does it anyway. vllm: its top-level import is
#: lazy (0.24.0 loads its version and torch-compiler patches; its compiled ops load when an engine
#: starts), so importing it proved little beyond finding it, for 8-10 s of every submission on an H200
#: node (2026-12-03); the torch it requires is compared with the node's instead. Other modules (flash-attn
#: loads its CUDA extension on import, where a broken build shows) are imported.
_FOUND_ONLY = frozenset({"verl", "vllm"})


def _required_torch(distribution: str) -> str | None:
    """The torch specifier ``distribution`` requires unconditionally (``==2.11.0``), if any."""
    from importlib import metadata

    from verl_pipeline.trainer.environment import unconditional_specifier

    try:
        return unconditional_specifier(metadata.requires(distribution), "torch")
    except metadata.PackageNotFoundError:
        return None


def _module_facts(module: str) -> dict[str, Any]:
    """Import ``module`` (for real: a broken CUDA build fails here, not in the job two minutes later), or
    for :data:`_FOUND_ONLY` find it and read which torch it requires."""
    import importlib
    import importlib.util
    from importlib import metadata

    t0 = time.monotonic()
    version = None
    try:
        if module in _FOUND_ONLY:
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named '{module}'")
        else:
            version = getattr(importlib.import_module(module), "__version__", None)
    except Exception as e:  # any failure to import is the finding (ImportError, OSError of a .so, …)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"ok": False, "error": f"{type(e).__name__}: {first}"[:300],
                "seconds": round(time.monotonic() - t0, 3)}
    distribution = module.replace("_", "-")
    if version is None:
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            version = None
    facts: dict[str, Any] = {"ok": True, "version": str(version) if version else None}
    if module in _FOUND_ONLY:
        facts["requires_torch"] = _required_torch(distribution)
    return {**facts, "seconds": round(time.monotonic() - t0, 3)}


def _torch_version_file() -> dict[str, Any]:
    """torch's version and CUDA build from ``torch/version.py``, without importing torch (~1.5 s)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "ModuleNotFoundError: No module named 'torch'"}
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    loader_spec = importlib.util.spec_from_file_location("_verl_pipeline_torch_version", path)
    if loader_spec is None or loader_spec.loader is None:
        return {"error": f"cannot read {path}"}
    mod = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(mod)
    except Exception as e:  # a damaged install is the finding
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"version": str(getattr(mod, "__version__", "")), "cuda": getattr(mod, "cuda", None)}


def _torch_facts(use_gpus: bool) -> dict[str, Any]:
    """torch's version and CUDA build; on a node with GPUs also whether CUDA works and how many GPUs
    torch sees (that needs the import)."""
    if not use_gpus:
        return _torch_version_file()
    try:
        import torch
    except Exception as e:  # a missing or broken torch is the finding
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    available = bool(torch.cuda.is_available())
    return {"version": str(torch.__version__), "cuda": torch.version.cuda, "cuda_available": available,
            "device_count": int(torch.cuda.device_count()) if available else 0}


def _driver_version() -> str | None:
    """The NVIDIA driver's version (from the kernel module's file, else NVML), None when neither answers."""
    import re

    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML on the node: the driver is not known
        return None


def _gpu_facts() -> dict[str, Any]:
    """Each GPU torch sees (name, memory in GiB, compute capability, UUID) and the driver; no CUDA context needed."""
    try:
        import torch

        devices = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            uuid_ = getattr(props, "uuid", None)  # what NVML calls GPU-<uuid>: a restart's check reads it
            devices.append({"name": str(props.name), "memory_gib": round(props.total_memory / 2**30, 1),
                            "capability": f"{props.major}.{props.minor}", "uuid": str(uuid_) if uuid_ else None})
    except Exception as e:  # a broken CUDA install is the finding
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"devices": devices, "driver": _driver_version()}


def _flash_attn_kernel() -> dict[str, Any]:
    """Run flash-attn's attention once on the node's first GPU: a wheel built for another GPU, CUDA or torch
    imports and then fails here, before a job's workers would."""
    t0 = time.monotonic()
    try:
        import torch
        from flash_attn import flash_attn_func

        q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)  # (batch, tokens, heads, head dim)
        out = flash_attn_func(q, q, q, causal=True)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all().item())
        error = None if ok else "flash_attn_func returned non-finite values"
    except Exception as e:  # any failure is the finding (no kernel image for this GPU, a CUDA error, …)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        ok, error = False, f"{type(e).__name__}: {first}"[:300]
    return {"ok": ok, "error": error, "seconds": round(time.monotonic() - t0, 3)}


def _versions(distributions: list[str]) -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model as ``cpuinfo`` names it (``model name``), None where it names none or cannot be read.
    One job ran two-fold apart on two machines of one GPU kind (2026-12-05): the CPU beside the GPU is a
    fact of the run too."""
    try:
        with open(cpuinfo, errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None


def node_facts(request: dict[str, Any]) -> dict[str, Any]:
    """What this node has for the job described by ``request`` (runs inside the pinned Ray task)."""
    from importlib import metadata

    t0 = time.monotonic()
    facts: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.version.split()[0],
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                             "os_cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
                             "torch": _torch_facts(bool(request.get("gpus")))}
    facts["modules"] = {m: _module_facts(m) for m in request.get("modules", [])}
    facts["versions"] = _versions(list(request.get("versions", [])))
    if request.get("gpus") and not facts["torch"].get("error"):
        facts["gpu"] = _gpu_facts()
        if (facts["modules"].get("flash_attn") or {}).get("ok"):
            facts["flash_attn_kernel"] = _flash_attn_kernel()
    try:
        facts["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        facts["transformers"] = None
    try:
        from verl_pipeline.trainer.environment import read_verl_pins

        facts["verl_transformers"] = read_verl_pins(metadata.requires("verl")).transformers
    except metadata.PackageNotFoundError:
        facts["verl_transformers"] = None
    facts["paths"] = {p: {"exists": os.path.exists(p), "readable": os.access(p, os.R_OK)}
                      for p in dict(request.get("paths", {})).values()}
    facts["seconds"] = round(time.monotonic() - t0, 3)
    return facts


def probe_nodes(request: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Run :func:`node_facts` once on every alive node (inside a Ray driver) and collect the answers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t0 = time.monotonic()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0, max_retries=0)(node_facts)
    refs = {}
    for n in nodes:
        strategy = NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
        gpus = float((n.get("Resources") or {}).get("GPU", 0))
        refs[n["NodeID"]] = task.options(scheduling_strategy=strategy).remote({**request, "gpus": gpus})
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    alive_after = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    report = []
    for n in nodes:
        node_id, ref = n["NodeID"], refs[n["NodeID"]]
        resources = n.get("Resources") or {}
        entry: dict[str, Any] = {"node_id": node_id, "ip": n.get("NodeManagerAddress"),
                                 "is_head": "node:__internal_head__" in resources,
                                 "cpus": float(resources.get("CPU", 0)), "gpus": float(resources.get("GPU", 0))}
        if ref in done:
            try:
                entry["facts"] = ray.get(ref)
            except ray.exceptions.RayError as e:  # the node died under the task, the worker crashed …
                entry["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        else:
            ray.cancel(ref, force=True)
            entry["error"] = f"no answer within {timeout_s:g}s"
        if node_id not in alive_after:
            entry["error"] = f"the node died during the probe ({entry.get('error', 'answered first')})"
            entry.pop("facts", None)
        report.append(entry)
    return {"nodes": report, "seconds": round(time.monotonic() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    """The probe job's entrypoint: prints the report after the marker line."""
    parser = argparse.ArgumentParser(prog="verl_pipeline.cluster.probe")
    parser.add_argument("--request", required=True, help="JSON: {'modules': [...], 'paths': {...}}")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds each node has to answer")
    args = parser.parse_args(argv)
    started = time.time()
    import ray

    ray.init(log_to_driver=False)
    report = probe_nodes(json.loads(args.request), timeout_s=args.timeout)
    report["driver"] = {"started_at": started, "ray_init_s": round(time.time() - started - report["seconds"], 3)}
    print(PROBE_REPORT_MARKER + json.dumps(report, sort_keys=True, default=str), flush=True)
    return 0


def parse_report(logs: str, marker: str = PROBE_REPORT_MARKER) -> dict[str, Any] | None:
    """The JSON object printed after the last ``marker`` in a job's log (the probe's by default; the
    evaluation job prints its record the same way); None when there is none or it is cut short."""
    for line in reversed(logs.splitlines()):
        idx = line.find(marker)
        if idx >= 0:
            try:
                data: dict[str, Any] = json.loads(line[idx + len(marker):])
                return data
            except json.JSONDecodeError:
                return None
    return None


def run_probe(
    client: RayJobsClient,
    *,
    request: dict[str, Any],
    runtime_env: dict[str, Any],
    id_prefix: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = 0.1,
) -> dict[str, Any]:
    """Submit the probe job with the verl job's ``runtime_env`` and return its report.

    Returns ``{"nodes": [...], "seconds": ..., "job_id": ..., "wall_seconds": ...}``; raises
    ClusterError when the probe job itself cannot run (it is then not the nodes' report).
    """
    import shlex

    t0, submitted_at = time.monotonic(), time.time()
    job_id = f"{id_prefix}-probe-{uuid.uuid4().hex[:8]}"
    entrypoint = shlex.join([*PROBE_COMMAND, "--request", json.dumps(request, sort_keys=True),
                             "--timeout", f"{timeout_s:g}"])
    try:
        client.submit(entrypoint=entrypoint, submission_id=job_id, runtime_env=runtime_env,
                      metadata={"purpose": "environment-probe"}, entrypoint_num_cpus=0)
    except PipelineError as e:
        raise ClusterError(f"cannot start the environment probe on {client.dashboard_url}: {e}") from e
    submit_s = round(time.monotonic() - t0, 3)
    deadline = t0 + timeout_s + JOB_SLACK_S
    while True:
        info = client.get_job(job_id)
        logs = client.logs(job_id) if info is not None else ""
        report = parse_report(logs)
        if report is not None:
            # The report is complete once printed; the job ends by itself.
            return {**report, "job_id": job_id, "wall_seconds": round(time.monotonic() - t0, 2),
                    "submitted_at": submitted_at, "submit_s": submit_s}
        if info is not None and info.status.is_terminal():
            tail = "\n".join(logs.strip().splitlines()[-5:])
            raise ClusterError(f"the environment probe job {job_id} ended {info.status.value} without a report: "
                               f"{info.message} {tail}".strip())
        if time.monotonic() > deadline:
            client.stop(job_id)
            raise ClusterError(f"the environment probe job {job_id} gave no report within {timeout_s + JOB_SLACK_S:g}s "
                               "(raise the cluster profile's probe_timeout_s on a slow cluster)")
        time.sleep(poll_s)


if __name__ == "__main__":
    raise SystemExit(main())
