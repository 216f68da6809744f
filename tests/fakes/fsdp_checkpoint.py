"""A real FSDP checkpoint of a HuggingFace model, written by verl's own ``FSDPCheckpointManager``.

torch FSDP on CPU with gloo: FSDP2's ``fully_shard`` per decoder layer and at the root over a 1-D
``fsdp`` device mesh, as verl's ``strategy: fsdp2`` workers build it (FSDP1 refuses a host without an
accelerator); ``world_size`` ranks forked from one launcher process. Each rank loads the model in
fp32 (verl's actor keeps fp32 parameters), optionally restores an earlier checkpoint with verl's
``load_checkpoint`` (model, optimizer, scheduler, RNG), runs a few real AdamW steps on a fixed
batch, and saves with verl's ``save_checkpoint`` into ``<step_dir>/actor``:
``{model,optim,extra_state}_world_size_{W}_rank_{r}.pt`` (sharded DTensor state dicts),
``fsdp_config.json`` and ``huggingface/`` (config + tokenizer; with ``lora_rank``, a PEFT LoRA actor and
verl's ``lora_train_meta.json``), exactly what
``python -m verl.model_merger merge --backend fsdp`` reads. Rank 0 then writes the dataloader's
``data.pt`` beside ``actor/``, as verl's trainer does.

Used by the stand-in trainer with ``+fake.real_fsdp=true`` and by tests through :func:`write_checkpoint`.
``full_state_path`` makes the ranks also gather the full (unsharded) trained state dict (each
DTensor's ``full_tensor()``) and rank 0 ``torch.save`` it there: the reference a test compares a merged model against.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Seconds a whole save (process start, imports, training, writing) may take before it is killed.
SAVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class FsdpJob:
    """What every rank does: load ``model_path`` (or resume ``resume_dir``), train, save ``step_dir``."""

    model_path: str
    step_dir: str
    global_step: int
    world_size: int
    optimizer_steps: int = 2
    lr: float = 1e-3
    resume_dir: str | None = None
    full_state_path: str | None = None
    #: Positive: train a LoRA adapter as verl's FSDP engine does (PEFT's get_peft_model over every linear layer).
    lora_rank: int = 0
    lora_alpha: int = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_checkpoint(job: FsdpJob, *, timeout_s: float = SAVE_TIMEOUT_S) -> Path:
    """Run ``job`` on ``job.world_size`` ranks; returns ``<step_dir>/actor``.

    One launcher process imports torch, transformers and verl once, then forks the ranks (imports are
    most of a save's time on a small model). Raises RuntimeError with the output when a rank fails or
    the save takes longer than ``timeout_s``.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.fakes.fsdp_checkpoint", json.dumps(asdict(job))],
                              env=env, cwd=str(Path(__file__).resolve().parents[2]), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"FSDP checkpoint of step {job.global_step} took over {timeout_s:.0f}s: {e.output!r}") from e
    if done.returncode != 0:
        raise RuntimeError(f"FSDP checkpoint ranks failed (exit {done.returncode}):\n{done.stdout[-6000:]}")
    return Path(job.step_dir) / "actor"


def _launch(job: FsdpJob) -> int:
    import multiprocessing

    # Imported before the fork, so the ranks inherit them.
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                       "WORLD_SIZE": str(job.world_size)})
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_rank_main, args=(job, r)) for r in range(job.world_size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    codes = [p.exitcode for p in ranks]
    print(f"FSDP ranks exited with {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def _batch(tokenizer: object, n: int = 4) -> object:
    """A fixed batch of chat prompts: every rank trains on its own slice, as data parallelism does."""
    texts = [f"<|im_start|>user\nWhat is {i} + {i + 3}?<|im_end|>\n<|im_start|>assistant\n{2 * i + 3}<|im_end|>"
             for i in range(n)]
    return tokenizer(texts, return_tensors="pt", padding=True)  # type: ignore[operator]


def _rank_main(job: FsdpJob, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=job.world_size)
    world = job.world_size
    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    tokenizer: Any = AutoTokenizer.from_pretrained(job.model_path)
    model: Any = AutoModelForCausalLM.from_pretrained(job.model_path, torch_dtype=torch.float32)
    if job.lora_rank:
        from peft import LoraConfig, TaskType, get_peft_model

        # As verl's FSDP engine builds a LoRA actor (workers/engine/fsdp/transformer_impl.py, _build_lora_module).
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=job.lora_rank,
                                                 lora_alpha=job.lora_alpha, target_modules="all-linear", bias="none"))
    for layer in (model.get_base_model() if job.lora_rank else model).model.layers:
        fully_shard(layer, mesh=mesh)
    fsdp: Any = fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=job.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    manager = FSDPCheckpointManager(model=fsdp, optimizer=optim, lr_scheduler=sched, processing_class=tokenizer,
                                    checkpoint_config=OmegaConf.create({"save_contents": ["model", "optimizer",
                                                                                          "extra"]}))
    if job.resume_dir:
        manager.load_checkpoint(job.resume_dir)
    batch = _batch(tokenizer, 2 * world)
    mine = {k: v[rank::world] for k, v in batch.items()}  # type: ignore[attr-defined]
    for _ in range(job.optimizer_steps):
        out = fsdp(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"], labels=mine["input_ids"])
        out.loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    manager.save_checkpoint(str(Path(job.step_dir) / "actor"), global_step=job.global_step)
    if job.full_state_path:
        # Every rank takes part in each all-gather; rank 0 keeps the result.
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fsdp.state_dict().items()}
        if rank == 0:
            torch.save(full, job.full_state_path)
    if rank == 0:
        # verl's trainer saves the dataloader's state beside the roles' folders.
        torch.save({"global_step": job.global_step}, Path(job.step_dir) / "data.pt")
        print(f"FSDP checkpoint of step {job.global_step} at {job.step_dir} (world size {world})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(_launch(FsdpJob(**json.loads(sys.argv[1]))))
