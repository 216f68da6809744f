"""What the probe reads of each module a job needs, on this machine's real files (no cluster).

vllm is looked up, not imported: its top-level import is lazy and took 8-10 s of every submission on
an H200 node, so the probe reads its version and the torch it requires, and the findings compare that
with the node's torch. A distribution written into a temporary directory stands in for vllm, which
cannot be installed on a CPU machine with this project's torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from verl_pipeline.cluster.probe import _module_facts
from verl_pipeline.trainer.environment import evaluate, needs_for, read_verl_pins
from verl_pipeline.trainer.nodes.attention import ACTOR_ATTN_KEY

PINS = read_verl_pins(['vllm==0.24.0; extra == "vllm"'])
#: GRPO with the actor on SDPA: vllm is the only package the job needs.
NEEDS = needs_for({"actor_rollout_ref.rollout.name": "vllm", "algorithm.adv_estimator": "grpo",
                   ACTOR_ATTN_KEY: "sdpa"}, PINS)


def _distribution(root: Path, requires: list[str], *, version: str = "0.24.0", importable: bool = True) -> None:
    """A ``vllm`` distribution on ``root``: its package (an ``__init__`` that fails when imported, so a
    test notices an import) and its metadata."""
    if importable:
        (root / "vllm").mkdir()
        (root / "vllm" / "__init__.py").write_text("raise RuntimeError('the probe imported vllm')\n")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", "Name: vllm", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def _node(torch_version: str, vllm: dict) -> dict:
    facts = {"torch": {"version": torch_version, "cuda": "13.0", "cuda_available": True, "device_count": 1},
             "modules": {"verl": {"ok": True, "version": "0.9.1"}, "vllm": vllm}, "transformers": None,
             "verl_transformers": None, "paths": {}}
    return {"node_id": "n" * 32, "ip": "10.0.0.2", "is_head": True, "cpus": 16, "gpus": 1, "facts": facts}


def test_vllm_is_looked_up_with_the_torch_it_requires_not_imported(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, ["torch==2.11.0", "torchvision==0.26.0", 'torch==2.9.0; extra == "old"'])
    monkeypatch.syspath_prepend(str(tmp_path))
    facts = _module_facts("vllm")
    assert facts["ok"] and facts["version"] == "0.24.0" and facts["requires_torch"] == "==2.11.0"
    # Looked up, not imported (its __init__ would have raised); the time is kept for environment.json.
    assert "vllm" not in sys.modules and isinstance(facts["seconds"], float)
    # The node's CUDA build of the same torch matches (a local version label is not a mismatch).
    assert evaluate(NEEDS, [_node("2.11.0+cu130", facts)]) == []
    lines = [f.line() for f in evaluate(NEEDS, [_node("2.13.0+cu130", facts)])]
    assert lines == ["node 10.0.0.2 (head nnnnnnnn): vllm='0.24.0': requires torch==2.11.0 (its compiled ops are "
                     "built against it); the node has torch 2.13.0+cu130 (fix: install requirements/gpu.txt "
                     "(verl[vllm]: vllm==0.24.0) on the node)"]


def test_a_vllm_without_a_torch_pin_or_without_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, ["numpy"], version="0.30.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    facts = _module_facts("vllm")
    assert facts["ok"] and facts["version"] == "0.30.0" and facts["requires_torch"] is None
    assert evaluate(NEEDS, [_node("2.13.0+cu130", facts)]) == []


def test_metadata_without_the_package_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, ["torch==2.11.0"], importable=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    facts = _module_facts("vllm")
    assert not facts["ok"] and facts["error"] == "ModuleNotFoundError: No module named 'vllm'"
    lines = [f.line() for f in evaluate(NEEDS, [_node("2.11.0+cu130", facts)])]
    assert len(lines) == 1 and lines[0].startswith("node 10.0.0.2 (head nnnnnnnn): vllm=\"ModuleNotFoundError")


def test_a_node_reports_the_versions_the_decisions_read_and_no_gpu_facts_without_gpus() -> None:
    from importlib.metadata import version

    from verl_pipeline.cluster.probe import node_facts
    from verl_pipeline.trainer.environment import REPORTED_VERSIONS

    facts = node_facts({"modules": ["flash_attn"], "paths": {}, "versions": list(REPORTED_VERSIONS), "gpus": 0})
    assert set(facts["versions"]) == set(REPORTED_VERSIONS)
    assert facts["versions"]["verl"] == version("verl") and facts["versions"]["vllm"] is None  # not on a CPU machine
    # flash-attn is looked for, found missing; a node without GPUs is not asked for GPUs or a kernel run.
    assert facts["modules"]["flash_attn"]["ok"] is False
    assert "gpu" not in facts and "flash_attn_kernel" not in facts
    # The node's CPUs: the count, and the model /proc/cpuinfo names (where it names one).
    assert facts["os_cpu_count"] == os.cpu_count()
    named = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    assert facts["cpu_model"] == (named[0] if named else None)


def test_the_cpu_model_is_read_where_cpuinfo_names_one(tmp_path: Path) -> None:
    from verl_pipeline.cluster.probe import cpu_model

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    arm = tmp_path / "arm"  # an Arm node's cpuinfo names parts, not a model
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2000.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n")
    assert cpu_model(str(x86)) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(str(arm)) is None and cpu_model(str(tmp_path / "absent")) is None
