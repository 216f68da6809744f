"""What a retry resumes from: the newest *complete* verl checkpoint of the run, at the right world size.

verl's ``resume_mode=auto`` trusts ``latest_checkpointed_iteration.txt`` alone: a tracker that names a
folder missing shards, an empty tracker (a kill inside its write) or shards written for another world
size only fail once the job loads them (or, for a missing folder, silently start from scratch). Before
each submit the pipeline reads the checkpoint directory instead and decides, in :func:`plan_resume`:

- the newest complete checkpoint is the one the tracker names → ``auto`` (what verl would do);
- it is an older one (the newest is incomplete, the tracker is unreadable) → ``resume_path`` to it;
- checkpoints exist but none is complete → ``disable`` (start over, said in the log);
- the checkpoint to resume was written by another world size → :class:`ConfigError` naming both, or,
  when the run profile says ``on_world_size_change: merge``, a plan to merge it (``merge=True``).

A merge starts a new **segment** of the run (:class:`Segment`, recorded in ``segments.json`` of the
run's checkpoint directory): verl's merger turns the checkpoint's actor shards into HuggingFace
weights, and the segment trains from them (``actor_rollout_ref.model.path``) with verl's
``resume_mode=disable`` in its own ``segment_<k>/`` checkpoint directory, for the steps the run has
left. The optimizer state, the learning-rate schedule's position and the critic's training are not
carried over (the critic starts again from its initial weights). Step ``s`` of segment ``k`` is run
step ``start_step + s``; later retries resume inside the newest segment.

Before each retry the pipeline also removes what verl leaves behind (:func:`stale_checkpoints`): verl keeps
``trainer.max_actor_ckpt_to_keep`` checkpoints (the pipeline's default: 2), but prunes only those its own
process saved, and of those only the ``actor``/``critic`` folders. So every attempt that ends leaves its
newest saves, and the ``data.pt`` of the pruned ones, for good: a week-long run with a restart a day
would keep a day's worth of checkpoints per restart. The complete checkpoints older than the newest kept
ones go, with the incomplete ones older than the newest complete one (verl's leftovers, a save cut short
before a later one completed); an incomplete one newer than it is what the next attempt saves over.

A checkpoint is complete when every rank's files for the configured ``checkpoint.save_contents``
(verl's FSDP names ``{model,optim,extra_state}_world_size_{W}_rank_{r}.pt``) are there for the actor,
and for the critic when the run uses one, plus the dataloader's ``data.pt``. A file written by
``torch.save`` (a zip archive) must also end with the archive's end record: a write cut short lacks it.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline.constants import WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import tracker_step

STEP_DIR = re.compile(r"^global_step_(\d+)$")
SHARD = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: ``checkpoint.save_contents`` entry → the file prefix verl's FSDP checkpoint manager writes per rank.
CONTENT_FILES = {"model": "model", "optimizer": "optim", "extra": "extra_state"}
#: verl's default ``actor_rollout_ref.actor.checkpoint.save_contents`` (and the critic's).
DEFAULT_SAVE_CONTENTS = ("model", "optimizer", "extra")
#: Strategies whose checkpoints use the layout above; Megatron's distributed checkpoints are not inspected.
FSDP_STRATEGIES = ("fsdp", "fsdp2")
DATALOADER_FILE = "data.pt"
#: The run's segments after a merge on a changed world size, in its checkpoint directory.
SEGMENTS_FILE = "segments.json"
_ZIP_MAGIC = b"PK\x03\x04"


class ResumeMode(str, Enum):
    """verl's ``trainer.resume_mode`` values, as the pipeline uses them."""

    AUTO = "auto"
    RESUME_PATH = "resume_path"
    DISABLE = "disable"


@dataclass(frozen=True)
class Checkpoint:
    """One ``global_step_N`` folder: its world size (None when no shard names one) and what it lacks."""

    step: int
    path: Path
    world_size: int | None
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing and self.world_size is not None


@dataclass(frozen=True)
class ResumePlan:
    """What the next attempt resumes from; ``step`` 0 means from scratch."""

    mode: ResumeMode
    step: int
    path: str | None
    reason: str
    #: Newer checkpoints passed over because they are incomplete: ``global_step_N (missing …)``.
    skipped: tuple[str, ...] = ()
    world_size: int | None = None
    #: The checkpoint at ``path`` is of another world size and is to be merged into a new segment.
    merge: bool = False

    def settings(self) -> dict[str, Any]:
        """The verl keys that carry the plan."""
        out: dict[str, Any] = {"trainer.resume_mode": self.mode.value}
        if self.mode is ResumeMode.RESUME_PATH:
            out["trainer.resume_from_path"] = self.path
        return out


def intact(path: Path) -> bool:
    """The file exists, is not empty and, when it is a ``torch.save`` zip archive, is not cut short."""
    try:
        if path.stat().st_size == 0:
            return False
        with open(path, "rb") as f:
            if f.read(4) != _ZIP_MAGIC:
                return True
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _world_size(role_dir: Path) -> int | None:
    sizes = set()
    for f in role_dir.iterdir() if role_dir.is_dir() else ():
        m = SHARD.match(f.name)
        if m:
            sizes.add(int(m.group(2)))
    # Shards of several sizes (a folder re-used by a run on another cluster): the largest names the
    # most files, and the files of that size decide completeness.
    return max(sizes) if sizes else None


def inspect_checkpoint(folder: Path, *, contents: tuple[str, ...] = DEFAULT_SAVE_CONTENTS,
                       critic: bool = False) -> Checkpoint:
    """Read one ``global_step_N`` folder (no file is loaded, only listed and, for archives, its end read)."""
    m = STEP_DIR.match(folder.name)
    if m is None:
        raise ValueError(f"{folder} is not a global_step_N folder")
    roles = ("actor", "critic") if critic else ("actor",)
    world = _world_size(folder / "actor")
    missing: list[str] = []
    if world is None:
        missing.append("actor/model_world_size_*_rank_*.pt")
    for role in roles:
        role_world = _world_size(folder / role)
        if role != "actor" and role_world != world:
            missing.append(f"{role}/ shards for world size {world}")
            continue
        for content in contents:
            prefix = CONTENT_FILES.get(content)
            if prefix is None or world is None:
                continue  # e.g. hf_model: rank 0 writes it after the shards, verl does not load it to resume
            for rank in range(world):
                name = f"{role}/{prefix}_world_size_{world}_rank_{rank}.pt"
                if not intact(folder / name):
                    missing.append(name)
    if not intact(folder / DATALOADER_FILE):
        missing.append(DATALOADER_FILE)
    return Checkpoint(int(m.group(1)), folder, world, tuple(missing))


def list_checkpoints(checkpoint_dir: Path, *, contents: tuple[str, ...] = DEFAULT_SAVE_CONTENTS,
                     critic: bool = False) -> list[Checkpoint]:
    """Every ``global_step_N`` folder of the run, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [inspect_checkpoint(p, contents=contents, critic=critic)
             for p in checkpoint_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda c: c.step)


def _describe(c: Checkpoint) -> str:
    shown = ", ".join(c.missing[:3]) + (f" and {len(c.missing) - 3} more" if len(c.missing) > 3 else "")
    return f"global_step_{c.step} (missing {shown})"


def plan_resume(checkpoints: list[Checkpoint], tracker: int | None, *, world_size: int,
                on_world_size_change: WorldSizeChange = WorldSizeChange.FAIL) -> ResumePlan:
    """The decision: resume the newest complete checkpoint; one of another world size is refused or merged.

    ``world_size`` is the training pool of the attempt about to be submitted
    (``trainer.nnodes * trainer.n_gpus_per_node``). When the checkpoint to resume was written by
    another world size (verl loads shards only at the size that wrote them): ``fail`` raises
    :class:`ConfigError` naming both sizes; ``merge`` returns a plan with ``merge=True``.
    """
    complete = [c for c in checkpoints if c.complete]
    newest = complete[-1] if complete else None
    skipped = tuple(_describe(c) for c in checkpoints if not c.complete and (newest is None or c.step > newest.step))
    if newest is None:
        if tracker is None and not checkpoints:
            return ResumePlan(ResumeMode.AUTO, 0, None, "no checkpoint yet: training from scratch")
        return ResumePlan(ResumeMode.DISABLE, 0, None, "no complete checkpoint: training from scratch "
                          f"(the tracker names {tracker})", skipped)
    if newest.world_size != world_size and on_world_size_change is WorldSizeChange.MERGE:
        return ResumePlan(ResumeMode.DISABLE, newest.step, str(newest.path),
                          f"global_step_{newest.step} was written by world size {newest.world_size} and this attempt "
                          f"runs on world size {world_size}: merging it with verl's merger and continuing from those "
                          "weights as a new segment (on_world_size_change: merge; the optimizer state is lost)",
                          skipped, newest.world_size, merge=True)
    if newest.world_size != world_size:
        raise ConfigError(
            "trainer.nnodes x trainer.n_gpus_per_node", world_size,
            f"checkpoint {newest.path} was written by world size {newest.world_size} "
            f"(model_world_size_{newest.world_size}_rank_*.pt) and verl loads shards only at the world size that "
            f"wrote them; this attempt would run on world size {world_size}",
            f"a cluster whose training pool has {newest.world_size} GPUs again (nnodes x n_gpus_per_node), "
            "on_world_size_change: merge in the run profile (continue from the merged weights, optimizer state "
            "lost), or a new DAG run, which starts from scratch in its own checkpoint directory")
    if tracker == newest.step:
        return ResumePlan(ResumeMode.AUTO, newest.step, str(newest.path),
                          f"the tracker names global_step_{newest.step}, which is complete", skipped,
                          newest.world_size)
    why = f"the tracker names {tracker}" if tracker is not None else "the tracker is missing or unreadable"
    return ResumePlan(ResumeMode.RESUME_PATH, newest.step, str(newest.path),
                      f"{why}; the newest complete checkpoint is global_step_{newest.step}", skipped,
                      newest.world_size)


def stale_checkpoints(checkpoints: list[Checkpoint], keep: int) -> list[Checkpoint]:
    """The checkpoints (oldest first) a run keeping its newest ``keep`` complete ones no longer needs: the
    complete ones older than those, and the incomplete ones older than the newest complete one. None while
    ``keep`` is 0 (keep every one) or no checkpoint is complete (nothing would be left to resume from)."""
    complete = [c.step for c in checkpoints if c.complete]
    if keep <= 0 or not complete:
        return []
    kept = set(complete[-keep:])
    return [c for c in checkpoints if c.step < complete[-1] and c.step not in kept]


def checkpoints_kept(settings: dict[str, Any]) -> int:
    """How many checkpoints the job keeps: the larger of its models' settings, or 0 (every one) when either
    model's is unset or 0, as verl then keeps every save of that model."""
    from verl_pipeline.trainer.owned import ACTOR_KEEP_KEY, CRITIC_KEEP_KEY
    from verl_pipeline.trainer.scaling import uses_critic

    keys = (ACTOR_KEEP_KEY, CRITIC_KEEP_KEY) if uses_critic(settings) else (ACTOR_KEEP_KEY,)
    counts = [int(settings.get(k) or 0) for k in keys]
    return 0 if min(counts) <= 0 else max(counts)


def remove_stale(checkpoint_dir: Path, settings: dict[str, Any]) -> list[Checkpoint]:
    """Remove the run's :func:`stale_checkpoints` for the job's settings (none with Megatron's checkpoints,
    which this module does not inspect); the ones removed, oldest first. Call it only while no attempt runs."""
    import shutil

    from verl_pipeline.trainer.scaling import uses_critic

    if str(settings.get("actor_rollout_ref.actor.strategy", "fsdp")) not in FSDP_STRATEGIES:
        return []
    found = list_checkpoints(checkpoint_dir, contents=save_contents(settings), critic=uses_critic(settings))
    stale = stale_checkpoints(found, checkpoints_kept(settings))
    for c in stale:
        shutil.rmtree(c.path, ignore_errors=True)
    return stale


def saves_at_once(settings: dict[str, Any]) -> int:
    """The most saves the run's checkpoint directory holds at once: keeping ``k`` (:func:`checkpoints_kept`),
    the ``k`` the attempt before left, this attempt's ``k`` and one cut short; keeping every one, every save
    of the run (one each ``trainer.save_freq`` steps, the last step's included)."""
    total = max(1, int(settings.get("trainer.total_training_steps") or 1))
    saves = -(-total // max(1, int(settings.get("trainer.save_freq") or total)))
    keep = checkpoints_kept(settings)
    return min(saves, 2 * keep + 1) if keep > 0 else saves


@dataclass(frozen=True)
class Room:
    """What the run's checkpoints may still take against the free space of their storage (bytes)."""

    #: One save: ``trainer.scaling.SAVE_BYTES_PER_PARAM`` per parameter of each model the run trains.
    save_bytes: int
    #: :func:`saves_at_once`.
    saves: int
    #: What those saves may add to what the checkpoint directory holds now.
    need: int
    free: int

    @property
    def short(self) -> bool:
        return self.need > self.free


def checkpoint_room(checkpoint_dir: Path, settings: dict[str, Any], params_b: float) -> Room:
    """The :class:`Room` of a run whose models have ``params_b`` billion parameters (the checkpoint directory,
    or its nearest existing parent, gives the free space)."""
    from verl_pipeline.paths import free_bytes
    from verl_pipeline.trainer.scaling import SAVE_BYTES_PER_PARAM, uses_critic

    save = int(params_b * 1e9 * SAVE_BYTES_PER_PARAM) * (2 if uses_critic(settings) else 1)
    saves = saves_at_once(settings)
    held = sum(f.stat().st_size for f in checkpoint_dir.rglob("*") if f.is_file()) if checkpoint_dir.is_dir() else 0
    return Room(save, saves, max(0, save * saves - held), free_bytes(checkpoint_dir))


def save_contents(settings: dict[str, Any]) -> tuple[str, ...]:
    value = settings.get("actor_rollout_ref.actor.checkpoint.save_contents")
    return tuple(str(v) for v in value) if isinstance(value, list | tuple) else DEFAULT_SAVE_CONTENTS


def train_world_size(settings: dict[str, Any]) -> int:
    """The world size verl's actor (and critic) shards are written for: the training pool."""
    return int(settings.get("trainer.nnodes", 1)) * int(settings.get("trainer.n_gpus_per_node", 1))


def plan_for_job(checkpoint_dir: Path, settings: dict[str, Any],
                 on_world_size_change: WorldSizeChange = WorldSizeChange.FAIL) -> ResumePlan | None:
    """:func:`plan_resume` for a rendered job's settings; None when its checkpoints are not FSDP shards."""
    from verl_pipeline.trainer.scaling import uses_critic

    strategy = str(settings.get("actor_rollout_ref.actor.strategy", "fsdp"))
    if strategy not in FSDP_STRATEGIES:
        return None
    found = list_checkpoints(checkpoint_dir, contents=save_contents(settings), critic=uses_critic(settings))
    return plan_resume(found, tracker_step(checkpoint_dir), world_size=train_world_size(settings),
                       on_world_size_change=on_world_size_change)


def newest_run_step(checkpoint_dir: Path, settings: dict[str, Any]) -> int:
    """The run step of the run's newest complete checkpoint, whatever its world size (0: none yet): what
    the next attempt resumes from. In a segment after a merge, counted from the run's start; checkpoints
    this module does not inspect (Megatron), the step verl's tracker names."""
    from verl_pipeline.trainer.scaling import uses_critic

    ckpt, start, _ = current_segment(checkpoint_dir)
    if str(settings.get("actor_rollout_ref.actor.strategy", "fsdp")) not in FSDP_STRATEGIES:
        return start + (tracker_step(ckpt) or 0)
    complete = [c for c in list_checkpoints(ckpt, contents=save_contents(settings), critic=uses_critic(settings))
                if c.complete]
    return start + (complete[-1].step if complete else 0)


@dataclass(frozen=True)
class Segment:
    """A part of the run trained from merged weights after the world size changed (index 2, 3, …)."""

    index: int
    #: Run steps done before it: its verl step ``s`` is run step ``start_step + s``.
    start_step: int
    #: Its own ``trainer.default_local_dir``.
    checkpoint_dir: str
    #: The merged HuggingFace weights its actor starts from.
    model_path: str
    world_size: int
    #: The checkpoint that was merged.
    merged_from: str

    def settings(self, total_steps: int) -> dict[str, Any]:
        """The verl keys that make an attempt train this segment (before its resume keys)."""
        return {"trainer.default_local_dir": self.checkpoint_dir, "actor_rollout_ref.model.path": self.model_path,
                "trainer.total_training_steps": total_steps - self.start_step}


def read_segments(checkpoint_dir: Path) -> list[Segment]:
    """The run's segments after the first, oldest first (``segments.json``; empty when it never merged)."""
    try:
        rows = json.loads((checkpoint_dir / SEGMENTS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [Segment(**row) for row in rows]


def record_segment(checkpoint_dir: Path, segment: Segment) -> None:
    from dataclasses import asdict

    from verl_pipeline.paths import write_json_atomic

    rows = [asdict(s) for s in read_segments(checkpoint_dir) if s.index != segment.index]
    write_json_atomic(checkpoint_dir / SEGMENTS_FILE, [*rows, asdict(segment)])


def current_segment(checkpoint_dir: Path) -> tuple[Path, int, int]:
    """Where the run's newest checkpoints are: (verl's checkpoint dir, the segment's start step, its index)."""
    segments = read_segments(checkpoint_dir)
    if not segments:
        return checkpoint_dir, 0, 1
    last = segments[-1]
    return Path(last.checkpoint_dir), last.start_step, last.index


def new_segment(checkpoint_dir: Path, plan: ResumePlan, *, world_size: int, job_id: str) -> Segment:
    """Merge ``plan``'s checkpoint (``plan.merge``) into the next segment's starting weights and record it."""
    from verl_pipeline.trainer.merge import merge_checkpoint

    if not plan.merge or plan.path is None:
        raise ValueError("new_segment needs a merge plan")
    _, start, index = current_segment(checkpoint_dir)
    folder = checkpoint_dir / f"segment_{index + 1}"
    merged = folder / f"merged_from_step_{start + plan.step}"
    merge_checkpoint(Path(plan.path) / "actor", merged, job_id=job_id)
    segment = Segment(index + 1, start + plan.step, str(folder / "checkpoints"), str(merged), world_size, plan.path)
    record_segment(checkpoint_dir, segment)
    return segment


__all__ = ["Checkpoint", "ResumeMode", "ResumePlan", "Segment", "current_segment", "inspect_checkpoint", "intact",
           "list_checkpoints", "new_segment", "newest_run_step", "plan_for_job", "plan_resume", "read_segments",
           "record_segment", "train_world_size"]
