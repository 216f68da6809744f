"""What a verl job needs on each Ray node, and what a node's probe report says it misses.

Pure functions of the job's settings and the facts each node reported (see
:mod:`verl_pipeline.cluster.probe`, which gathers them): which packages the configuration needs
(the rollout engine it names; flash-attn for a critic or an actor whose settings name a flash-attention
implementation),
verl's supported transformers range (read from verl's own package metadata), the paths the job
reads, and the CPUs verl reserves. No heavy imports: this runs on the Airflow worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from verl_pipeline.trainer.jobfiles import DIR_KEYS, FILE_KEYS
from verl_pipeline.trainer.nodes.attention import (
    ACTOR_ATTN_KEY,
    FLASH_IMPLS,
    SDPA,
    SDPA_OVERRIDE,
    explicit_attn_implementation,
)
from verl_pipeline.trainer.nodes.facts import node_label
from verl_pipeline.trainer.scaling import CPUS_PER_GPU_BUNDLE, MIN_RAY_VERSION, required_cpus, uses_critic

#: What the probe always looks for on the GPU nodes, whatever the job needs: flash-attn decides the
#: attention path (:mod:`verl_pipeline.trainer.nodes.fastpath`), so it is imported (and on a node with GPUs run
#: once on a GPU) even where the rendered settings do not need it.
OPTIONAL_MODULES = ("flash_attn",)
#: The distributions whose versions each node reports: what the warm caches are keyed by
#: (:mod:`verl_pipeline.trainer.nodes.warmstart`) and what the decision record shows.
REPORTED_VERSIONS = ("torch", "triton", "vllm", "flashinfer-python", "flash-attn", "verl", "transformers")
#: verl's extra that pins flash-attn for its torch 2.11 / CUDA 13 stack (``flash-attn==2.8.3`` in 0.9.1).
FLASH_ATTN_EXTRA = "flash-attn-cu130torch211"
#: Where the docs say how to get flash-attn when no wheel can be had.
FLASH_ATTN_DOC = "docs/deployment.md: Building the GPU image"
GPU_REQUIREMENTS = "requirements/gpu.txt"

# rollout.name -> (module to import, pip distribution, verl extra that installs it)
_ROLLOUT_ENGINES = {
    "vllm": ("vllm", "vllm", "vllm"),
    "sglang": ("sglang", "sglang", "sglang"),
    "trtllm": ("tensorrt_llm", "tensorrt-llm", None),
}
#: Settings naming files and directories the job reads on the nodes.
PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "critic.model.path",
             "reward.reward_model.model_path", *FILE_KEYS, *DIR_KEYS)


@dataclass(frozen=True)
class Need:
    """A Python package the job imports on the nodes that run its GPU workers (or on every node)."""

    module: str
    package: str
    #: What in the configuration needs it.
    why: str
    fix: str
    #: Only the nodes that run GPU workers import it (every node when the cluster has no GPUs).
    gpu_nodes: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Needs:
    """Everything the probe checks on each node for one job."""

    modules: tuple[Need, ...]
    #: ``(setting, path)`` pairs: each must exist on every node.
    paths: tuple[tuple[str, str], ...]
    #: verl's transformers range when known on this side (a node's own verl metadata wins).
    transformers: str | None = None

    def request(self) -> dict[str, Any]:
        """The JSON the probe job receives: which modules to import (the needed ones and
        :data:`OPTIONAL_MODULES`), which paths to stat, which distributions' versions to read."""
        return {"modules": sorted({n.module for n in self.modules} | {"verl", *OPTIONAL_MODULES}),
                "paths": dict(self.paths), "versions": list(REPORTED_VERSIONS)}


@dataclass(frozen=True)
class Finding:
    """One thing a node (or the cluster) misses, in the project's one-line error form."""

    node: str
    what: str
    value: Any
    rule: str
    fix: str
    #: False for what is reported but cannot be the user's fault (a node that died mid-probe).
    blocking: bool = True

    def line(self) -> str:
        return f"node {self.node}: {self.what}={self.value!r}: {self.rule} (fix: {self.fix})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "value": str(self.value), "line": self.line()}


@dataclass(frozen=True)
class VerlPins:
    """Versions verl's package metadata pins: its transformers range and the pins of its extras."""

    transformers: str | None = None
    extras: dict[str, dict[str, str]] = field(default_factory=dict)

    def pin(self, extra: str, package: str, default: str) -> str:
        return self.extras.get(extra, {}).get(package, default)


def unconditional_specifier(requires: Iterable[str] | None, package: str) -> str | None:
    """The specifier with which a distribution's requirements (``importlib.metadata.requires``) ask for
    ``package`` without a marker (``==2.11.0`` from ``torch==2.11.0``), or None."""
    from packaging.requirements import InvalidRequirement, Requirement

    for text in requires or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") == package and not req.marker and str(req.specifier):
            return str(req.specifier)
    return None


def read_verl_pins(requires: Iterable[str] | None) -> VerlPins:
    """Parse ``importlib.metadata.requires("verl")``: the unconditional transformers specifier and
    ``name==version`` pins per extra (``flash-attn==2.8.3; extra == "flash-attn-cu130torch211"``)."""
    from packaging.requirements import InvalidRequirement, Requirement

    texts = list(requires or ())
    extras: dict[str, dict[str, str]] = {}
    for text in texts:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        marker = str(req.marker) if req.marker else ""
        if marker.startswith("extra ==") and str(req.specifier):
            extra = marker.split("==", 1)[1].strip().strip("'\"")
            extras.setdefault(extra, {})[name] = f"{req.name}{req.specifier}"
    return VerlPins(unconditional_specifier(texts, "transformers"), extras)


def installed_verl_pins() -> VerlPins:
    """verl's pins from the metadata installed here (empty when verl is not installed)."""
    from importlib import metadata

    try:
        return read_verl_pins(metadata.requires("verl"))
    except metadata.PackageNotFoundError:
        return VerlPins()


def _outside(version: str, spec: str) -> bool:
    """``version`` is outside the specifier ``spec`` (False when either cannot be parsed: not judged)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) not in SpecifierSet(spec)
    except (InvalidSpecifier, InvalidVersion):
        return False


def transformers_problem(spec: str | None, version: str | None) -> str | None:
    """Why ``version`` of transformers is outside verl's range ``spec``, else None."""
    if not spec:
        return None
    if version is None:
        return f"transformers is not installed; verl needs transformers{spec}"
    return f"verl supports transformers{spec} only" if _outside(version, spec) else None


def needs_for(settings: Mapping[str, Any], pins: VerlPins | None = None) -> Needs:
    """Which packages and paths the job with these verl ``settings`` needs on the cluster's nodes."""
    pins = pins or VerlPins()
    modules: list[Need] = []
    engine = str(settings.get("actor_rollout_ref.rollout.name") or "")
    if engine in _ROLLOUT_ENGINES:
        module, package, extra = _ROLLOUT_ENGINES[engine]
        if extra == "vllm":
            fix = f"install {GPU_REQUIREMENTS} (verl[vllm]: {pins.pin('vllm', 'vllm', 'vllm')}) on the node"
        elif extra:
            fix = f"pip install 'verl[{extra}]' ({pins.pin(extra, package, package)}) on the node"
        else:
            fix = f"install {package} on the node, or actor_rollout_ref.rollout.name=vllm"
        modules.append(Need(module, package, f"actor_rollout_ref.rollout.name={engine} runs the rollout with it", fix))
    flash_pin = pins.pin(FLASH_ATTN_EXTRA, "flash-attn", "flash-attn")
    critic = uses_critic(dict(settings))
    # Left unset, the actor's attention is decided for the nodes (flash-attn where every GPU node has it,
    # sdpa otherwise: trainer/nodes/fastpath.py), so only an attention the settings name is a need.
    attn = explicit_attn_implementation(settings)
    if critic:
        modules.append(Need(
            "flash_attn", "flash-attn",
            "the job trains a critic, and verl 0.9.1 loads it with attn_implementation=flash_attention_2 whatever the "
            "config says (verl/utils/model.py load_valuehead_model)",
            f"install {flash_pin} on the node ({FLASH_ATTN_DOC}), or train without a critic "
            "(algorithm.adv_estimator=grpo)"))
    if attn in FLASH_IMPLS and not (critic and FLASH_IMPLS[attn][0] == "flash_attn"):
        module, package = FLASH_IMPLS[attn]
        install = flash_pin if module == "flash_attn" else package
        fix = (f"install {install} on the node, or leave {ACTOR_ATTN_KEY} unset (the pipeline then runs {SDPA} "
               f"where a GPU node lacks flash-attn) or set {SDPA_OVERRIDE}")
        if critic:
            fix = f"install {install} on the node"
        modules.append(Need(module, package, f"the actor's attn_implementation is {attn}", fix))
    paths: list[tuple[str, str]] = []
    for key in PATH_KEYS:
        value = settings.get(key)
        for path in value if isinstance(value, list | tuple) else [value]:
            if isinstance(path, str) and path.startswith("/"):
                paths.append((key, path))
    return Needs(tuple(modules), tuple(paths), pins.transformers)


def render_notes(needs: Needs, *, n_gpus: int | None = None, settings: Mapping[str, Any] | None = None) -> list[str]:
    """What ``verl-pipeline render`` says the nodes need: one line per check the environment probe makes
    (:func:`evaluate`), and with ``n_gpus`` the cluster as a whole (``steps.cluster_problems``)."""
    engines = [n for n in needs.modules if n.module not in ("flash_attn", "flash_attn_interface")]
    notes = [f"needs torch with CUDA on every GPU node, seeing as many GPUs as Ray advertises there: verl trains and "
             f"rolls out on CUDA GPUs ({GPU_REQUIREMENTS}: the torch verl[vllm] pins)",
             "needs verl on every node" + (f", with transformers{needs.transformers}" if needs.transformers else "")
             + f" ({GPU_REQUIREMENTS})"]
    for need in needs.modules:
        where = "every GPU node"
        if need in engines:
            notes.append(f"needs {need.package} on {where}, built for the node's torch: {need.why} ({need.fix})")
        else:
            notes.append(f"needs {need.package} on {where}: {need.why}. {GPU_REQUIREMENTS} does not install it; "
                         f"the GPU image does with --build-arg FLASH_ATTN=build, wheels or a wheel's URL "
                         f"({FLASH_ATTN_DOC}); fix otherwise: {need.fix}")
    if needs.paths:
        notes.append("needs on every node, at the same path: " + ", ".join(f"{key}={path}" for key, path in needs.paths)
                     + " (storage every node mounts)")
    notes.append(f"needs {CPUS_PER_GPU_BUNDLE} CPUs per GPU on every GPU node (verl's placement bundles)")
    if n_gpus is not None:
        need_cpus, why = required_cpus(n_gpus, dict(settings or {}))
        wanted = ".".join(map(str, MIN_RAY_VERSION))
        notes.append(f"needs on the cluster as a whole: Ray >= {wanted}, {n_gpus} GPU(s) and {need_cpus} CPUs ({why})")
    return notes


def _import_error(facts: Mapping[str, Any], module: str) -> str | None:
    entry = (facts.get("modules") or {}).get(module)
    if entry is None:
        return "not checked"
    return None if entry.get("ok") else str(entry.get("error") or "does not import")


def _torch_mismatch(facts: Mapping[str, Any], module: str) -> tuple[str, str] | None:
    """``(value, rule)`` when the node's torch is outside the one ``module`` requires (the probe reads that
    from the distribution's requirements for the modules it only looks up: vllm), else None."""
    entry = (facts.get("modules") or {}).get(module) or {}
    spec, torch = entry.get("requires_torch"), (facts.get("torch") or {}).get("version")
    if not spec or not torch or not _outside(torch, spec):
        return None
    return (str(entry.get("version")),
            f"requires torch{spec} (its compiled ops are built against it); the node has torch {torch}")


def evaluate(needs: Needs, nodes: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """What each node misses for a GPU training job with ``needs``.

    GPU work runs on the nodes with GPUs; when no node has any, every node is held to the GPU
    rules (the report then says what a GPU run on these nodes would miss).
    """
    answered = [n for n in nodes if n.get("facts")]
    any_gpu = any(float(n.get("gpus") or 0) > 0 for n in nodes)
    out: list[Finding] = []
    for node in nodes:
        label = node_label(node)
        facts = node.get("facts")
        if not facts:
            out.append(Finding(label, "probe", node.get("error") or "no answer",
                               "the node did not report (it died or hung during the probe)",
                               "check the node (`verl-pipeline cluster status`); a retry re-checks it", blocking=False))
            continue
        gpus = float(node.get("gpus") or 0)
        gpu_work = gpus > 0 or not any_gpu
        out.extend(_torch_findings(label, facts, gpus, gpu_work))
        verl_error = _import_error(facts, "verl")
        if verl_error:
            out.append(Finding(label, "verl", verl_error, "every node runs verl's workers",
                               f"install {GPU_REQUIREMENTS} (verl[vllm]==0.9.1) on the node"))
        else:
            spec = facts.get("verl_transformers") or needs.transformers
            problem = transformers_problem(spec, facts.get("transformers"))
            if problem:
                out.append(Finding(label, "transformers", facts.get("transformers"), problem,
                                   f"pip install 'transformers{spec}' on the node (verl[vllm] pins it)"))
        for need in needs.modules:
            if need.gpu_nodes and not gpu_work:
                continue
            error = _import_error(facts, need.module)
            if error:
                out.append(Finding(label, need.package, error, need.why, need.fix))
                continue
            mismatch = _torch_mismatch(facts, need.module)
            if mismatch:
                out.append(Finding(label, need.package, mismatch[0], mismatch[1], need.fix))
        for key, path in needs.paths:
            seen = (facts.get("paths") or {}).get(path) or {}
            if not seen.get("exists"):
                out.append(Finding(label, key, path, "does not exist on this node",
                                   "put it on storage every node mounts at the same path (the cluster profile's "
                                   "storage.root) and run preprocess/prefetch there"))
        cpus = float(node.get("cpus") or 0)
        if gpus > 0 and cpus < CPUS_PER_GPU_BUNDLE * gpus:
            out.append(Finding(label, "CPU", cpus,
                               f"verl reserves {CPUS_PER_GPU_BUNDLE} CPUs per GPU bundle: {gpus:g} GPU(s) need "
                               f"{CPUS_PER_GPU_BUNDLE * gpus:g}",
                               f"start the node with --num-cpus >= {CPUS_PER_GPU_BUNDLE * gpus:g}"))
    if not answered and nodes:
        out.append(Finding("cluster", "probe", "no node answered", "nothing could be checked",
                           "check the cluster; a retry re-checks it", blocking=False))
    return out


def _torch_findings(label: str, facts: Mapping[str, Any], gpus: float, gpu_work: bool) -> list[Finding]:
    torch = facts.get("torch") or {}
    fix = f"install {GPU_REQUIREMENTS} (torch with CUDA, as verl[vllm] pins it) on the node"
    if torch.get("error"):
        return [Finding(label, "torch", torch["error"], "verl's workers import torch", fix)]
    if not gpu_work:
        return []
    if not torch.get("cuda"):
        return [Finding(label, "torch", torch.get("version"), "is a CPU build (torch.version.cuda is None): verl "
                        "trains and rolls out on CUDA GPUs", fix)]
    if not torch.get("cuda_available") or int(torch.get("device_count") or 0) < 1:
        return [Finding(label, "GPU", torch.get("device_count", 0),
                        f"torch {torch.get('version')} (CUDA {torch.get('cuda')}) sees no usable GPU",
                        "check the node's NVIDIA driver (nvidia-smi) supports this CUDA and CUDA_VISIBLE_DEVICES")]
    if gpus and int(torch["device_count"]) < gpus:
        return [Finding(label, "GPU", torch["device_count"],
                        f"torch sees {torch['device_count']} of the {gpus:g} GPU(s) Ray advertises on the node",
                        "start the node's Ray with --num-gpus matching the GPUs torch sees (CUDA_VISIBLE_DEVICES)")]
    return []


__all__ = ["OPTIONAL_MODULES", "PATH_KEYS", "REPORTED_VERSIONS", "Finding", "Need", "Needs",
           "VerlPins", "evaluate", "installed_verl_pins", "needs_for", "read_verl_pins", "render_notes",
           "transformers_problem", "unconditional_specifier"]
