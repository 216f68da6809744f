from __future__ import annotations

from pathlib import Path

from verl_pipeline.jobs.gpu_usage import NodeGpuSample, append_samples, read_samples, readings_from_summary

#: The shape of one node's ``gpus`` in Ray's node summary as seen on an H200 (fields abridged).
_SUMMARY_GPUS = [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-36e1567d-37ed-051e-f8ff-df807517b396",
                  "utilizationGpu": 97, "memoryUsed": 70123, "memoryTotal": 143771, "powerMw": 650000,
                  "processesPids": []}]


def test_readings_from_summary_keep_util_and_memory() -> None:
    (gpu,) = readings_from_summary(_SUMMARY_GPUS)
    assert (gpu.index, gpu.utilization_pct, gpu.memory_used_mib, gpu.memory_total_mib) == (0, 97.0, 70123.0, 143771.0)
    assert gpu.uuid == "GPU-36e1567d-37ed-051e-f8ff-df807517b396"  # what names the GPU across raylet restarts
    assert round(gpu.memory_pct or 0, 1) == 48.8
    assert readings_from_summary(None) == ()
    assert readings_from_summary([{"memoryUsed": 1, "memoryTotal": 2}])[0].utilization_pct is None


def test_samples_round_trip_skip_cpu_nodes_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "gpu-usage.jsonl"
    gpu_node = NodeGpuSample(10.0, "n1", "10.0.0.1", readings_from_summary(_SUMMARY_GPUS * 2))
    append_samples(path, [gpu_node, NodeGpuSample(10.0, "head", "10.0.0.2", ())])
    with path.open("a") as f:
        f.write('{"time": 11, "node_')  # a writer killed mid-line
    assert list(read_samples(path)) == [gpu_node]
    assert gpu_node.mean_utilization_pct == 97.0
    assert list(read_samples(tmp_path / "absent.jsonl")) == []


def test_samples_written_before_the_uuid_was_recorded_still_read(tmp_path: Path) -> None:
    path = tmp_path / "gpu-usage.jsonl"
    path.write_text('{"time": 5.0, "node_id": "n1", "node_ip": "10.0.0.1", "gpus": [{"index": 3, "utilization_pct": '
                    '50.0, "memory_used_mib": 1.0, "memory_total_mib": 2.0}]}\n')
    (sample,) = read_samples(path)
    assert sample.gpus[0].index == 3 and sample.gpus[0].uuid is None
