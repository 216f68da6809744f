"""The evaluation-cost bench on the CPU: the evaluation job's own path (transformers here; vLLM on a GPU)
over the example task's prompts, timed per 1,000 rows."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from tests.bench import bench_script

cost = bench_script("evaluation_cost")


def test_the_prompts_are_the_example_tasks_in_verls_schema(tmp_path: Path) -> None:
    rows = pq.read_table(cost.write_rows(tmp_path / "rows.parquet", 12)).to_pylist()
    assert len(rows) == 12 and rows[11]["prompt"] == [{"role": "user", "content": "Repeat: 1"}]
    assert rows[11]["reward_model"]["ground_truth"] == "1" and rows[0]["data_source"] == "example/repeat-digit"


def test_a_transformers_run_scores_every_row_and_times_it(tmp_path: Path, tiny_model_path: Path) -> None:
    args = argparse.Namespace(model=tiny_model_path, rows=6, engine="transformers", max_new_tokens=3,
                              gpu_memory_utilization=None)
    figures = cost.measure(args, tmp_path)
    assert (figures["engine"], figures["rows"], figures["max_new_tokens"]) == ("transformers", 6, 3)
    # Per 1,000 rows from the unrounded seconds: within the rounding of the seconds printed (0.005 s x 1000/6).
    assert abs(figures["s_per_1000_rows"] - 1000 * figures["seconds"] / 6) < 1
    assert 0.0 <= figures["mean_reward"] <= 1.0
    assert cost.table_row(figures).startswith(f"| {tiny_model_path.name} | transformers | 6 |")
