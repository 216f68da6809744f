"""Which checkpoint a retry resumes from: verl's FSDP layout read from real folders (no Ray)."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.checkpoints import (
    ResumeMode,
    checkpoint_room,
    checkpoints_kept,
    inspect_checkpoint,
    intact,
    list_checkpoints,
    plan_for_job,
    plan_resume,
    remove_stale,
    saves_at_once,
    stale_checkpoints,
)
from verl_pipeline.rundir import tracker_step
from verl_pipeline.trainer.render import RenderedJob, with_settings
from verl_pipeline.trainer.scaling import SAVE_BYTES_PER_PARAM


def _archive() -> bytes:
    """Bytes shaped like a ``torch.save`` file (a zip archive)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 100)
    return buf.getvalue()


def save(root: Path, step: int, *, world: int = 2, critic: bool = True, skip: tuple[str, ...] = (),
         tracker: bool = True) -> Path:
    """A ``global_step_N`` folder as verl's FSDP checkpoint manager writes it; ``skip`` leaves files out."""
    folder = root / f"global_step_{step}"
    names = [f"{role}/{prefix}_world_size_{world}_rank_{r}.pt" for role in (("actor", "critic") if critic else
             ("actor",)) for r in range(world) for prefix in ("model", "optim", "extra_state")]
    for name in [*names, "data.pt"]:
        if name in skip:
            continue
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(_archive())
    (folder / "actor" / "fsdp_config.json").write_text(f'{{"FSDP_version": 1, "world_size": {world}}}')
    if tracker:
        (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def test_a_complete_checkpoint_names_its_world_size(tmp_path: Path) -> None:
    c = inspect_checkpoint(save(tmp_path, 4, world=4), critic=True)
    assert (c.step, c.world_size, c.missing, c.complete) == (4, 4, (), True)


@pytest.mark.parametrize("gone", ["actor/model_world_size_2_rank_1.pt", "actor/optim_world_size_2_rank_0.pt",
                                  "actor/extra_state_world_size_2_rank_1.pt", "critic/model_world_size_2_rank_0.pt",
                                  "data.pt"])
def test_any_missing_file_makes_it_incomplete(tmp_path: Path, gone: str) -> None:
    c = inspect_checkpoint(save(tmp_path, 2, skip=(gone,)), critic=True)
    assert c.missing == (gone,) and not c.complete


def test_the_critic_is_required_only_when_the_run_uses_one(tmp_path: Path) -> None:
    folder = save(tmp_path, 2, critic=False)
    assert inspect_checkpoint(folder, critic=False).complete
    assert not inspect_checkpoint(folder, critic=True).complete


def test_only_the_configured_contents_are_required(tmp_path: Path) -> None:
    folder = save(tmp_path, 2, critic=False, skip=("actor/optim_world_size_2_rank_0.pt",
                                                    "actor/optim_world_size_2_rank_1.pt"))
    assert not inspect_checkpoint(folder).complete
    assert inspect_checkpoint(folder, contents=("model", "extra")).complete


def test_a_shard_cut_short_is_not_intact(tmp_path: Path) -> None:
    folder = save(tmp_path, 2, critic=False)
    shard = folder / "actor" / "model_world_size_2_rank_1.pt"
    shard.write_bytes(_archive()[:60])  # torch.save killed mid-write: no end record
    assert not intact(shard)
    assert inspect_checkpoint(folder).missing == ("actor/model_world_size_2_rank_1.pt",)
    shard.write_bytes(b"")
    assert not intact(shard)


def test_tracker_step_is_none_when_missing_or_empty(tmp_path: Path) -> None:
    assert tracker_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")  # open("w") done, the write never came
    assert tracker_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6\n")
    assert tracker_step(tmp_path) == 6


def test_tracker_naming_the_newest_complete_keeps_auto(tmp_path: Path) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4)
    plan = plan_resume(list_checkpoints(tmp_path, critic=True), tracker_step(tmp_path), world_size=2)
    assert (plan.mode, plan.step, plan.skipped) == (ResumeMode.AUTO, 4, ())
    assert plan.settings() == {"trainer.resume_mode": "auto"}


def test_killed_mid_save_resumes_the_previous_complete_one(tmp_path: Path) -> None:
    save(tmp_path, 2)
    # Step 4's save died after rank 0's shards: the tracker still names 2.
    save(tmp_path, 4, skip=("actor/model_world_size_2_rank_1.pt",), tracker=False)
    plan = plan_resume(list_checkpoints(tmp_path, critic=True), tracker_step(tmp_path), world_size=2)
    assert (plan.mode, plan.step) == (ResumeMode.AUTO, 2)
    assert plan.skipped and plan.skipped[0].startswith("global_step_4 (missing actor/model_world_size_2_rank_1.pt")


def test_tracker_naming_an_incomplete_checkpoint_resumes_by_path(tmp_path: Path) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4, skip=("critic/optim_world_size_2_rank_1.pt",))  # tracker says 4
    plan = plan_resume(list_checkpoints(tmp_path, critic=True), tracker_step(tmp_path), world_size=2)
    assert (plan.mode, plan.step) == (ResumeMode.RESUME_PATH, 2)
    assert plan.settings() == {"trainer.resume_mode": "resume_path",
                               "trainer.resume_from_path": str(tmp_path / "global_step_2")}


def test_an_empty_tracker_resumes_the_newest_complete_by_path(tmp_path: Path) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")  # verl's auto would fail on int("")
    plan = plan_resume(list_checkpoints(tmp_path, critic=True), tracker_step(tmp_path), world_size=2)
    assert (plan.mode, plan.step, plan.path) == (ResumeMode.RESUME_PATH, 4, str(tmp_path / "global_step_4"))


def test_nothing_complete_starts_over_and_nothing_saved_keeps_auto(tmp_path: Path) -> None:
    assert plan_resume([], None, world_size=2).mode is ResumeMode.AUTO
    save(tmp_path, 2, skip=("data.pt",))
    plan = plan_resume(list_checkpoints(tmp_path, critic=True), tracker_step(tmp_path), world_size=2)
    assert (plan.mode, plan.step) == (ResumeMode.DISABLE, 0)


def test_another_world_size_is_refused_naming_both(tmp_path: Path) -> None:
    save(tmp_path, 4, world=4)
    with pytest.raises(ConfigError) as e:
        plan_resume(list_checkpoints(tmp_path, critic=True), 4, world_size=2)
    text = str(e.value)
    assert "world size 4" in text and "world size 2" in text and "\n" not in text
    assert "4 GPUs again" in text and "new DAG run" in text


def test_plan_for_job_reads_the_rendered_settings(tmp_path: Path) -> None:
    save(tmp_path, 2, world=2, critic=False)
    settings = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 2, "algorithm.adv_estimator": "grpo"}
    plan = plan_for_job(tmp_path, settings)
    assert plan is not None and (plan.mode, plan.step) == (ResumeMode.AUTO, 2)
    with pytest.raises(ConfigError):
        plan_for_job(tmp_path, {**settings, "trainer.n_gpus_per_node": 1})
    # GAE uses a critic: its shards are missing, so nothing is complete.
    gae = plan_for_job(tmp_path, {**settings, "algorithm.adv_estimator": "gae"})
    assert gae is not None and gae.mode is ResumeMode.DISABLE
    assert plan_for_job(tmp_path, {**settings, "actor_rollout_ref.actor.strategy": "megatron"}) is None


def test_stale_checkpoints_are_the_complete_ones_past_the_kept_and_the_incomplete_ones_before_the_newest(
        tmp_path: Path) -> None:
    """An earlier attempt's leftovers: verl pruned steps 1-2 to their data.pt, 3-5 are complete, 6 was cut
    short before 7 completed, 8 was cut short by the node loss that ended the attempt."""
    for step in range(1, 9):
        save(tmp_path, step, critic=False)
    for step in (1, 2):
        shutil.rmtree(tmp_path / f"global_step_{step}" / "actor")
    for step in (6, 8):
        (tmp_path / f"global_step_{step}" / "data.pt").unlink()
    found = list_checkpoints(tmp_path)
    assert [c.step for c in stale_checkpoints(found, 2)] == [1, 2, 3, 4, 6]
    assert [c.step for c in stale_checkpoints(found, 1)] == [1, 2, 3, 4, 5, 6]
    assert [c.step for c in stale_checkpoints(found, 10)] == [1, 2, 6]  # only leftovers: 3-5 and 7 stay
    assert stale_checkpoints(found, 0) == []  # 0 keeps every one
    # Nothing complete: nothing is removed (the next attempt starts over, and what is there may be all there is).
    assert stale_checkpoints([c for c in found if not c.complete], 2) == []


def test_remove_stale_reads_how_many_to_keep_from_the_jobs_settings(tmp_path: Path) -> None:
    settings = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 2, "algorithm.adv_estimator": "gae",
                "trainer.max_actor_ckpt_to_keep": 2, "trainer.max_critic_ckpt_to_keep": 3}
    for step in range(1, 6):
        save(tmp_path, step)
    assert checkpoints_kept(settings) == 3  # the larger: the critic still needs its third newest
    assert [c.step for c in remove_stale(tmp_path, settings)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_3", "global_step_4", "global_step_5", "latest_checkpointed_iteration.txt"]
    # Unset (verl keeps every one), 0 for either model, or Megatron's checkpoints: nothing is removed.
    megatron = {"trainer.max_actor_ckpt_to_keep": 1, "actor_rollout_ref.actor.strategy": "megatron"}
    for keep_all in ({**settings, "trainer.max_actor_ckpt_to_keep": None},
                     {**settings, "trainer.max_critic_ckpt_to_keep": 0}, {**settings, **megatron}):
        assert remove_stale(tmp_path, keep_all) == []
    assert len(list_checkpoints(tmp_path, critic=True)) == 3


def test_the_saves_a_run_holds_at_once_are_bounded_by_what_it_keeps() -> None:
    week = {"trainer.total_training_steps": 10_000, "trainer.save_freq": 100, "trainer.max_actor_ckpt_to_keep": 2,
            "algorithm.adv_estimator": "grpo"}  # the actor alone: its setting decides
    assert saves_at_once(week) == 5  # the attempt before's 2, this attempt's 2, one cut short
    assert saves_at_once({**week, "trainer.max_actor_ckpt_to_keep": 0}) == 100  # every save of the run
    assert saves_at_once({**week, "trainer.total_training_steps": 150}) == 2  # steps 100 and 150
    assert saves_at_once({"trainer.total_training_steps": 6}) == 1  # unset save_freq: one save, at the end


def test_the_room_a_runs_checkpoints_need_against_its_storages_free_space(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    from verl_pipeline.steps import warn_checkpoint_room

    settings = {"trainer.total_training_steps": 6, "trainer.save_freq": 1, "trainer.max_actor_ckpt_to_keep": 2,
                "trainer.max_critic_ckpt_to_keep": 2, "algorithm.adv_estimator": "gae"}
    ckpt = tmp_path / "checkpoints" / "run"  # not made yet: its parent's storage answers
    small = checkpoint_room(ckpt, settings, params_b=1e-6)  # 1,000 parameters, actor and critic
    assert (small.save_bytes, small.saves, small.need) == (2 * 1000 * SAVE_BYTES_PER_PARAM, 5, 120_000)
    assert not small.short and small.free > 0
    save(ckpt, 1, world=1)  # what the directory holds already counts
    held = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert checkpoint_room(ckpt, settings, params_b=1e-6).need == 120_000 - held
    assert checkpoint_room(ckpt, settings, params_b=1e6).short  # a million billion parameters fit nowhere
    with caplog.at_level("WARNING", logger="verl_pipeline.steps"):
        warn_checkpoint_room(ckpt, settings, 1e-6)
        assert caplog.records == []
        warn_checkpoint_room(ckpt, settings, 1e6)
    (record,) = caplog.records
    assert "may not fit" in record.getMessage() and "trainer.max_actor_ckpt_to_keep" in record.getMessage()


def test_with_settings_renders_the_entrypoint_again() -> None:
    job = RenderedJob(mode=Mode.TRAIN, entrypoint="python -m verl.trainer.main_ppo trainer.resume_mode=auto",
                      overrides=["trainer.resume_mode=auto"], runtime_env={}, settings={"trainer.resume_mode": "auto"},
                      derived={})
    out = with_settings(job, {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "/c/global_step_2"},
                        {"trainer.resume_mode": "why"})
    assert out.entrypoint == ("python -m verl.trainer.main_ppo trainer.resume_from_path=/c/global_step_2 "
                              "trainer.resume_mode=resume_path")
    assert out.derived["trainer.resume_mode"] == "why" and job.settings["trainer.resume_mode"] == "auto"
