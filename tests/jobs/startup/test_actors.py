"""How each Ray actor of a start came up: Ray's records in, the parts of each actor's start out.

The records below have the shape a real Ray 2.60 head gave (``/api/v0/tasks?detail=1`` for an
``ACTOR_CREATION_TASK``, ``/api/v0/workers?detail=1``); the last test reads them from a real head.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.startup import actors
from verl_pipeline.jobs.startup.actors import ActorStart, by_class, from_ray

SUBMITTED = 1_000_000_000_000.0  # the job's submission, epoch ms


def _task(cls: str, worker: str, *, asked: float, running: float | None, loaded: float | None,
          finished: float | None, state: str = "FINISHED", node: str = "10.0.0.2") -> dict[str, Any]:
    """An actor creation task as Ray's state API lists it; times in seconds after the submission."""
    def ms(s: float) -> float:
        return SUBMITTED + 1000 * s

    events = [{"state": "PENDING_ARGS_AVAIL", "created_ms": ms(asked)},
              {"state": "PENDING_NODE_ASSIGNMENT", "created_ms": ms(asked) + 4}]
    if running is not None:
        events.append({"state": "RUNNING", "created_ms": ms(running)})
    if finished is not None:
        events.append({"state": state, "created_ms": ms(finished)})
    profiling = {"component_type": "worker", "component_id": worker, "node_ip_address": node,
                 "events": [] if loaded is None else [
                     {"start_time": ms(loaded), "end_time": ms(loaded) + 0.004, "extra_data": {},
                      "event_name": "task:deserialize_arguments"}]}
    return {"type": "ACTOR_CREATION_TASK", "func_or_class_name": f"{cls}.__init__", "name": f"{cls}.__init__",
            "state": state if finished is not None else "RUNNING", "node_id": None, "worker_id": None,
            "creation_time_ms": ms(asked), "start_time_ms": ms(running) if running is not None else None,
            "end_time_ms": ms(finished) if finished is not None else None, "events": events,
            "profiling_data": profiling}


def _worker(worker: str, *, launch: float, ready: float) -> dict[str, Any]:
    return {"worker_id": worker, "worker_type": "WORKER", "pid": 4100,
            "worker_launch_time_ms": int(SUBMITTED + 1000 * launch),
            "worker_launched_time_ms": int(SUBMITTED + 1000 * (ready - 0.02)),
            "start_time_ms": int(SUBMITTED + 1000 * ready), "end_time_ms": 0}


def test_each_actor_start_splits_into_waiting_process_class_load_and_init() -> None:
    tasks = [_task("WorkerDict", "w1", asked=57, running=61, loaded=86, finished=90),
             _task("TaskRunner", "w0", asked=24, running=26, loaded=50, finished=50.1)]
    workers = [_worker("w1", launch=58, ready=60.9), _worker("w0", launch=10, ready=11)]
    runner, group = from_ray(tasks, workers, SUBMITTED)
    assert [runner.cls, group.cls] == ["TaskRunner", "WorkerDict"]  # in the order they were asked for
    assert group == ActorStart("WorkerDict", "10.0.0.2", 57.0, before_s=4.0, process_s=pytest.approx(2.9),
                               load_s=25.0, init_s=pytest.approx(4.0, abs=1e-3), ready_s=90.0)
    assert group.waiting_s == pytest.approx(1.1)
    # Its worker was running before the TaskRunner was asked for (Ray starts workers ahead): no process start.
    assert runner.reused and runner.process_s == 0.0 and runner.waiting_s == 2.0 and runner.load_s == 24.0


def test_what_ray_did_not_record_is_unknown_and_a_failed_or_unready_actor_has_no_ready_time() -> None:
    tasks = [_task("vLLMHttpServer", "gone", asked=130, running=131, loaded=None, finished=170, state="FAILED"),
             _task("AgentLoopWorker", "w2", asked=200, running=None, loaded=None, finished=None)]
    failed, pending = from_ray(tasks, [], SUBMITTED)
    assert failed.failed and failed.ready_s is None and failed.load_s is None and failed.init_s is None
    assert failed.before_s == 1.0 and failed.process_s is None and failed.waiting_s is None  # no worker record
    assert not pending.failed and pending.before_s is None and pending.ready_s is None
    assert [g.name for g in by_class([pending, failed])] == ["vLLMHttpServer", "AgentLoopWorker"]
    assert by_class([failed])[0].text() == ("vLLMHttpServer x 1: asked 130 s after submission, not ready (1 failed) "
                                            "(waiting unknown · process unknown · class load unknown · __init__ "
                                            "unknown)")
    assert by_class([pending])[0].last_ready_s is None


def test_an_actor_is_settled_once_ray_sent_both_its_state_and_its_class_load() -> None:
    """Ray sends an actor's state events and its profiling events apart: a read between the two finds it
    ready with its class load and node unknown (a real head did, in CI on 2026-12-05). That is read again."""
    task = _task("Slow", "w0", asked=5, running=5.8, loaded=9.0, finished=9.3)
    whole = from_ray([task], [_worker("w0", launch=5.1, ready=5.7)], SUBMITTED)[0]
    assert whole.settled and whole.node == "10.0.0.2"
    state_only = from_ray([{**task, "profiling_data": {}}], [], SUBMITTED)[0]
    assert state_only.ready_s == 9.3 and state_only.before_s is not None
    assert state_only.load_s is None and state_only.node == "" and not state_only.settled
    failed = from_ray([_task("Slow", "w0", asked=5, running=5.8, loaded=None, finished=6, state="FAILED")], [],
                      SUBMITTED)[0]
    assert failed.settled  # nothing more will come


def test_a_class_of_many_actors_shows_the_median_and_the_slowest() -> None:
    tasks = [_task("WorkerDict", f"w{i}", asked=57, running=60, loaded=60 + load, finished=64 + load)
             for i, load in enumerate([25, 24, 26, 40])]
    workers = [_worker(f"w{i}", launch=57.5, ready=59.5) for i in range(4)]
    (group,) = by_class(from_ray(tasks, workers, SUBMITTED))
    assert len(group.actors) == 4 and group.first_asked_s == 57 and group.last_ready_s == 104
    assert group.spread("load_s") == (25.5, 40.0)
    assert group.cell("load_s") == "26 s (slowest 40 s)" and group.cell("process_s") == "2 s"
    assert group.text() == ("WorkerDict x 4: asked 57 s after submission, ready at 104 s (waiting 1 s · process 2 s · "
                            "class load 26 s (slowest 40 s) · __init__ 4 s)")


def test_the_record_reads_back_as_written_and_a_missing_one_is_none(tmp_path: Path) -> None:
    starts = from_ray([_task("TaskRunner", "w0", asked=24, running=26, loaded=50, finished=50.1)],
                      [_worker("w0", launch=24.5, ready=25.5)], SUBMITTED)
    path = tmp_path / "metrics-a1.actors.json"
    path.write_text(json.dumps(actors.to_record(starts)))
    assert actors.load(path) == starts
    assert actors.load(tmp_path / "absent.json") is None
    path.write_text('{"actors": [{"cls": 1}]}')
    assert actors.load(path) is None


#: The job the real head runs: an actor whose module takes IMPORT_S to import and whose __init__ takes INIT_S.
IMPORT_S, INIT_S = 3.0, 0.5
JOB = """
import pathlib, time, ray
ray.init()
import slow_module
actor = ray.remote(slow_module.Slow).options(num_cpus=0).remote()  # the class by reference, as verl's workers
ray.get(actor.ping.remote())
while not pathlib.Path("{gate}").exists():
    time.sleep(0.1)
"""
MODULE = f"""
import time
time.sleep({IMPORT_S})

class Slow:
    def __init__(self):
        time.sleep({INIT_S})

    def ping(self):
        return 1
"""


@pytest.mark.integration
async def test_a_real_head_records_the_class_load_apart_from_the_init(ray_cluster: ClusterHandle,
                                                                     tmp_path: Path) -> None:
    """Ray's own records of a real actor, read as the waiter reads them: the module's import is the class
    load, the sleep in ``__init__`` the init; while the job runs (its actor's worker alive) and after."""
    work = tmp_path / "job"
    work.mkdir()
    (work / "slow_module.py").write_text(MODULE)
    gate = tmp_path / "gate"
    sync = ray_cluster.client()
    job_id = f"actor-starts-{int(time.time() * 1000)}"
    sync.submit(entrypoint=f"python -c {shlex.quote(JOB.format(gate=gate))}", submission_id=job_id,
                runtime_env={"working_dir": str(work)})
    deadline = time.monotonic() + 180
    async with aiohttp.ClientSession() as session:
        client = ray_cluster.client(session=session)
        starts: list[ActorStart] = []
        while not starts or not starts[0].settled:  # Ray flushes its state and profiling events apart
            assert time.monotonic() < deadline, f"no finished actor start recorded: {starts}"
            info = await client.aget_job(job_id)
            assert info is not None and not info.status.is_terminal(), info
            if info.ray_job_id and info.start_time:
                tasks, workers = await client.aactor_starts(info.ray_job_id, alive_only=True)
                starts = from_ray(tasks, workers, info.start_time)
            await asyncio.sleep(0.5)
        gate.touch()
        while (ended := await client.aget_job(job_id)) is None or not ended.status.is_terminal():
            assert time.monotonic() < deadline, "the job did not end"
            await asyncio.sleep(0.2)
        assert ended.ray_job_id == info.ray_job_id
        tasks, workers = await client.aactor_starts(ended.ray_job_id, alive_only=False)
        after = from_ray(tasks, workers, ended.start_time or 0)
    (actor,) = starts
    print(f"real actor start: {actor}")
    assert actor.cls == "Slow" and actor.node and not actor.failed
    assert actor.load_s is not None and actor.load_s >= IMPORT_S  # the module's import
    assert actor.init_s is not None and INIT_S <= actor.init_s < actor.load_s  # the __init__ alone
    assert actor.process_s is not None and actor.before_s is not None and actor.process_s <= actor.before_s
    assert actor.ready_s is not None and actor.ready_s >= actor.asked_s + actor.load_s + actor.init_s
    assert after == starts  # the same record once the job ended (its worker is gone from the alive list)
