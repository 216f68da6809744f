"""What an evaluation costs: seconds to generate and score 1,000 prompts with the evaluation job's own code.

The evaluate task's job (``verl_pipeline.evaluation.job``) generates greedily with vLLM on a GPU (each
model in a process of its own: the engine's start is part of the cost) or with transformers on a CPU, then
scores every response with the run's reward function. This times that path on the example task's prompts
(``Repeat: 7``, the reward in ``configs/tasks/repeat-digit/``) for one model: the built-in tiny model by
default, or any HuggingFace model directory.

    python bench/evaluation_cost.py [--rows 1000] [--engine vllm|transformers] [--model DIR]
                                    [--gpu-memory-utilization 0.3] [--max-new-tokens 8] [--out FILE]

It prints the figures (model, engine, rows, seconds, seconds per 1,000 rows, mean reward) and the row of
docs/benchmarks.md's table. vLLM needs a GPU and requirements/gpu.txt; transformers runs anywhere
(``--rows 64`` keeps a CPU run short).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REWARD = REPO / "configs" / "tasks" / "repeat-digit" / "reward.py"


def write_rows(path: Path, n: int) -> Path:
    """``n`` prompts of the example task in verl's row schema (the digits in turn)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    digits = [str(i % 10) for i in range(n)]
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": f"Repeat: {d}"}] for d in digits],
        "data_source": ["example/repeat-digit"] * n,
        "reward_model": [{"style": "rule", "ground_truth": d} for d in digits],
        "extra_info": [{"index": i} for i in range(n)]}), path)
    return path


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from verl_pipeline.evaluation.job import evaluate_models
    from verl_pipeline.evaluation.request import EvaluationRequest
    from verl_pipeline.models.tiny import build_tiny_model
    from verl_pipeline.scores import Role

    model = args.model or build_tiny_model(work / "tiny")
    rows = write_rows(work / "rows.parquet", args.rows)
    request = EvaluationRequest(
        models={Role.TRAINED: str(model)}, data_path=str(rows), engine=args.engine, sample=args.rows,
        reward={"path": str(REWARD), "name": "compute_score", "kwargs": {}}, max_new_tokens=args.max_new_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization)
    t0 = time.monotonic()
    evaluation = evaluate_models(request)
    seconds = time.monotonic() - t0
    score = evaluation.score(Role.TRAINED)
    if score is None:
        raise SystemExit(f"the model was not scored: {evaluation.errors}")
    return {"model": str(model), "engine": evaluation.engine.value, "rows": score.n, "seconds": round(seconds, 2),
            "s_per_1000_rows": round(1000 * seconds / score.n, 2), "mean_reward": round(score.mean_reward, 4),
            "max_new_tokens": args.max_new_tokens, "gpu_memory_utilization": args.gpu_memory_utilization}


def table_row(f: dict[str, Any]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip() or "?"
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False).stdout.strip().splitlines() if f["engine"] == "vllm" else []
    machine = gpu[0] if gpu else "CPU"
    return (f"| {Path(f['model']).name} | {f['engine']} | {f['rows']} | {f['seconds']} | {f['s_per_1000_rows']} | "
            f"{machine} | {commit} | {time.strftime('%Y-%m-%d')} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    p.add_argument("--model", type=Path, default=None, help="a HuggingFace model directory (default: the tiny model)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="the example task's data.max_response_length")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share (default: vLLM's)")
    p.add_argument("--out", type=Path, default=None, help="write the figures (JSON) here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(args, Path(tmp))
    print(json.dumps(figures, indent=1))
    print(table_row(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
