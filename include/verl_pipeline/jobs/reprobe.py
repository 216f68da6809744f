"""Whether a restart probes the cluster's nodes again or reuses the probe its run's earlier attempt passed.

The environment probe (:mod:`verl_pipeline.cluster.probe`) runs before every first submission: it
costs 14-25 s on an H200 node (docs/benchmarks.md), against the ~4-6 minutes a verl job takes to its
first step. A restart after an infrastructure failure repeats it only when something may have changed
on the nodes since. The kept probe (``probe.json`` in the run directory, written by every probe of the
run) is reused when **all** of these hold; otherwise the nodes are probed again:

- the run profile's ``restarts: reprobe`` is ``on_change`` (the default; ``always`` probes before every
  restart, as before the first attempt);
- the kept probe is less than :data:`MAX_AGE_S` old (a week-long run's restart on day 6 looks again:
  packages can change on a long-lived node without a new Ray node id);
- every node answered the kept probe, and it asked exactly what this job asks (the same modules,
  versions and paths: a job rendered differently probes again); its findings are judged again as a
  new probe's would be;
- the cluster's alive nodes are exactly the nodes it probed, by Ray node id: a node lost and replaced,
  a restarted raylet, a re-provisioned cluster or one more node all have new ids;
- every GPU the probe saw on a node is still reported there by the node's agent (NVML, Ray's node
  summary), by UUID; a GPU node whose agent reports no GPUs cannot show it, and is probed again;
- the attempt that failed, failed for a reason that spares the nodes
  (:data:`verl_pipeline.jobs.classify.NODES_SPARED`: a killed worker process, a lost actor or object,
  an unreachable Jobs API, an overloaded head, GPUs held by another job), not a hang, an NCCL error or
  an unclassified end.

:func:`decide` is the one place that decides it, a pure function of those facts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_pipeline.jobs.classify import NODES_SPARED
from verl_pipeline.jobs.client import NodeInfo
from verl_pipeline.jobs.restart_budget import RestartOutcome
from verl_pipeline.restarts import Reprobe
from verl_pipeline.rundir import RunDir

#: The oldest probe a restart reuses, in seconds.
MAX_AGE_S = 24 * 3600.0


@dataclass(frozen=True)
class ProbeReuse:
    """What :func:`decide` decided: reuse the kept probe or probe again, and why (one line)."""

    reuse: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"reused": self.reuse, "why": self.why}


def _uuid(value: object) -> str | None:
    """A GPU's UUID as torch and NVML both name it (NVML prefixes ``GPU-``)."""
    text = str(value or "").strip()
    return text.removeprefix("GPU-").lower() or None


def _gpus_missing(kept_nodes: Sequence[Mapping[str, Any]], alive: Mapping[str, NodeInfo]) -> str | None:
    """Why the GPUs the probe saw cannot be confirmed on the nodes now, or None when every one is reported."""
    for node in kept_nodes:
        devices = ((node.get("facts") or {}).get("gpu") or {}).get("devices") or []
        if not devices:
            continue
        now = alive[str(node["node_id"])]
        reported = {_uuid(g.uuid) for g in now.gpus}
        if not now.gpus:
            return f"node {now.ip} reports no GPUs to check against the {len(devices)} the probe saw"
        seen = [_uuid(d.get("uuid")) for d in devices]
        if None in seen:  # a probe from before UUIDs were recorded: count them
            if len(now.gpus) < len(devices):
                return f"node {now.ip} reports {len(now.gpus)} GPU(s), the probe saw {len(devices)}"
            continue
        gone = [u for u in seen if u not in reported]
        if gone:
            return f"node {now.ip} no longer reports GPU(s) {', '.join(str(u) for u in gone)} that the probe saw"
    return None


def decide(policy: Reprobe, kept: Mapping[str, Any] | None, *, request: Mapping[str, Any],
           alive: Callable[[], Sequence[NodeInfo]], failure: str | None, now: float) -> ProbeReuse:
    """Reuse the ``kept`` probe (``{"request", "report", "at"}``) for a job asking ``request`` at ``now`` (epoch
    seconds), given the reason the run's latest attempt failed (None: not a restart the pipeline decided, or
    unknown) and the cluster's nodes now (``alive``: read only when the rest allows a reuse)?"""
    if policy is Reprobe.ALWAYS:
        return ProbeReuse(False, "restarts.reprobe is always")
    if kept is None:
        return ProbeReuse(False, "no probe of this run is kept")
    if failure is None:
        return ProbeReuse(False, "not a restart after a known infrastructure failure")
    if failure not in NODES_SPARED:
        return ProbeReuse(False, f"the attempt failed for a reason that may lie in the nodes ({failure})")
    age = now - float(kept.get("at") or 0.0)
    if age > MAX_AGE_S:
        return ProbeReuse(False, f"the kept probe is {age / 3600:.0f} h old (reused up to {MAX_AGE_S / 3600:.0f} h)")
    if dict(kept.get("request") or {}) != dict(request):
        return ProbeReuse(False, "the job asks the nodes for something else than the kept probe did")
    report = kept.get("report") or {}
    silent = [n for n in report.get("nodes", []) if n.get("error") or not n.get("facts")]
    if silent:
        return ProbeReuse(False, f"{len(silent)} node(s) did not answer the kept probe")
    probed = {str(n["node_id"]) for n in report.get("nodes", [])}
    current = {n.node_id: n for n in alive() if n.alive}
    if probed != set(current):
        return ProbeReuse(False, f"the alive nodes changed since probe job {report.get('job_id')} "
                                 f"({len(probed - set(current))} gone, {len(set(current) - probed)} new)")
    missing = _gpus_missing(report.get("nodes", []), current)
    if missing:
        return ProbeReuse(False, missing)
    return ProbeReuse(True, f"the same {len(current)} node(s) and GPUs that probe job {report.get('job_id')} checked, "
                            f"and the attempt failed for a reason that spares them ({failure})")


def latest_failure(run_dir: RunDir) -> str | None:
    """The reason the run's latest attempt failed, as its restart decision recorded it; None when the latest
    attempt has no restart decision (the first submission, a task retry the pipeline did not decide)."""
    attempts = run_dir.attempts()
    records = run_dir.restart_records()
    if not attempts or not records:
        return None
    last = records[-1]
    if last.get("submission_id") != attempts[-1].submission_id or last.get("outcome") != RestartOutcome.RESTART.value:
        return None
    reason = last.get("reason")
    return str(reason) if reason else None


__all__ = ["MAX_AGE_S", "ProbeReuse", "decide", "latest_failure"]
