"""The GPU acceptance run: the DAG in train mode on this machine's GPUs, checked end to end.

Usage (on a machine with requirements/gpu.txt installed and at least one GPU)::

    python bench/gpu_acceptance.py [--scenario NAME ...] [--workdir DIR] [--out FILE]

Scenarios (default: ``acceptance``):

``acceptance``
    ``airflow dags test verl_ppo`` with the ``gpu-acceptance`` profile (the built-in tiny model, GRPO
    with an entropy bonus so its weights move, 4 steps). Checks every task succeeded, steps 1..N were
    logged, a checkpoint per step, the report's numbers (throughput, peak memory, phase shares ≤ 100%,
    time to first step, GPU utilisation when recorded) and the export: it loads, generates, and
    differs from the base model.
``ppo``
    The same with PPO: the ``tiny-ppo`` model profile (a critic, GAE advantages) with a learning signal
    (an entropy bonus, and learning rates a tiny random model moves with). Checks besides
    ``acceptance``'s: actor **and** critic checkpoints every step, the report's critic section (value
    loss, explained variance, values, the critic's phases) and plot, and an export that is the actor
    (a causal LM, not the critic's value head).
``real-size``
    The shipped ``qwen2.5-0.5b-grpo`` model profile's architecture (24 layers, hidden 896, 14 heads,
    vocabulary 151,936) with random weights written here (no hub), through the DAG, then the job's
    exact overrides as bare ``python -m verl.trainer.main_ppo`` on the same machine: time to first
    step and steady seconds per step of both, and their ratio. ``--real-size-profile
    qwen2.5-0.5b-ppo`` runs the same architecture with PPO (a critic of the same size, GAE); its
    critic is then checked as ``ppo``'s is.
``learn-grpo`` / ``learn-ppo``
    The example task (profiles ``repeat-digit`` and ``repeat-digit-ppo``: generated ``Repeat: …``
    prompts, the reward function in ``configs/tasks/repeat-digit/``) trained through the DAG as the
    profile says. Passes only when the report's learning verdict says the run learned (the train reward
    rose by its margin, validation did not fall, entropy did not collapse) **and** the validation reward
    (greedy, verl's ``val-core``) rose by at least ``VALIDATION_RISE``; the report's reward plot is kept
    as ``<scenario>-reward.png`` in the workdir.
``lora``
    ``acceptance`` with a LoRA adapter (``LORA``): the export must be the base weights with the trained
    adapter merged in, so it differs from the base model.
``resume-worker`` / ``resume-raylet`` / ``resume-ppo``
    A 6-step run whose attempt 1 loses, after checkpoint 3, a training worker (SIGKILL, as the OOM
    killer does) or its node's raylet; the DAG retries, and attempt 2 must train steps 4 to 6 only.
    ``resume-ppo`` kills a worker of the PPO run: attempt 2 must also restore the critic, so its value
    loss at step 4 goes on from step 3's rather than starting again from step 1's. With ``--twin``, bare
    verl is then killed alike and started again by hand (``bare_verl_resumed``): the seconds from each
    kill to the first resumed step, the pipeline's retry against that restart.

On a machine without a GPU it says so and exits 0; with a GPU but without vLLM/verl it says what to
install and exits 2. Each scenario prints its figures and writes them (JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "verl_ppo"
PROFILE = "gpu-acceptance"
REAL_SIZE_MODEL_PROFILE = "qwen2.5-0.5b-grpo"
#: The model profiles of the 0.5B architecture the real-size scenario runs (the same random weights).
REAL_SIZE_PROFILES = (REAL_SIZE_MODEL_PROFILE, "qwen2.5-0.5b-ppo")
SCENARIOS = ("acceptance", "ppo", "real-size", "learn-grpo", "learn-ppo", "lora", "resume-worker", "resume-raylet",
             "resume-ppo")
#: The example task's run profile of each learning scenario.
LEARN_PROFILES = {"learn-grpo": "repeat-digit", "learn-ppo": "repeat-digit-ppo"}
#: The least rise of the greedy validation reward (last validation minus the first, before training) that
#: a learning scenario passes with: on the example's 0-to-1 reward, a tenth of its range.
VALIDATION_RISE = 0.1
#: A LoRA adapter on every linear of the tiny model, and a learning rate an adapter moves with.
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-3")
PPO_MODEL_PROFILE = "tiny-ppo"
#: The actor's entropy bonus (verl's key).
ENTROPY_COEFF = "actor_rollout_ref.actor.entropy_coeff"
#: A tiny random model's rewards are all 0: an entropy bonus gives its actor a gradient, and learning rates
#: larger than a real model's move both networks within a few steps (the critic's values must visibly move
#: for a resumed attempt to show whether it restored them).
PPO_LEARNING_SIGNAL = (f"{ENTROPY_COEFF}=0.01", "actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=1e-4")
#: What the report must show of a PPO run's critic (verl's metric names).
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_explained_var", "critic/values/mean")
CRITIC_TIMINGS = ("timing_s/update_critic", "timing_s/values")
#: Qwen2.5-0.5B's config.json (the shipped model profile names the same facts): only the weights are random.
QWEN25_05B_ARCH: dict[str, Any] = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "vocab_size": 151936, "hidden_act": "silu",
}
RESUME_TOTAL, RESUME_KILL_AFTER = 6, 3


@dataclass
class Result:
    scenario: str
    ok: bool = True
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def check(self, condition: bool, what: str) -> bool:
        if not condition:
            self.ok = False
            self.failures.append(what)
        return condition

    def line(self, **extra: Any) -> str:
        """The result as one JSON line (what the script prints per scenario)."""
        return json.dumps({"scenario": self.scenario, "ok": self.ok, "failures": self.failures,
                           "figures": self.figures, **extra}, default=str)


# -- the machine ----------------------------------------------------------------------------------

def gpu_memory_mib() -> list[int]:
    """Each visible GPU's memory (MiB) from nvidia-smi; [] when there is no NVIDIA GPU or driver."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [int(float(x)) for x in out.stdout.split() if x.strip()]


def missing_gpu_packages() -> list[str]:
    import importlib.util

    return [name for name in ("vllm", "verl", "airflow", "ray") if importlib.util.find_spec(name) is None]


def write_configs(workdir: Path, memory_mib: list[int], *, caches: Path | None = None) -> Path:
    """A copy of configs/ whose ``local-gpu`` cluster profile describes this machine's GPUs (and keeps
    the workers' warm caches in ``caches``, shared by every scenario's run, when given)."""
    import yaml

    configs = workdir / "configs"
    if configs.exists():
        shutil.rmtree(configs)
    shutil.copytree(REPO / "configs", configs)
    path = configs / "clusters" / "local-gpu.yaml"
    prof = yaml.safe_load(path.read_text())
    n, cpus = len(memory_mib), os.cpu_count() or 16
    prof["cluster"].update(num_gpus=n, num_cpus=cpus)
    prof["hardware"].update(n_gpus_per_node=n, gpu_memory_gb=round(min(memory_mib) / 1024), cpus_per_node=cpus)
    if caches is not None:  # on this machine's disk, which every (local) node sees, as the runs' homes are
        prof.setdefault("storage", {}).update(caches=str(caches), shared=[str(caches), str(workdir)])
    path.write_text(yaml.safe_dump(prof, sort_keys=False))
    return configs


def write_real_size_model(dest: Path) -> Path:
    """Random weights in Qwen2.5-0.5B's architecture, with the built-in model's tokenizer grown to its
    vocabulary (ids past the trained ones decode to ``<extra_N>``: a random model samples them)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl_pipeline.models.tiny import build_tiny_model

    tiny = build_tiny_model(dest.parent / "tiny-for-tokenizer")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, tmp / f.name)
    tok = json.loads((tmp / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    used = len(vocab) + sum(1 for t in tok.get("added_tokens", []) if t["content"] not in vocab)
    for i in range(used, QWEN25_05B_ARCH["vocab_size"]):
        vocab[f"<extra_{i}>"] = i
    (tmp / "tokenizer.json").write_text(json.dumps(tok))
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    config = Qwen2Config(**QWEN25_05B_ARCH, **{k: tiny_cfg[k] for k in ("eos_token_id", "pad_token_id",
                                                                      "bos_token_id")})
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, dest)
    return dest


# -- running the DAG --------------------------------------------------------------------------------

@dataclass
class DagRun:
    home: Path
    airflow_home: Path
    log: Path
    rc: int = -1
    seconds: float = 0.0

    def env(self, configs: Path) -> dict[str, str]:
        return {**os.environ, "AIRFLOW_HOME": str(self.airflow_home), "VERL_PIPELINE_HOME": str(self.home),
                "VERL_PIPELINE_CONFIGS": str(configs), "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "HF_HUB_OFFLINE": "1"}

    def run_dir(self) -> Path | None:
        runs = sorted((self.home / "runs").glob("*/job.json"))
        return runs[0].parent if runs else None


def cold_caches(root: Path) -> dict[str, str]:
    """Environment that gives a run compile and autotune caches of its own, empty at its start: every cache
    the pipeline's warm starts keep (``trainer/warmstart.CACHE_DIRS``: vLLM's torch.compile cache, inductor,
    Triton, CUDA's JIT cache, flashinfer) and the rest of ``~/.cache``. Two runs compared on one machine then
    both start as a first run does, whichever went first. A DAG run's job keeps its caches under the run's
    storage (its runtime_env sets them over these), which each scenario starts empty."""
    from verl_pipeline.trainer.nodes.warmstart import CACHE_DIRS

    return {"XDG_CACHE_HOME": str(root), **{var: str(root / sub) for var, sub in CACHE_DIRS.items()}}


def run_dag(workdir: Path, configs: Path, name: str, conf: dict[str, Any],
            during: Callable[[DagRun], None] | None = None, extra_env: dict[str, str] | None = None) -> DagRun:
    run = DagRun(home=workdir / name / "home", airflow_home=workdir / name / "airflow", log=workdir / f"{name}.log")
    shutil.rmtree(workdir / name, ignore_errors=True)
    run.airflow_home.mkdir(parents=True)
    env = {**run.env(configs), **(extra_env or {})}  # the local Ray head, and so the job, inherits it
    subprocess.run(["airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    t0 = time.monotonic()
    with run.log.open("w") as log:
        proc = subprocess.Popen(["airflow", "dags", "test", DAG_ID, "-c", json.dumps(conf)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if during is not None:
            during(run)
        run.rc = proc.wait()
    run.seconds = time.monotonic() - t0
    return run


def _airflow_json(run: DagRun, configs: Path, *args: str) -> Any:
    """An ``airflow … -o json`` command's answer (Airflow logs warnings to stdout before it)."""
    out = subprocess.run(["airflow", *args, "-o", "json"], env=run.env(configs), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("[")))


def task_states(run: DagRun, configs: Path) -> dict[str, str]:
    run_id = _airflow_json(run, configs, "dags", "list-runs", DAG_ID)[0]["run_id"]
    tasks = _airflow_json(run, configs, "tasks", "states-for-dag-run", DAG_ID, run_id)
    return {t["task_id"]: t["state"] for t in tasks}


# -- reading a finished run -------------------------------------------------------------------------

def job_overrides(run_dir: Path) -> dict[str, str]:
    job = json.loads((run_dir / "job.json").read_text())
    return dict(o.lstrip("+").split("=", 1) for o in job["overrides"])


def training_row(line: str) -> dict[str, float] | None:
    """One line of a verl metrics file as a training step's row (its metrics and ``step``), or None: a
    validation-only row, or a line cut short."""
    from verl_pipeline.jobs.progress import parse_jsonl_row
    from verl_pipeline.trainer import metrics as m

    parsed = parse_jsonl_row(line)
    if parsed is None or m.is_validation_only(parsed[1]):
        return None
    return {**parsed[1], "step": parsed[0]}


def training_rows(metrics: Path) -> list[dict[str, float]]:
    """The training steps' rows of one verl metrics file (validation-only rows and cut lines skipped)."""
    lines = metrics.read_text(errors="replace").splitlines() if metrics.exists() else []
    return [row for line in lines if (row := training_row(line)) is not None]


def steady_step_s(rows: list[dict[str, float]]) -> float | None:
    """Median ``timing_s/step`` after the first step (which pays warm-up: CUDA graphs, caches)."""
    from verl_pipeline.trainer import metrics as m

    values = [r[m.TIMING_STEP] for r in rows[1:] if m.TIMING_STEP in r]
    return statistics.median(values) if values else None


def check_export(result: Result, model_dir: Path, base_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    exported, base = tensors(model_dir), tensors(base_dir)
    shared = sorted(set(exported) & set(base))
    diffs = {k: (exported[k].float() - base[k].float()).abs().max().item() for k in shared
             if exported[k].shape == base[k].shape}
    changed = sum(1 for v in diffs.values() if v > 0)
    result.figures.update(export_tensors=len(shared), export_tensors_changed=changed,
                          export_max_abs_diff=max(diffs.values(), default=0.0))
    result.check(changed > 0, f"the exported weights equal the base model's ({len(shared)} tensors compared)")
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("1 + 1 =", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    result.check(torch.as_tensor(out).shape[-1] > ids["input_ids"].shape[-1], "the exported model generated nothing")


def actor_lines(report: dict[str, Any]) -> list[list[str] | None]:
    """Each attempt's start by class of Ray actor, as the task log says it (None: not recorded): where
    the start's phases spent their seconds (waiting, process start, class load, ``__init__``)."""
    from verl_pipeline.jobs.startup.actors import ActorStart, by_class

    return [None if a.get("actors") is None else [g.text() for g in by_class(ActorStart(**x) for x in a["actors"])]
            for a in report.get("attempts", [])]


def check_trained_run(result: Result, run: DagRun, configs: Path, total: int) -> Path | None:
    """The checks every training scenario shares: tasks, steps, checkpoints, report numbers."""
    from verl_pipeline.rundir import RunDir, tracker_step
    from verl_pipeline.trainer import metrics as m

    result.figures["dag_seconds"] = round(run.seconds, 1)
    if not result.check(run.rc == 0, f"airflow dags test exited {run.rc} (log: {run.log})"):
        return None
    states = task_states(run, configs)
    result.figures["tasks"] = states
    result.check(all(s == "success" for s in states.values()), f"tasks not successful: {states}")
    run_dir = run.run_dir()
    if not result.check(run_dir is not None, "no run directory with a job.json"):
        return None
    assert run_dir is not None
    rd = RunDir(run_dir)
    ckpt = Path(job_overrides(run_dir)["trainer.default_local_dir"])
    steps_seen = sorted({int(r["step"]) for f in rd.metrics_files().values() for r in training_rows(f)})
    result.figures["steps_logged"] = steps_seen
    result.check(steps_seen == list(range(1, total + 1)), f"steps logged {steps_seen}, want 1..{total}")
    saved = sorted(int(p.name.removeprefix("global_step_")) for p in ckpt.glob("global_step_*"))
    result.figures["checkpoints"] = saved
    result.check(tracker_step(ckpt) == total, f"checkpoint tracker says {tracker_step(ckpt)}, want {total}")
    report = json.loads((rd.report_dir / "report.json").read_text())
    shares = report.get("phase_share") or {}
    figures = {k: report.get(k) for k in ("throughput_per_gpu", "time_per_step_s", "mfu_actor",
                                          "peak_memory_allocated_gb", "peak_memory_reserved_gb", "wall_time_s")}
    figures["phase_share_total"] = round(sum(shares.values()), 3)
    figures["time_to_first_step_s"] = [a.get("time_to_first_step_s") for a in report.get("attempts", [])]
    figures["flags"] = [f.get("kind") for f in report.get("flags", [])]
    # Each attempt's start by phase (None: the line that ends it was not seen: jobs/startup/markers.py).
    figures["startup_s"] = [{p["phase"]: p["duration_s"] for p in a.get("startup", [])}
                            for a in report.get("attempts", [])]
    figures["actor_starts"] = actor_lines(report)
    result.check(all(lines for lines in figures["actor_starts"]),
                 f"an attempt has no record of how its Ray actors started: {figures['actor_starts']}")
    figures["gpus"] = report.get("gpus")
    rows = [r for f in rd.metrics_files().values() for r in training_rows(f)]
    figures["steady_step_s"] = steady_step_s(rows)
    # Per step, so that a change to the rollout engine (its executor, its start) is judged by it.
    figures["rollout_vs_actor"] = {int(r["step"]): [r.get(k) for k in m.ROLLOUT_VS_ACTOR] for r in rows}
    result.figures.update(figures)
    for key in ("throughput_per_gpu", "time_per_step_s", "peak_memory_allocated_gb"):
        result.check(bool(report.get(key)), f"the report has no {key}")
    share = figures["phase_share_total"]
    result.check(0 < share <= 1.0 + 1e-6, f"phase shares add up to {share}")
    result.check(rd.gpu_usage_file.exists() and bool(report.get("gpus")),
                 f"no GPU readings recorded ({rd.gpu_usage_file}) or none in the report")
    if zero_gradient_expected(job_overrides(run_dir), rows):
        result.figures["zero_gradient_expected"] = True  # said, not failed: see zero_gradient_expected
    else:
        result.check("grad_norm_zero" not in figures["flags"], "the report flags a gradient norm that stayed 0")
    return run_dir


def zero_gradient_expected(overrides: dict[str, str], rows: list[dict[str, float]]) -> bool:
    """Whether a zero gradient is what the run should get: no entropy bonus (unset: verl's default has
    none) and every advantage 0, as a random model that scores 0 on every answer gets under GRPO (the
    0.5B architecture, 2026-12-05). With an entropy bonus or any non-zero advantage, a zero gradient is
    a broken run."""
    from verl_pipeline.trainer import metrics as m

    bonus = float(overrides.get(ENTROPY_COEFF) or 0)
    advantages = [r[k] for r in rows for k in (m.ADVANTAGES_MIN, m.ADVANTAGES_MAX) if k in r]
    return bonus == 0 and bool(advantages) and not any(advantages)


# -- the scenarios ----------------------------------------------------------------------------------

def base_conf(args: argparse.Namespace, total: int | None, *, ppo: bool = False,
              profile: str = PROFILE) -> dict[str, Any]:
    """A scenario's DAG params (``total`` None: the profile's own steps)."""
    conf: dict[str, Any] = {"profile": profile, "mode": "train", "verl_overrides": list(args.verl_override)}
    if total is not None:
        conf["total_training_steps"] = total
    if ppo:
        conf["model_profile"] = PPO_MODEL_PROFILE
        conf["verl_overrides"] += list(PPO_LEARNING_SIGNAL)
    if args.gpu_memory_utilization:
        # Several scenarios side by side on one GPU: each vLLM must find its share free at start-up.
        conf["verl_overrides"].append(f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}")
    return conf


def acceptance(args: argparse.Namespace, configs: Path) -> Result:
    result = Result("acceptance")
    run = run_dag(args.workdir, configs, "acceptance", base_conf(args, args.steps))
    run_dir = check_trained_run(result, run, configs, args.steps)
    if run_dir is not None:
        from verl_pipeline.rundir import RunDir

        check_export(result, RunDir(run_dir).model_dir, Path(job_overrides(run_dir)["actor_rollout_ref.model.path"]))
    return result


def learn(args: argparse.Namespace, configs: Path, name: str) -> Result:
    """The example task trained as its profile says: the report's learning verdict must say it learned, and
    the greedy validation reward must have risen by ``VALIDATION_RISE``."""
    import yaml

    result = Result(name)
    profile = LEARN_PROFILES[name]
    total = int(yaml.safe_load((configs / "profiles" / f"{profile}.yaml").read_text())["trainer"]
                ["total_training_steps"])
    run = run_dag(args.workdir, configs, name, base_conf(args, None, profile=profile))
    run_dir = check_trained_run(result, run, configs, total)
    if run_dir is None:
        return result
    from verl_pipeline.report.plots import REWARD_PNG
    from verl_pipeline.rundir import RunDir

    rd = RunDir(run_dir)
    verdict = json.loads((rd.report_dir / "report.json").read_text()).get("learning") or {}
    result.figures["learning"] = verdict
    result.check(verdict.get("learned") is True, f"the report says the run did not learn: {verdict.get('words')}")
    first, last = verdict.get("validation_first"), verdict.get("validation_last")
    rise = None if first is None or last is None else round(last - first, 4)
    result.figures["validation_rise"] = rise
    result.check(rise is not None and rise >= VALIDATION_RISE,
                 f"the validation reward rose {rise} ({first} to {last}), want at least {VALIDATION_RISE}")
    if (rd.report_dir / REWARD_PNG).is_file():
        shutil.copy(rd.report_dir / REWARD_PNG, args.workdir / f"{name}-reward.png")
    return result


def lora(args: argparse.Namespace, configs: Path) -> Result:
    result = Result("lora")
    conf = base_conf(args, args.steps)
    conf["verl_overrides"] += list(LORA)
    run = run_dag(args.workdir, configs, "lora", conf)
    run_dir = check_trained_run(result, run, configs, args.steps)
    if run_dir is not None:
        from verl_pipeline.rundir import RunDir
        from verl_pipeline.trainer.lora_merge import ADAPTER_DIR

        model_dir = RunDir(run_dir).model_dir
        result.check((model_dir / ADAPTER_DIR).is_dir(), f"the export has no {ADAPTER_DIR}/ (was the run LoRA?)")
        check_export(result, model_dir, Path(job_overrides(run_dir)["actor_rollout_ref.model.path"]))
    return result


def check_critic(result: Result, run_dir: Path, total: int) -> None:
    """A PPO run's critic: a checkpoint every step beside the actor's, and the report's critic section and plot."""
    from verl_pipeline.rundir import RunDir

    ckpt = Path(job_overrides(run_dir)["trainer.default_local_dir"])
    with_critic = sorted(int(p.parent.name.removeprefix("global_step_")) for p in ckpt.glob("global_step_*/critic")
                         if any(p.iterdir()))
    result.figures["critic_checkpoints"] = with_critic
    result.check(with_critic == list(range(1, total + 1)),
                 f"critic checkpoints at steps {with_critic}, want 1..{total}")
    rd = RunDir(run_dir)
    critic = json.loads((rd.report_dir / "report.json").read_text()).get("critic") or {}
    trends, timing = critic.get("trends") or {}, critic.get("timing_s") or {}
    result.figures["critic"] = {"trends": trends, "timing_s": timing, "share_of_step": critic.get("share_of_step")}
    result.check(all(k in trends for k in CRITIC_METRICS) and all(k in timing for k in CRITIC_TIMINGS),
                 f"the report's critic section lacks some of {CRITIC_METRICS + CRITIC_TIMINGS}: {critic}")
    result.check((rd.report_dir / "critic.png").is_file(), "the report has no critic plot")
    result.figures["critic_per_step"] = critic_per_step([r for f in rd.metrics_files().values()
                                                         for r in training_rows(f)])


def critic_per_step(rows: list[dict[str, float]]) -> dict[int, dict[str, float | None]]:
    """The critic's figures of each step (a later row of a step wins: a resumed attempt's)."""
    return {int(r["step"]): {k: r.get(k) for k in CRITIC_METRICS} for r in rows}


def check_export_is_actor(result: Result, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    result.figures["export_architectures"] = config.get("architectures")
    result.check(any(a.endswith("ForCausalLM") for a in config.get("architectures") or []),
                 f"the export is not the actor (a causal LM): {config.get('architectures')}")


def ppo(args: argparse.Namespace, configs: Path) -> Result:
    result = Result("ppo")
    run = run_dag(args.workdir, configs, "ppo", base_conf(args, args.steps, ppo=True))
    run_dir = check_trained_run(result, run, configs, args.steps)
    if run_dir is not None:
        from verl_pipeline.rundir import RunDir

        check_critic(result, run_dir, args.steps)
        model_dir = RunDir(run_dir).model_dir
        check_export_is_actor(result, model_dir)
        check_export(result, model_dir, Path(job_overrides(run_dir)["actor_rollout_ref.model.path"]))
        if args.twin:
            add_twin(result, args.workdir, run_dir)
    return result


def real_size(args: argparse.Namespace, configs: Path) -> Result:
    result = Result("real-size")
    model = write_real_size_model(args.workdir / "models" / "qwen2.5-0.5b-arch-random")
    conf = {**base_conf(args, args.steps), "model_profile": args.real_size_profile, "model_source": str(model)}
    conf["verl_overrides"] = [o for o in conf["verl_overrides"] if "gpu_memory_utilization" not in o]
    # A repeated run keeps the earlier one's log and run directory beside its own.
    args.real_size_runs = getattr(args, "real_size_runs", 0) + 1
    name = "real-size" if args.real_size_runs == 1 else f"real-size-{args.real_size_runs}"
    run = run_dag(args.workdir, configs, name, conf, extra_env=cold_caches(args.workdir / f"{name}-caches"))
    run_dir = check_trained_run(result, run, configs, args.steps)
    if run_dir is None:
        return result
    if args.real_size_profile != REAL_SIZE_MODEL_PROFILE:  # PPO: its critic trained and is reported
        check_critic(result, run_dir, args.steps)
    if args.no_bare:
        free_checkpoints(Path(job_overrides(run_dir)["trainer.default_local_dir"]))
    else:
        add_twin(result, args.workdir, run_dir)
    return result


def add_twin(result: Result, workdir: Path, run_dir: Path) -> None:
    """The checked DAG run's bare-verl twin in ``workdir``/bare, run after it once the DAG run's checkpoints
    are deleted (cold caches of its own too, see bare_verl): its figures, the steady s/step ratio (DAG /
    bare) and the gap between their times to the first step."""
    print(result.line(before="its bare-verl twin"), flush=True)  # on record should the twin not end
    # Checked: the twin needs the disk (the 0.5B PPO run's 3 actor and critic checkpoints took about 36 GB
    # of the GPU machine's 64 GB, and the twin's first save found it full on 2026-12-05).
    free_checkpoints(Path(job_overrides(run_dir)["trainer.default_local_dir"]))
    bare = bare_verl(workdir / "bare", run_dir)
    result.figures["bare"] = bare
    dag_first = result.figures["time_to_first_step_s"][0] if result.figures.get("time_to_first_step_s") else None
    if bare.get("steady_step_s") and result.figures.get("steady_step_s"):
        result.figures["steady_step_ratio"] = round(result.figures["steady_step_s"] / bare["steady_step_s"], 4)
    if bare.get("time_to_first_step_s") and dag_first:
        result.figures["first_step_delta_s"] = round(dag_first - bare["time_to_first_step_s"], 1)
    result.check(bare["rc"] == 0, f"bare verl exited {bare['rc']}{' at its deadline' if bare['timed_out'] else ''} "
                                  f"(log: {bare['log']})")


def free_checkpoints(ckpt: Path) -> None:
    """Delete the step folders of a checked run's checkpoints (verl's tracker file stays)."""
    for step in ckpt.glob("global_step_*"):
        shutil.rmtree(step, ignore_errors=True)


#: What bare verl runs: its trainer's module, after the Python that runs this script.
BARE_TRAINER = ("-m", "verl.trainer.main_ppo")
#: How long bare verl gets to end by itself once a training worker of it is killed, before the twin ends it:
#: a run that hangs on a dead worker is what the pipeline's hang watch is for, and bare verl has none.
BARE_EXIT_WAIT_S = 300.0
#: How long one start of bare verl may run before the twin ends it: more than twice the longest seen (the
#: 0.5B PPO twin, 382 s with 3 steps), and a bound on what a hung twin takes of a 30-minute device session.
BARE_DEADLINE_S = 900.0


def bare_setup(workdir: Path, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The DAG's job as bare verl: its overrides unchanged but for its own checkpoint directory and name,
    and its environment with cold caches of its own (the DAG run filled its own: the twin starts as cold)."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    job = json.loads((run_dir / "job.json").read_text())
    mine = {"trainer.default_local_dir": str(workdir / "checkpoints"), "trainer.experiment_name": "bare-verl"}
    overrides = []
    for o in job["overrides"]:
        key = o.split("=", 1)[0]
        overrides.append(f"{key}={mine[key]}" if key in mine else o)
    env = {**os.environ, **{k: v for k, v in job["runtime_env"].get("env_vars", {}).items()},
           **cold_caches(workdir / "caches")}
    return overrides, env


@dataclass
class BareStart:
    """One start of bare verl: its log, when it began (monotonic), its exit code and seconds, the seconds to
    its first training row, its rows, the kill when it was killed (see ``kill_in_bare``), and whether it was
    ended at its deadline."""

    log: Path
    began: float
    rc: int
    seconds: float
    first_step_s: float | None
    rows: list[dict[str, float]]
    kill: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False


def start_bare(workdir: Path, overrides: list[str], env: dict[str, str], *, name: str = "bare",
               kill_after: int | None = None, kill_kind: str = "worker", exit_wait_s: float = BARE_EXIT_WAIT_S,
               deadline_s: float = BARE_DEADLINE_S, trainer: tuple[str, ...] = BARE_TRAINER) -> BareStart:
    """Bare verl in ``workdir`` until it ends, or until ``deadline_s`` when it has not (log ``<name>.log``,
    metrics ``metrics<suffix>.jsonl``). With ``kill_after``: once step ``kill_after`` is checkpointed and
    logged, what ``kill_kind`` names in it is killed (``kill_target``'s kinds: a training worker, or the
    raylet of the Ray it started)."""
    from verl_pipeline.rundir import tracker_step

    suffix = name.removeprefix("bare")
    metrics, log, ckpt = workdir / f"metrics{suffix}.jsonl", workdir / f"{name}.log", workdir / "checkpoints"
    t0 = time.monotonic()
    first: float | None = None
    kill: dict[str, Any] = {}
    timed_out = False
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *trainer, *overrides], cwd=workdir, stdout=out,
                                env={**env, "VERL_FILE_LOGGER_PATH": str(metrics)}, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            rows = training_rows(metrics)
            if first is None and rows:
                first = time.monotonic() - t0
            # Checkpointed and logged, in whichever order verl does them: the killed attempt's loss at that
            # step is then on record, for the restart's to be compared with.
            saved, logged = tracker_step(ckpt) or 0, max((r["step"] for r in rows), default=0)
            if kill_after is not None and not kill and min(saved, logged) >= kill_after:
                kill = {"killed_at_step": saved, **kill_in_bare(proc, kill_kind, exit_wait_s)}
            elif time.monotonic() - t0 > deadline_s:
                timed_out = True
                end_tree(proc, [proc.pid, *_descendants(proc.pid)])
            time.sleep(0.5)
    rows = training_rows(metrics)
    if first is None and rows:
        first = time.monotonic() - t0
    return BareStart(log=log, began=t0, rc=proc.returncode, seconds=round(time.monotonic() - t0, 1),
                     first_step_s=None if first is None else round(first, 1), rows=rows, kill=kill,
                     timed_out=timed_out)


def kill_in_bare(proc: subprocess.Popen[Any], kind: str, exit_wait_s: float) -> dict[str, Any]:
    """SIGKILL what ``kind`` names among bare verl's processes (``proc`` and the Ray its ``ray.init`` started),
    as the resume scenarios do in the DAG's cluster; give verl ``exit_wait_s`` to end by itself, then end
    what is left of it."""
    tree = [proc.pid, *_descendants(proc.pid)]
    target = kill_target(kind, tree)
    marks: dict[str, Any] = {"killed_mono": time.monotonic()}
    if target is None:
        marks["error"] = f"no {kind} process among the {len(tree)} processes of bare verl"
    else:
        marks["killed"] = [target[0], target[1][:80]]
        with contextlib.suppress(ProcessLookupError):
            os.kill(target[0], signal.SIGKILL)
        try:
            proc.wait(timeout=exit_wait_s)
            marks["exit_after_kill_s"] = round(time.monotonic() - marks["killed_mono"], 1)
        except subprocess.TimeoutExpired:
            marks["exit_after_kill_s"] = None  # verl did not end by itself: it is ended below
    marks["left_running"] = end_tree(proc, tree)
    return marks


def end_tree(proc: subprocess.Popen[Any], known: list[int]) -> list[int]:
    """SIGKILL ``proc``'s process group, its descendants and ``known`` (listed while it ran: a process whose
    parent ended is no one's descendant), and wait until they are gone. Returns those still alive after 60 s."""
    import psutil

    pids = {proc.pid, *known, *_descendants(proc.pid)}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    proc.wait()
    _, alive = psutil.wait_procs(procs, timeout=60)
    return [p.pid for p in alive]


def bare_verl(workdir: Path, run_dir: Path) -> dict[str, Any]:
    """The DAG's job as bare verl on a Ray of its own: seconds from launch to its first training row, steady
    seconds per step."""
    start = start_bare(workdir, *bare_setup(workdir, run_dir))
    free_checkpoints(workdir / "checkpoints")
    return {"rc": start.rc, "timed_out": start.timed_out, "log": str(start.log), "seconds": start.seconds,
            "time_to_first_step_s": start.first_step_s, "steps": len(start.rows),
            "steady_step_s": steady_step_s(start.rows),
            "throughput_per_gpu": statistics.median([r.get("perf/throughput", 0.0) for r in start.rows] or [0.0])}


def bare_verl_resumed(workdir: Path, run_dir: Path, kill_after: int, *, kill_kind: str = "worker",
                      exit_wait_s: float = BARE_EXIT_WAIT_S, deadline_s: float = BARE_DEADLINE_S,
                      trainer: tuple[str, ...] = BARE_TRAINER) -> dict[str, Any]:
    """A resume scenario's twin: the DAG's job as bare verl, what ``kill_kind`` names killed once step
    ``kill_after`` is checkpointed, then started again at once with the same overrides, as a person would
    by hand (verl's ``resume_mode=auto`` finds the checkpoint). Its figures: how long verl took to end
    after the kill, the restart's time to its first step, the seconds from the kill to the first resumed
    step, and each start's steps and critic figures."""
    from verl_pipeline.rundir import tracker_step

    overrides, env = bare_setup(workdir, run_dir)
    first = start_bare(workdir, overrides, env, kill_after=kill_after, kill_kind=kill_kind, exit_wait_s=exit_wait_s,
                       deadline_s=deadline_s, trainer=trainer)
    resumed_from = tracker_step(workdir / "checkpoints") or 0  # verl may have saved another step before it ended
    restart = start_bare(workdir, overrides, env, name="bare-restart", deadline_s=deadline_s, trainer=trainer)
    kill = {k: v for k, v in first.kill.items() if k != "killed_mono"}
    recovery = None
    if "killed" in first.kill and restart.first_step_s is not None:
        recovery = round(restart.began + restart.first_step_s - first.kill["killed_mono"], 1)
    free_checkpoints(workdir / "checkpoints")
    return {"rc": first.rc, "restart_rc": restart.rc, "timed_out": [first.timed_out, restart.timed_out],
            "log": str(first.log), "restart_log": str(restart.log),
            "time_to_first_step_s": first.first_step_s, "steps": [int(r["step"]) for r in first.rows],
            "kill": kill, "resumed_from": resumed_from, "restart_time_to_first_step_s": restart.first_step_s,
            "restart_steps": [int(r["step"]) for r in restart.rows], "kill_to_resumed_step_s": recovery,
            "critic_per_step": critic_per_step(first.rows + restart.rows)}


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_target(kind: str, pids: list[int]) -> tuple[int, str] | None:
    """The first of ``pids`` that ``kind`` names ("raylet", or "worker": verl's colocated training workers,
    the Ray actors of class WorkerDict), with its command line. A process that ends between the listing and
    the read is skipped: on 2026-12-05 one did, and the scenario died with NoSuchProcess before any kill."""
    import psutil

    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name, cmdline = proc.name(), " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if (name == "raylet") if kind == "raylet" else ("WorkerDict" in cmdline):
            return pid, cmdline
    return None


def _kill_after_checkpoint(kind: str, marks: dict[str, Any]) -> Callable[[DagRun], None]:
    """Wait until attempt 1 checkpointed RESUME_KILL_AFTER, then SIGKILL what ``kind`` names in its cluster."""
    from verl_pipeline.rundir import RunDir, tracker_step

    def during(run: DagRun) -> None:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            run_dir = run.run_dir()
            if run_dir is not None:
                ckpt = Path(job_overrides(run_dir)["trainer.default_local_dir"])
                if (tracker_step(ckpt) or 0) >= RESUME_KILL_AFTER:
                    break
            time.sleep(1)
        else:
            marks["error"] = "attempt 1 never checkpointed"
            return
        assert run_dir is not None
        cluster = RunDir(run_dir).cluster() or {}
        roots = [int(n["pgid"]) for n in (cluster.get("extra") or {}).get("nodes", [])]
        pids = [p for r in roots for p in [r, *_descendants(r)]]
        target = kill_target(kind, pids)
        marks.update(killed=[] if target is None else [(target[0], target[1][:80])],
                     killed_at_step=tracker_step(ckpt), killed_at=round(time.time(), 1))
        if target is None:
            marks["error"] = f"no {kind} process found among {len(pids)} cluster processes"
            return
        with contextlib.suppress(ProcessLookupError):  # ended by itself: the attempts check then fails
            os.kill(target[0], signal.SIGKILL)

    return during


def check_critic_restored(result: Result, per_step: dict[int, dict[str, float | None]], resumed_from: int, *,
                          who: str = "") -> None:
    """The resumed attempt's critic went on from the checkpoint: its value loss at the first resumed step
    lies nearer the last step before it than the run's first step (a critic started again from its
    initial weights gives the first step's loss back). The values' mean is kept beside it as a figure
    (``critic_restored``, or ``<who>_critic_restored``); ``who`` also names the run in a failure."""
    figures: dict[str, Any] = {}
    for name in ("critic/vf_loss", "critic/values/mean"):
        at = {s: (row or {}).get(name) for s, row in per_step.items()}
        figures[name] = {f"step_{s}": at.get(s) for s in (1, resumed_from, resumed_from + 1)}
    result.figures[f"{who}_critic_restored" if who else "critic_restored"] = figures
    loss = {s: (row or {}).get("critic/vf_loss") for s, row in per_step.items()}
    first, before, after = loss.get(1), loss.get(resumed_from), loss.get(resumed_from + 1)
    run = f"{who}: " if who else ""
    if not result.check(None not in (first, before, after), f"{run}critic/vf_loss missing at steps 1, "
                                                             f"{resumed_from}, {resumed_from + 1}: {loss}"):
        return
    assert first is not None and before is not None and after is not None
    result.check(abs(before - first) > 0, f"{run}the critic's loss did not move before the kill: nothing to tell apart")
    result.check(abs(after - before) < abs(after - first),
                 f"{run}the resumed critic's loss ({after:.4g}) is nearer step 1's ({first:.4g}) than step "
                 f"{resumed_from}'s ({before:.4g}): it started again instead of restoring its checkpoint")


def resume(args: argparse.Namespace, configs: Path, kind: str) -> Result:
    from verl_pipeline.rundir import RunDir

    result = Result(f"resume-{kind}")
    marks: dict[str, Any] = {}
    run = run_dag(args.workdir, configs, f"resume-{kind}", base_conf(args, RESUME_TOTAL, ppo=kind == "ppo"),
                  during=_kill_after_checkpoint("raylet" if kind == "raylet" else "worker", marks))
    result.figures["kill"] = marks
    result.check("error" not in marks, str(marks.get("error")))
    run_dir = check_trained_run(result, run, configs, RESUME_TOTAL)
    if run_dir is None:
        return result
    rd = RunDir(run_dir)
    attempts = rd.attempts()
    result.figures["attempts"] = [(a.attempt, a.resume_from_step) for a in attempts]
    last = attempts[-1]
    if "killed_at" in marks:  # the failure's cost before training resumes: detection, retry delay, provision, probe
        result.figures["kill_to_resubmit_s"] = round(last.submitted_at - marks["killed_at"], 1)
    result.check(len(attempts) >= 2 and last.resume_from_step >= RESUME_KILL_AFTER,
                 f"attempts {result.figures['attempts']}: the last should resume from step ≥ {RESUME_KILL_AFTER}")
    # A killed worker spares the node: the restart reuses attempt 1's probe (jobs/reprobe.py); a lost raylet is a
    # new Ray node, which is probed again.
    probes = [str(d.get("rules", {}).get("probe", "")).split("' — ")[0].lstrip("'") for d in rd.decisions()]
    result.figures["probes"] = probes
    if kind != "raylet" and len(probes) >= 2:
        result.check(probes[-1].startswith("reused probe job"),
                     f"the restart after a killed worker probed the node again ({probes[-1]}): the node's GPU "
                     "UUIDs (torch's, NVML's in Ray's node summary) may not have matched")
    steps = sorted(int(r["step"]) for r in training_rows(rd.metrics_file(last.attempt)))
    result.figures["last_attempt_steps"] = steps
    result.check(steps == list(range(last.resume_from_step + 1, RESUME_TOTAL + 1)),
                 f"the last attempt trained steps {steps}, want {last.resume_from_step + 1}..{RESUME_TOTAL}")
    if kind == "ppo":
        check_critic(result, run_dir, RESUME_TOTAL)
        check_critic_restored(result, result.figures["critic_per_step"], last.resume_from_step)
        check_export_is_actor(result, rd.model_dir)
        check_export(result, rd.model_dir, Path(job_overrides(run_dir)["actor_rollout_ref.model.path"]))
    if args.twin:
        add_resume_twin(result, args.workdir, run_dir, ppo=kind == "ppo",
                        kill_kind="raylet" if kind == "raylet" else "worker")
    return result


def add_resume_twin(result: Result, workdir: Path, run_dir: Path, *, ppo: bool, **bare: Any) -> None:
    """The checked resume run's bare-verl twin in ``workdir``/bare (``bare_verl_resumed``; ``bare`` goes to
    it): the restart trains the steps after the kill only (and with a critic, restores it), and what
    recovery cost each: the seconds from the kill to the first resumed step, the DAG's (its retry:
    detection, retry delay, provision, probe, submission, start) against a restart by hand at once."""
    print(result.line(before="its bare-verl twin"), flush=True)  # on record should the twin not end
    twin = bare_verl_resumed(workdir / "bare", run_dir, RESUME_KILL_AFTER, **bare)
    result.figures["bare"] = twin
    kill = twin["kill"]
    if not result.check("error" not in kill and "killed_at_step" in kill,
                        f"bare verl: nothing killed ({kill.get('error', 'no checkpoint to kill after')}"
                        f"{', ended at its deadline' if twin['timed_out'][0] else ''})"):
        return
    result.check(not kill["left_running"], f"bare verl: processes {kill['left_running']} outlived their kill")
    at = twin["resumed_from"]
    result.check(at >= kill["killed_at_step"] and twin["restart_rc"] == 0
                 and twin["restart_steps"] == list(range(at + 1, RESUME_TOTAL + 1)),
                 f"bare verl's restart from checkpoint {at} (killed after {kill['killed_at_step']}) exited "
                 f"{twin['restart_rc']}{' at its deadline' if twin['timed_out'][1] else ''} having trained steps "
                 f"{twin['restart_steps']}, want {at + 1}..{RESUME_TOTAL} (log: {twin['restart_log']})")
    if ppo:
        check_critic_restored(result, twin["critic_per_step"], at, who="bare")
    first = (result.figures.get("time_to_first_step_s") or [None])[-1]
    if twin["kill_to_resumed_step_s"] is not None and result.figures.get("kill_to_resubmit_s") is not None and first:
        dag = round(result.figures["kill_to_resubmit_s"] + first, 1)
        result.figures["kill_to_resumed_step_s"] = dag
        result.figures["recovery_delta_s"] = round(dag - twin["kill_to_resumed_step_s"], 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default: acceptance")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "verl-gpu-acceptance")
    p.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    p.add_argument("--steps", type=int, default=4, help="training steps of the acceptance and real-size runs")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="cap vLLM's share of the GPU (tiny-model scenarios), so several runs share one GPU")
    p.add_argument("--no-bare", action="store_true", help="real-size: skip the bare-verl twin")
    p.add_argument("--twin", action="store_true",
                   help="ppo and resume-*: run its bare-verl twin after it (a resume twin is killed after the same "
                        "checkpoint and started again by hand); real-size runs one unless --no-bare")
    p.add_argument("--real-size-profile", default=REAL_SIZE_MODEL_PROFILE, choices=REAL_SIZE_PROFILES,
                   help="real-size: the 0.5B model profile (GRPO, or PPO with a critic)")
    p.add_argument("--shared-caches", type=Path, default=None, metavar="DIR",
                   help="keep every run's warm caches in DIR (the cluster profile's storage.caches), so a later "
                        "scenario (or the same one named again) starts as a repeated run on one cluster does")
    p.add_argument("--verl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="repeatable: a verl override for every scenario's DAG run (the bare-verl twin runs the "
                        "DAG job's overrides, so it gets them too), e.g. to try a setting against a run without it")
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    memory = gpu_memory_mib()
    if not memory:
        print("gpu_acceptance: no NVIDIA GPU on this machine (nvidia-smi found none): nothing to run")
        return 0
    missing = missing_gpu_packages()
    if missing:
        print(f"gpu_acceptance: {len(memory)} GPU(s) but {', '.join(missing)} not importable: "
              "pip install -r requirements/gpu.txt (README: Building the GPU image)")
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    configs = write_configs(args.workdir, memory, caches=args.shared_caches.resolve() if args.shared_caches else None)
    results = []
    for i, name in enumerate(args.scenario or ["acceptance"]):
        t0 = time.monotonic()
        if name == "acceptance":
            r = acceptance(args, configs)
        elif name == "ppo":
            r = ppo(args, configs)
        elif name == "real-size":
            r = real_size(args, configs)
        elif name in LEARN_PROFILES:
            r = learn(args, configs, name)
        elif name == "lora":
            r = lora(args, configs)
        else:
            r = resume(args, configs, name.removeprefix("resume-"))
        r.figures["scenario_seconds"] = round(time.monotonic() - t0, 1)
        if (args.scenario or []).count(name) > 1:  # a scenario named again (a repeated run): tell them apart
            r.scenario = f"{name}#{(args.scenario or [])[:i + 1].count(name)}"
        results.append(r)
        print(r.line(), flush=True)
    if args.out:
        args.out.write_text(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
