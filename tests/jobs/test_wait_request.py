"""The wait's request: the trigger's kwargs, defaults written once, checked before a deferral."""

from __future__ import annotations

import json

import pytest

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.wait_request import WaitRequest


def test_to_dict_is_json_and_builds_the_same_request() -> None:
    request = WaitRequest(cluster={"backend": "local"}, job_id="j", watch={"stall_timeout_s": 60.0},
                          progress={"step": 1})
    kwargs = json.loads(json.dumps(request.to_dict()))
    assert WaitRequest(**kwargs) == request
    assert kwargs["poll_interval"] == 5.0 and kwargs["max_lines_per_poll"] == 1000


def test_a_request_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        WaitRequest({"backend": "local"}, "j")  # type: ignore[misc]
    request = WaitRequest(cluster={}, job_id="j")
    with pytest.raises(AttributeError):
        request.poll_interval = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value"), [
    ("poll_interval", 0), ("poll_interval", -1.0), ("max_poll_errors", 0), ("node_grace_polls", 0),
    ("max_read_bytes", 0), ("progress_interval", -1), ("max_lines_per_poll", -5), ("log_offset_bytes", -1),
    ("poll_interval", "5"), ("max_poll_errors", True), ("gpu_sample_interval", -60),
])
def test_a_bad_setting_names_the_field_and_its_default(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        WaitRequest(cluster={}, job_id="j", **{field: value})  # type: ignore[arg-type]
    assert str(err.value).startswith(f"wait.{field}={value!r}: must be a number")
    assert f"{field}={getattr(WaitRequest, field)!r}, the default" in str(err.value)


def test_zero_lines_and_an_immediate_progress_report_are_allowed() -> None:
    request = WaitRequest(cluster={}, job_id="j", max_lines_per_poll=0, progress_interval=0)
    assert (request.max_lines_per_poll, request.progress_interval) == (0, 0)
