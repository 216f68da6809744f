"""Ray's node summary as the waiter reads it: liveness, resources, and each GPU's utilisation and memory.

``ray_node_summary.json`` is the answer of a real local Ray 2.60 head to ``GET /nodes?view=summary``
(paths shortened); a CPU node, so its ``gpus`` list is empty. The GPU node is that node with a
``gpus`` list in Ray's ``GpuUtilizationInfo`` shape (``ray/dashboard/modules/reporter/reporter_models.py``),
the fields an H200 node reported.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.exceptions import ClusterError
from verl_pipeline.jobs.client import RayJobsClient

RECORDED = Path(__file__).with_name("ray_node_summary.json")


def _h200(index: int, util: int | None, used: int) -> dict[str, Any]:
    return {"index": index, "name": "NVIDIA H200", "uuid": f"GPU-{index:08x}-0000-0000-0000-000000000000",
            "utilizationGpu": util, "memoryUsed": used, "memoryTotal": 143771,
            "processesPids": [{"pid": 4100 + index, "gpuMemoryUsage": used - 500, "gpuUtilization": util}],
            "powerMw": 512000, "temperatureC": 51}


def _summary() -> dict[str, Any]:
    """The recorded head, a GPU worker made from it, and a dead node (Ray keeps dead nodes in the summary)."""
    recorded = json.loads(RECORDED.read_text())
    head = recorded["data"]["summary"][0]
    worker = copy.deepcopy(head)
    worker["ip"] = "10.0.0.2"
    worker["raylet"].update(nodeId="b" * 56, isHeadNode=False, nodeManagerAddress="10.0.0.2")
    worker["raylet"]["resourcesTotal"] = {"CPU": 64.0, "GPU": 2.0, "memory": 1.0e12}
    worker["gpus"] = [_h200(0, 97, 101234), _h200(1, None, 512)]
    dead = {"raylet": {"nodeId": "d" * 56, "state": "DEAD", "isHeadNode": False, "nodeManagerAddress": "10.0.0.3",
                       "stateMessage": "Expected termination: received SIGTERM"}, "tpus": []}
    recorded["data"]["summary"] = [head, worker, dead]
    return recorded


@pytest.fixture
async def dashboard() -> AsyncIterator[Callable[[bytes], str]]:
    """A stand-in for the dashboard's ``/nodes`` route serving a chosen body; returns its URL."""
    served: dict[str, bytes] = {}

    async def nodes(request: web.Request) -> web.Response:
        assert request.query.get("view") == "summary"
        return web.Response(body=served["body"], content_type="application/json", charset="utf-8")

    app = web.Application()
    app.router.add_get("/nodes", nodes)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def serve(body: bytes) -> str:
        served["body"] = body
        return url

    yield serve
    await runner.cleanup()


async def test_each_gpu_of_each_node_with_its_utilisation_and_memory(dashboard: Callable[[bytes], str]) -> None:
    client = RayJobsClient(dashboard(json.dumps(_summary()).encode()))
    head, worker, dead = await client.anodes()
    assert (head.alive, head.is_head, head.ip, head.gpus) == (True, True, "192.0.2.2", ())
    assert head.resources["CPU"] == 2.0
    assert (worker.alive, worker.is_head, worker.node_id, worker.resources["GPU"]) == (True, False, "b" * 56, 2.0)
    busy, unknown = worker.gpus
    assert (busy.index, busy.utilization_pct, busy.memory_used_mib, busy.memory_total_mib) == (0, 97.0, 101234.0,
                                                                                               143771.0)
    assert unknown.utilization_pct is None and unknown.memory_used_mib == 512.0
    assert (dead.alive, dead.ip, dead.gpus, dead.resources) == (False, "10.0.0.3", (), {})
    assert await client.anodes() == await asyncio.to_thread(client.nodes)  # the sync client reads the same


async def test_a_body_that_is_not_a_node_summary_names_the_route(dashboard: Callable[[bytes], str]) -> None:
    client = RayJobsClient(dashboard(b'{"result": false, "msg": "Unknown view", "data": {}}'))
    with pytest.raises(ClusterError, match=r"GET /nodes\?view=summary answered something that is not"):
        await client.anodes()


@pytest.mark.integration
async def test_a_real_local_node_reports_no_gpus(ray_cluster: ClusterHandle) -> None:
    """What a CPU-only node of a real cluster says: alive, its CPUs, no GPU readings."""
    nodes = await ray_cluster.client().anodes()
    alive = [n for n in nodes if n.alive]
    assert alive and all(n.gpus == () for n in nodes)
    assert any(n.is_head and n.resources.get("CPU", 0) > 0 for n in alive)
