"""Warm starts: the cache key, the environment the job's workers get, and validation on a resume (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.nodes.probed import H200_VERSIONS, h200, probe_node
from verl_pipeline.trainer.nodes.choices import Choices
from verl_pipeline.trainer.nodes.facts import NodeFacts
from verl_pipeline.trainer.nodes.warmstart import (
    CACHE_DIRS,
    COMPILE_CACHE_SWITCH,
    VAL_BEFORE_TRAIN_KEY,
    cache_key,
    fingerprint,
    plan_caches,
    resume_validation,
)

ROOT = Path("/shared/caches")


def _key(**kwargs: object) -> str:
    return cache_key(fingerprint(h200(**kwargs).gpu_nodes[0]))  # type: ignore[arg-type]


def test_the_cache_key_changes_with_any_version_the_gpu_or_the_driver() -> None:
    key = _key()
    assert key == _key() and key.startswith("nvidia-h200-sm90-torch2.11.0_cu130-")
    assert _key(node_id="b" * 56, ip="10.0.0.9") == key  # another node with the same stack shares it
    others = {_key(versions={**H200_VERSIONS, name: "9.9.9"}) for name in H200_VERSIONS}
    others |= {_key(name="NVIDIA H100 80GB HBM3", memory_gib=79.2), _key(capability="10.0"), _key(driver="590.1"),
               _key(flash_attn=False)}
    assert key not in others and len(others) == len(H200_VERSIONS) + 4


def test_the_workers_caches_live_under_the_key_on_the_shared_storage() -> None:
    plan = plan_caches(h200(), root=ROOT, enabled=True, user_env={})
    assert plan.enabled and plan.directory == str(ROOT / plan.key)  # type: ignore[operator]
    for var, sub in CACHE_DIRS.items():
        assert plan.env[var] == str(ROOT / str(plan.key) / sub)
    assert set(plan.env) == {*CACHE_DIRS, "CUDA_CACHE_MAXSIZE", COMPILE_CACHE_SWITCH}
    # torch 2.11 writes inductor's artifacts atomically: vLLM's compile cache is turned back on.
    assert plan.env[COMPILE_CACHE_SWITCH] == "0" and "atomically" in plan.why
    assert plan.facts["versions"]["vllm"] == "0.24.0" and plan.facts["gpu_name"] == "NVIDIA H200"
    old = plan_caches(h200(versions={**H200_VERSIONS, "torch": "2.9.1+cu128"}), root=ROOT, enabled=True, user_env={})
    assert COMPILE_CACHE_SWITCH not in old.env and "stays off" in old.why and "VLLM_CACHE_ROOT" in old.env


def test_caches_are_off_where_they_cannot_be_keyed_or_the_cluster_profile_says_so() -> None:
    off = plan_caches(h200(), root=ROOT, enabled=False, user_env={})
    assert not off.enabled and off.env == {} and "runtime.warm_caches: false" in off.why
    assert not plan_caches(NodeFacts(), root=ROOT, enabled=True, user_env={}).enabled
    mixed = NodeFacts.from_probe([probe_node(), probe_node(node_id="b" * 56, driver="590.1")], source="probe job p")
    plan = plan_caches(mixed, root=ROOT, enabled=True, user_env={})
    assert not plan.enabled and plan.env == {} and "differ in driver" in plan.why


def test_the_cluster_profiles_runtime_env_wins() -> None:
    mine = {"VLLM_CACHE_ROOT": "/mine", COMPILE_CACHE_SWITCH: "1"}
    plan = plan_caches(h200(), root=ROOT, enabled=True, user_env=mine)
    assert "VLLM_CACHE_ROOT" not in plan.env and COMPILE_CACHE_SWITCH not in plan.env and "TRITON_CACHE_DIR" in plan.env
    assert plan.kept == ("VLLM_CACHE_ROOT", COMPILE_CACHE_SWITCH) and "(kept)" in plan.why


@pytest.mark.parametrize(("settings", "step", "validate_on_resume", "expected"), [
    ({VAL_BEFORE_TRAIN_KEY: True}, 0, False, {}),                           # attempt 1: the baseline runs
    ({VAL_BEFORE_TRAIN_KEY: True}, 3, False, {VAL_BEFORE_TRAIN_KEY: False}),  # a resume skips it
    ({}, 3, False, {VAL_BEFORE_TRAIN_KEY: False}),                            # verl's default is true
    ({f"++{VAL_BEFORE_TRAIN_KEY}": True}, 3, False, {f"++{VAL_BEFORE_TRAIN_KEY}": False}),
    ({"trainer": {"val_before_train": True}}, 3, False, {VAL_BEFORE_TRAIN_KEY: False}),
    ({VAL_BEFORE_TRAIN_KEY: True}, 3, True, {}),                            # validate_on_resume: true keeps it
    ({VAL_BEFORE_TRAIN_KEY: False}, 3, False, {}),                          # never validates: nothing to skip
])
def test_a_resume_attempt_skips_validation_before_training(
        settings: dict[str, object], step: int, validate_on_resume: bool, expected: dict[str, object]) -> None:
    c = Choices(settings)
    resume_validation(c, resume_step=step, validate_on_resume=validate_on_resume)
    assert c.updates == expected
    if expected:
        assert f"from run step {step}" in c.rules[-1].rule and "validate_on_resume" in c.rules[-1].rule
    if validate_on_resume:
        assert "validate_on_resume: true" in c.rules[-1].rule and c.rules[-1].value is True
