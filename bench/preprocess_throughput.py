"""Preprocessing throughput and peak RSS: this project's ``preprocess`` vs verl's example-script way.

Usage: .venv/bin/python bench/preprocess_throughput.py [--rows 1000000 10000000] [--baseline-max 1000000]
       [--work /tmp/vp-bench] [--gsm8k DIR]

Input: the real GSM8K train+test rows (``--gsm8k``, else ``$VERL_PIPELINE_GSM8K_DIR``: a directory with
train.jsonl and test.jsonl) replicated to N rows as one JSONL file.
Copy k of a row gets the prefix ``[k] `` on its question so that every prompt stays distinct (else
the deduplication would remove all but the first copy and the runs would not write the same rows).

Each measurement runs in its own process; peak RSS is that process's ``ru_maxrss``.

- ``project``: ``verl_pipeline.data.preprocess.preprocess`` with every per-row check, deduplication
  and the length filter (built-in tiny model's tokenizer, chat template, max_prompt_length 512 as in
  the qwen2.5-0.5b profile).
- ``project (no length filter)``: the same without a tokenizer.
- ``baseline``: what verl's ``examples/data_preprocess/gsm8k.py`` does: ``datasets.load_dataset("json")``,
  ``Dataset.map`` with a per-row Python function building the verl row, ``to_parquet``, on one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASELINE = r'''
import json, re, sys, time
import datasets
src, out, cache = sys.argv[1], sys.argv[2], sys.argv[3]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
def extract_solution(solution_str):
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    return solution.group(0).split("#### ")[1].replace(",", "")
def make_map_fn(split):
    def process_fn(example, idx):
        question_raw = example.pop("question")
        question = question_raw + " " + INSTRUCTION
        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw}}
    return process_fn
t0 = time.monotonic()
ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
ds = ds.map(function=make_map_fn("train"), with_indices=True, remove_columns=ds.column_names)
ds.to_parquet(out)
print(json.dumps({"rows": ds.num_rows, "seconds": time.monotonic() - t0}))
'''

PROJECT = r'''
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
from verl_pipeline.spec import DataSource
from verl_pipeline.data.preprocess import preprocess
src, out, tok = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.monotonic()
r = preprocess(DataSource.parse(src), {}, Path(out), tokenizer=tok or None, max_prompt_length=512 if tok else None)
print(json.dumps({"rows": r.counts["written"], "seconds": time.monotonic() - t0, "counts": r.counts}))
'''


def make_input(gsm8k: Path, rows: int, dest: Path) -> Path:
    if dest.is_file():
        return dest
    base = [json.loads(line) for name in ("train.jsonl", "test.jsonl")
            for line in (gsm8k / name).read_text().splitlines() if line.strip()]
    tmp = dest.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(rows):
            r = base[i % len(base)]
            k = i // len(base)
            q = r["question"] if k == 0 else f"[{k}] {r['question']}"
            f.write(json.dumps({"question": q, "answer": r["answer"]}) + "\n")
    tmp.rename(dest)
    return dest


def measure(code: str, args: list[str], env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, env=env, text=True)
    t0 = time.monotonic()
    stdout = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed ({proc.returncode})")
    result = json.loads(stdout.strip().splitlines()[-1])
    return {"rows": result["rows"], "seconds": wall, "rows_per_s": result["rows"] / wall,
            "peak_rss_mib": usage.ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--baseline-max", type=int, default=1_000_000, help="largest size the baseline runs at")
    ap.add_argument("--nolen-max", type=int, default=1_000_000, help="largest size the no-length-filter run runs at")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vp-bench-preprocess"))
    ap.add_argument("--gsm8k", type=Path, default=os.environ.get("VERL_PIPELINE_GSM8K_DIR"),
                    help="GSM8K's train.jsonl and test.jsonl (default: $VERL_PIPELINE_GSM8K_DIR)")
    ap.add_argument("--keep", action="store_true", help="keep the generated inputs")
    args = ap.parse_args()
    if args.gsm8k is None or not (Path(args.gsm8k) / "train.jsonl").is_file():
        ap.error(f"--gsm8k {args.gsm8k}: no train.jsonl there (fix: pass GSM8K's directory, or set "
                 "VERL_PIPELINE_GSM8K_DIR)")
    args.gsm8k = Path(args.gsm8k)
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "include"), "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "true"}
    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.spec import ModelSource

    tok = prefetch(ModelSource("builtin", "tiny-qwen2"), args.work / "models").path
    table = []
    for n in args.rows:
        src = make_input(args.gsm8k, n, args.work / f"gsm8k-{n}.jsonl")
        runs = [("project", PROJECT, [str(src), str(args.work / f"out-{n}"), tok])]
        if n <= args.nolen_max:
            runs.append(("project (no length filter)", PROJECT, [str(src), str(args.work / f"out-nolen-{n}"), ""]))
        if n <= args.baseline_max:
            runs.append(("baseline (datasets.map + to_parquet)", BASELINE,
                         [str(src), str(args.work / f"baseline-{n}.parquet"), str(args.work / f"hf-cache-{n}")]))
        for name, code, argv in runs:
            for d in (argv[1],):
                shutil.rmtree(d, ignore_errors=True) if Path(d).is_dir() else Path(d).unlink(missing_ok=True)
            if name.startswith("baseline"):
                shutil.rmtree(argv[2], ignore_errors=True)
            m = measure(code, argv, env)
            table.append({"rows_in": n, "impl": name, **m})
            print(json.dumps(table[-1]), flush=True)
            if name.startswith("baseline"):
                shutil.rmtree(argv[2], ignore_errors=True)
                Path(argv[1]).unlink(missing_ok=True)
            else:
                shutil.rmtree(argv[1], ignore_errors=True)
        if not args.keep:
            src.unlink()
    print("\n| rows in | implementation | seconds | rows/s | peak RSS (MiB) |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r['rows_in']:,} | {r['impl']} | {r['seconds']:.1f} | {r['rows_per_s']:,.0f} | "
              f"{r['peak_rss_mib']:.0f} |")
    for n in args.rows:
        ours = next((r for r in table if r["rows_in"] == n and r["impl"] == "project"), None)
        base = next((r for r in table if r["rows_in"] == n and r["impl"].startswith("baseline")), None)
        if ours and base:
            print(f"\n{n:,} rows: project / baseline rows/s = {ours['rows_per_s'] / base['rows_per_s']:.1f}x")


if __name__ == "__main__":
    main()
