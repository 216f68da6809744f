"""Cache-hit verification time of ``prefetch`` for a synthetic 10 GB model (target: <= 1 s).

Usage: .venv/bin/python bench/prefetch_cache_hit.py [--gib 10] [--shards 5] [--runs 7] [--dir DIR]

Builds a model directory of sparse safetensors shards (valid headers, tensor byte ranges that fill
each file exactly; the data is holes, so it costs no disk), places it in the hub layout of the
cache with its manifest (as a completed ``hf://`` download leaves it), then times:

- ``prefetch(hf://bench/synthetic@<commit>)``: the repeat run of a pinned hub model (no network);
- the same directory as a local source: first verification (headers + transformers architecture
  check) and the repeat run (manifest check by stat + headers).

Nothing is hashed on a cache hit, so the time does not grow with the size of the weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "torch_dtype": "bfloat16",
}


def write_sparse_shard(path: Path, size: int, tensors: int, index: int) -> None:
    """A valid safetensors file of exactly ``size`` bytes whose tensors (BF16) fill the data section."""
    names = [f"model.layers.{index}.t{i}.weight" for i in range(tensors)]
    # The header length depends on the offsets' digits: pad it to a fixed size with __metadata__.
    header_len = 64 * 1024
    data = size - 8 - header_len
    per = (data // tensors) // 2 * 2
    header: dict[str, object] = {}
    offset = 0
    for i, name in enumerate(names):
        nbytes = per if i < tensors - 1 else data - offset
        header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (header_len - len(raw))
    with path.open("wb") as f:
        f.write(struct.pack("<Q", header_len) + raw)
        f.truncate(size)


def build(root: Path, gib: float, shards: int) -> Path:
    from verl_pipeline.models.manifest import FileEntry, Manifest, list_files

    model = root / "hf" / "bench--synthetic" / COMMIT
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    tiny = root / "tiny"
    from verl_pipeline.models.tiny import build_tiny_model

    build_tiny_model(tiny)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, model / name)
    total = int(gib * 1024**3)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_sparse_shard(model / name, total // shards, 200, i)
        weight_map[f"model.layers.{i}.t0.weight"] = name
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = {rel: FileEntry(size=p.stat().st_size) for rel, p in list_files(model).items()}
    Manifest(source=f"hf://bench/synthetic@{COMMIT}", kind="hf", path=str(model), revision=COMMIT, commit=COMMIT,
             files=files, facts={}).write(model.with_name(f"{COMMIT}.manifest.json"))
    return model


def timed(fn: object, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=10.0)
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to build the synthetic model (default: a temp dir)")
    args = ap.parse_args()

    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.spec import ModelSource

    root = Path(tempfile.mkdtemp(prefix="prefetch-bench-", dir=args.dir))
    try:
        model = build(root, args.gib, args.shards)
        apparent = sum(p.stat().st_size for p in model.iterdir())
        on_disk = sum(p.stat().st_blocks * 512 for p in model.iterdir())
        print(f"synthetic model: {apparent / 1024**3:.2f} GiB apparent, {on_disk / 1024**2:.1f} MiB on disk, "
              f"{args.shards} shards x 200 tensors")
        hub = ModelSource("hf", "bench/synthetic", COMMIT)
        hits = timed(lambda: prefetch(hub, root), args.runs)
        r = prefetch(hub, root)
        assert r.cached and r.bytes == apparent, r

        local = ModelSource("path", str(model))
        first = timed(lambda: prefetch(local, root / "local-cache"), 1)[0]
        local_hits = timed(lambda: prefetch(local, root / "local-cache"), args.runs)
        print(f"hf:// pinned commit, cache hit: median {statistics.median(hits) * 1000:.1f} ms "
              f"(min {min(hits) * 1000:.1f}, max {max(hits) * 1000:.1f}, {args.runs} runs)")
        print(f"local directory, first verification (headers + transformers architecture check): "
              f"{first * 1000:.0f} ms")
        print(f"local directory, repeat (manifest by stat + headers): median "
              f"{statistics.median(local_hits) * 1000:.1f} ms (min {min(local_hits) * 1000:.1f}, "
              f"max {max(local_hits) * 1000:.1f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
