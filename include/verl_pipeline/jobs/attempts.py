"""What an attempt's metrics say: the steps verl logged, in run steps.

The attempt records themselves (``attempts.jsonl``) are kept by :class:`verl_pipeline.rundir.RunDir`:
Ray's job table lives in the cluster's GCS and is gone when a cluster is re-provisioned; that record
survives, so attempt numbers never repeat and a resumed attempt knows which checkpoint it should
start from.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_pipeline.rundir import Attempt
from verl_pipeline.trainer.metrics import STEP, is_validation_only


def metric_steps(metrics_path: Path) -> list[int]:
    """The training steps verl's file logger wrote (``{"step": N, "data": {…}}``): a row of validation
    alone (``val_before_train`` at step 0, or at the step a resumed run starts from) is not one."""
    if not metrics_path.is_file():
        return []
    steps = []
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        data = row.get("data") or {}
        if is_validation_only(data):
            continue
        steps.append(int(data.get(STEP, row.get("step", 0))))
    return steps


def run_steps(attempt: Attempt) -> list[int]:
    """The run steps ``attempt`` logged: verl's steps offset by its segment's start (see ``segment``)."""
    if not attempt.metrics_path:
        return []
    return [attempt.segment_start_step + s for s in metric_steps(Path(attempt.metrics_path))]
