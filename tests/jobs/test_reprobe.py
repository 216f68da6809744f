"""Whether a restart probes the nodes again: case by case, and the failure reason read from the run's records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.jobs.client import NodeInfo
from verl_pipeline.jobs.gpu_usage import GpuReading
from verl_pipeline.jobs.reprobe import MAX_AGE_S, decide, latest_failure
from verl_pipeline.jobs.restart_budget import RestartOutcome
from verl_pipeline.restarts import Reprobe
from verl_pipeline.rundir import Attempt, RunDir

REQUEST = {"modules": ["verl", "vllm", "flash_attn"], "paths": {"data.train_files": "/d/t.parquet"}}
UUIDS = ("de02e498-1cca-8a7c-1acf-426a79f02f30", "0b7c4a3e-52f1-4c8e-9a1d-2f4b6c8d0e12")
KILLED = "worker killed (OOM or signal)"


def probed_node(node_id: str, uuids: Sequence[str | None] = UUIDS) -> dict[str, Any]:
    devices = [{"name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0", "uuid": u} for u in uuids]
    return {"node_id": node_id, "ip": "10.0.0.1", "gpus": float(len(uuids)),
            "facts": {"gpu": {"devices": devices, "driver": "580.95"}} if uuids else {"modules": {}}}


NOW = 1_800_000_000.0


def kept(*nodes: dict[str, Any], request: dict[str, Any] = REQUEST, age_s: float = 600.0) -> dict[str, Any]:
    return {"request": request, "report": {"job_id": "run-probe-1", "nodes": list(nodes)}, "at": NOW - age_s}


def alive(node_id: str, uuids: Sequence[str] = UUIDS, *, is_alive: bool = True) -> NodeInfo:
    gpus = tuple(GpuReading(i, 0.0, 600.0, 143771.0, f"GPU-{u}") for i, u in enumerate(uuids))
    return NodeInfo(node_id, is_alive, False, "10.0.0.1", {"GPU": float(len(uuids))}, gpus)


def reuse(kept_probe: dict[str, Any] | None, nodes: list[NodeInfo], failure: str | None = KILLED,
          policy: Reprobe = Reprobe.ON_CHANGE, request: dict[str, Any] = REQUEST) -> tuple[bool, str]:
    d = decide(policy, kept_probe, request=request, alive=lambda: nodes, failure=failure, now=NOW)
    return d.reuse, d.why


def test_a_restart_on_the_same_nodes_and_gpus_after_a_killed_worker_reuses_the_probe() -> None:
    ok, why = reuse(kept(probed_node("a"), probed_node("b")), [alive("a"), alive("b")])
    assert ok and why == ("the same 2 node(s) and GPUs that probe job run-probe-1 checked, and the attempt failed "
                          f"for a reason that spares them ({KILLED})")
    # CPU nodes (no GPU to check): the node ids decide.
    assert reuse(kept(probed_node("c", ())), [alive("c", ())])[0]
    # A dead node in Ray's list is not one of the alive nodes.
    assert reuse(kept(probed_node("a")), [alive("a"), alive("gone", is_alive=False)])[0]


@pytest.mark.parametrize(("failure", "why"), [
    (None, "not a restart after a known infrastructure failure"),
    ("NCCL timeout or error", "the attempt failed for a reason that may lie in the nodes (NCCL timeout or error)"),
    ("hang: no training step for 30m", "may lie in the nodes (hang: no training step for 30m)"),
    ("node died", "may lie in the nodes (node died)"),
])
def test_a_failure_that_may_lie_in_the_nodes_probes_again(failure: str | None, why: str) -> None:
    ok, text = reuse(kept(probed_node("a")), [alive("a")], failure=failure)
    assert not ok and why in text


def test_changed_nodes_gpus_or_request_probe_again() -> None:
    k = kept(probed_node("a"), probed_node("b"))
    assert reuse(k, [alive("a"), alive("b2")]) == (False, "the alive nodes changed since probe job run-probe-1 "
                                                          "(1 gone, 1 new)")
    assert reuse(k, [alive("a"), alive("b"), alive("c")])[1].endswith("(0 gone, 1 new)")
    lost = reuse(k, [alive("a"), alive("b", UUIDS[:1])])
    assert lost == (False, f"node 10.0.0.1 no longer reports GPU(s) {UUIDS[1]} that the probe saw")
    assert reuse(k, [alive("a"), alive("b", ())]) == (
        False, "node 10.0.0.1 reports no GPUs to check against the 2 the probe saw")
    other = {**REQUEST, "modules": ["verl", "vllm"]}
    assert reuse(k, [alive("a"), alive("b")], request=other) == (
        False, "the job asks the nodes for something else than the kept probe did")


def test_a_probe_older_than_a_day_is_not_reused() -> None:
    assert reuse(kept(probed_node("a"), age_s=MAX_AGE_S - 1), [alive("a")])[0]
    assert reuse(kept(probed_node("a"), age_s=3 * 86400), [alive("a")]) == (
        False, "the kept probe is 72 h old (reused up to 24 h)")


def test_a_probe_from_before_uuids_were_recorded_counts_the_gpus() -> None:
    k = kept(probed_node("a", (None, None)))
    assert reuse(k, [alive("a")])[0]
    assert reuse(k, [alive("a", UUIDS[:1])]) == (False, "node 10.0.0.1 reports 1 GPU(s), the probe saw 2")


def test_a_node_that_did_not_answer_always_reprobes_and_so_does_the_policy() -> None:
    silent = {"node_id": "b", "ip": "10.0.0.2", "gpus": 8.0, "error": "no answer within 60s"}
    assert reuse(kept(probed_node("a"), silent), [alive("a"), alive("b")]) == (
        False, "1 node(s) did not answer the kept probe")
    assert reuse(kept(probed_node("a")), [alive("a")], policy=Reprobe.ALWAYS) == (False, "restarts.reprobe is always")
    assert reuse(None, [alive("a")]) == (False, "no probe of this run is kept")


def test_the_nodes_are_not_read_unless_everything_else_allows_a_reuse() -> None:
    def unreachable() -> list[NodeInfo]:
        raise AssertionError("read the nodes")

    assert not decide(Reprobe.ALWAYS, kept(probed_node("a")), request=REQUEST, alive=unreachable, failure=KILLED,
                      now=NOW).reuse
    assert not decide(Reprobe.ON_CHANGE, kept(probed_node("a")), request=REQUEST, alive=unreachable,
                      failure="node died", now=NOW).reuse


def _attempt(run: RunDir, n: int) -> None:
    run.record_attempt(Attempt(f"job-a{n}", n, 0.0, "http://h", 0, None))


def test_the_failure_is_the_latest_attempts_restart_decision(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert latest_failure(run) is None
    _attempt(run, 1)
    assert latest_failure(run) is None  # the first submission
    run.record_restart({"attempt": 1, "submission_id": "job-a1", "reason": KILLED,
                        "outcome": RestartOutcome.RESTART.value})
    assert latest_failure(run) == KILLED
    _attempt(run, 2)  # attempt 2 ended, but no restart was decided for it (a task retry): unknown
    assert latest_failure(run) is None
    run.record_restart({"attempt": 2, "submission_id": "job-a2", "reason": KILLED,
                        "outcome": RestartOutcome.EXHAUSTED.value})
    assert latest_failure(run) is None


def test_a_kept_probe_reads_back(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.kept_probe() is None
    k = kept(probed_node("a"))
    run.keep_probe(k["request"], k["report"])
    back = run.kept_probe()
    assert back is not None and (back["request"], back["report"]) == (k["request"], k["report"])
