"""The package's enums: values are what earlier releases wrote to XCom and the run files."""

from __future__ import annotations

import json

from verl_pipeline.constants import Mode, SubmitAction


def test_submit_actions_read_what_earlier_runs_wrote() -> None:
    written = ["submitted", "reattached", "already_succeeded", "queued_for_pool"]
    assert [SubmitAction(value) for value in written] == list(SubmitAction)
    # A str enum goes to XCom (JSON) as its plain value, and compares equal to it when read back.
    assert json.loads(json.dumps({"action": SubmitAction.QUEUED_FOR_POOL})) == {"action": "queued_for_pool"}
    assert SubmitAction("already_succeeded") is SubmitAction.ALREADY_SUCCEEDED


def test_modes_read_what_earlier_runs_wrote() -> None:
    assert [Mode(value) for value in ("auto", "train", "preflight")] == list(Mode)
