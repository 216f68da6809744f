"""verl's FSDP checkpoint merger: a ``global_step_N/actor`` folder into HuggingFace safetensors, verified.

A LoRA run's adapter, which the merger writes beside the base weights, is merged into them
(:mod:`verl_pipeline.trainer.lora_merge`) and kept in ``lora_adapter/``.

Used to export a run's trained model and to start a new run segment from merged weights when a
retry lands on a cluster of another world size.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError
from verl_pipeline.trainer.lora_merge import ADAPTER_DIR, merge_lora_adapter
from verl_pipeline.trainer.verify import verify_model_dir

log = logging.getLogger(__name__)

MERGER_MODULE = "verl.model_merger"
#: How the model ran in training, which verl writes into the checkpoint's ``huggingface/config.json`` (its
#: ``override_config`` set on the model config): the merged model leaves it out, so it loads wherever it is
#: used with transformers' default attention, on a CPU too (with ``attn_implementation: flash_attention_2``
#: in its config, neither the merger on the export task's CPU nor a user without flash-attn could build it).
#: Whoever loads the model may still ask for flash-attn.
TRAINING_ONLY_CONFIG_KEYS = ("attn_implementation",)
#: A merge that takes longer is stuck: the merger of a 7B model takes minutes, not hours.
MERGE_TIMEOUT_S = 3 * 3600.0
_TAIL_LINES = 20


def merge_command(actor_dir: Path, target_dir: Path, *, python: str = sys.executable) -> list[str]:
    """verl's FSDP merger as an argument list."""
    return [python, "-m", MERGER_MODULE, "merge", "--backend", "fsdp", "--local_dir", str(actor_dir),
            "--target_dir", str(target_dir)]


def _staged(actor_dir: Path, stage: Path) -> Path:
    """``actor_dir`` as the merger is to read it: each entry a link to the checkpoint's own, but for
    ``huggingface/``, a copy whose ``config.json`` lacks :data:`TRAINING_ONLY_CONFIG_KEYS` (the merger
    reads the config from ``<local_dir>/huggingface`` and takes no other path). The checkpoint is not changed."""
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for entry in actor_dir.iterdir():
        if entry.name != "huggingface":
            (stage / entry.name).symlink_to(entry.resolve())
    shutil.copytree(actor_dir / "huggingface", stage / "huggingface")
    config_path = stage / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    dropped = {k: config.pop(k) for k in TRAINING_ONLY_CONFIG_KEYS if k in config}
    if dropped:
        log.info("Merging %s without its training-only config %s", actor_dir, dropped)
        config_path.write_text(json.dumps(config, indent=2))
    return stage


def merge_checkpoint(actor_dir: Path, target_dir: Path, *, job_id: str, timeout_s: float = MERGE_TIMEOUT_S) -> dict[
        str, Any]:
    """Merge ``actor_dir`` (a ``global_step_N/actor`` folder) into ``target_dir`` and verify it.

    Written to a sibling temporary directory and renamed, so ``target_dir`` is complete or absent.
    Returns the verification's facts. ModelError naming the checkpoint and the merger's last lines
    when it fails, or naming the file when the merged model does not verify.
    """
    for need in ("fsdp_config.json", "huggingface/config.json"):
        if not (actor_dir / need).is_file():
            raise ModelError(f"{actor_dir} has no {need}: not a verl FSDP checkpoint the merger can read "
                             "(verl writes it with the shards on every save)")
    tmp = target_dir.with_name(f".{target_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    stage = tmp.with_name(f".{target_dir.name}.stage")
    cmd = merge_command(_staged(actor_dir, stage), tmp)
    log.info("%s: merging %s with verl's merger: %s", job_id, actor_dir, " ".join(cmd))
    started = time.monotonic()
    tail: list[str] = []
    # verl's merger works on CPU (map_location="cpu"): it must not take a GPU of the worker's host.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        # A merger that stops printing must still end: killed at the timeout, from another thread.
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    log.info("%s: merger: %s", job_id, line)
                    tail = [*tail, line][-_TAIL_LINES:]
            code = proc.wait()
        finally:
            watchdog.cancel()
    shutil.rmtree(stage, ignore_errors=True)
    if code != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        why = f"killed after {timeout_s:.0f}s" if time.monotonic() - started >= timeout_s else f"exit {code}"
        raise ModelError(f"verl's merger failed on {actor_dir} ({why}): " + " | ".join(tail[-5:]))
    try:
        # A LoRA run: the merger put the trained adapter beside the base weights; the model is both, merged.
        lora = merge_lora_adapter(tmp)
        facts = verify_model_dir(tmp)
    except ModelError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lora is not None:
        facts["lora"] = lora.to_dict()
        log.info("%s: merged the LoRA adapter (rank %d, alpha %g) into %d of its %d weights (largest change %.3g); "
                 "the adapter is kept in %s", job_id, lora.rank, lora.alpha, lora.changed, lora.adapted,
                 lora.max_abs_change, ADAPTER_DIR)
        if lora.changed < lora.adapted:
            log.warning("%s: %d of the adapter's %d weights are unchanged (their lora_B is zero)", job_id,
                        lora.adapted - lora.changed, lora.adapted)
    for p in [*tmp.iterdir(), *(tmp / ADAPTER_DIR).glob("*")]:  # the merger writes 0600; every node's user reads
        os.chmod(p, p.stat().st_mode | (0o755 if p.is_dir() else 0o644))
    if target_dir.exists():
        shutil.rmtree(target_dir)
    os.replace(tmp, target_dir)
    log.info("%s: merged %s into %s in %.1fs (%d tensors)", job_id, actor_dir, target_dir,
             time.monotonic() - started, facts.get("tensors", 0))
    return facts


__all__ = ["MERGER_MODULE", "MERGE_TIMEOUT_S", "TRAINING_ONLY_CONFIG_KEYS", "merge_checkpoint", "merge_command"]
