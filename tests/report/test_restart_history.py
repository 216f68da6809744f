"""The report's restart section: the budget and each decision, from the run's restarts.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from verl_pipeline.jobs.restart_budget import AttemptProgress, RestartBudget, RestartOutcome
from verl_pipeline.report.build import RunOutcome
from verl_pipeline.report.html import restarts_html
from verl_pipeline.report.restart_history import RestartSummary, summarise
from verl_pipeline.report.write import write_report
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.rundir import RunDir


def _decision(attempts: list[AttemptProgress], outcome: RestartOutcome = RestartOutcome.RESTART) -> dict[str, object]:
    """A restarts.jsonl line as the wait task writes it."""
    return RestartBudget(RestartPolicy(), tuple(attempts)).record(outcome=outcome, reason="node died")


def test_restarts_after_progress_and_the_closest_the_run_came_to_its_limit() -> None:
    a = [AttemptProgress(n, f"j-a{n}", 2 * (n - 1), 2 * n, 2 * n + 1) for n in range(1, 4)]
    stuck = AttemptProgress(4, "j-a4", 6, 6, None)
    rows = [_decision(a[:1]), _decision(a[:2]), _decision(a[:2]), _decision(a), _decision([*a, stuck])]
    s = summarise(rows, 2)
    assert [d.attempt for d in s.decisions] == [1, 2, 3, 4]  # a decision taken again counts once
    assert (s.restarts, s.after_progress, s.most_in_a_row, s.exhausted) == (4, 3, 1, False)
    assert s.headline() == ("4 restart(s), 3 after progress; at most 1 attempt(s) in a row without progress, of the "
                            "2 the budget allows.")
    page = restarts_html(s)
    assert "<h2>Restarts</h2>" in page and "checkpoint 0 → 2" in page and "no step" in page
    assert "restarted after 40 s" in page and page.count("<tr>") == 5
    assert json.loads(json.dumps(s.to_dict()))["after_progress"] == 3


def test_a_used_up_budget_and_a_run_without_restarts() -> None:
    crashed = [AttemptProgress(n, f"j-a{n}", 0, 0, None) for n in range(1, 4)]
    rows = [_decision(crashed[:1]), _decision(crashed[:2]), _decision(crashed, RestartOutcome.EXHAUSTED)]
    s = summarise(rows, 2)
    assert s.exhausted and s.restarts == 2
    assert s.headline().startswith("The restart budget was used up: 3 attempts in a row made no progress, the "
                                   "last attempt 3 (restarts.no_progress_limit 2)")
    assert "budget used up: run failed" in restarts_html(s)
    none = RestartSummary(2)
    assert none.headline().startswith("No restart.") and "<table>" not in restarts_html(none)
    assert restarts_html(None) == ""


def test_the_written_report_carries_the_budget_from_the_spec_and_the_records(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    spec = {"run_name": "verl_ppo/r1", "profile": "p", "nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": 4,
            "mode": "train", "storage_root": str(tmp_path), "restarts": RestartPolicy(no_progress_limit=5).to_dict()}
    (run_dir / "run_spec.json").write_text(json.dumps(spec))
    (run_dir / "job.json").write_text(json.dumps({"mode": "train"}))
    RunDir(run_dir).record_restart(_decision([AttemptProgress(1, "j-a1", 0, 2, 3)]))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    written = json.loads(files.json.read_text())["restarts"]
    assert (written["no_progress_limit"], written["restarts"], written["after_progress"]) == (5, 1, 1)
    assert "<h2>Restarts</h2>" in files.html.read_text()
