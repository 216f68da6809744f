"""The one place where a job's node-dependent decisions are made: what the probe found, what the job uses.

The frozen spec (``run_spec.json``) holds what the user asked for; every submission — the first,
a retry on other nodes, the CLI's — decides here, from what the probe of the cluster as it is found
(:class:`~verl_pipeline.trainer.nodes.facts.NodeFacts`; a restart on unchanged nodes reuses the run's
last probe, :mod:`verl_pipeline.jobs.reprobe`):

- the attention path and what goes with it (:mod:`verl_pipeline.trainer.nodes.fastpath`): flash-attn's
  fast path with packed sequences and dynamic batches sized for the GPU, or SDPA with fused
  log-prob kernels;
- the workers' warm caches, keyed by the versions and the GPU the probe found
  (:mod:`verl_pipeline.trainer.nodes.warmstart`);
- validation before training on an attempt that resumes from a checkpoint (``warmstart``).

A setting the run's settings give, in any spelling, is kept, and the record says what the rule would
have chosen. The :class:`Decision` goes into the rendered job (``job.json``: its ``decision``, and
each decided key's rule among ``derived``) and, per attempt, into the run's ``decisions.jsonl``; a
retry whose decision differs from the previous attempt's says so in the task log
(:meth:`Decision.changes_from`). Pure; no heavy imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.spec import Hardware, ModelFacts, RunSpec
from verl_pipeline.trainer.nodes.attention import ACTOR_ATTN_KEY
from verl_pipeline.trainer.nodes.choices import Choices
from verl_pipeline.trainer.nodes.facts import NodeFacts
from verl_pipeline.trainer.nodes.fastpath import (
    ACTOR_TOKENS_KEY,
    DYNAMIC_BSZ_KEY,
    FUSED_KERNELS_KEY,
    ROLLOUT_LOG_PROB_TOKENS_KEY,
    AttentionPath,
    decide_fast_path,
)
from verl_pipeline.trainer.nodes.warmstart import VAL_BEFORE_TRAIN_KEY, CachePlan, plan_caches, resume_validation
from verl_pipeline.trainer.overrides import spellings
from verl_pipeline.trainer.scaling import Rule

#: A GPU memory the probe found this far from the cluster profile's is named in the record: the scaling
#: rules of the frozen spec (rollout TP, vLLM's share, offload) were sized for the profile's.
MEMORY_MISMATCH = 0.1
#: When a submission probes the nodes (the record says it; docs/failures.md too; ``jobs/reprobe.py`` decides).
PROBE_RULE = ("the first submission probes the nodes; a restart probes them again unless the same nodes (Ray node "
              "ids), the same GPUs (UUIDs, as the nodes' agents report them) and a failure that spares the nodes say "
              "nothing changed since the run's last probe, at most a day old (~20 s on an H200 node against ~4 min "
              "to a first step); restarts.reprobe: always probes before every restart")


@dataclass(frozen=True)
class Decision:
    """What was decided for one submission on one set of nodes, and why."""

    nodes: NodeFacts
    attention: AttentionPath
    #: The verl settings the decision sets (keys the run's settings leave unset).
    settings: dict[str, Any]
    #: What the job's runtime_env gets (the warm caches).
    env: dict[str, str]
    rules: tuple[Rule, ...]
    caches: CachePlan
    #: The run step the attempt resumes from (0: from the start).
    resume_step: int = 0
    gpu_memory_gb: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def derived(self) -> dict[str, str]:
        """Each decided (or kept) verl key's rule, as ``RenderedJob.derived`` records the scaling rules'."""
        where = "decided at submit for the probed nodes" if self.nodes.gpu_nodes else "no GPU node probed"
        return {r.key: f"{r.text()} [{where}]" for r in self.rules if "." in r.key}

    def summary(self) -> str:
        """One line for a log or a report: the path, the budgets, the caches, the resume."""
        attention = next((r.value for r in self.rules if r.key in spellings(ACTOR_ATTN_KEY)), None)
        shown = self.attention.value if attention in (None, self.attention.value) else \
            f"{self.attention.value} ({attention})"
        parts = [f"attention: {shown}"]
        budgets = {r.key: r.value for r in self.rules if r.key in (ACTOR_TOKENS_KEY, ROLLOUT_LOG_PROB_TOKENS_KEY)}
        dynamic = next((r.value for r in self.rules if r.key == DYNAMIC_BSZ_KEY), None)
        if dynamic is not None:
            parts.append(f"dynamic batches: {dynamic}" + (
                f" (update {budgets.get(ACTOR_TOKENS_KEY)}, log-prob {budgets.get(ROLLOUT_LOG_PROB_TOKENS_KEY)} "
                "tokens per GPU)" if budgets else ""))
        fused = next((r.value for r in self.rules if r.key in spellings(FUSED_KERNELS_KEY)), None)
        if fused is not None:
            parts.append(f"fused log-prob kernels: {fused}")
        parts.append(f"warm caches: {self.caches.key}" if self.caches.enabled else "warm caches: off")
        if self.resume_step:
            validate = next((r.value for r in self.rules if r.key in spellings(VAL_BEFORE_TRAIN_KEY)), None)
            parts.append(f"resumes from step {self.resume_step}" +
                         ("" if validate is None else f", validation before training: {validate}"))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "attention": self.attention.value, "nodes": self.nodes.to_dict(),
                "gpu_memory_gb": self.gpu_memory_gb, "settings": self.settings, "env": self.env,
                "rules": {r.key: r.text() for r in self.rules},
                "caches": {k: v for k, v in self.caches.to_dict().items() if k != "env"},  # its env is ``env``
                "resume_step": self.resume_step, "notes": list(self.notes)}

    def changes_from(self, previous: Mapping[str, Any] | None) -> list[str]:
        """How this decision differs from ``previous`` (an earlier attempt's record): other nodes, another
        path, other settings or caches. Empty when it is the same."""
        if not previous:
            return []
        out = []
        before = NodeFacts.from_dict(previous.get("nodes") or {})
        if before.node_ids != self.nodes.node_ids:
            out.append(f"other GPU nodes ({len(before.node_ids)} -> {len(self.nodes.node_ids)}; "
                       f"{', '.join(n.node for n in self.nodes.gpu_nodes) or 'none'})")
        if previous.get("attention") != self.attention.value:
            out.append(f"attention {previous.get('attention')} -> {self.attention.value}")
        old = previous.get("settings") or {}
        changed = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
        if changed:
            out.append("settings " + ", ".join(f"{k}: {old.get(k)!r} -> {self.settings.get(k)!r}" for k in changed))
        if (previous.get("caches") or {}).get("key") != self.caches.key:
            out.append(f"warm caches {(previous.get('caches') or {}).get('key')} -> {self.caches.key}")
        return out


def decide(
    settings: Mapping[str, Any],
    *,
    nodes: NodeFacts,
    model: ModelFacts | None,
    hardware: Hardware | None,
    cache_root: Path,
    warm_caches: bool = True,
    runtime_env: Mapping[str, Any] | None = None,
    resume_step: int = 0,
    validate_on_resume: bool = False,
    probe: str = "ran",
) -> Decision:
    """Every node-dependent decision for a job with these verl ``settings`` on ``nodes`` (pure); ``probe`` says
    how the nodes were seen (``ran``, or the probe reused and why)."""
    c = Choices(settings)
    notes = []
    profile_gb = hardware.gpu_memory_gb if hardware is not None else None
    found_gb = nodes.gpu_memory_gb
    memory = found_gb or profile_gb or 0.0
    if found_gb and profile_gb and abs(found_gb - profile_gb) > MEMORY_MISMATCH * profile_gb:
        notes.append(f"the GPU nodes have {found_gb:g} GB per GPU, the cluster profile says {profile_gb:g} GB: the "
                     "decisions here use the nodes' memory; the frozen spec's scaling rules (rollout TP, vLLM's share, "
                     "offload) used the profile's (fix hardware.gpu_memory_gb for the next run)")
    path = decide_fast_path(c, nodes, model, memory)
    caches = plan_caches(nodes, root=cache_root, enabled=warm_caches, user_env=dict(runtime_env or {}))
    resume_validation(c, resume_step=resume_step, validate_on_resume=validate_on_resume)
    if nodes.probed:
        c.note("probe", probe, PROBE_RULE)
    return Decision(nodes, path, dict(c.updates), dict(caches.env), tuple(c.rules), caches, resume_step,
                    memory or None, tuple(notes))


def decide_for_spec(spec: RunSpec, settings: Mapping[str, Any], nodes: NodeFacts | None = None, *,
                    resume_step: int = 0, probe: str = "ran") -> Decision:
    """:func:`decide` for a run's job: its model facts, hardware, cache storage and restart settings."""
    return decide(settings, nodes=nodes or NodeFacts(), model=spec.model_facts, hardware=spec.hardware,
                  cache_root=spec.cache_root, warm_caches=spec.warm_caches, runtime_env=spec.runtime.get("env") or {},
                  resume_step=resume_step, validate_on_resume=spec.validate_on_resume, probe=probe)


__all__ = ["MEMORY_MISMATCH", "PROBE_RULE", "Decision", "decide", "decide_for_spec"]
