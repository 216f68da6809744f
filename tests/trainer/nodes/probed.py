"""What a probe of GPU nodes reports, as the tests' input: the H200 node the GPU runs use, with or without
a usable flash-attn (its facts as ``cluster/probe.py`` reports them)."""

from __future__ import annotations

from typing import Any

from verl_pipeline.trainer.nodes.facts import NodeFacts

#: The versions of the H200 node that docs/benchmarks.md's GPU runs used (flash-attn 2.8.3.post2 built for it).
H200_VERSIONS = {"torch": "2.11.0+cu130", "triton": "3.5.0", "vllm": "0.24.0", "flashinfer-python": "0.5.3",
                 "flash-attn": "2.8.3.post2", "verl": "0.9.1", "transformers": "5.9.0"}


#: The CPU the probe reports on the test nodes.
CPU_MODEL = "AMD EPYC 9654 96-Core Processor"


def probe_node(*, flash_attn: bool | str = True, node_id: str = "a" * 56, ip: str = "10.0.0.7", gpus: int = 1,
               name: str = "NVIDIA H200", memory_gib: float = 139.8, capability: str = "9.0",
               versions: dict[str, str | None] | None = None, driver: str = "580.65.06") -> dict[str, Any]:
    """One node of a probe report (``run_probe``'s ``nodes``). ``flash_attn``: True (imports and runs),
    False (not installed) or ``"broken"`` (imports, fails on the GPU)."""
    versions = dict(H200_VERSIONS if versions is None else versions)
    modules: dict[str, Any] = {"verl": {"ok": True, "version": "0.9.1"}}
    facts: dict[str, Any] = {"python": "3.12.3", "os_cpu_count": 16, "cpu_model": CPU_MODEL,
                             "torch": {"version": versions.get("torch"), "cuda": "13.0",
                                       "cuda_available": True, "device_count": gpus},
                             "gpu": {"devices": [{"name": name, "memory_gib": memory_gib, "capability": capability}]
                                     * gpus, "driver": driver}}
    if flash_attn:
        modules["flash_attn"] = {"ok": True, "version": "2.8.3.post2"}
        facts["flash_attn_kernel"] = ({"ok": True, "error": None} if flash_attn is True else
                                      {"ok": False, "error": "RuntimeError: CUDA error: no kernel image is available"})
    else:
        modules["flash_attn"] = {"ok": False, "error": "ModuleNotFoundError: No module named 'flash_attn'"}
        versions["flash-attn"] = None
    facts.update(modules=modules, versions=versions)
    return {"node_id": node_id, "ip": ip, "is_head": True, "cpus": 16.0, "gpus": float(gpus), "facts": facts}


def h200(flash_attn: bool | str = True, **kwargs: Any) -> NodeFacts:
    """One H200 node as the probe found it."""
    return NodeFacts.from_probe([probe_node(flash_attn=flash_attn, **kwargs)], source="probe job test-probe-1")
