"""The verl keys the pipeline sets: a user's value is honoured or refused before any cluster, never replaced."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.checkpoints import ResumeMode, ResumePlan, Segment
from verl_pipeline.paths import configs_dir
from verl_pipeline.profiles import build_run_spec, list_profiles, load_yaml_profile
from verl_pipeline.trainer.owned import DEFAULT_CHECKPOINTS_KEPT, DEFAULT_PROJECT, OWNED, Ownership, check_owned_keys
from verl_pipeline.trainer.render import job_settings, render_job


def _refused(overrides: dict[str, Any] | None = None, **params: Any) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        build_run_spec(params, run_name="owned/refused", overrides=overrides)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{err.value.key}="), message
    return err.value


# One case per family: the key the error names, and words of the fix it must give.
REFUSED = [
    ("trainer.nnodes", 4, "the nnodes param"),
    ("trainer.n_gpus_per_node", 2, "the n_gpus_per_node param"),
    ("trainer.total_training_steps", 7, "the total_training_steps param"),
    ("trainer.default_local_dir", "/shared/ckpt", "the cluster profile's storage.checkpoints"),
    ("trainer.resume_mode", "disable", "start a new run"),
    ("trainer.resume_from_path", "/shared/ckpt/global_step_2", "start a new run"),
    ("trainer.experiment_name", "mine", "--run-name"),
    ("data.train_files", "/d/train.parquet", "the data_source param"),
    ("data.val_files", "/d/val.parquet", "the data_source param"),
    ("actor_rollout_ref.model.path", "/m/actor", "the model_source param"),
    ("critic.model.path", "/m/critic", "model.critic_source"),
    ("reward.reward_model.model_path", "/m/rm", "model.reward_source"),
]


@pytest.mark.parametrize(("key", "value", "fix"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_key_names_itself_and_what_to_set_instead(key: str, value: Any, fix: str) -> None:
    e = _refused({key: value})
    assert (e.key, e.value) == (key, value)
    assert "the pipeline sets it itself" in e.rule
    assert e.fix is not None and fix in e.fix, str(e)


def test_a_refused_key_is_refused_however_it_is_written() -> None:
    # The verl_overrides param, with a Hydra append prefix.
    e = _refused(verl_overrides=["++trainer.nnodes=2"])
    assert e.key == "trainer.nnodes" and e.fix and "nnodes param" in e.fix
    # A whole section as one override.
    e = _refused({"trainer": {"resume_mode": "disable"}})
    assert e.key == "trainer.resume_mode"


def test_a_refused_key_in_a_profiles_verl_section_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root)
    path = root / "models" / "tiny-ppo.yaml"
    profile = yaml.safe_load(path.read_text())
    profile["verl"]["trainer"]["default_local_dir"] = "/elsewhere"
    path.write_text(yaml.safe_dump(profile))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(root))
    e = _refused()
    assert (e.key, e.value) == ("trainer.default_local_dir", "/elsewhere")


def test_honoured_keys_keep_the_users_value() -> None:
    spec = build_run_spec({"verl_overrides": ["trainer.project_name=team-rl"]}, run_name="owned/honoured",
                          overrides={"trainer.save_freq": 3, "trainer.logger": ["wandb"]})
    s = job_settings(spec, train_files="/d/t", val_files="/d/v", model_path="/m")
    assert s["trainer.project_name"] == "team-rl"
    assert s["trainer.save_freq"] == 3
    assert s["trainer.logger"] == ["wandb", "console", "file"]  # the user's tracker, then what the pipeline reads
    # 0 keeps every checkpoint (verl's meaning); a count is kept as it is; the critic's unset one gets the default.
    spec = build_run_spec({}, run_name="owned/kept", overrides={"trainer.max_actor_ckpt_to_keep": 0})
    s = job_settings(spec, train_files="/d/t", val_files="/d/v", model_path="/m")
    assert (s["trainer.max_actor_ckpt_to_keep"], s["trainer.max_critic_ckpt_to_keep"]) == (0, DEFAULT_CHECKPOINTS_KEPT)


def test_honoured_keys_left_unset_get_the_pipelines_value() -> None:
    spec = build_run_spec({"total_training_steps": 5}, run_name="owned/unset")
    s = job_settings(spec, train_files="/d/t", val_files="/d/v", model_path="/m")
    assert s["trainer.project_name"] == DEFAULT_PROJECT
    assert s["trainer.save_freq"] == 5  # one save, at the end
    assert s["trainer.logger"] == ["console", "file"]
    # The default profile trains a critic (GAE): both models keep the newest 2 checkpoints; without one only the actor.
    assert (s["trainer.max_actor_ckpt_to_keep"], s["trainer.max_critic_ckpt_to_keep"]) == (2, 2)
    grpo = build_run_spec({"model_profile": "tiny-grpo"}, run_name="owned/unset-grpo")
    s = job_settings(grpo, train_files="/d/t", val_files="/d/v", model_path="/m")
    assert s["trainer.max_actor_ckpt_to_keep"] == 2 and "trainer.max_critic_ckpt_to_keep" not in s


@pytest.mark.parametrize("value", [-1, "two", 1.5, True])
def test_a_number_of_checkpoints_kept_that_is_not_one_is_refused(value: Any) -> None:
    e = _refused({"trainer.max_critic_ckpt_to_keep": value})
    assert (e.key, e.value) == ("trainer.max_critic_ckpt_to_keep", value)
    assert e.fix == "trainer.max_critic_ckpt_to_keep=2, or 0 to keep every checkpoint"


@pytest.mark.parametrize("value", [0, -1, -5])
def test_a_save_freq_that_never_saves_is_refused(value: int) -> None:
    e = _refused({"trainer.save_freq": value})
    assert (e.key, e.value) == ("trainer.save_freq", value)
    assert "never save" in e.rule and e.fix and e.fix.startswith("trainer.save_freq=10, or unset")


def test_an_honoured_key_is_refused_when_it_is_not_honourable() -> None:
    e = _refused({"trainer.project_name": " "})
    assert e.key == "trainer.project_name" and "non-empty" in e.rule
    # The pipeline merges the plain key only: an append of it would replace the merged value in Hydra.
    e = _refused(verl_overrides=["+trainer.save_freq=5"])
    assert (e.key, e.fix) == ("+trainer.save_freq", "trainer.save_freq=5")


def test_every_key_the_pipeline_sets_is_in_the_table() -> None:
    spec = build_run_spec({}, run_name="owned/table")  # smoke: PPO with a critic, no owned key set
    settings = job_settings(spec, train_files="/d/t", val_files="/d/v", model_path="/m/actor", critic_path="/m/c",
                            reward_path="/m/rm")
    set_here = {k for k, v in settings.items() if k not in spec.verl or spec.verl[k] != v}
    assert "critic.model.path" in set_here and "reward.reward_model.model_path" in set_here
    assert set_here <= set(OWNED), sorted(set_here - set(OWNED))
    # What the submit sets on a resume, and for a segment after a merge.
    plan = ResumePlan(mode=ResumeMode.RESUME_PATH, step=2, path="/c/global_step_2", reason="r")
    segment = Segment(index=2, start_step=4, checkpoint_dir="/c/segment_2", model_path="/c/merged", world_size=8,
                      merged_from="/c/global_step_4")
    assert {*plan.settings(), *segment.settings(10)} <= set(OWNED)
    # And nothing in the table that no code sets.
    assert set(OWNED) == set_here | set(plan.settings())


def test_the_logged_rule_of_each_owned_key_comes_from_the_table() -> None:
    spec = build_run_spec({"nnodes": 2, "n_gpus_per_node": 4}, run_name="owned/rules")
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v", model_path="/m")
    for key in ("trainer.nnodes", "trainer.default_local_dir", "trainer.resume_mode", "trainer.save_freq",
                "trainer.logger", "data.train_files", "actor_rollout_ref.model.path"):
        owned = OWNED[key]
        assert job.derived[key].startswith(repr(job.settings[key])), key
        said = "yours" if owned.ownership is Ownership.HONOURED else "to change it"
        assert f"({said}: {owned.instead})" in job.derived[key], job.derived[key]
    assert "the nnodes param" in job.derived["trainer.nnodes"]
    assert "storage.checkpoints" in job.derived["trainer.default_local_dir"]


def test_the_training_pool_rule_says_how_the_cluster_was_split() -> None:
    spec = build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib", "placement": "separate"},
                          run_name="owned/pools")
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v", model_path="/m")
    assert job.settings["trainer.nnodes"] == 2
    assert "the training pool of a 4 x 8 cluster" in job.derived["trainer.nnodes"]
    assert "the training pool of a" not in job.derived["trainer.default_local_dir"]


@pytest.mark.parametrize("kind", ["profiles", "models", "clusters"])
def test_no_shipped_profile_sets_a_key_the_pipeline_refuses(kind: str) -> None:
    for name in list_profiles(kind):
        check_owned_keys([load_yaml_profile(kind, name).get("verl") or {}])
