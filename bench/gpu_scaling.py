"""The scaling runs: the DAG on 1, 2, 4 and 8 GPUs of one host, each configuration's steps timed.

Usage (runs need a GPU machine with requirements/gpu.txt; ``--plan``, ``--table`` and ``--validate`` need none)::

    python bench/gpu_scaling.py --plan [--gpus 8] [--bare]         # configurations, waves, sittings, minutes
    python bench/gpu_scaling.py --gpus 8 --sitting 1 --out DIR     # run sitting 1's waves
    python bench/gpu_scaling.py --gpus 1 --only 'tiny-grpo-*'      # the one-GPU dry run
    python bench/gpu_scaling.py --table DIR [DIR ...]              # the table of earlier sittings' results
    python bench/gpu_scaling.py --validate [--gpus 8]              # every configuration through verl (CPU)

**Configurations** (:func:`matrix`, for a host of ``--gpus`` GPUs): each model profile (``tiny-grpo``,
``tiny-ppo``, and the 0.5B architecture with random weights, ``qwen2.5-0.5b-grpo`` / ``-ppo``, as
``gpu_acceptance.py``'s real-size scenario) colocated with rollout TP 1 on 1, 2, 4, 8 GPUs of one Ray node
(the weak-scaling series); at the host's GPU count also the host as two Ray nodes (each its own
``ray start`` on half the GPUs: ``cluster.gpu_devices``), a separate rollout pool on one node and on two
(rollout on one node, training on the other: the weight sync crosses the nodes), rollout TP 2, and the
batch as the scaling rules give it for one node (``shipped``).

**Weak scaling**: the global batch (``data.train_batch_size``, ``ppo_mini_batch_size``) is the rules'
batch for one GPU times the run's GPUs, so every GPU gets the one-GPU run's work; the rules derive the rest
(micro batches, memory, the separate placement's sync step). The rules themselves grow the batch with
nodes, not with GPUs per node: the ``shipped`` configuration shows what they give.

**Waves and sittings**: configurations of one model size on disjoint GPUs run side by side (a wave; each
run a DAG with its own Ray cluster on its own GPUs); ``--serial`` runs one at a time. A sitting is the waves
that fit one device session (``--sitting-minutes``); ``--plan`` prints them with their estimated minutes.

Each configuration's result goes to ``--out``/<configuration>.json as it finishes, and the table of every
result in ``--out`` to ``--out``/scaling.json, with the series' tokens/s against the GPUs beside the ideal
line in ``--out``/scaling.png (figures: ``gpu_scaling_figures.py``). On a machine without
a GPU a run says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # its sibling modules, however it is started
    sys.path.insert(0, str(BENCH))

import gpu_acceptance as acceptance  # noqa: E402  (its DAG runner, checks and the 0.5B weights)
import gpu_scaling_figures as figures  # noqa: E402

REPO = BENCH.parent
RUN_PROFILE = "gpu-scaling"
GPU_COUNTS = (1, 2, 4, 8)
#: Short name -> the shipped model profile.
MODELS = {"0.5b-grpo": "qwen2.5-0.5b-grpo", "0.5b-ppo": "qwen2.5-0.5b-ppo", "tiny-grpo": "tiny-grpo",
          "tiny-ppo": "tiny-ppo"}
#: Training steps per run: the first pays the warm-up, the rest are the steady steps measured.
STEPS = {"tiny": 6, "0.5b": 2}
#: Random weights earn no reward: an entropy bonus gives GRPO's update a direction, as in the GPU acceptance
#: runs (the step does the same work either way; the report flags a gradient norm that stays 0).
LEARNING_SIGNAL = "actor_rollout_ref.actor.entropy_coeff=0.01"
TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
BATCH_KEY, MINI_KEY = "data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"
COLOCATED, SEPARATE = "colocated", "separate"
#: The order the plan runs in: the 0.5B weak-scaling series (what the goals are judged on), then every other
#: shape once with the tiny model (does it run at all: minutes each, several side by side), then the same
#: shapes with the 0.5B architecture (what they cost), then the remaining series.
GROUPS = (("0.5b-grpo", True), ("tiny-grpo", False), ("tiny-ppo", False), ("0.5b-grpo", False), ("0.5b-ppo", True),
          ("tiny-grpo", True), ("tiny-ppo", True), ("0.5b-ppo", False))


@dataclass(frozen=True)
class Config:
    """One run: a model profile on ``gpus`` GPUs of this host, as ``nodes`` Ray nodes."""

    model: str
    gpus: int
    nodes: int = 1
    tp: int = 1
    placement: str = COLOCATED
    #: The batch grown with the GPUs (weak scaling); False: the rules' batch for this shape.
    weak: bool = True

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def size(self) -> str:
        return self.model.split("-")[0]

    @property
    def model_profile(self) -> str:
        return MODELS[self.model]

    @property
    def spine(self) -> bool:
        """One of the weak-scaling series (one node, colocated, TP 1)."""
        return self == Config(self.model, self.gpus)

    @property
    def name(self) -> str:
        return (f"{self.model}-{self.nodes}x{self.gpus_per_node}-tp{self.tp}-{self.placement}"
                + ("" if self.weak else "-shipped-batch"))

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.name, "model": self.model, "model_profile": self.model_profile, "gpus": self.gpus,
                "nodes": self.nodes, "tp": self.tp, "placement": self.placement, "weak": self.weak}


def variants(model: str, gpus: int) -> list[Config]:
    """The configurations at the host's GPU count besides the series: the two-node split, a separate
    rollout pool on one node and across two, rollout TP 2, the rules' own batch."""
    return [Config(model, gpus, nodes=2), Config(model, gpus, placement=SEPARATE),
            Config(model, gpus, nodes=2, placement=SEPARATE), Config(model, gpus, tp=2),
            Config(model, gpus, weak=False)]


def order(c: Config) -> tuple[int, int, int]:
    kinds = [Config(c.model, c.gpus), *variants(c.model, c.gpus)] if c.gpus > 1 else [c]
    return GROUPS.index((c.model, c.spine)), kinds.index(c), c.gpus


def every_config() -> list[Config]:
    """The configurations of every host size (1, 2, 4 and 8 GPUs), in plan order."""
    return sorted({c for g in GPU_COUNTS for c in matrix(g)}, key=order)


def matrix(max_gpus: int) -> list[Config]:
    """Every configuration for a host of ``max_gpus`` GPUs, in plan order: the series up to the host's GPU count
    (the largest of GPU_COUNTS it has); the other shapes at that count for the 0.5B architecture, and on 2 GPUs
    for the tiny model (whether each shape runs, several side by side)."""
    top = max(g for g in GPU_COUNTS if g <= max_gpus)
    out = [Config(model, g) for model in MODELS for g in GPU_COUNTS if g <= top]
    if top > 1:
        out += [v for model in MODELS for v in variants(model, top if model.startswith("0.5b") else 2)]
    return sorted(out, key=order)


# -- how long each run takes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """One model profile's run on one H200 (docs/benchmarks.md), the basis of every estimate."""

    #: Submit to the first step, without the step itself.
    startup_s: float
    step_s: float
    #: The DAG's own time around the job: Airflow, provision, data, probe before; report, teardown after.
    around_s: float
    source: str


MEASURED = {
    "tiny-grpo": Measured(255, 3.9, 90, "acceptance alone on one H200, 2026-12-03: 258.5 s to the first step, "
                                        "3.93 s/step, DAG 361 s for 4 steps"),
    "tiny-ppo": Measured(308, 5.9, 95, "tiny-ppo on one H200, 2026-12-04: 314 s to the first step, 5.9 s/step, "
                                       "DAG 422 s for 3 steps"),
    "0.5b-grpo": Measured(314, 141, 105, "real-size with fused kernels on one H200, 2026-12-03: 454 s to the first "
                                         "step, 139.9 / 142.3 s/step, DAG 701 s for 2 steps"),
    "0.5b-ppo": Measured(370, 48, 105, "not run yet: the 0.5B GRPO start-up plus the critic's (tiny-ppo over "
                                       "tiny-grpo); its step from the GRPO step by tokens (256 x 572 against "
                                       "640 x 1,084) plus 60% for the critic's two passes"),
}
#: Guesses, until a multi-GPU run measures them: start-up per doubling of the GPUs (workers, NCCL
#: communicators, vLLM engines), for a second pool (separate placement) and for a second Ray node.
STARTUP_PER_DOUBLING_S, SEPARATE_STARTUP_S, SECOND_NODE_STARTUP_S = 15.0, 30.0, 15.0
#: The efficiency an estimate assumes on more than one GPU.
ASSUMED_EFFICIENCY = 0.9
#: Writing the 0.5B architecture's random weights (once per machine, before its first 0.5B wave).
WEIGHTS_S = 60.0


def steps_for(c: Config, steps: int | None) -> int:
    return steps or STEPS[c.size]


def estimate_s(c: Config, steps: int | None = None) -> float:
    """Wall seconds of the configuration's DAG run."""
    m = MEASURED[c.model]
    startup = (m.startup_s + STARTUP_PER_DOUBLING_S * math.log2(c.gpus)
               + (SEPARATE_STARTUP_S if c.placement == SEPARATE else 0.0) + SECOND_NODE_STARTUP_S * (c.nodes - 1))
    work = 1.0 if c.weak else 1.0 / c.gpus  # the rules' batch spreads one GPU's work over every GPU
    step = m.step_s * work / (1.0 if c.gpus == 1 else ASSUMED_EFFICIENCY)
    return m.around_s + startup + steps_for(c, steps) * step


def bare_estimate_s(c: Config, steps: int | None = None) -> float:
    """The bare-verl twin of a one-node configuration: the job alone, no DAG around it."""
    return estimate_s(c, steps) - MEASURED[c.model].around_s if c.nodes == 1 else 0.0


@dataclass
class Wave:
    """Configurations of one model size run side by side, each on GPUs of its own."""

    size: str
    runs: list[tuple[Config, tuple[int, ...]]] = field(default_factory=list)

    def used(self) -> set[int]:
        return {d for _, devices in self.runs for d in devices}

    def seconds(self, steps: int | None, bare: bool) -> float:
        run = max(estimate_s(c, steps) for c, _ in self.runs)
        return run + (sum(bare_estimate_s(c, steps) for c, _ in self.runs) if bare else 0.0)


def waves(configs: Sequence[Config], devices: Sequence[int], *, serial: bool = False) -> list[Wave]:
    """Configurations packed in order into waves: each into the first wave of its size with GPUs left."""
    out: list[Wave] = []
    for c in configs:
        wave = next((w for w in out if not serial and w.size == c.size
                     and len(devices) - len(w.used()) >= c.gpus), None)
        if wave is None:
            wave = Wave(c.size)
            out.append(wave)
        free = [d for d in devices if d not in wave.used()]
        wave.runs.append((c, tuple(free[:c.gpus])))
    return out


def sittings(plan: Sequence[Wave], budget_s: float, steps: int | None, bare: bool) -> list[list[Wave]]:
    """The waves in order, cut into device sessions of at most ``budget_s`` (a longer wave sits alone); each
    session on a fresh machine writes the 0.5B weights before its first 0.5B wave."""
    out: list[list[Wave]] = []
    used = budget_s
    for w in plan:
        weights = WEIGHTS_S if w.size == "0.5b" and not any(v.size == "0.5b" for v in (out[-1] if out else [])) else 0.0
        if out and used + w.seconds(steps, bare) + weights <= budget_s:
            used += w.seconds(steps, bare) + weights
            out[-1].append(w)
            continue
        out.append([w])
        used = w.seconds(steps, bare) + (WEIGHTS_S if w.size == "0.5b" else 0.0)
    return out


def plan_text(groups: list[list[Wave]], *, gpus: int, steps: int | None, bare: bool, serial: bool,
              only: Sequence[str] = (), first: int = 1) -> str:
    """The plan as the command prints it (``first``: the number of the first sitting shown)."""
    n = sum(len(w.runs) for g in groups for w in g)
    total = sum(w.seconds(steps, bare) for g in groups for w in g) / 60
    lines = [f"gpu_scaling plan: {gpus} GPU(s), {n} configuration(s) in {sum(map(len, groups))} wave(s), "
             f"{len(groups)} sitting(s), about {total:.0f} min of runs ("
             + ("one at a time" if serial else "side by side on disjoint GPUs") + ("; with bare-verl twins" if bare
                                                                                  else "") + ")"]
    flags = "".join(f" --only '{g}'" for g in only) + (f" --steps {steps}" if steps else "") + (
        " --bare" if bare else "") + (" --serial" if serial else "")
    for i, group in enumerate(groups, first):
        weights = WEIGHTS_S / 60 if any(w.size == "0.5b" for w in group) else 0.0
        minutes = sum(w.seconds(steps, bare) for w in group) / 60 + weights
        lines.append(f"sitting {i}: about {minutes:.0f} min"
                     + (f" (with {weights:.1f} min writing the 0.5B weights)" if weights else "")
                     + f": python bench/gpu_scaling.py --gpus {gpus} --sitting {i}{flags} --out OUT")
        for w in group:
            lines.append(f"  wave, about {w.seconds(steps, bare) / 60:.1f} min:")
            for c, devices in w.runs:
                lines.append(f"    {c.name:<42} GPUs {','.join(map(str, devices)):<16} "
                             f"{steps_for(c, steps)} steps, about {estimate_s(c, steps) / 60:.1f} min")
    return "\n".join(lines)


# -- one configuration's run ------------------------------------------------------------------------

@contextlib.contextmanager
def configs_env(configs: Path) -> Iterator[None]:
    """Profiles read from ``configs`` (``VERL_PIPELINE_CONFIGS``) inside the block."""
    before = os.environ.get("VERL_PIPELINE_CONFIGS")
    os.environ["VERL_PIPELINE_CONFIGS"] = str(configs)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VERL_PIPELINE_CONFIGS", None)
        else:
            os.environ["VERL_PIPELINE_CONFIGS"] = before


def cpus_per_node(c: Config, host_cpus: int, host_gpus: int) -> int:
    """The configuration's share of the host's cores, at least what verl reserves (3 per GPU + 10)."""
    need = math.ceil((3 * c.gpus + 10) / c.nodes)
    return max(need, host_cpus * c.gpus // max(host_gpus, 1) // c.nodes)


def write_run_configs(root: Path, c: Config, devices: Sequence[int], memory_mib: Sequence[int], *,
                      cpus: int) -> Path:
    """``root``/configs: the shipped configs, whose ``local-gpu`` cluster is this configuration's: its Ray
    nodes on this host, each on its own GPUs (``gpu_devices``), its share of the cores, NCCL reporting on."""
    configs = acceptance.write_configs(root, [memory_mib[d] for d in devices])
    path = configs / "clusters" / "local-gpu.yaml"
    prof = yaml.safe_load(path.read_text())
    prof["cluster"].update(nodes=c.nodes, num_gpus=c.gpus_per_node, num_cpus=cpus, gpu_devices=list(devices))
    prof["hardware"].update(nnodes=c.nodes, n_gpus_per_node=c.gpus_per_node, cpus_per_node=cpus)
    prof["runtime"]["nccl_debug"] = True
    path.write_text(yaml.safe_dump(prof, sort_keys=False))
    return configs


def one_gpu_batch(model_profile: str) -> tuple[int, int]:
    """The rules' prompts per step and per update for the model profile on one GPU (the profiles of the
    process's configs)."""
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": RUN_PROFILE, "model_profile": model_profile, "nnodes": 1,
                           "n_gpus_per_node": 1}, run_name="gpu-scaling/one-gpu")
    return int(spec.verl[BATCH_KEY]), int(spec.verl[MINI_KEY])


def dag_conf(c: Config, steps: int | None, model_path: Path | None, one_gpu: tuple[int, int]) -> dict[str, Any]:
    """The DAG params of the configuration's run."""
    overrides = [LEARNING_SIGNAL]
    if c.weak:
        overrides += [f"{BATCH_KEY}={one_gpu[0] * c.gpus}", f"{MINI_KEY}={one_gpu[1] * c.gpus}"]
    if c.tp != 1:
        overrides.append(f"{TP_KEY}={c.tp}")
    conf: dict[str, Any] = {"profile": RUN_PROFILE, "model_profile": c.model_profile, "mode": "train",
                            "total_training_steps": steps_for(c, steps), "nnodes": c.nodes,
                            "n_gpus_per_node": c.gpus_per_node, "placement": c.placement,
                            "verl_overrides": overrides}
    if model_path is not None and c.size == "0.5b":
        conf["model_source"] = str(model_path)
    return conf


def nccl_lines(run_dir: Path) -> Iterator[str]:
    """The lines NCCL printed in the run's Ray session logs (every worker's own file, not deduplicated as
    the job's log is), from the cluster record (live or stopped) that names the cluster's temp dir."""
    from verl_pipeline.rundir import RunDir

    record = RunDir(run_dir).cluster_file
    for path in sorted(record.parent.glob(record.stem + "*.json")):
        temp_dir = (json.loads(path.read_text()).get("extra") or {}).get("temp_dir")
        for log in sorted(Path(temp_dir).glob("session_*/logs/*")) if temp_dir else []:
            if log.suffix in (".out", ".err") and log.is_file():
                yield from (line for line in log.read_text(errors="replace").splitlines() if "NCCL INFO" in line)
        return


def run_config(args: argparse.Namespace, c: Config, devices: tuple[int, ...], memory_mib: Sequence[int],
               model_path: Path | None) -> dict[str, Any]:
    """The configuration's DAG run on its GPUs, checked as the acceptance runs are, and its figures."""
    from verl_pipeline.rundir import RunDir

    result = acceptance.Result(c.name)
    steps = steps_for(c, args.steps)
    configs = write_run_configs(args.workdir / "configs" / c.name, c, devices, memory_mib,
                                cpus=cpus_per_node(c, os.cpu_count() or 16, len(memory_mib)))
    conf = dag_conf(c, args.steps, model_path, args.one_gpu_batch[c.model_profile])
    run = acceptance.run_dag(args.workdir, configs, c.name, conf,
                             extra_env=acceptance.cold_caches(args.workdir / f"{c.name}-caches"))
    run_dir = acceptance.check_trained_run(result, run, configs, steps)
    if run_dir is not None:
        rows = [r for f in RunDir(run_dir).metrics_files().values() for r in acceptance.training_rows(f)]
        report = json.loads((RunDir(run_dir).report_dir / "report.json").read_text())
        result.figures.update(figures.step_figures(rows, c.gpus))
        result.figures.update(train_batch_size=int(acceptance.job_overrides(run_dir)[BATCH_KEY]),
                              own_gpus=figures.own_gpus(report.get("gpus") or [], devices),
                              nccl=figures.nccl_summary(nccl_lines(run_dir)), run_dir=str(run_dir))
    return {**c.to_dict(), "devices": list(devices), "ok": result.ok, "failures": result.failures,
            "figures": result.figures}


def run_guarded(args: argparse.Namespace, c: Config, devices: tuple[int, ...], memory_mib: Sequence[int],
                model_path: Path | None) -> dict[str, Any]:
    """:func:`run_config`, whose own error is the run's failure: the wave's other runs go on and are recorded."""
    try:
        return run_config(args, c, devices, memory_mib, model_path)
    except Exception as e:  # any error of one run is that run's result
        return {**c.to_dict(), "devices": list(devices), "ok": False, "failures": [f"the bench: {e!r}"],
                "figures": {}}


def bare_twin(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The run's job as bare ``python -m verl.trainer.main_ppo`` on a Ray of its own, on the same GPUs, alone
    on the host: its steps' figures and the DAG run's steady step over it."""
    run_dir = Path(result["figures"]["run_dir"])
    work = args.workdir / f"{result['config']}-bare"
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, result["devices"]))  # the twin's Ray inherits it
    try:
        bare = acceptance.bare_verl(work, run_dir)
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    bare.update(figures.step_figures(acceptance.training_rows(work / "metrics.jsonl"), result["gpus"]))
    result["figures"]["bare"] = bare
    if bare.get("step_s") and result["figures"].get("step_s"):
        result["figures"]["step_ratio_to_bare"] = round(result["figures"]["step_s"] / bare["step_s"], 4)


# -- the table --------------------------------------------------------------------------------------

def load_results(dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """Every configuration's result in ``dirs`` (a later file of one configuration wins)."""
    found: dict[str, dict[str, Any]] = {}
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "config" in data and "figures" in data:
                found[data["config"]] = data
    return sorted(found.values(), key=lambda r: order(Config(r["model"], r["gpus"], r["nodes"], r["tp"],
                                                             r["placement"], r["weak"])))


def write_table(out: Path, extra_dirs: Sequence[Path] = ()) -> str:
    results = load_results([*extra_dirs, out])
    rows = figures.table_rows(results)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    (out / "scaling.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit,
                                                  "gpus": acceptance.gpu_memory_mib(), "cpus": os.cpu_count(),
                                                  "rows": rows}, indent=2, default=str))
    figures.plot_scaling(rows, out / "scaling.png")
    return figures.render_table(rows)


# -- verl's checks on the CPU -----------------------------------------------------------------------

def run_spec(c: Config, root: Path, *, host_cpus: int = 128, host_gpus: int = 8, memory_mib: int = 143771) -> Any:
    """The configuration's run spec as its provision builds it, from the configs its run writes (an H200
    host of ``host_gpus`` GPUs and ``host_cpus`` cores by default)."""
    from verl_pipeline.profiles import build_run_spec

    devices = tuple(range(c.gpus))
    configs = write_run_configs(root / c.name, c, devices, [memory_mib] * host_gpus,
                                cpus=cpus_per_node(c, host_cpus, host_gpus))
    with configs_env(configs):
        conf = dag_conf(c, None, None, one_gpu_batch(c.model_profile))
        return build_run_spec(conf, run_name=f"gpu-scaling/{c.name}")


def h200_node(gpus: int) -> Any:
    """An H200 node of ``gpus`` GPUs with a working flash-attn, as the probe reports one (the GPU stack of
    requirements/gpu.txt)."""
    from verl_pipeline.trainer.nodes.facts import NodeFacts

    versions = {"torch": "2.11.0+cu130", "vllm": "0.24.0", "flash-attn": "2.8.3.post2", "verl": "0.9.1"}
    facts = {"python": "3.12.3", "versions": versions, "flash_attn_kernel": {"ok": True, "error": None},
             "modules": {"verl": {"ok": True}, "flash_attn": {"ok": True, "version": versions["flash-attn"]}},
             "torch": {"version": versions["torch"], "cuda": "13.0", "cuda_available": True, "device_count": gpus},
             "gpu": {"devices": [{"name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0"}] * gpus}}
    node = {"node_id": "h200", "ip": "10.0.0.1", "is_head": True, "cpus": 16.0 * gpus, "gpus": float(gpus),
            "facts": facts}
    return NodeFacts.from_probe([node], source="an H200 node as the probe reports it")


def validate_all(configs: Sequence[Config], root: Path) -> list[str]:
    """Every configuration through the rules and verl's own composition and validation, its job decided for
    H200 nodes with flash-attn as the submit decides it: the refusals, one line each."""
    from verl_pipeline import steps
    from verl_pipeline.exceptions import ConfigError
    from verl_pipeline.trainer.nodes.decisions import decide_for_spec
    from verl_pipeline.trainer.render import job_settings
    from verl_pipeline.trainer.validate import session

    refused = []
    with session():
        for c in configs:
            t0 = time.monotonic()
            try:
                spec = run_spec(c, root)
                settings = job_settings(spec, train_files="/d/train.parquet", val_files="/d/val.parquet",
                                        model_path="/m")
                decision = decide_for_spec(spec, settings, h200_node(c.gpus_per_node))
                out = steps.validate_spec_with_verl(spec, decision=decision)
                print(f"{c.name:<46} verl accepts {out['n_gpus']} GPU(s), batch {spec.verl[BATCH_KEY]} "
                      f"({time.monotonic() - t0:.1f} s)", flush=True)
            except ConfigError as e:
                refused.append(f"{c.name}: {e}")
                print(refused[-1], flush=True)
    return refused


# -- the command ------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print the configurations, waves and minutes; run nothing")
    p.add_argument("--table", type=Path, nargs="+", metavar="DIR", help="the table of the results in DIR(s)")
    p.add_argument("--validate", action="store_true",
                   help="every configuration through the scaling rules and verl's validation, on this CPU")
    p.add_argument("--gpus", type=int, default=None, choices=GPU_COUNTS,
                   help="GPUs of this host to use (default: every GPU nvidia-smi lists; --plan: 8)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="repeatable: only the configurations whose name matches, e.g. 'tiny-grpo-*'")
    p.add_argument("--sitting", type=int, default=None, help="only this sitting's waves (1, 2, …; see --plan)")
    p.add_argument("--sitting-minutes", type=float, default=27.0,
                   help="minutes of runs per device session (its 30 minus the kit's set-up)")
    p.add_argument("--serial", action="store_true", help="one configuration at a time, not side by side")
    p.add_argument("--bare", action="store_true",
                   help="after each wave, each one-node configuration's job as bare verl on its GPUs, alone")
    p.add_argument("--steps", type=int, default=None, help=f"training steps of every run (default: {STEPS})")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "verl-gpu-scaling")
    p.add_argument("--out", type=Path, default=None, help="results folder (default: WORKDIR/results)")
    return p


def _progress(out: Path, text: str) -> None:
    with (out / "progress").open("a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
    print(text, flush=True)


def run_waves(args: argparse.Namespace, chosen: Sequence[Wave], memory_mib: Sequence[int]) -> bool:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_path = None
    with configs_env(REPO / "configs"):
        args.one_gpu_batch = {m: one_gpu_batch(m) for m in MODELS.values()}
    ok = True
    for i, wave in enumerate(chosen, 1):
        if wave.size == "0.5b" and model_path is None:
            model_path = acceptance.write_real_size_model(args.workdir / "models" / "qwen2.5-0.5b-arch-random")
        _progress(out, f"wave {i}/{len(chosen)}: " + ", ".join(f"{c.name} on GPUs {d}" for c, d in wave.runs))
        with ThreadPoolExecutor(max_workers=len(wave.runs)) as pool:
            results = list(pool.map(run_guarded, *zip(*[(args, c, d, memory_mib, model_path) for c, d in wave.runs],
                                                     strict=True)))
        for r in results:
            if args.bare and r["nodes"] == 1 and r["figures"].get("run_dir"):
                bare_twin(args, r)
            (out / f"{r['config']}.json").write_text(json.dumps(r, indent=2, default=str))
            ok &= r["ok"]
            _progress(out, f"{r['config']}: {'ok' if r['ok'] else 'FAILED ' + '; '.join(r['failures'])}")
        print(write_table(out), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.table:  # the table of every sitting's results (its JSON and plot into the last folder)
        print(write_table(args.table[-1], args.table[:-1]))
        return 0
    memory = [] if args.plan or args.validate else acceptance.gpu_memory_mib()
    gpus = args.gpus or (len(memory) if memory else 8)
    chosen = [c for c in matrix(gpus) if not args.only or any(fnmatch.fnmatch(c.name, g) for g in args.only)]
    args.workdir = args.workdir.resolve()
    if args.validate:
        if args.gpus is None:  # every host size's configurations
            chosen = [c for c in every_config() if not args.only or any(fnmatch.fnmatch(c.name, o) for o in args.only)]
        refused = validate_all(chosen, args.workdir / "validate")
        print(f"{len(chosen) - len(refused)} of {len(chosen)} configuration(s) accepted")
        return 1 if refused else 0
    groups = sittings(waves(chosen, list(range(gpus)), serial=args.serial), args.sitting_minutes * 60,
                      args.steps, args.bare)
    if args.sitting is not None and not 1 <= args.sitting <= len(groups):
        print(f"gpu_scaling: --sitting {args.sitting}: the plan has sittings 1 to {len(groups)} (see --plan)")
        return 2
    if args.plan:
        shown = groups if args.sitting is None else [groups[args.sitting - 1]]
        print(plan_text(shown, gpus=gpus, steps=args.steps, bare=args.bare, serial=args.serial, only=args.only,
                        first=args.sitting or 1))
        return 0
    if not memory:
        print("gpu_scaling: no NVIDIA GPU on this machine (nvidia-smi found none): nothing to run")
        return 0
    if gpus > len(memory):
        print(f"gpu_scaling: --gpus {gpus}, but nvidia-smi lists {len(memory)} GPU(s) here")
        return 2
    missing = acceptance.missing_gpu_packages()
    if missing:
        print(f"gpu_scaling: {', '.join(missing)} not importable: pip install -r requirements/gpu.txt")
        return 2
    args.out = (args.out or args.workdir / "results").resolve()
    chosen_waves = [w for g in (groups if args.sitting is None else [groups[args.sitting - 1]]) for w in g]
    return 0 if run_waves(args, chosen_waves, memory) else 1


if __name__ == "__main__":
    sys.exit(main())
