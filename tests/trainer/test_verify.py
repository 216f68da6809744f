"""Model directory verification, manifests, local and fsspec sources, and the run's model plan."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest

from verl_pipeline.exceptions import ConfigError, ModelError
from verl_pipeline.models.prefetch import models_by_role, prefetch
from verl_pipeline.spec import ModelSource
from verl_pipeline.trainer.verify import check_safetensors, verify_model_dir


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model_path, d)
    return d


def _write_safetensors(path: Path, tensors: dict[str, dict[str, object]], data: bytes) -> None:
    header = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_the_tiny_model_verifies(model_dir: Path) -> None:
    facts = verify_model_dir(model_dir)
    assert facts["model_type"] == "qwen2" and facts["architectures"] == ["Qwen2ForCausalLM"]
    assert facts["tensors"] > 10


def test_truncated_weights_name_the_file_and_tensor(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor '.+' bytes \[\d+, \d+\) exceed the \d+ data"):
        verify_model_dir(model_dir)
    weights.write_bytes(data[:4])
    with pytest.raises(ModelError, match=r"model\.safetensors: 4 bytes is too short"):
        verify_model_dir(model_dir)
    weights.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ModelError, match=r"header length .* does not fit the file size"):
        verify_model_dir(model_dir)
    weights.write_bytes(struct.pack("<Q", 4) + b"{oops")
    with pytest.raises(ModelError, match="header is not valid JSON"):
        verify_model_dir(model_dir)


def test_safetensors_shapes_and_dtypes_are_checked(tmp_path: Path) -> None:
    f = tmp_path / "w.safetensors"
    _write_safetensors(f, {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 16)
    assert check_safetensors(f).tensors == 1
    _write_safetensors(f, {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(ModelError, match=r"tensor 'a' occupies 16 bytes but shape \[2, 3\] F32 needs 24"):
        check_safetensors(f)
    _write_safetensors(f, {"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(ModelError, match="unknown dtype 'Q9'"):
        check_safetensors(f)
    _write_safetensors(f, {"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)
    with pytest.raises(ModelError, match="lacks dtype/shape/data_offsets"):
        check_safetensors(f)


def test_config_tokenizer_index_and_architecture(model_dir: Path) -> None:
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelError, match=r"names shard.* missing: model-00002-of-00002\.safetensors"):
        verify_model_dir(model_dir)
    (model_dir / "model.safetensors.index.json").unlink()

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["NotARealForCausalLM"]}))
    with pytest.raises(ModelError, match=r"config\.json: architecture\(s\) NotARealForCausalLM unknown"):
        verify_model_dir(model_dir)
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "not-a-model"}))
    with pytest.raises(ModelError, match=r"config\.json: model_type 'not-a-model' is not one transformers"):
        verify_model_dir(model_dir)
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "x", "auto_map": {"AutoConfig": "a.B"}}))
    with pytest.raises(ModelError, match=r"custom code \(auto_map\) but no \*\.py"):
        verify_model_dir(model_dir)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"config\.json: cannot read JSON"):
        verify_model_dir(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer file"):
        verify_model_dir(model_dir)


def test_local_directory_is_verified_once_then_checked_by_stat(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = prefetch(ModelSource.parse(str(model_dir)), cache)
    assert first.path == str(model_dir) and not first.cached
    again = prefetch(ModelSource.parse(str(model_dir)), cache)
    assert again.cached and again.seconds < 10  # no work redone; the bound survives a busy machine
    # Changed weights are verified again (and a broken file is caught).
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ModelError, match="exceed"):
        prefetch(ModelSource.parse(str(model_dir)), cache)


def test_builtin_manifest_and_readable_files(tmp_path: Path) -> None:
    r = prefetch(ModelSource.parse("builtin:tiny-qwen2"), tmp_path)
    m = json.loads(Path(r.manifest or "").read_text())
    assert m["commit"] == r.commit and "model.safetensors" in m["files"]
    for p in Path(r.path).iterdir():
        assert p.stat().st_mode & 0o044 == 0o044, f"{p} is not readable by the Ray nodes' users"
    assert prefetch(ModelSource.parse("builtin:tiny-qwen2"), tmp_path).cached


def test_fsspec_url_is_copied_once_and_refreshed_when_it_changes(tiny_model_path: Path, tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"/models-{time.monotonic_ns()}/tiny"
    for p in tiny_model_path.iterdir():
        fs.pipe(f"{base}/{p.name}", p.read_bytes())
    fs.pipe(f"{base}/notes.bin", b"ignored by the default patterns")
    url = f"memory://{base}"
    first = prefetch(ModelSource.parse(url), tmp_path)
    local = Path(first.path)
    assert not first.cached and (local / "model.safetensors").read_bytes() == \
        (tiny_model_path / "model.safetensors").read_bytes()
    assert not (local / "notes.bin").exists()
    assert prefetch(ModelSource.parse(url), tmp_path).cached
    fs.pipe(f"{base}/generation_config.json", b'{"changed": true}')
    again = prefetch(ModelSource.parse(url), tmp_path)
    assert not again.cached and json.loads((local / "generation_config.json").read_text()) == {"changed": True}
    with pytest.raises(ModelError, match=r"no such directory|no files under this URL"):
        prefetch(ModelSource.parse("memory:///nothing/here"), tmp_path)


def test_model_source_parsing() -> None:
    assert ModelSource.parse("s3://bucket/models/qwen/").kind == "fsspec"
    assert ModelSource.parse("s3://bucket/models/qwen/").ref == "s3://bucket/models/qwen"
    assert ModelSource.parse("file:///shared/models/m") == ModelSource("path", "/shared/models/m")
    hf = ModelSource.parse("hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0", allow_patterns=["*.json"])
    assert hf.allow_patterns == ("*.json",) and hf == ModelSource("hf", "Qwen/Qwen2.5-0.5B-Instruct", "v1.0")
    with pytest.raises(ConfigError, match="unknown URL scheme 'nope'"):
        ModelSource.parse("nope://x/y")
    with pytest.raises(ConfigError, match="allow_patterns"):
        ModelSource.parse("hf://a/b", allow_patterns="*.json")  # type: ignore[arg-type]


def test_models_by_role_merges_mapped_results() -> None:
    one = {"actor": {"path": "/a"}, "critic": {"path": "/a"}}
    assert models_by_role(one) == one
    assert models_by_role([{"actor": {"path": "/a"}}, {"critic": {"path": "/c"}}]) == {
        "actor": {"path": "/a"}, "critic": {"path": "/c"}}
    assert models_by_role(None) == {}
