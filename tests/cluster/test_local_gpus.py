"""Several local Ray nodes on one GPU host: each node's own GPUs (``cluster.gpu_devices``, else the caller's
GPUs split over the nodes), and what a profile gets wrong about them refused before anything starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.cluster.local import CUDA_VISIBLE_DEVICES, LocalBackend
from verl_pipeline.exceptions import ClusterError, ConfigError


def _backend(**cluster: Any) -> LocalBackend:
    return LocalBackend.from_spec({"backend": "local", **cluster})


def test_listed_gpus_go_to_the_nodes_in_order() -> None:
    split = _backend(nodes=2, num_gpus=4, gpu_devices=[0, 1, 2, 3, 4, 5, 6, 7])
    assert split.node_devices({}) == ["0,1,2,3", "4,5,6,7"]
    # A run of its own on two GPUs of a larger host, whatever the caller sees.
    assert _backend(num_gpus=2, gpu_devices=[6, 7]).node_devices({CUDA_VISIBLE_DEVICES: "0"}) == ["6,7"]


def test_without_a_list_several_nodes_split_the_gpus_the_caller_sees() -> None:
    two = _backend(nodes=2, num_gpus=2)
    assert two.node_devices({CUDA_VISIBLE_DEVICES: "4,5,6,7"}) == ["4,5", "6,7"]
    assert two.node_devices({}) == ["0,1", "2,3"]
    with pytest.raises(ClusterError, match=r"2 local Ray nodes x 2 GPU\(s\) need 4 GPUs, but "
                                           r"CUDA_VISIBLE_DEVICES=4,5 names 2 \(fix: cluster.gpu_devices"):
        two.node_devices({CUDA_VISIBLE_DEVICES: "4,5"})
    # One node keeps the caller's GPUs; nodes without GPUs (the CPU test clusters) are left alone.
    assert _backend(num_gpus=8).node_devices({CUDA_VISIBLE_DEVICES: "1"}) == [None]
    assert _backend(nodes=3, num_gpus=0).node_devices({}) == [None, None, None]


@pytest.mark.parametrize(("cluster", "message"), [
    ({"nodes": 2, "num_gpus": 4, "gpu_devices": [0, 1, 2, 3]},
     r"cluster.gpu_devices=\[0, 1, 2, 3\]: lists 4 GPU\(s\); 2 node\(s\) x num_gpus 4 use 8 "
     r"\(fix: gpu_devices: \[0, 1, 2, 3, 4, 5, 6, 7\]\)"),
    ({"num_gpus": 2, "gpu_devices": [3, 3]}, r"names a GPU twice.*\(fix: gpu_devices: \[3\]\)"),
    ({"num_gpus": 1, "gpu_devices": [-1]}, r"must list GPU indices as nvidia-smi numbers them"),
    ({"num_gpus": 1, "gpu_devices": "0"}, r"cluster.gpu_devices='0': must list GPU indices"),
    ({"num_gpus": 0, "gpu_devices": [0]}, r"\(fix: gpu_devices: \[\] \(num_gpus is 0\)\)"),
])
def test_a_wrong_gpu_list_is_refused_naming_the_setting(cluster: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _backend(**cluster)


def test_a_node_process_starts_with_its_gpus_and_nvidia_smis_numbering(tmp_path: Path) -> None:
    """What each ``ray start`` gets (Ray reads its GPUs from that environment at start, and its workers inherit
    the raylet's); a node left to inherit gets the caller's. A real process stands in for ``ray start`` here:
    a two-node cluster costs half a minute of this suite, and Ray's reading of the variable is Ray's."""
    show = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), "
                                  "os.environ.get('CUDA_DEVICE_ORDER'))"]
    backend = _backend(nodes=2, num_gpus=1, gpu_devices=[3, 5], auth_mode="disabled")
    out = {}
    for devices in ("5", None):
        log = tmp_path / f"node-{devices}.log"
        assert backend._start(show, log, None, devices).wait(timeout=60) == 0
        out[devices] = log.read_text().split()
    assert out["5"] == ["5", "PCI_BUS_ID"]
    assert out[None] == [os.environ.get(CUDA_VISIBLE_DEVICES, "None"), os.environ.get("CUDA_DEVICE_ORDER", "None")]
