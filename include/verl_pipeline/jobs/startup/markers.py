"""The lines of a verl job's log that end each phase of its start, one table, in the order a start goes.

A training job spends minutes between its submission and its first step; a restart pays it again.
The waiter times each phase by the arrival of the line that ends it (:mod:`verl_pipeline.jobs.startup.phases`).
Each :class:`Marker` is a literal piece of one line, as verl 0.9.1 (its v1 trainer, the default),
vLLM 0.24 or Ray print it; the comment above each names the file and the call that prints it. To
correct the table against a real job log, change the text (or add a marker for the same phase: any
of a phase's markers ends it).

A phase whose line never shows is **unknown**, never guessed: the line differs from the table, the
phase did not run, or the job logs at a level that hides it. A phase the job was rendered without
(validation before training, off on a resume) is **skipped** instead (``jobs.startup.phases.skipped_phases``). vLLM's
own lines are INFO, which verl's runtime environment silences (``VLLM_LOGGING_LEVEL=WARN``) unless
the job sets the variable itself; the pipeline's jobs set it to INFO (``trainer/render.py``).

The first step has no marker here: it is the first training step verl reports
(:mod:`verl_pipeline.jobs.progress`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    """The phases of a start, in order; each ends where the next begins."""

    #: Submission to the GPU workers' actors running: the driver, Ray's runtime environment, verl's
    #: TaskRunner (config, tokenizer, datasets), the worker group's actors.
    WORKER_START = "worker_start"
    #: The actor (and reference, critic) models built and their weights loaded by the training engine (FSDP).
    MODEL_LOAD = "model_load"
    #: The rollout engines (vLLM) started: processes, weights, memory profiling, KV cache.
    ENGINE_START = "engine_start"
    #: vLLM captures its CUDA graphs (none with ``enforce_eager``: the phase stays unknown).
    GRAPH_CAPTURE = "graph_capture"
    #: The rest of the setup: the engines' servers, weight sync, and on a resume the checkpoint load.
    CHECKPOINT_LOAD = "checkpoint_load"
    #: verl's validation before training (``trainer.val_before_train``).
    VALIDATION = "validation"
    #: The first training step.
    FIRST_STEP = "first_step"

    @property
    def words(self) -> str:
        """How the task log and the report name the phase."""
        return self.value.replace("_", " ")


@dataclass(frozen=True)
class Marker:
    """A piece of the line that ends ``phase``."""

    phase: Phase
    text: str


MARKERS: tuple[Marker, ...] = (
    # verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py, in the trainer's setup, after each resource pool's
    # worker group spawned its actors: logger.info(f"create worker group {spawn_wg.keys()}") (TaskRunnerV1).
    Marker(Phase.WORKER_START, "create worker group"),
    # verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py, after actor_rollout_wg.init_model() (the critic's
    # engine comes before it): logger.info("actor and ref model engine initialized").
    Marker(Phase.MODEL_LOAD, "actor and ref model engine initialized"),
    # vLLM 0.24 vllm/v1/core/kv_cache_utils.py, get_kv_cache_configs, once per engine after memory
    # profiling and before the CUDA graphs: logger.info_once("GPU KV cache size: %s tokens", ...).
    Marker(Phase.ENGINE_START, "GPU KV cache size:"),
    # vLLM 0.24 vllm/v1/worker/gpu_model_runner.py, capture_model, once per engine:
    # logger.info("Graph capturing finished in %.0f secs, took %.2f GiB", ...).
    Marker(Phase.GRAPH_CAPTURE, "Graph capturing finished in"),
    # verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py, the last line of the setup, after the engines'
    # servers (verl's print "LLMServerManager: [...]"), the checkpoint engine and _load_checkpoint
    # ("Training from scratch" / "Resuming from ..."): logger.info("all initialize finished, ready to fit").
    Marker(Phase.CHECKPOINT_LOAD, "all initialize finished, ready to fit"),
    # verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py fit() (and ray_trainer.py, the legacy trainer),
    # after the validation before training: pprint(f"Initial validation metrics: {val_metrics}").
    Marker(Phase.VALIDATION, "Initial validation metrics:"),
)

#: The phases in order (the first step last).
PHASES: tuple[Phase, ...] = tuple(Phase)
