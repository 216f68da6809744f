"""The evaluation request: its JSON round trip, and a bad field refused in one line that names it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from verl_pipeline.evaluation.job import read_request
from verl_pipeline.evaluation.request import DEFAULT_MAX_NEW_TOKENS, DEFAULT_SAMPLE, EvaluationRequest
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.scores import Engine, Role
from verl_pipeline.trainer.reward import RewardFunction

MODELS = {"trained": "/runs/r1/model", "base": "/models/base", "champion": "/runs/r0/model"}


def test_a_request_reads_back_as_it_was_written() -> None:
    request = EvaluationRequest.from_dict({
        "models": dict(MODELS), "data_path": "/data/val.parquet",
        "reward": {"path": "reward.py", "name": "score", "kwargs": {"scale": 2}}, "max_new_tokens": 8, "sample": 4,
        "seed": 3, "engine": "transformers", "use_gpus": True, "run_dirs": {"champion": "/runs/r0"},
        "gpu_memory_utilization": 0.2})
    assert request.models == {Role(k): v for k, v in MODELS.items()}
    assert request.reward == RewardFunction("reward.py", "score", {"scale": 2})
    assert request.engine is Engine.TRANSFORMERS and request.run_dirs == {Role.CHAMPION: "/runs/r0"}
    assert request.gpu_memory_utilization == 0.2
    assert read_request(json.dumps(request.to_dict())) == request
    # Left out: verl's default scorer, the run's sample and length defaults, the engine chosen on the node.
    plain = EvaluationRequest.from_dict({"models": {"base": "/models/base"}, "data_path": "/data/val.parquet"})
    assert (plain.reward, plain.engine, plain.sample, plain.max_new_tokens, plain.split,
            plain.gpu_memory_utilization) == (None, None, DEFAULT_SAMPLE, DEFAULT_MAX_NEW_TOKENS, "val", None)


@pytest.mark.parametrize(("change", "message"), [
    ({"models": {}}, r"^models=\{\}: names no model to evaluate \(fix: "),
    ({"models": {"teacher": "/m"}}, r"^models\.teacher='/m': is not a role of an evaluation \(fix: one of \['trained'"),
    ({"models": {"base": ""}}, r"^models\.base='': must be a non-empty path"),
    ({"data_path": ""}, r"^data_path='': must be a non-empty path"),
    ({"sample": 0}, r"^sample=0: must be a whole number of at least 1 \(fix: sample: 16\)"),
    ({"max_new_tokens": True}, r"^max_new_tokens=True: must be a whole number of at least 1"),
    ({"engine": "sglang"}, r"^engine='sglang': is not an evaluation engine \(fix: vllm, transformers or null"),
    ({"reward": "reward.py"}, r"^reward='reward.py': must be \{path, name, kwargs\} or null"),
    ({"run_dirs": {"champion": "/runs/r0"}}, r"^run_dirs\.champion='/runs/r0': names a role that is not evaluated"),
    ({"gpu_memory_utilization": 1.5}, r"^gpu_memory_utilization=1\.5: must be a share of the GPU's memory above 0"),
    ({"gpu_memory_utilization": "half"}, r"^gpu_memory_utilization='half': must be a share"),
    ({"temperature": 0.7}, r"^request\.temperature=0\.7: is not a field of an evaluation request"),
])
def test_a_bad_field_is_one_line_naming_it(change: dict[str, Any], message: str) -> None:
    data: dict[str, Any] = {"models": {"base": "/models/base"}, "data_path": "/data/val.parquet", **change}
    with pytest.raises(ConfigError, match=message) as err:
        EvaluationRequest.from_dict(data)
    assert "\n" not in str(err.value)


def test_the_command_line_request_must_be_a_json_object() -> None:
    with pytest.raises(ConfigError, match=r"^--request='\{models': is not JSON"):
        read_request("{models")
    with pytest.raises(ConfigError, match=r"^--request='\[\]': is not a JSON object"):
        read_request("[]")
    with pytest.raises(ConfigError, match=r"^request\.data_path=None: is missing"):
        read_request('{"models": {"base": "/m"}}')
