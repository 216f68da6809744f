"""A stand-in for ``python -m verl.trainer.main_ppo`` on a CPU-only Ray cluster (verl cannot train on CPU).

It behaves like verl's trainer where the pipeline depends on it:
- takes the same Hydra overrides (parsed with Hydra's own override parser);
- runs each step's work on worker actors placed on the cluster's worker nodes
  (``local_worker_node`` resource), created once like verl's worker groups and never restarted:
  when their node dies, the next call fails with Ray's ActorDiedError and the job fails;
- honours ``trainer.resume_mode`` (``auto``: resume from ``latest_checkpointed_iteration.txt`` in the
  absolute ``trainer.default_local_dir``; ``disable``: start over; ``resume_path``: from that dir);
- saves in verl's FSDP layout and order (``_save_checkpoint`` + ``FSDPCheckpointManager``): per rank
  ``actor/{model,optim,extra_state}_world_size_{W}_rank_{r}.pt`` (W = ``trainer.nnodes`` x
  ``trainer.n_gpus_per_node``), ``actor/fsdp_config.json``, the same under ``critic/`` when the run
  uses a critic (verl's rule: ``critic.enable``, else GAE), then ``data.pt``, then the tracker file
  (written in place, like verl), every ``trainer.save_freq`` steps and at the last step; keeps as many of
  its own saves as ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` say (:class:`Retention`);
- with ``trainer.use_v1=false`` (verl's legacy trainer, the only one of verl 0.9.1 that does), also
  saves when verl's own ``should_save_ckpt_esi`` says the allocation ends before another step and
  a save would fit (``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``, ``trainer.esi_redundant_time``),
  printing verl's "Force saving checkpoint" line;
- logs verl's metric names per step as JSON lines ``{"step": N, "data": {...}}`` to
  ``$VERL_FILE_LOGGER_PATH`` and to every other backend of ``trainer.logger`` (``mlflow``, ``wandb`` …)
  through verl's own ``Tracking`` (its module loaded by :func:`verl_pipeline.trackers.verl_tracking`,
  without the torch import of ``import verl``), created with verl's arguments (project, experiment,
  backends, the config as a nested dict) in a Ray actor on the driver's node, as verl creates it in
  its TaskRunner actor: a worker process, where the job's ``worker_process_setup_hook`` has loaded
  the tracker credentials; ``console`` lines are printed in the format of verl's ``LocalLogger``
  (``step:N - key:np.float64(value) - …``) by the driver, as verl's console logger imports torch;
- prints the lines verl and vLLM print while a job starts, in their order (:func:`startup_lines`:
  the markers of ``verl_pipeline.jobs.startup.markers``), and ``Training from scratch`` or
  ``Resuming from …``;
- exits non-zero with a traceback on failure.
Extra knobs for tests (not verl keys): ``+fake.step_seconds``, ``+fake.fail_at_step`` (raise a
ValueError in the driver, a user error), ``+fake.bad_key`` (a config error before training), and
``+fake.gate_file`` + ``+fake.gate_after_step``: after logging that step the trainer waits until the
gate file exists (at most ``GATE_MAX_WAIT_S``), so a test can act mid-run without racing the steps;
``+fake.hang_after_step`` + ``+fake.hang_once_file``: after that step, once per run (the file marks it),
the driver waits on its workers' next call, which never returns — a hang with every node alive.
``+fake.die_in_save_at_step`` + ``+fake.die_after_files``: the save of that step is killed (SIGKILL
to the trainer itself) after writing that many of its files, as a node lost mid-save; a count past
the last file kills it inside the tracker's write (the tracker is left empty).
``+fake.die_before_first_step=true``: every attempt SIGKILLs its own driver once its workers are up,
before its first step (as the kernel's OOM killer ends a trainer loading more than the host holds):
an infrastructure failure that never makes progress.
``+fake.real_fsdp=true``: each save's ``actor/`` is a real FSDP checkpoint of
``actor_rollout_ref.model.path`` (torch FSDP2 on CPU, ``trainer.nnodes`` x ``trainer.n_gpus_per_node``
ranks, saved by verl's ``FSDPCheckpointManager``, see ``tests/fakes/fsdp_checkpoint.py``), trained
on from the checkpoint the run resumed or last saved; ~20 s per save, so only the tests that merge it ask.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

GATE_MAX_WAIT_S = 900.0


def parse(argv: list[str]) -> dict[str, Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out: dict[str, Any] = {}
    for item in argv:
        o = parser.parse_override(item)
        out[o.key_or_group.lstrip("+")] = o.value()
    return out


def _killed(when: str = "mid-save") -> None:
    print(f"killed {when}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(ckpt: Path, step: int, *, world: int, critic: bool, die_after: int | None = None,
                    real: Any = None) -> None:
    """verl's files in verl's order; ``die_after``: SIGKILL after that many of them; ``real``: an
    ``FsdpJob`` whose ranks write ``actor/`` and ``data.pt`` for real first."""
    folder = ckpt / f"global_step_{step}"
    if real is not None:
        from tests.fakes.fsdp_checkpoint import write_checkpoint

        write_checkpoint(replace(real, step_dir=str(folder), global_step=step))
    files = []
    for role in ("actor", "critic") if critic else ("actor",):
        for rank in range(world):
            files += [folder / role / f"{prefix}_world_size_{world}_rank_{rank}.pt"
                      for prefix in ("model", "optim", "extra_state")]
        files.append(folder / role / "fsdp_config.json")
    files.append(folder / "data.pt")
    if real is not None:
        files = [f for f in files if f.parent.name != "actor" and f.name != "data.pt"]
    for n, path in enumerate(files):
        if die_after is not None and n >= die_after:
            _killed()
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"FSDP_version": 1, "world_size": world} if path.name == "fsdp_config.json" else {"step": step}
        path.write_text(json.dumps(body))
    with open(ckpt / "latest_checkpointed_iteration.txt", "w") as f:  # in place, as verl writes it
        if die_after is not None:
            _killed()
        f.write(str(step))
    print(f"Saved checkpoint {folder}", flush=True)


class Retention:
    """verl's checkpoint retention (``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``; unset or 0:
    keep all), as its checkpoint manager does it: it knows only the saves of this process, makes room before
    a save (down to one fewer, for 2 or more) and prunes after it, removing a save's role folder only (the
    step folder and its ``data.pt`` stay)."""

    def __init__(self, cfg: dict[str, Any], roles: tuple[str, ...]) -> None:
        counts = {r: cfg.get(f"trainer.max_{r}_ckpt_to_keep") for r in roles}
        self.keep = {r: int(v) if isinstance(v, int) and v > 0 else 0 for r, v in counts.items()}
        self.saved: dict[str, list[Path]] = {r: [] for r in roles}

    def before_save(self) -> None:
        for role, keep in self.keep.items():
            if keep > 1:
                self._prune(role, keep - 1)

    def after_save(self, folder: Path) -> None:
        for role, keep in self.keep.items():
            self.saved[role].append(folder / role)
            self._prune(role, keep)

    def _prune(self, role: str, left: int) -> None:
        while self.keep[role] and len(self.saved[role]) > left:
            path = self.saved[role].pop(0)
            print(f"Checkpoint manager remove previous save local path: {path}", flush=True)
            shutil.rmtree(path, ignore_errors=True)


def step_metrics(step: int, dt: float, results: list[dict[str, float]], *, world: int,
                 critic: bool) -> dict[str, float]:
    """One training step's row, under the names verl 0.9.1's trainers log."""
    scores = [r["score"] for r in results]
    mean_score = sum(scores) / len(scores)
    metrics = {
        "training/global_step": step,
        "training/epoch": 0,
        "critic/score/mean": mean_score,
        # Group-relative advantages (GRPO): each response's reward minus the group's mean; equal
        # rewards leave every advantage 0, and the actor's gradient with them (verl logs the norm as
        # actor/grad_norm: the worker's grad_norm, prefixed with the role).
        "critic/advantages/min": min(scores) - mean_score,
        "critic/advantages/max": max(scores) - mean_score,
        "actor/grad_norm": 10.0 * (max(scores) - min(scores)),
        "response_length/mean": sum(r["length"] for r in results) / len(results),
        "response_length/max": max(r["length"] for r in results),
        # verl's compute_throughout_metrics: the batch's tokens, per second and per GPU.
        "perf/total_num_tokens": 2 * 64,
        "perf/time_per_step": dt,
        "perf/throughput": 2 * 64 / (dt * world),
        # verl's marked_timer phases of a step (generation, old log-prob, actor update).
        "timing_s/step": dt,
        "timing_s/gen": dt * 0.6,
        "timing_s/old_log_prob": dt * 0.1,
        "timing_s/update_actor": dt * 0.25,
    }
    # Peak memory: each worker logs perf/max_memory_*_gb, the trainer prefixes its role
    # (engine_workers.py _postprocess_output; rename_dict(…, "actor/") in the trainers).
    if critic:
        # The critic's learning (workers/utils/losses.py, compute_data_metrics), a function of the run's step
        # so a resumed critic goes on where it was, and its two phases, taken from the actor's update.
        metrics.update({"critic/vf_loss": 0.05 / step, "critic/vf_explained_var": 1.0 - 1.0 / step,
                        "critic/values/mean": 0.1 * step, "timing_s/values": dt * 0.02,
                        "timing_s/update_critic": dt * 0.05, "timing_s/update_actor": dt * 0.18})
    for role in ("actor", "critic") if critic else ("actor",):
        metrics[f"{role}/perf/max_memory_allocated_gb"] = 2.0 + 0.01 * step
        metrics[f"{role}/perf/max_memory_reserved_gb"] = 2.1 + 0.01 * step
    return metrics


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    required = ["trainer.total_training_steps", "trainer.default_local_dir", "trainer.resume_mode", "trainer.save_freq"]
    missing = [k for k in required if k not in cfg]
    if missing or "fake.bad_key" in cfg:
        raise ValueError(f"ConfigError: missing or invalid trainer keys {missing or ['fake.bad_key']}")
    total = int(cfg["trainer.total_training_steps"])
    save_freq = int(cfg["trainer.save_freq"])
    ckpt = Path(str(cfg["trainer.default_local_dir"]))
    if not ckpt.is_absolute():
        raise ValueError(f"trainer.default_local_dir must be absolute for resume_mode=auto: {ckpt}")
    step_seconds = float(cfg.get("fake.step_seconds", 1.0))
    fail_at = int(cfg.get("fake.fail_at_step", 0))
    gate_file = Path(str(cfg["fake.gate_file"])) if cfg.get("fake.gate_file") else None
    gate_after = int(cfg.get("fake.gate_after_step", 0))
    hang_after = int(cfg.get("fake.hang_after_step", 0))
    hang_once = Path(str(cfg["fake.hang_once_file"])) if cfg.get("fake.hang_once_file") else None

    world = int(cfg.get("trainer.nnodes", 1)) * int(cfg.get("trainer.n_gpus_per_node", 1))
    critic = bool(cfg["critic.enable"]) if cfg.get("critic.enable") is not None else \
        cfg.get("algorithm.adv_estimator", "gae") == "gae"
    die_at = int(cfg.get("fake.die_in_save_at_step", 0))
    die_after = int(cfg.get("fake.die_after_files", 0))
    esi = None
    if cfg.get("trainer.use_v1") is False and os.environ.get("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"):
        from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi as esi
    redundant = float(cfg.get("trainer.esi_redundant_time", 0) or 0)
    max_steps_duration = 0.0
    retention = Retention(cfg, ("actor", "critic") if critic else ("actor",))

    import ray

    ray.init()
    workers = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("local_worker_node")]
    # Like verl's worker groups: actors created once, not restarted when their node dies.
    options: dict[str, Any] = {"num_cpus": 0.5, "max_restarts": 0, "max_task_retries": 0}
    if workers:
        options["resources"] = {"local_worker_node": 0.01}

    @ray.remote
    class RolloutWorker:
        def __init__(self, shard: int) -> None:
            self.shard = shard

        def step(self, step: int, seconds: float) -> dict[str, float]:
            time.sleep(seconds)
            return {"score": 0.1 * step + 0.01 * self.shard, "length": 50.0 + step}

    group = [RolloutWorker.options(**options).remote(s) for s in range(2)]
    ray.get([w.step.remote(0, 0.0) for w in group])  # the actors are up, as verl's worker group is once spawned

    start = 1
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    mode = str(cfg["trainer.resume_mode"])
    if mode == "auto" and tracker.is_file():
        start = int(tracker.read_text().strip()) + 1
        resume = f"Resuming from checkpoint: {ckpt / f'global_step_{start - 1}'}"
    elif mode == "resume_path" and cfg.get("trainer.resume_from_path"):
        start = int(Path(str(cfg["trainer.resume_from_path"])).name.split("_")[-1]) + 1
        resume = f"Resuming from {cfg['trainer.resume_from_path']}"
    else:
        resume = "Training from scratch"
    for line in startup_lines(resume, validate=cfg.get("trainer.val_before_train", True) is not False):
        print(line, flush=True)
    real = None
    if cfg.get("fake.real_fsdp"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.fakes.fsdp_checkpoint import FsdpJob

        resumed = ckpt / f"global_step_{start - 1}" / "actor"
        real = FsdpJob(model_path=str(cfg["actor_rollout_ref.model.path"]), step_dir="", global_step=0,
                       world_size=world, resume_dir=str(resumed) if start > 1 else None)

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote
    class TrackingRunner:
        """Owns verl's Tracking, like verl's TaskRunner."""

        def __init__(self, flat: dict[str, Any]) -> None:
            self.tracking = _tracking(flat)

        def log(self, data: dict[str, Any], step: int) -> None:
            self.tracking.log(data=data, step=step)

        def finish(self) -> None:
            self.tracking.finish()

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    tracking = TrackingRunner.options(num_cpus=0, scheduling_strategy=here).remote(cfg)
    console = "console" in _backends(cfg)
    if cfg.get("fake.die_before_first_step"):
        ray.get([w.step.remote(0, 0.0) for w in group])  # the workers are up, as verl's are before step 1
        _killed("before the first step")
    try:
        for step in range(start, total + 1):
            t0 = time.time()
            if step == fail_at:
                raise ValueError(f"user code failed at step {step}")
            results = ray.get([w.step.remote(step, step_seconds) for w in group])
            metrics = step_metrics(step, time.time() - t0, results, world=world, critic=critic)
            dt = metrics["perf/time_per_step"]
            ray.get(tracking.log.remote(metrics, step))  # the line is written before the step goes on
            if console:
                print(console_line(metrics, step), flush=True)
            max_steps_duration = max(max_steps_duration, dt)
            close = bool(esi(max_steps_duration=max_steps_duration, redundant_time=redundant)) if esi else False
            if save_freq > 0 and (step % save_freq == 0 or step == total or close):
                if close:
                    print("Force saving checkpoint: ESI instance expiration approaching.", flush=True)
                retention.before_save()
                save_checkpoint(ckpt, step, world=world, critic=critic,
                                die_after=die_after if step == die_at else None, real=real)
                retention.after_save(ckpt / f"global_step_{step}")
                if real is not None:
                    real = replace(real, resume_dir=str(ckpt / f"global_step_{step}" / "actor"))
            if hang_once is not None and step == hang_after and not hang_once.exists():
                hang_once.touch()
                print(f"step {step} done; the next step hangs (a collective waiting on a peer)", flush=True)
                ray.get([w.step.remote(step + 1, 10 ** 9) for w in group])
            if gate_file is not None and step == gate_after:
                print(f"waiting for the gate {gate_file}", flush=True)
                gate_deadline = time.monotonic() + GATE_MAX_WAIT_S
                while not gate_file.exists() and time.monotonic() < gate_deadline:
                    time.sleep(0.1)
    finally:
        try:
            ray.get(tracking.finish.remote())
        except ray.exceptions.RayError:
            pass  # the actor went with its node: the error that ended the run is the one to report
    return 0


def startup_lines(resume: str, *, validate: bool) -> list[str]:
    """The lines verl 0.9.1's v1 trainer and vLLM print between the worker group's start and the first
    step that end each phase of a start (``verl_pipeline.jobs.startup.markers``), in their order and
    shape: verl's logger (``INFO:<time>:<message>``), vLLM's (``INFO <date> <time> [<file>:<line>] …``)
    and verl's prints; ``resume``: the checkpoint line (verl's ``_load_checkpoint``)."""
    day, now = time.strftime("%m-%d"), time.strftime("%H:%M:%S")
    verl = f"INFO:{time.strftime('%Y-%m-%d')} {now},000:"
    lines = [
        f"{verl}create worker group dict_keys(['actor_rollout'])",
        f"{verl}actor and ref model engine initialized",
        f"(EngineCore pid={os.getpid()}) INFO {day} {now} [kv_cache_utils.py:1087] GPU KV cache size: 49,152 tokens",
        f"(EngineCore pid={os.getpid()}) INFO {day} {now} [gpu_model_runner.py:3480] Graph capturing finished "
        "in 0 secs, took 0.00 GiB",
        "LLMServerManager: ['127.0.0.1:8000']",
        f"{verl}checkpoint engine manager initialized",
        f"{verl}{resume}",
        f"{verl}all initialize finished, ready to fit",
    ]
    if validate:
        lines.append("\"Initial validation metrics: {'val-core/openai/gsm8k/reward/mean@1': "
                     "np.float64(0.0)}\"")
    return lines


def console_line(metrics: dict[str, Any], step: int) -> str:
    """The step's line as verl 0.9.1's ``LocalLogger`` prints it (``concat_dict_to_str``: each number
    through ``pprint.pformat``, not imported here since its module imports torch). verl's metrics are
    means of numpy arrays, and numpy 2 prints those ``np.float64(0.41)``."""
    import pprint

    import numpy as np

    values = {k: v if isinstance(v, int) else np.float64(v) for k, v in metrics.items()}
    return " - ".join([f"step:{step}", *(f"{k}:{pprint.pformat(v)}" for k, v in values.items())])


def _backends(cfg: dict[str, Any]) -> list[str]:
    """``trainer.logger``; without one (a test's own overrides), console, and file when its path is set."""
    value = cfg.get("trainer.logger")
    if value is None:
        return ["console", "file"] if os.environ.get("VERL_FILE_LOGGER_PATH") else ["console"]
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """The overrides as the nested config verl hands its Tracking (``OmegaConf.to_container(config)``)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _tracking(cfg: dict[str, Any]) -> Any:
    """verl's ``Tracking`` for the run, as verl's trainer creates it (console printed by the caller)."""
    from verl_pipeline.trackers import verl_tracking

    backends = [b for b in _backends(cfg) if b != "console"]
    return verl_tracking().Tracking(project_name=str(cfg.get("trainer.project_name", "verl_pipeline")),
                                    experiment_name=str(cfg.get("trainer.experiment_name", "fake")),
                                    default_backend=backends, config=_nested(cfg))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
