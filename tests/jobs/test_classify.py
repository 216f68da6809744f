from __future__ import annotations

import pytest

from verl_pipeline.jobs.classify import FailureKind, classify

EXIT = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):"

INFRA = [
    ("ray.exceptions.NodeDiedError: Task failed due to the node (node ID: ab12) where this task was running "
     "crashing unexpectedly.", "node died"),
    ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task. The actor's node "
     "was terminated", "actor died with its node"),
    ("ray.exceptions.WorkerCrashedError: The worker died unexpectedly while executing this task.",
     "worker killed (OOM or signal)"),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
     "worker killed (OOM or signal)"),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE)",
     "NCCL timeout or error"),
    ("Failed to connect to GCS at address 10.0.0.1:6379 within 5 seconds", "raylet or GCS lost"),
    ("The instance was preempted by the cloud provider", "preempted"),
    ("Ray Jobs API unreachable: Cannot connect to host 127.0.0.1:8265", "Jobs API unreachable"),
    ("ray.exceptions.ObjectLostError: Failed to retrieve object", "object lost with its node"),
    ("ray.exceptions.ActorUnavailableError: The actor 801b is unavailable: The actor is temporarily unavailable: "
     "RpcError: RPC error: Socket closed rpc_code: 14.", "actor unreachable (its node or process is gone)"),
    # What ray.init in the job's driver raises when the GCS of a busy head answers too late.
    ("  File \".../ray/_private/node.py\", in __init__\n    node_info = ray._private.services.get_node(\n"
     "RuntimeError: b'RPC error: Deadline Exceeded'", "Ray control plane overloaded (GCS call timed out)"),
    ("Exception: The current node timed out during startup. This could happen because some of the raylet "
     "failed to startup or the GCS has become overloaded.", "Ray control plane overloaded (GCS call timed out)"),
    # verl's own check of the GPUs free at its start: on a shared cluster, another job holds them.
    ("  File \".../verl/single_controller/ray/base.py\", in _check_resource_available\n"
     "ValueError: Total available GPUs 4.0 is less than total desired GPUs 8",
     "GPUs held by another job (verl's resource check)"),
]

USER = [
    ("omegaconf.errors.ConfigAttributeError: Key 'bad' is not in struct", "configuration rejected"),
    ("ValueError: ConfigError: missing or invalid trainer keys", "configuration rejected"),
    ("ModuleNotFoundError: No module named 'my_reward'", "import error"),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/data/train.parquet'", "data error"),
    ("Traceback (most recent call last):\n  File x\nZeroDivisionError: division by zero", "exception in user code"),
]


@pytest.mark.parametrize(("log", "reason"), INFRA)
def test_infrastructure_failures_are_retryable(log: str, reason: str) -> None:
    c = classify(EXIT, "some output\nTraceback (most recent call last):\n" + log)
    assert c.kind is FailureKind.INFRASTRUCTURE and c.retryable
    assert c.reason == reason
    assert c.evidence


@pytest.mark.parametrize(("log", "reason"), USER)
def test_user_failures_are_not(log: str, reason: str) -> None:
    c = classify(EXIT, log)
    assert c.kind is FailureKind.USER and not c.retryable
    assert c.reason == reason


def test_a_gcs_timeout_ray_logged_and_retried_does_not_make_a_user_error_infrastructure() -> None:
    log = ("INFO node.py:438 -- Failed to get node info b'RPC error: Deadline Exceeded'\n"
           "Traceback (most recent call last):\n  File x\nZeroDivisionError: division by zero")
    c = classify(EXIT, log)
    assert c.kind is FailureKind.USER and c.reason == "exception in user code"


def test_unknown_and_stopped() -> None:
    assert classify("exit code 2", "no idea").reason == "unrecognised failure (not retried)"
    assert classify("Job was intentionally stopped.", "", status="STOPPED").reason == "job was stopped"
    # A node death during a stop still counts as the infrastructure's.
    assert classify("stopped", "NodeDiedError", status="STOPPED").retryable


def test_the_evidence_is_the_exception_that_ended_the_job_not_the_first_warning() -> None:
    # Seen on a GPU run (verl 0.9.1, no flash-attn): the first line naming an import failure is a
    # harmless warning printed at start; the job died of the last one.
    log = "\n".join([
        "(TaskRunner pid=812) WARNING:verl.workers.engine: torchtitan engine is not available: "
        "ModuleNotFoundError: No module named 'torchtitan'",
        "(TaskRunner pid=812) step:0 - val-core/openai/gsm8k/reward/mean@1:0.02",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3/site-packages/transformers/modeling_utils.py", line 2160, in _check_and_adjust',
        "(WorkerDict pid=913) ImportError: FlashAttention2 has been toggled on, but it cannot be used due to the "
        "following error: the package flash_attn seems to be not installed.",
    ])
    c = classify(EXIT, log)
    assert c.kind is FailureKind.USER and c.reason == "import error"
    assert "flash_attn seems to be not installed" in c.evidence and "torchtitan" not in c.evidence


def test_a_wrapped_task_error_is_the_ending_exception() -> None:
    log = "Traceback (most recent call last):\nray.exceptions.RayTaskError(ZeroDivisionError): division by zero"
    c = classify(EXIT, "WARNING: retrying after ValueError in a callback\n" + log)
    assert c.reason == "exception in user code"
    assert c.evidence.startswith("ray.exceptions.RayTaskError(ZeroDivisionError)")


def test_infrastructure_evidence_prefers_the_ending_exception() -> None:
    log = ("WARNING: Connection refused by 10.0.0.3 (retrying)\nTraceback (most recent call last):\n"
           "ray.exceptions.ActorDiedError: The actor died because its node was terminated")
    c = classify(EXIT, log)
    assert c.retryable and c.reason == "actor died with its node"
    assert c.evidence.startswith("ray.exceptions.ActorDiedError")


@pytest.mark.parametrize("line", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 1.10 GiB is free.",
    "RuntimeError: CUDA error: out of memory",
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine.",
])
def test_a_gpu_out_of_memory_is_the_configuration_s_and_names_the_fix(line: str) -> None:
    # Seen on an H200: vLLM's rollout ran out of memory in a worker; the actor that raised it died, and
    # the job ended on a later, generic exception (which alone read as "exception in user code", or as a
    # lost worker). A retry with the same batch sizes and memory share runs out again.
    log = "\n".join([
        f"\x1b[36m(WorkerDict pid=4711)\x1b[0m {line}",
        "(TaskRunner pid=812) ray.exceptions.ActorDiedError: The actor died because of an error raised in "
        "its creation task, on node 3f2a",
        "Traceback (most recent call last):",
        "RuntimeError: rollout failed",
    ])
    c = classify(EXIT, log)
    assert c.kind is FailureKind.USER and c.reason == "GPU out of memory"
    assert c.evidence == " ".join(line.split())  # the out-of-memory line, without Ray's coloured prefix
    if "cache blocks" in line:  # vLLM's weights and activations filled its share: a larger share
        assert c.remedy.startswith("raise actor_rollout_ref.rollout.gpu_memory_utilization")
    else:
        assert c.remedy.startswith("lower actor_rollout_ref.rollout.gpu_memory_utilization")
        assert "param_offload" in c.remedy


def test_ray_s_host_memory_kill_is_not_a_gpu_out_of_memory() -> None:
    c = classify(EXIT, "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.")
    assert c.retryable and c.reason == "worker killed (OOM or signal)" and not c.remedy
