"""A stand-in for bare ``python -m verl.trainer.main_ppo`` (verl cannot train on CPU), for the GPU acceptance
script's bare-verl twins: a driver that, like verl's after its ``ray.init()``, has its training worker as a
process of its own below it (``ray::WorkerDict`` in its command line, as Ray names an actor's process), and
fails when that worker dies, as verl's driver does on Ray's ``ActorDiedError``.

Like verl it takes Hydra overrides (the stand-in trainer's parser), resumes as ``trainer.resume_mode=auto``
does from the tracker in ``trainer.default_local_dir``, saves every step in verl's layout and order (the
stand-in trainer's ``save_checkpoint``: actor, critic with GAE, ``data.pt``, then the tracker) and then logs
the step's row, verl's metric names under ``{"step": N, "data": {...}}``, to ``$VERL_FILE_LOGGER_PATH``.
Its critic's value loss falls with every step the critic has trained, counted from the checkpoint it
restored: a restart that did not restore it gives step 1's loss back.

Knobs (not verl keys): ``+fake.step_seconds``; ``+fake.hang_on_dead_worker=true``: the driver does not notice
its worker died and waits on it for ever, as a run hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.fakes.fake_verl_trainer import parse, save_checkpoint
from verl_pipeline.rundir import tracker_step
from verl_pipeline.trainer import metrics as m

#: The worker: a process that only waits, its command line starting as Ray's title of an actor's process does.
WORKER = ["bash", "-c", "exec -a ray::WorkerDict.__init__ sleep 86400"]


def critic_steps(folder: Path) -> int:
    """The steps the critic saved in ``folder`` had trained (0: no critic there to restore)."""
    state = folder / "critic" / "model_world_size_1_rank_0.pt"
    return int(json.loads(state.read_text())["step"]) if state.exists() else 0


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    ckpt = Path(str(cfg["trainer.default_local_dir"]))
    total = int(cfg["trainer.total_training_steps"])
    critic = cfg.get("algorithm.adv_estimator") == "gae"
    step_s = float(cfg.get("fake.step_seconds", 0.2))
    done = tracker_step(ckpt) or 0
    trained = critic_steps(ckpt / f"global_step_{done}") if done else 0
    print(f"Resuming from {ckpt / f'global_step_{done}'}" if done else "Training from scratch", flush=True)
    worker = subprocess.Popen(WORKER)
    Path("worker.pid").write_text(str(worker.pid))  # in the working directory: for a test to look it up
    try:
        for step in range(done + 1, total + 1):
            if worker.poll() is not None:
                if cfg.get("fake.hang_on_dead_worker"):
                    while True:
                        time.sleep(1)
                raise RuntimeError(f"ray.exceptions.ActorDiedError: the actor died unexpectedly (pid {worker.pid})")
            time.sleep(step_s)
            save_checkpoint(ckpt, step, world=1, critic=critic)
            row = {m.TIMING_STEP: step_s, "perf/throughput": 100.0}
            if critic:
                trained += 1
                row |= {"critic/vf_loss": 0.1 * 0.7 ** trained, "critic/values/mean": -1 + 0.1 * step,
                        "critic/vf_explained_var": -10.0 / step}
            with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
                f.write(json.dumps({"step": step, "data": row}) + "\n")
    finally:
        worker.kill()
        worker.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
