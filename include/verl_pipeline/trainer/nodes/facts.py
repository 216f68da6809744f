"""What the probe found on a cluster's GPU nodes, as far as the run's decisions depend on it.

The probe (:mod:`verl_pipeline.cluster.probe`) reports everything it saw on every node; this keeps
what :mod:`verl_pipeline.trainer.nodes.decisions` decides from — whether flash-attn imports *and runs* on
each GPU node, the GPU (name, memory, compute capability), the driver, and the versions the warm
caches are keyed by — and the node's CPUs (count, model: nothing is decided from them, but two runs
on one GPU kind compare only beside them), in a form the run directory keeps (``environment.json``,
``job.json``, ``decisions.jsonl``) and ``verl-pipeline render`` reads back. Pure; no heavy imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def node_label(node: Mapping[str, Any]) -> str:
    """A node as the task log names it: its address, head or worker, and its id's first characters."""
    role = "head" if node.get("is_head") else "worker"
    return f"{node.get('ip', '?')} ({role} {str(node.get('node_id', ''))[:8]})"


@dataclass(frozen=True)
class GpuNode:
    """One GPU node as the probe saw it."""

    node: str
    node_id: str
    #: GPUs Ray advertises on the node.
    gpus: float
    gpu_name: str | None = None
    gpu_memory_gb: float | None = None
    #: CUDA compute capability, ``"9.0"`` for Hopper.
    capability: str | None = None
    driver: str | None = None
    python: str | None = None
    #: torch's CUDA build (``torch.version.cuda``).
    cuda: str | None = None
    #: flash-attn's version where it imported and ran on the node's first GPU, else None.
    flash_attn: str | None = None
    #: Why flash-attn is not usable there (None when it is).
    flash_attn_error: str | None = None
    #: Distribution -> version (None: not installed), the probe's ``versions``.
    versions: dict[str, str | None] = field(default_factory=dict)
    #: The node's CPUs as the OS counts them, and their model (None where not reported).
    cpus: int | None = None
    cpu_model: str | None = None

    @classmethod
    def from_probe(cls, node: Mapping[str, Any]) -> GpuNode:
        facts = node.get("facts") or {}
        gpu = facts.get("gpu") or {}
        devices = gpu.get("devices") or []
        names = sorted({str(d.get("name")) for d in devices})
        memory = [float(d["memory_gib"]) for d in devices if d.get("memory_gib")]
        capabilities = sorted({str(d.get("capability")) for d in devices})
        module = (facts.get("modules") or {}).get("flash_attn") or {}
        kernel = facts.get("flash_attn_kernel") or {}
        if not module:
            usable, error = None, "not checked by the probe"
        elif not module.get("ok"):
            usable, error = None, str(module.get("error") or "does not import")
        elif not kernel.get("ok"):
            usable, error = None, f"imports, but does not run on the GPU: {kernel.get('error') or 'not run'}"
        else:
            usable, error = str(module.get("version") or "installed"), None
        return cls(node=node_label(node), node_id=str(node.get("node_id") or ""), gpus=float(node.get("gpus") or 0),
                   gpu_name=" + ".join(names) if names else None, gpu_memory_gb=min(memory) if memory else None,
                   capability=" + ".join(capabilities) if capabilities else None, driver=gpu.get("driver"),
                   python=facts.get("python"), cuda=(facts.get("torch") or {}).get("cuda"), flash_attn=usable,
                   flash_attn_error=error, versions=dict(facts.get("versions") or {}),
                   cpus=int(facts["os_cpu_count"]) if facts.get("os_cpu_count") else None,
                   cpu_model=facts.get("cpu_model"))

    def describe(self) -> str:
        gpu = f"{self.gpus:g} x {self.gpu_name or 'unknown GPU'}"
        if self.gpu_memory_gb:
            gpu += f" ({self.gpu_memory_gb:g} GB"
            gpu += f", sm {self.capability})" if self.capability else ")"
        flash = (f"flash-attn {self.flash_attn}" if self.flash_attn
                 else f"no usable flash-attn ({self.flash_attn_error})")
        cpu = ""
        if self.cpus:
            cpu = f", {self.cpus} CPUs" + (f" ({self.cpu_model})" if self.cpu_model else "")
        return f"{self.node}: {gpu}{cpu}, {flash}"


@dataclass(frozen=True)
class NodeFacts:
    """The GPU nodes of one probe (or none: ``probed`` False when nothing was probed)."""

    gpu_nodes: tuple[GpuNode, ...] = ()
    probed: bool = False
    #: GPU nodes that did not answer (died or hung during the probe).
    silent_gpu_nodes: int = 0
    #: Where the facts come from: a probe job, a file a probe wrote, or "not probed".
    source: str = "not probed"

    @classmethod
    def from_probe(cls, nodes: Sequence[Mapping[str, Any]], *, source: str) -> NodeFacts:
        """The GPU nodes of a probe report's ``nodes`` (those Ray advertises GPUs on)."""
        gpu = [n for n in nodes if float(n.get("gpus") or 0) > 0]
        return cls(tuple(GpuNode.from_probe(n) for n in gpu if n.get("facts")), True,
                   sum(1 for n in gpu if not n.get("facts")), source)

    # -- what the decisions read -------------------------------------------------------------------
    @property
    def flash_attn(self) -> bool | None:
        """flash-attn usable on every GPU node; None when there is no GPU node to judge (none answered)."""
        if not self.gpu_nodes:
            return None
        return self.silent_gpu_nodes == 0 and all(n.flash_attn for n in self.gpu_nodes)

    @property
    def gpu_memory_gb(self) -> float | None:
        """The smallest GPU memory of any GPU node (the budgets must fit the smallest)."""
        found = [n.gpu_memory_gb for n in self.gpu_nodes if n.gpu_memory_gb]
        return min(found) if found else None

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(sorted(n.node_id for n in self.gpu_nodes))

    def describe(self) -> str:
        if not self.probed:
            return "the nodes have not been probed"
        if not self.gpu_nodes:
            return f"no GPU node answered the probe ({self.source})"
        silent = f"; {self.silent_gpu_nodes} GPU node(s) did not answer" if self.silent_gpu_nodes else ""
        return f"{len(self.gpu_nodes)} GPU node(s){silent} ({self.source}): " + "; ".join(
            n.describe() for n in self.gpu_nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"probed": self.probed, "source": self.source, "silent_gpu_nodes": self.silent_gpu_nodes,
                "flash_attn_on_every_gpu_node": self.flash_attn, "gpu_memory_gb": self.gpu_memory_gb,
                "gpu_nodes": [asdict(n) for n in self.gpu_nodes]}

    @classmethod
    def from_record(cls, data: Mapping[str, Any], *, source: str) -> NodeFacts | None:
        """The facts a file of the pipeline's keeps: a run's ``environment.json`` (``found``), ``job.json`` or a
        ``decisions.jsonl`` line (``decision`` / ``nodes``), or a cluster's latest probe; None when it has none."""
        for candidate in (data.get("found"), (data.get("decision") or {}).get("nodes"), data.get("nodes")):
            if isinstance(candidate, Mapping) and candidate.get("probed"):
                facts = cls.from_dict(candidate)
                return cls(facts.gpu_nodes, True, facts.silent_gpu_nodes, f"{facts.source}, as kept in {source}")
        return None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeFacts:
        fields = set(GpuNode.__dataclass_fields__)
        return cls(tuple(GpuNode(**{k: v for k, v in n.items() if k in fields}) for n in data.get("gpu_nodes") or []),
                   bool(data.get("probed")), int(data.get("silent_gpu_nodes") or 0),
                   str(data.get("source") or "a recorded probe"))


__all__ = ["GpuNode", "NodeFacts", "node_label"]
