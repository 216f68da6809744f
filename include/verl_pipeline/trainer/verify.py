"""Checks that a model directory is one verl can load, each failure naming the file and the problem.

- ``config.json`` parses and names an architecture transformers knows (or ships its own code);
- a tokenizer is present;
- every ``*.safetensors`` header parses and every tensor's byte range fits inside the file;
- a sharded checkpoint's index names only shards that exist.

Reading a safetensors header touches a few KB per file, never the weights, so this is fast on
multi-GB checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError

log = logging.getLogger(__name__)

#: One of these makes a tokenizer transformers can load (fast JSON, sentencepiece, BPE vocab, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "qwen.tiktoken")

#: Bytes per element of each safetensors dtype (sub-byte types count in bits below).
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6,
}
#: A header larger than this is not a safetensors file (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class SafetensorsInfo:
    tensors: int
    data_bytes: int


def _header(path: Path) -> tuple[dict[str, Any], int]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path}: {size} bytes is too short for a safetensors file (truncated download?)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ModelError(f"{path}: safetensors header length {n} does not fit the file size {size} "
                             "(truncated or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ModelError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not a JSON object")
    return header, n


def check_safetensors(path: Path) -> SafetensorsInfo:
    """Parse the header and check every tensor's dtype, shape and byte range against the file size."""
    header, n = _header(path)
    data_size = path.stat().st_size - 8 - n
    end_max = 0
    tensors = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= set(t):
            raise ModelError(f"{path}: tensor {name!r} lacks dtype/shape/data_offsets in the header")
        bits = _DTYPE_BITS.get(str(t["dtype"]))
        if bits is None:
            raise ModelError(f"{path}: tensor {name!r} has unknown dtype {t['dtype']!r}")
        begin, end = (int(x) for x in t["data_offsets"])
        if not 0 <= begin <= end:
            raise ModelError(f"{path}: tensor {name!r} has invalid data_offsets [{begin}, {end}]")
        if end > data_size:
            raise ModelError(f"{path}: tensor {name!r} bytes [{begin}, {end}) exceed the {data_size} data bytes "
                             f"of the file (truncated download?)")
        expected = math.ceil(math.prod(int(d) for d in t["shape"]) * bits / 8)
        if end - begin != expected:
            raise ModelError(f"{path}: tensor {name!r} occupies {end - begin} bytes but shape {t['shape']} "
                             f"{t['dtype']} needs {expected}")
        end_max = max(end_max, end)
        tensors += 1
    return SafetensorsInfo(tensors=tensors, data_bytes=end_max)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e})") from None


def check_files(path: Path) -> dict[str, Any]:
    """Files and headers (no transformers import): config, tokenizer, weights. Returns facts for the manifest."""
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelError(f"model directory {path} has no config.json")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ModelError(f"{config_path}: not a JSON object")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"model directory {path} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)})")
    shards = sorted(path.glob("*.safetensors"))
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        wanted = sorted(set((index.get("weight_map") or {}).values())) if isinstance(index, dict) else []
        missing = [w for w in wanted if not (path / w).is_file()]
        if missing:
            raise ModelError(f"{index_path}: names shard(s) that are missing: {', '.join(missing[:5])}")
    if not shards and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
        raise ModelError(f"model directory {path} has no weights (*.safetensors)")
    tensors = 0
    for shard in shards:
        tensors += check_safetensors(shard).tensors
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures") or [],
            "auto_map": sorted((config.get("auto_map") or {}).keys()), "tensors": tensors}


def check_architecture(path: Path, facts: dict[str, Any]) -> None:
    """The config's model_type and architectures must be ones transformers knows, or ship their own code."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_path = path / "config.json"
    if facts.get("auto_map"):
        code = [p.name for p in path.glob("*.py")]
        if not code:
            raise ModelError(f"{config_path}: uses custom code (auto_map) but no *.py file was fetched: "
                             "add '*.py' to the allow patterns")
        log.warning("%s uses custom model code (%s): verl must run with trust_remote_code", path, ", ".join(code))
        return
    model_type = facts.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelError(f"{config_path}: model_type {model_type!r} is not one transformers "
                         f"{transformers.__version__} knows (newer transformers needed, or a wrong config?)")
    known = set(dir(transformers))
    unknown = [a for a in facts.get("architectures") or [] if a not in known]
    if unknown:
        raise ModelError(f"{config_path}: architecture(s) {', '.join(unknown)} unknown to transformers "
                         f"{transformers.__version__}")


def verify_model_dir(path: Path, *, architecture: bool = True) -> dict[str, Any]:
    """Every check above; ModelError naming the file and the problem on the first failure."""
    facts = check_files(path)
    if architecture:
        check_architecture(path, facts)
    return facts


__all__ = ["TOKENIZER_FILES", "check_architecture", "check_files", "check_safetensors",
           "verify_model_dir"]
