"""The trained model as HuggingFace safetensors: verl's merger over the run's last complete checkpoint.

``python -m verl.model_merger merge --backend fsdp --local_dir <global_step_N>/actor --target_dir …``
(verl's own merger, run as a subprocess; every output line goes to the log with the job id) turns the
FSDP shards ``model_world_size_{W}_rank_{r}.pt`` plus ``fsdp_config.json`` and ``huggingface/`` into a
model transformers and vLLM load. The result is checked with :func:`verl_pipeline.trainer.verify.verify_model_dir`
before it is moved into place, so a directory at the final path is always a merged, verified model.

A run's export is ``<run_dir>/model/`` with its manifest ``<run_dir>/model.json`` beside it (run, step,
checkpoint, data content hash, base model and revision, final reward, the merged files). An export
of the same checkpoint that is already there is kept (idempotent retries).

The same merge gives the weights a run continues from when its cluster size changed
(``on_world_size_change: merge``, see :mod:`verl_pipeline.jobs.checkpoints`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError
from verl_pipeline.jobs.checkpoints import Checkpoint
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import RunDir
from verl_pipeline.trainer.merge import merge_checkpoint
from verl_pipeline.trainer.metrics import SCORE

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ExportManifest:
    """What the published model is: ``model.json`` next to the merged model."""

    run_key: str
    run_name: str
    profile: str
    step: int
    checkpoint: str
    world_size: int | None
    model_dir: str
    data_hash: str | None
    base_model_source: str | None
    base_model_revision: str | None
    final_reward: float | None
    files: dict[str, Any]
    exported_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def newest_complete(checkpoints: list[Checkpoint]) -> Checkpoint | None:
    """The checkpoint to export: the newest complete one (an incomplete newer one is passed over)."""
    complete = [c for c in checkpoints if c.complete]
    return complete[-1] if complete else None


def final_reward(metrics_files: list[Path]) -> float | None:
    """The final reward: verl's mean sequence score (:data:`~verl_pipeline.trainer.metrics.SCORE`) of the highest
    step any attempt logged (files in attempt order)."""
    best: tuple[int, float] | None = None
    for path in metrics_files:
        for line in path.read_text().splitlines() if path.is_file() else ():
            try:
                data = json.loads(line).get("data", {})
            except (ValueError, AttributeError):
                continue  # a line cut by a kill
            if SCORE in data:
                step = int(data.get("training/global_step", 0))
                if best is None or step >= best[0]:
                    best = (step, float(data[SCORE]))
    return best[1] if best else None


def read_export(run_dir: Path) -> ExportManifest | None:
    """The run's export manifest, when its model was exported and is still there."""
    try:
        data = json.loads(RunDir(run_dir).model_manifest_file.read_text())
        manifest = ExportManifest(**data)
    except (OSError, ValueError, TypeError):
        return None
    return manifest if (Path(manifest.model_dir) / "config.json").is_file() else None


def export_run(
    *,
    run_dir: Path,
    checkpoints: list[Checkpoint],
    run_key: str,
    run_name: str,
    profile: str,
    job_id: str,
    data: dict[str, Any] | None = None,
    actor_model: dict[str, Any] | None = None,
    start_step: int = 0,
) -> ExportManifest:
    """Merge the run's newest complete checkpoint into ``<run_dir>/model``, verify it, write ``model.json``.

    ``checkpoints``: the run's checkpoints (:func:`verl_pipeline.jobs.checkpoints.list_checkpoints`);
    ``data``: the preprocess result (its ``key`` is the data content hash); ``actor_model``: the
    prefetched base model (``source``, ``revision``); ``start_step``: the run step the checkpoints' segment
    starts from (:func:`verl_pipeline.jobs.checkpoints.current_segment`), so ``step`` is the run's step.
    ModelError when no checkpoint is complete.
    """
    from verl_pipeline.rundir import RunDir

    chosen = newest_complete(checkpoints)
    if chosen is None:
        shown = ", ".join(f"global_step_{c.step}" for c in checkpoints) or "none"
        raise ModelError(f"run {run_key} has no complete checkpoint to export (checkpoints: {shown})")
    if checkpoints and checkpoints[-1].step != chosen.step:
        log.warning("%s: newest checkpoint global_step_%d is incomplete (missing %s): exporting global_step_%d",
                    job_id, checkpoints[-1].step, ", ".join(checkpoints[-1].missing[:3]), chosen.step)
    target = RunDir(run_dir).model_dir
    done = read_export(run_dir)
    if done is not None and done.checkpoint == str(chosen.path):
        log.info("%s: global_step_%d is already exported to %s: kept", job_id, chosen.step, target)
        return done
    facts = merge_checkpoint(chosen.path / "actor", target, job_id=job_id)
    actor_model = actor_model or {}
    manifest = ExportManifest(
        run_key=run_key, run_name=run_name, profile=profile, step=start_step + chosen.step,
        checkpoint=str(chosen.path),
        world_size=chosen.world_size, model_dir=str(target), data_hash=(data or {}).get("key"),
        base_model_source=actor_model.get("source"), base_model_revision=actor_model.get("revision"),
        final_reward=final_reward(list(RunDir(run_dir).metrics_files().values())),
        files={**facts, "names": sorted(p.name for p in target.iterdir() if p.is_file())},
    )
    write_json_atomic(RunDir(run_dir).model_manifest_file, manifest.to_dict())
    log.info("%s: exported step %d of run %s to %s (final %s %s)", job_id, manifest.step, run_key, target,
             SCORE, manifest.final_reward)
    return manifest


__all__ = ["ExportManifest", "export_run", "final_reward", "newest_complete", "read_export"]
