from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.trainer.overrides import entrypoint, flatten, hydra_value, render_overrides

NASTY = [
    "plain",
    "with space",
    "it's",
    'double "quotes"',
    "$(rm -rf /)",
    "`touch /tmp/pwned`; echo hi",
    "a=b,c",
    "[not, a, list]",
    "back\\slash",
    "ends with\\",
    "quote\\'s",
    "123",
    "1e-06",
    "true",
    "null",
    "/abs/path/file.parquet",
    "hf://Qwen/Qwen2.5-0.5B@main",
]


@pytest.mark.parametrize("text", NASTY)
def test_hydra_parses_rendered_strings_back_unchanged(text: str) -> None:
    override = f"data.some_key={hydra_value(text)}"
    parsed = OverridesParser.create().parse_override(override)
    assert parsed.value() == text


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, "true"), (False, "false"), (None, "null"), (8, "8"), (0.5, "0.5"), (["console", "file"], "[console,file]")],
)
def test_hydra_value_primitives(value: object, expected: str) -> None:
    assert hydra_value(value) == expected


def test_lists_parse_as_lists() -> None:
    parsed = OverridesParser.create().parse_override(f"trainer.logger={hydra_value(['console', 'file'])}")
    assert parsed.value() == ["console", "file"]


@pytest.mark.parametrize("text", NASTY)
def test_entrypoint_is_shell_safe(text: str) -> None:
    overrides = render_overrides({"data.train_files": text, "trainer.nnodes": 2})
    line = entrypoint(["python", "-m", "verl.trainer.main_ppo"], overrides)
    # The shell hands the program exactly the words we rendered: no expansion, no injection.
    assert shlex.split(line) == ["python", "-m", "verl.trainer.main_ppo", *overrides]


def test_render_overrides_is_sorted_and_rejects_bad_keys() -> None:
    assert render_overrides({"b.x": 1, "a.y": 2}) == ["a.y=2", "b.x=1"]
    with pytest.raises(ConfigError, match="not a valid verl config key"):
        render_overrides({"data.train files": 1})
    with pytest.raises(ConfigError):
        render_overrides({"x=1 y": 1})


def test_flatten_nested_profile_sections() -> None:
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None}) == {"a.b.c": 1, "a.d": [1, 2], "e": None}


def test_blank_override_lines_are_skipped() -> None:
    from verl_pipeline.trainer.overrides import parse_overrides

    assert parse_overrides(["trainer.save_freq=1", "", "  "], field="verl_overrides") == {"trainer.save_freq": 1}


def test_a_key_is_found_however_the_user_wrote_it() -> None:
    from verl_pipeline.trainer.overrides import spelled

    key = "actor_rollout_ref.model.use_remove_padding"
    cases = [({key: False}, key), ({f"+{key}": False}, f"+{key}"), ({f"++{key}": False}, f"++{key}"),
             ({"actor_rollout_ref.model": {"use_remove_padding": False}}, "actor_rollout_ref.model"),
             ({"+actor_rollout_ref": {"model": {"+use_remove_padding": False}}}, "+actor_rollout_ref")]
    for settings, spelling in cases:
        found = spelled(settings, key)
        assert found is not None and (found.spelling, found.value) == (spelling, False), settings
    # Unset, or a sibling key only: not found (a False value is found: it is set).
    assert spelled({}, key) is None
    assert spelled({"actor_rollout_ref.model": {"use_fused_kernels": True}}, key) is None
    assert spelled({"actor_rollout_ref.model.use_remove_paddings": True}, key) is None
    assert spelled({"actor_rollout_ref.model": "not a section"}, key) is None


def test_a_section_given_whole_is_read_key_by_key_later_items_winning() -> None:
    from verl_pipeline.trainer.overrides import parse_overrides

    items = ["trainer.project_name=a", "trainer={project_name:b,logger:[console,wandb]}", "+trainer={x:{y:1}}",
             "trainer={val_before_train:false}"]
    assert parse_overrides(items) == {"trainer.project_name": "b", "trainer.logger": ["console", "wandb"],
                                      "+trainer.x.y": 1, "trainer.val_before_train": False}
    with pytest.raises(ConfigError, match=r"--set='trainer=\{a-b:1\}': 'trainer.a-b' is not a verl config key"):
        parse_overrides(["trainer={a-b:1}"])
    with pytest.raises(ConfigError, match=r"Hydra cannot read the value"):
        parse_overrides(["trainer={'bad key':1}"])
    # YAML would read {a:b} as a key 'a:b' without a value; the section is read by Hydra's grammar, as verl reads it.
    assert parse_overrides(["trainer={a:b,c:1e-6}"]) == {"trainer.a": "b", "trainer.c": 1e-6}


def test_a_whole_section_override_merges_with_the_pipelines_settings_in_verls_own_config() -> None:
    """``--set 'trainer={logger:[console,wandb],val_before_train:false}'``: verl's composed config keeps the
    user's keys and the pipeline's for the same section (the file logger it reads, the shape, the run's
    checkpoints), as a ``trainer.logger=`` override would."""
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.trainer.overrides import parse_overrides
    from verl_pipeline.trainer.render import job_settings
    from verl_pipeline.trainer.validate import compose

    sets = parse_overrides(["trainer={logger:[console,wandb],val_before_train:false}"])
    spec = build_run_spec({"nnodes": 2}, run_name="pytest/section", overrides=sets)
    cfg = compose(render_overrides(job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet",
                                                model_path="/m/actor")))
    assert list(cfg.trainer.logger) == ["console", "wandb", "file"]  # the user's, then what the pipeline reads
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.nnodes == 2 and cfg.trainer.default_local_dir == str(spec.checkpoint_dir)
    assert cfg.trainer.project_name == "verl_pipeline"  # the profile's, left as it was
    # The whole section in the DAG's verl_overrides param is read the same way.
    param = build_run_spec({"nnodes": 2, "verl_overrides": ["trainer={logger:[console,wandb],val_before_train:false}"]},
                           run_name="pytest/section")
    assert param.verl == spec.verl


def test_a_key_is_spelled_three_ways() -> None:
    from verl_pipeline.trainer.overrides import spellings

    assert spellings("trainer.save_freq") == ("trainer.save_freq", "+trainer.save_freq", "++trainer.save_freq")
