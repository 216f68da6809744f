"""What every trainer start pays for the data: verl's ``RLHFDataset`` with ``filter_overlong_prompts`` on and off.

Usage: .venv/bin/python bench/rlhf_dataset_filter.py [--rows 1000000] [--work /tmp/vp-bench-rlhf]
       [--gsm8k ../shared/data/gsm8k] [--max-prompt-length 512]

Input: the real GSM8K train+test rows (../shared/data/gsm8k; generated GSM8K-shaped problems when it is
absent) preprocessed by this project into verl's parquet rows (with the built-in tiny model's tokenizer,
the one the project's tiny profiles use), then tiled to N rows in one parquet file.

Each measurement runs in its own process with a fresh ``datasets`` cache (a new node, or a new
attempt's cluster, starts cold): ``RLHFDataset(data_files=[…], tokenizer, config)`` as verl's trainer
builds it (``filter_overlong_prompts_workers`` at verl's default, max(1, cpus // 4)). Reported:
wall seconds to a usable dataset, rows kept, peak RSS of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MEASURE = r'''
import json, resource, sys, time
from omegaconf import OmegaConf
t0 = time.monotonic()
from verl.utils import hf_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
t_import = time.monotonic() - t0
path, model, cache, limit, on = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "on"
tok = hf_tokenizer(model)
cfg = OmegaConf.create({"max_prompt_length": limit, "filter_overlong_prompts": on, "cache_dir": cache})
t1 = time.monotonic()
ds = RLHFDataset(data_files=[path], tokenizer=tok, config=cfg)
seconds = time.monotonic() - t1
print("RESULT " + json.dumps({"rows": len(ds), "seconds": round(seconds, 2), "import_s": round(t_import, 2),
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
'''


def _source(gsm8k: Path, work: Path) -> str:
    if (gsm8k / "train.jsonl").is_file():
        return str(gsm8k)
    from verl_pipeline.data.generator import generate_problems

    path = work / "generated.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for p in generate_problems(8000, seed=1):
            f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
    return str(path)


def build_input(rows: int, work: Path, gsm8k: Path, limit: int) -> tuple[Path, str, int]:
    """The tiled parquet of ``rows`` rows, the tokenizer's directory, and the rows preprocessing kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_pipeline.data.preprocess import preprocess
    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.spec import DataSource, ModelSource

    model = prefetch(ModelSource("builtin", "tiny-qwen2"), work / "models").path
    r = preprocess(DataSource.parse(_source(gsm8k, work)), {}, work / "data", tokenizer=model,
                   max_prompt_length=limit)
    base = pq.read_table(r.train_path)
    out = work / f"train-{rows}.parquet"
    if not out.is_file():
        reps = -(-rows // base.num_rows)
        pq.write_table(pa.concat_tables([base] * reps).slice(0, rows), out)
    return out, model, base.num_rows


def measure(path: Path, model: str, limit: int, on: bool) -> dict[str, object]:
    cache = Path(tempfile.mkdtemp(prefix="vp-rlhf-cache-"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(path), model, str(cache / "verl"), str(limit),
                               "on" if on else "off"], capture_output=True, text=True, env=env, check=False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"measurement failed: {proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(line[len("RESULT "):])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vp-bench-rlhf")
    ap.add_argument("--gsm8k", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    ap.add_argument("--max-prompt-length", type=int, default=512)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"cpus: {os.cpu_count()}; max_prompt_length {args.max_prompt_length}; built-in tiny model's tokenizer")
    print("| rows | filter_overlong_prompts | seconds | rows/s | rows kept | peak RSS (MB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in args.rows:
        path, model, _ = build_input(rows, args.work, args.gsm8k, args.max_prompt_length)
        for on in (True, False):
            r = measure(path, model, args.max_prompt_length, on)
            rate = rows / float(r["seconds"]) if float(r["seconds"]) > 0 else float("inf")  # type: ignore[arg-type]
            print(f"| {rows:,} | {'on' if on else 'off'} | {r['seconds']} | {rate:,.0f} | {r['rows']:,} | "
                  f"{r['peak_rss_mb']:,} |", flush=True)


if __name__ == "__main__":
    main()
