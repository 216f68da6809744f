"""The model's size facts: a profile that contradicts the model's own config.json is refused, what it leaves out
is taken from the config, at provision (a model on this machine) and after the prefetch (any model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.models.prefetch import config_on_this_machine, prefetch_roles
from verl_pipeline.models.tiny import config_facts as tiny_config
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.spec import ModelSource
from verl_pipeline.trainer.modelfacts import check_prefetched, estimate_params_b_from_config, facts_for, read_config


def _model(tiny_model_path: Path, dest: Path, **config: object) -> Path:
    """The tiny model's files with ``config`` changed in its config.json (what the facts are read from)."""
    shutil.copytree(tiny_model_path, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    return dest


def test_a_local_model_contradicting_its_profile_is_refused_naming_both(tiny_model_path: Path,
                                                                        tmp_path: Path) -> None:
    model = _model(tiny_model_path, tmp_path / "mm", num_attention_heads=28)
    with pytest.raises(ConfigError) as e:
        build_run_spec({"model_source": str(model)}, run_name="facts/heads", model_profile="tiny-grpo")
    message = str(e.value)
    assert "\n" not in message
    assert (e.value.key, e.value.value) == ("models/tiny-grpo.model.num_attention_heads", 2)
    assert f"contradicts the model's own {model / 'config.json'}: num_attention_heads=28" in message
    assert "num_attention_heads: 28 in the model profile" in message


def test_facts_a_profile_leaves_out_are_taken_from_the_config(tiny_model_path: Path, own_configs: Path,
                                                              tmp_path: Path) -> None:
    model = _model(tiny_model_path, tmp_path / "mm", num_attention_heads=28, num_key_value_heads=4,
                   hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, vocab_size=152064,
                   tie_word_embeddings=False)
    prof = yaml.safe_load((own_configs / "models" / "tiny-grpo.yaml").read_text())
    prof["model"] = {"source": str(model)}  # no facts: all from config.json
    (own_configs / "models" / "bare.yaml").write_text(yaml.safe_dump(prof))
    spec = build_run_spec({}, run_name="facts/taken", model_profile="bare", cluster_profile="h100-ib")
    facts = spec.model_facts
    assert facts is not None and facts.config_file == str(model / "config.json")
    assert (facts.hidden_size, facts.num_layers, facts.num_attention_heads, facts.num_key_value_heads,
            facts.vocab_size, facts.intermediate_size) == (3584, 28, 28, 4, 152064, 18944)
    # params_b from the whole shape (Qwen2.5-7B's: 7.6B with its biases and norms), marked as estimated.
    assert facts.estimated and 7.5 < facts.params_b < 7.7


def test_the_config_estimate_of_params_is_the_models_own_count(tiny_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = read_config(tiny_model_path)
    assert config is not None
    counted = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path,
                                                                          dtype=torch.bfloat16).parameters())
    estimate = estimate_params_b_from_config(config[0])
    assert estimate is not None and abs(estimate * 1e9 - counted) / counted < 0.01  # biases and norms left out


def test_the_builtin_models_config_is_read_without_building_it(tiny_model_path: Path) -> None:
    found = config_on_this_machine(ModelSource("builtin", "tiny-qwen2"))
    built = read_config(tiny_model_path)
    assert found is not None and built is not None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "tie_word_embeddings"):
        assert found[0][key] == built[0][key] == tiny_config()[key], key
    # The shipped tiny profiles agree with it (a contradiction would be refused at provision).
    for profile in ("tiny-grpo", "tiny-ppo"):
        facts = build_run_spec({}, run_name="facts/tiny", model_profile=profile,
                               model_config=config_on_this_machine).model_facts
        assert facts is not None and facts.config_file is not None and facts.num_key_value_heads == 2
    assert config_on_this_machine(ModelSource("hf", "Qwen/Qwen2.5-0.5B-Instruct", "main")) is None


def test_any_model_is_checked_after_the_prefetch(tiny_model_path: Path, tmp_path: Path, own_configs: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    # A model profile that leaves num_key_value_heads out.
    profile = own_configs / "models" / "tiny-grpo.yaml"
    doc = yaml.safe_load(profile.read_text())
    del doc["model"]["num_key_value_heads"]
    profile.write_text(yaml.safe_dump(doc))
    # A spec built where the model was not readable (a hub model, a path on storage this machine lacks).
    model = _model(tiny_model_path, tmp_path / "mm", num_hidden_layers=2)
    spec = build_run_spec({"model_source": str(model)}, run_name="facts/after", model_profile="tiny-grpo",
                          model_config=lambda source: None)
    assert spec.model_facts is not None and spec.model_facts.config_file is None
    out = prefetch_roles(spec, ["actor"], cache_root=tmp_path / "cache")
    assert out["actor"]["path"] == str(model)
    # The profile leaves num_key_value_heads out: said, with the value the config has.
    assert "num_key_value_heads: the model's" in caplog.text and "num_key_value_heads=2" in caplog.text
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    with pytest.raises(ConfigError, match=r"models/tiny-grpo\.model\.hidden_size=128: contradicts the model's own "
                                          r".*config\.json: hidden_size=256"):
        prefetch_roles(spec, ["actor"], cache_root=tmp_path / "cache2")


def test_check_prefetched_names_what_the_rules_assumed() -> None:
    facts = facts_for({"hidden_size": 128, "num_layers": 2, "num_attention_heads": 2}, "p", None)
    notes = check_prefetched(facts, ({"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "vocab_size": 843, "intermediate_size": 256}, "/m/config.json"), profile="p")
    assert notes == [
        "vocab_size: the model's /m/config.json has vocab_size=843; the scaling rules of this run assumed the token "
        "budgets stay at verl's floor (set vocab_size: 843 in models/p.yaml)",
        "intermediate_size: the model's /m/config.json has intermediate_size=256; the scaling rules of this run "
        "assumed 4 x hidden_size (set intermediate_size: 256 in models/p.yaml)"]
