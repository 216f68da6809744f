"""Warm starts: what a restarted attempt, or a later run on the same cluster, need not do again.

**The workers' caches.** vLLM's torch.compile artifacts, torch inductor's graph and autotune caches,
Triton's compiled kernels, the CUDA driver's JIT cache and flashinfer's JIT-built kernels normally
live in each process's home (and verl 0.9.1 turns vLLM's compile cache off: ``VLLM_DISABLE_COMPILE_CACHE=1``
in ``verl/trainer/constants_ppo.py``), so every attempt of every run builds them again. Here they live
on the cluster's shared storage (``<storage>/caches``, or the cluster profile's ``storage.caches``),
one folder per **key**: the GPU (name, compute capability), the driver, Python, torch's CUDA build and
the versions of torch, Triton, vLLM, flashinfer, flash-attn, verl and transformers, as the probe found
them on the GPU nodes. A change of any of them is another folder, so nothing built for other versions
or another GPU is ever loaded. verl leaves a variable the job's environment sets to the job's value
(its ``get_ppo_ray_runtime_env`` drops its own default for a variable the driver has), so the job
sets ``VLLM_DISABLE_COMPILE_CACHE=0`` — where the nodes' torch writes inductor artifacts atomically
(>= 2.10; the corruption verl's comment cites came from concurrent non-atomic writes). GPU nodes that
differ in any key fact, and ``runtime.warm_caches: false``, get no shared caches.

**Validation before training** (``trainer.val_before_train``) is the baseline before the run's first
update: a resume attempt (one that starts from a checkpoint) skips it, unless the run profile says
``validate_on_resume: true``.

Pure functions; no heavy imports.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.trainer.nodes.choices import Choices
from verl_pipeline.trainer.nodes.facts import GpuNode, NodeFacts
from verl_pipeline.trainer.overrides import spelled, spellings

#: Each cache the job's workers keep: environment variable -> its folder under the key's folder.
CACHE_DIRS = {
    # vLLM's torch.compile artifacts (torch_compile_cache/) and its other caches.
    "VLLM_CACHE_ROOT": "vllm",
    # torch inductor's FX graph, AOT autograd and autotune caches (vLLM's graphs, the actor's torch.compile).
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    # Compiled Triton kernels (inductor's, flash-attn's cross-entropy, verl's).
    "TRITON_CACHE_DIR": "triton",
    # The CUDA driver's cache of kernels JIT-compiled from PTX.
    "CUDA_CACHE_PATH": "cuda",
    # flashinfer's JIT-built kernels (it keeps them under <base>/.cache/flashinfer).
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}
#: The CUDA JIT cache's size limit: its largest (4 GiB; the default of 1 GiB evicts a model's kernels).
CUDA_CACHE_MAXSIZE = ("CUDA_CACHE_MAXSIZE", str(4 * 2**30))
#: verl sets it to 1 for every worker; the job's environment sets it to 0 where the cache is safe.
COMPILE_CACHE_SWITCH = "VLLM_DISABLE_COMPILE_CACHE"
#: torch writes inductor's artifacts atomically from this version on (pytorch#162432).
ATOMIC_TORCH = (2, 10)
#: What a key stands for, beside the versions the probe reports: a field of :class:`GpuNode` each.
_KEY_FIELDS = ("gpu_name", "capability", "driver", "python", "cuda")
VAL_BEFORE_TRAIN_KEY = "trainer.val_before_train"


def fingerprint(node: GpuNode) -> dict[str, Any]:
    """What a cache built on ``node`` was built for: the GPU, driver, Python, CUDA build and versions."""
    return {**{name: getattr(node, name) for name in _KEY_FIELDS}, "versions": dict(sorted(node.versions.items()))}


def cache_key(facts: Mapping[str, Any]) -> str:
    """A folder name for ``facts``: readable (GPU, compute capability, torch) and a digest of all of it."""
    digest = hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()
    gpu = re.sub(r"[^a-z0-9]+", "-", str(facts.get("gpu_name") or "gpu").lower()).strip("-")[:32]
    torch = (facts.get("versions") or {}).get("torch") or "unknown"
    cap = str(facts.get("capability") or "").replace(".", "")
    return f"{gpu}-sm{cap}-torch{re.sub(r'[^A-Za-z0-9.]+', '_', str(torch))}-{digest}"


def _torch_version(text: str | None) -> tuple[int, ...]:
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else ()


@dataclass(frozen=True)
class CachePlan:
    """Where the job's workers keep their caches, and why (or why not)."""

    enabled: bool
    why: str
    directory: str | None = None
    key: str | None = None
    #: What the key stands for (:func:`fingerprint`), written beside the caches (:attr:`key_file`).
    facts: dict[str, Any] = field(default_factory=dict)
    #: What the job's runtime_env gets.
    env: dict[str, str] = field(default_factory=dict)
    #: Variables the cluster profile's runtime.env sets itself (kept; the plan does not set them).
    kept: tuple[str, ...] = ()

    @property
    def key_file(self) -> Path | None:
        """``key.json`` in the cache folder: the key and what it stands for, for a reader of the folder."""
        return Path(self.directory) / "key.json" if self.enabled and self.directory else None

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "why": self.why, "directory": self.directory, "key": self.key,
                "facts": self.facts, "env": self.env, "kept_from_runtime_env": list(self.kept)}


def plan_caches(nodes: NodeFacts, *, root: Path, enabled: bool, user_env: Mapping[str, Any]) -> CachePlan:
    """The caches of a job on ``nodes``: one folder under ``root`` for the versions and GPU they share."""
    if not enabled:
        return CachePlan(False, "runtime.warm_caches: false in the cluster profile: every worker builds its caches "
                                f"afresh (verl's {COMPILE_CACHE_SWITCH}=1 stays)")
    if not nodes.gpu_nodes:
        return CachePlan(False, f"{nodes.describe()}: no GPU node's versions to key the caches by")
    prints = [fingerprint(n) for n in nodes.gpu_nodes]
    differ = sorted({k for p in prints[1:] for k in p if p[k] != prints[0][k]})
    if differ:
        return CachePlan(False, f"the GPU nodes differ in {', '.join(differ)}: no one cache folder is keyed for all "
                                "of them, so each worker builds its caches afresh")
    key = cache_key(prints[0])
    folder = root / key
    env = {var: str(folder / sub) for var, sub in CACHE_DIRS.items()}
    env[CUDA_CACHE_MAXSIZE[0]] = CUDA_CACHE_MAXSIZE[1]
    torch = prints[0]["versions"].get("torch")
    why = f"shared by every attempt and run on these versions and this GPU ({folder})"
    if _torch_version(torch) >= ATOMIC_TORCH:
        env[COMPILE_CACHE_SWITCH] = "0"
        why += (f"; vLLM's compile cache on ({COMPILE_CACHE_SWITCH}=0): torch {torch} writes inductor artifacts "
                "atomically")
    else:
        why += (f"; vLLM's compile cache stays off (verl's {COMPILE_CACHE_SWITCH}=1): torch {torch} predates atomic "
                f"inductor writes ({'.'.join(map(str, ATOMIC_TORCH))})")
    kept = tuple(sorted(k for k in env if k in user_env))
    if kept:
        why += f"; the cluster profile's runtime.env sets {', '.join(kept)} itself (kept)"
    return CachePlan(True, why, str(folder), key, prints[0], {k: v for k, v in env.items() if k not in kept}, kept)


def resume_validation(c: Choices, *, resume_step: int, validate_on_resume: bool) -> None:
    """``trainer.val_before_train=false`` on an attempt that resumes from run step ``resume_step`` > 0.

    The run's ``val_before_train`` (verl's default: true) is the baseline before its first update,
    which an attempt resuming from a checkpoint is past: validating again costs the restart a full
    validation pass before its first step. The run profile's ``validate_on_resume: true`` keeps it."""
    if resume_step <= 0:
        return
    found = spelled(c.settings, VAL_BEFORE_TRAIN_KEY)
    if found is not None and str(found.value).lower() != "true":
        return  # no validation before training at all: nothing to skip
    if validate_on_resume:
        c.note(VAL_BEFORE_TRAIN_KEY, True, f"a resume attempt (from run step {resume_step}) validates before training "
                                           "again: validate_on_resume: true in the run profile")
        return
    # Written where the run wrote it (its bare or ++ key), or bare after a section given as one value.
    name = found.spelling if found is not None and found.spelling in spellings(VAL_BEFORE_TRAIN_KEY) else \
        VAL_BEFORE_TRAIN_KEY
    c.updates[name] = False
    c.note(name, False, f"a resume attempt (from run step {resume_step}): the validation before the run's first "
                        "update ran in the attempt that started at step 0 (validate_on_resume: true in the run profile "
                        "keeps it)")


__all__ = ["ATOMIC_TORCH", "CACHE_DIRS", "COMPILE_CACHE_SWITCH", "CUDA_CACHE_MAXSIZE", "VAL_BEFORE_TRAIN_KEY",
           "CachePlan", "cache_key", "fingerprint", "plan_caches", "resume_validation"]
