"""Filter once: verl's filter_overlong_prompts is off only when preprocessing did the same filter."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.constants import Mode
from verl_pipeline.data.preprocess import preprocess
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.spec import DataSource
from verl_pipeline.trainer.prefilter import filter_already_done
from verl_pipeline.trainer.render import render_job

RECORD = {"tokenizer": "/m/actor", "tokenizer_digest": "abc", "max_prompt_length": 256}
SETTINGS = {"data.filter_overlong_prompts": True, "data.max_prompt_length": 256}


def test_a_matching_record_turns_verl_filter_off() -> None:
    reason = filter_already_done(RECORD, SETTINGS, "abc")
    assert reason is not None and "256" in reason
    assert filter_already_done(RECORD, {**SETTINGS, "data.max_prompt_length": 512}, "abc")  # stricter is enough


@pytest.mark.parametrize(("record", "settings", "digest"), [
    (RECORD, SETTINGS, "other"),  # another tokenizer
    (RECORD, SETTINGS, None),  # the model's tokenizer is not readable here
    ({**RECORD, "max_prompt_length": 512}, SETTINGS, "abc"),  # preprocessing let longer prompts through
    ({k: v for k, v in RECORD.items() if k != "tokenizer_digest"}, SETTINGS, "abc"),  # older data: not recorded
    ("off (no tokenizer or max_prompt_length)", SETTINGS, "abc"),
    (RECORD, {**SETTINGS, "data.apply_chat_template_kwargs": {"enable_thinking": True}}, "abc"),
    (RECORD, {**SETTINGS, "data.tool_config_path": "/t.yaml"}, "abc"),
    # verl's data.tool_config_path and function_tool_path default to the rollout's multi_turn keys.
    (RECORD, {**SETTINGS, "actor_rollout_ref.rollout.multi_turn.tool_config_path": "/t.yaml"}, "abc"),
    (RECORD, {**SETTINGS, "actor_rollout_ref.rollout.multi_turn.function_tool_path": "/tools.py"}, "abc"),
    (RECORD, {**SETTINGS, "data.custom_cls.path": "/my_dataset.py"}, "abc"),
    (RECORD, {**SETTINGS, "data.prompt_key": "question"}, "abc"),
    (RECORD, {**SETTINGS, "data.filter_overlong_prompts": False}, "abc"),  # already off: nothing to change
])
def test_verl_filter_stays_as_configured_otherwise(record: Any, settings: dict[str, Any], digest: str | None) -> None:
    assert filter_already_done(record, settings, digest) is None


def _render(model: Path, length_filter: dict[str, Any], overrides: dict[str, Any] | None = None) -> list[str]:
    spec = build_run_spec({}, run_name="verl_ppo/filter_once", overrides=overrides)
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/train.parquet", val_files="/d/val.parquet",
                     model_path=str(model), length_filter=length_filter)
    return shlex.split(job.entrypoint)


def test_preprocessed_with_the_run_tokenizer_renders_filter_off(tmp_path: Path, tiny_model_path: Path) -> None:
    spec = build_run_spec({}, run_name="verl_ppo/filter_once")
    limit = int(spec.verl["data.max_prompt_length"])
    r = preprocess(DataSource("builtin", "arithmetic"), {"train_size": 40, "val_size": 8}, tmp_path / "data",
                   tokenizer=str(tiny_model_path), max_prompt_length=limit)
    record = json.loads((Path(r.output_dir) / "stats.json").read_text())["length_filter"]
    assert record["tokenizer_digest"] and record["max_prompt_length"] == limit
    assert "data.filter_overlong_prompts=false" in _render(tiny_model_path, record)
    # The same data for a model whose chat template differs: verl must measure again.
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_path, other)
    config = other / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = "SYSTEM: be brief\n" + str(cfg.get("chat_template", ""))
    config.write_text(json.dumps(cfg))
    assert "data.filter_overlong_prompts=true" in _render(other, record)


def test_a_tool_config_on_the_rollout_keeps_verl_filter_on(tmp_path: Path, tiny_model_path: Path) -> None:
    """verl renders the tool schemas into the prompts it measures: a record made without them cannot
    stand in, whichever of verl's keys names the tools."""
    spec = build_run_spec({}, run_name="verl_ppo/filter_once")
    limit = int(spec.verl["data.max_prompt_length"])
    r = preprocess(DataSource("builtin", "arithmetic"), {"train_size": 40, "val_size": 8}, tmp_path / "data",
                   tokenizer=str(tiny_model_path), max_prompt_length=limit)
    record = json.loads((Path(r.output_dir) / "stats.json").read_text())["length_filter"]
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    for key in ("actor_rollout_ref.rollout.multi_turn.tool_config_path", "data.tool_config_path"):
        words = _render(tiny_model_path, record, {key: str(tools)})
        assert "data.filter_overlong_prompts=true" in words, key
        # The file is off shared storage: it ships in the job's working_dir, named there by its file name.
        assert f"{key}={tools.name}" in words
